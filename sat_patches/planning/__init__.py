"""Planning a run: the memory estimator (parameters, optimizer, activations per rank, host memory) and the
recommended settings for a box."""
