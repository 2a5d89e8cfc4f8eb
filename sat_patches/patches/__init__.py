"""Every patch of SAT (and of the torch/DeepSpeed functions SAT calls), one module per concern.

A new patch goes into the module of its concern (or a new module listed below): a ``Patch`` record
in that module's ``PATCHES`` names the target, the replacement factory, a gate on the shape of SAT's
code and the upstream issue it answers. :mod:`sat_patches.core.registry` applies them in this order.

Several SAT functions carry patches from more than one module. On a shared target a module listed
later wraps the ones listed earlier (its code runs first on the way in and last on the way out):

* ``sat.arguments:get_args``: faults (DeepSpeed config read as JSON first) under distributed (CPU
  device accepted), so the config is checked whatever device the run ends up on.
* ``sat.arguments:initialize_distributed``: distributed (the process group's backends, its destruction at exit), then
  deepspeed_setup (config lint before DeepSpeed reads it), ledger (baseline row once the group
  exists), hangs (collective timeout set around all of it).
* ``sat.training.deepspeed_training:training_main``: faults (the rank heartbeat runs around SAT's
  training), distributed (a passed-in model goes to the compute device), loading (outermost: one
  experiment name is chosen on rank 0 before anything beneath it runs).
* ``setup_model_untrainable_params_and_optimizer``: distributed (names the collective when the
  parameter sync fails), trainable (the adapters-only choice is in place before SAT asks the model
  what trains), ledger (memory after DeepSpeed's set-up), resume (optimizer shards loaded after
  DeepSpeed built the optimizer).
* ``MetaModel.__call__`` and ``BaseModel.add_mixin``: construction (build on the compute device, in
  the run's dtype), then ledger (the row is taken once the construction context has closed).
* ``load_checkpoint`` and ``BaseModel.from_pretrained``: loading replaces SAT's code without
  calling it, so ledger must come after it to see the call.
* ``sat.training.model_io:save_checkpoint``: resume (optimizer shards written) inside
  checkpointing (the atomic save stages everything the save writes, shards included).
"""
import sys

from ..core.registry import REGISTRY

# rotary first: importing it installs the substitute for SAT's triton module, without which (no triton
# installed) the ``import sat`` in the modules below fails.
from . import rotary  # noqa: I001
from . import (standins, adapters, checkpointing, console, construction, deepspeed_setup, devices, distributed, faults,
               hangs, ledger, loading, lora, preprocess, progress, resume, trainable)

# Innermost first.
MODULES = [
    rotary,
    standins,
    devices,
    faults,
    distributed,
    deepspeed_setup,
    lora,
    trainable,
    construction,
    loading,
    ledger,
    progress,
    console,
    hangs,
    resume,
    adapters,
    checkpointing,
    preprocess,
]

PATCHES = [patch for module in MODULES for patch in module.PATCHES]
REGISTRY.add(*PATCHES)

# Importing the modules above imported SAT. If that was SAT's first import, ``import sat_patches``
# left the patches waiting for it: they go on now.
sys.modules[__name__.rpartition(".")[0]]._apply_on_import()
