"""Stand-in for ``xformers`` where it is not installed (its wheels are CUDA-only): the one function
CogVLM's EVA2-CLIP calls, ``xformers.ops.memory_efficient_attention``, in plain torch. Served by
sat_patches' import hook as ``xformers`` (patch ``xformers_standin``); never when xformers is installed."""
__sat_patches__ = "xformers_standin"
__version__ = "0+sat_patches.standin"

from . import ops  # noqa: E402,F401
