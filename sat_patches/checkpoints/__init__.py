"""SAT checkpoint directories: finding and checking them (:mod:`.files`), splitting their tensors
across model-parallel ranks (:mod:`.sharding`), loading their state into a model (:mod:`.state`),
writing them atomically (:mod:`.writer`)."""
