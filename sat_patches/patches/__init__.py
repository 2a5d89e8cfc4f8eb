"""Every patch of SAT (and of the torch/DeepSpeed functions SAT calls), one module per concern: each ``Patch``
record names its target, the replacement factory, a gate on SAT's code and the upstream issue it answers.
Patches sharing a target are ordered in :data:`STACKS` (innermost first, with the reason for each place).
"""
from ..core.registry import REGISTRY

from . import (rotary, checkpointing, construction, deepspeed_setup, devices, distributed, faults,
               fork_models, hangs, ledger, loading, lora, progress, resume)

# Innermost first.
MODULES = [
    rotary,
    checkpointing,
    devices,
    faults,
    distributed,
    deepspeed_setup,
    lora,
    construction,
    loading,
    ledger,
    progress,
    hangs,
    resume,
    fork_models,
]

# Innermost first: each patch wraps the ones above it, so its code runs first on the way in and last on the
# way out. (name, why it sits there)
STACKS = {
    "sat.arguments:get_args": (
        ("deepspeed_config_json", "the DeepSpeed config is read as JSON before anything else reads it"),
        ("get_args_cpu_device", "outermost, so the config is checked whatever device the run ends up on"),
    ),
    "sat.arguments:initialize_distributed": (
        ("process_group_backend", "creates the process group with a backend for each device (cpu:gloo,cuda:nccl)"),
        ("destroy_group_at_exit", "registers the group's destruction once the group exists"),
        ("deepspeed_config_lint", "lints the DeepSpeed config before DeepSpeed reads it, above the group"),
        ("ledger_start", "takes its baseline row once the group exists"),
        ("collective_timeout", "outermost: the collective timeout is set around all of it"),
    ),
    "sat.training.deepspeed_training:training_main": (
        ("hang_watch_training_main", "innermost: SAT's own timed-out collective ends the run first"),
        ("rank_heartbeat", "the rank heartbeat runs around SAT's training itself"),
        ("training_main_device", "a passed-in model goes to the compute device before training starts"),
        ("shared_experiment_name", "outermost: rank 0 chooses one experiment name before anything beneath runs"),
    ),
    "sat.training.deepspeed_training:setup_model_untrainable_params_and_optimizer": (
        ("hang_watch_parameter_sync", "innermost: SAT's own timed-out collective ends the run first"),
        ("explain_sync_collective", "names the collective when SAT's parameter sync fails"),
        ("trainable_setting", "the adapters-only choice is made before SAT asks the model what trains"),
        ("ledger_deepspeed_init", "the memory row is taken after DeepSpeed's set-up"),
        ("resume_optimizer_load", "optimizer shards are loaded after DeepSpeed built the optimizer"),
    ),
    "sat.model.registry:MetaModel.__call__": (
        ("build_models_on_device", "builds on the compute device, in the run's dtype"),
        ("ledger_build", "the row is taken once the construction context has closed"),
    ),
    "sat.model.base_model:BaseModel.add_mixin": (
        ("add_mixin_on_device", "builds the mixin on the compute device, in the run's dtype"),
        ("ledger_lora", "the row is taken once the construction context has closed"),
    ),
    "sat.training.model_io:load_checkpoint": (
        ("load_checkpoint_mmap", "replaces SAT's code without calling it"),
        ("ledger_load", "must wrap the replacement to see the call"),
    ),
    "sat.model.base_model:BaseModel.from_pretrained": (
        ("from_pretrained_rank_local", "replaces SAT's code without calling it"),
        ("ledger_from_pretrained", "must wrap the replacement to see the call"),
    ),
    "sat.training.deepspeed_training:train_step": (
        ("hang_watch_train_step", "innermost: SAT's own timed-out collective ends the run first"),
        ("ledger_train_step", "the memory row is taken once the step has run"),
    ),
    "sat.mpu.data:broadcast_data": (
        ("broadcast_data_device", "replaces SAT's code without calling it"),
        ("hang_watch_broadcast_data", "must wrap the replacement to see the call"),
    ),
    "sat.training.model_io:save_checkpoint": (
        ("hang_watch_save_checkpoint", "innermost: SAT's own timed-out collective ends the run first"),
        ("resume_optimizer_save", "writes the optimizer shards beside the model's"),
        ("atomic_checkpoint_save", "outermost: stages everything the save writes, shards included, then publishes"),
    ),
}

PATCHES = [patch for module in MODULES for patch in module.PATCHES]
REGISTRY.add(*PATCHES)
REGISTRY.declare_stacks({target: [name for name, _ in stack] for target, stack in STACKS.items()})
