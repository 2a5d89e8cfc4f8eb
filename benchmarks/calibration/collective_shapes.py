"""SAT's model-parallel collectives replaced by their output shapes, for measuring a rank on meta."""
from sat_patches.cogvlm.on_meta import stood_in  # first: makes ``import sat`` work

import sat.mpu.mappings as mappings
import torch


def collectives_as_shapes(mp: int):
    """SAT's model-parallel collectives as their output shapes on rank 0 of ``mp``, wherever a loaded module
    imported them (no process group: the tensors may be on meta)."""
    shapes = {
        "gather_from_model_parallel_region": lambda x: torch.cat([x] * mp, dim=-1),
        "scatter_to_model_parallel_region": lambda x: x[..., : x.shape[-1] // mp].contiguous(),
        "copy_to_model_parallel_region": lambda x: x,
        "reduce_from_model_parallel_region": lambda x: x,
    }
    return stood_in({name: (getattr(mappings, name), shape) for name, shape in shapes.items()})
