"""Planning a run: the memory estimator (parameters, optimizer, activations per rank, host memory), the step-time
model (:mod:`.timing`) and the recommended settings for a box: the fastest that fits."""
