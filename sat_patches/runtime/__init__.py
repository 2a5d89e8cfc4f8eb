"""Library code the training ranks run: the device policy, construction on a device, process groups,
DeepSpeed config checks, argument checks, rank-0-first preprocessing, what trains."""
