"""Planning a run (``sat-patches plan``), before any GPU hour is spent: the parameters of the model's parts
(:mod:`.shapes`), the memory one rank holds (:mod:`.memory`), the step-time model (:mod:`.timing`), every setting
for a box and the fastest that fits (:mod:`.search`), and what realises it (:mod:`.realise`)."""
