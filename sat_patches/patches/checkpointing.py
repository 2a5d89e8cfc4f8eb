"""Atomic checkpoint saves: a rank killed during a save leaves the previous checkpoint loadable.

What SwissArmyTransformer 0.4.12 does (``sat/training/model_io.py``): ``save_checkpoint`` has every
model-parallel rank write ``<save>/<N>/mp_rank_XX_model_states.pt`` in place, and
``save_ds_checkpoint_no_optim`` makes every one of them overwrite ``<save>/latest`` with ``N`` right
after its own shard is written; after a barrier rank 0 rewrites ``latest`` and ``model_config.json``
in place. A rank killed during a save (host OOM as in THUDM/CogVLM#283 and THUDM/CogVLM#320,
"kill -9"; preemption) leaves ``latest`` naming an iteration whose other shards (and LoRA weights,
which live in the same files) are missing or truncated: the run can no longer resume from anything.

Here global rank 0 first takes the folder's save lock (:mod:`sat_patches.checkpoints.save_lock`: a
second live run saving into the same folder is refused) and sweeps the staging folders earlier saves
left (a crash, a full disk); every rank saves iteration N into ``<save>/.saving-<N>-<run>/`` (SAT's own
code, unchanged, with ``args.save`` pointing there; ``<run>`` is rank 0's host and process id) and
fsyncs what it wrote; all ranks meet; global rank 0 checks that staged directory with
:func:`sat_patches.checkpoints.files.find_checkpoint` (every MP shard present, none truncated), then ONE rename
makes ``<save>/<N>`` appear (an atomic exchange when ``<save>/<N>`` already exists, e.g. SAT's final
save of the last interval's iteration), then ``model_config.json`` and last ``latest`` are replaced
with ``os.replace`` of a fsynced temporary file (:mod:`sat_patches.checkpoints.writer`, which fsyncs
every staged file before the rename). A crash at any point leaves ``latest`` naming the
previous complete iteration. A save that fails (e.g. ENOSPC) removes its staging folder.

SAT's EMA check reads ``optimizer.optimizer``, which a bare torch optimizer (DeepSpeed without a ZeRO
wrapper) lacks: such an optimizer is not passed on (SAT uses it for nothing else there).

Assumes ``<save>`` is one filesystem seen by every rank (as SAT's own ``latest`` handling does).
"""
from __future__ import annotations

from ..checkpoints.saving import save_checkpoint_staged
from ..core.registry import Patch, delegate, expect_names


PATCHES = [
    Patch("atomic_checkpoint_save", "sat.training.model_io:save_checkpoint", delegate(save_checkpoint_staged),
          answers="THUDM/CogVLM#283, #320 (ranks killed with kill -9): a rank killed mid-save left 'latest' "
                  "naming an iteration with missing/truncated MP shards; saves are now staged and renamed",
          expect=expect_names("save_ds_checkpoint", "get_checkpoint_tracker_filename", "barrier")),
]
