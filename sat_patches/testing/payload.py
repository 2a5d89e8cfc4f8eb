"""A checkpoint entry that runs ``touch <marker>`` when unpickled in full: what a malicious file
would do, made harmless, so tests can tell whether a loading path ran it."""
import os

import torch


class Payload:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def plant(checkpoint_file: str, marker: str) -> None:
    """Add a :class:`Payload` to a saved dict (a file this process wrote itself)."""
    state = torch.load(checkpoint_file, weights_only=False)
    state["payload"] = Payload(marker)
    torch.save(state, checkpoint_file)
