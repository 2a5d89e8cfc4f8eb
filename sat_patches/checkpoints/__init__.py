"""SAT checkpoint directories: finding and checking them (:mod:`.files`), splitting their tensors
across model-parallel ranks (:mod:`.sharding`), writing them atomically (:mod:`.writer`)."""
