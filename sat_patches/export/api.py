"""The conversions and the errors they raise, in one import for the command line (which loads torch and SAT only
when a conversion runs)."""
from ..checkpoints.files import CheckpointError
from ..checkpoints.safe_load import UnsafeCheckpointError
from .hf import export_hf
from .importer import import_hf
from .peft import export_peft

__all__ = ["CheckpointError", "UnsafeCheckpointError", "export_hf", "export_peft", "import_hf"]
