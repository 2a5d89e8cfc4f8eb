"""A pickle payload for the safe-loading tests: runs ``touch <marker>`` when unpickled in full, what a malicious
checkpoint would do, made harmless. Test support only: never shipped in the wheel."""
import os


class Payload:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def plant(checkpoint_file: str, marker: str) -> None:
    """Add a :class:`Payload` to a saved dict (a file the test wrote itself)."""
    import torch
    state = torch.load(checkpoint_file, weights_only=False)
    state["payload"] = Payload(marker)
    torch.save(state, checkpoint_file)
