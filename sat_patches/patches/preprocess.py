"""Data preprocessing on rank 0 first, the other ranks waiting behind a barrier with a timeout.

SAT's ``training_main`` calls ``make_loaders(args, create_dataset_function, collate_fn)`` on every rank
at the same time, before the model is built. ``make_loaders`` calls the user's
``create_dataset_function(path, args)`` (CogVLM: an ``ItemDataset`` over a folder of images, where
users preprocess and cache) and contains no collective. So:

* the ranks that finish early wait in the next NCCL collective while a slow rank preprocesses, and
  NCCL's watchdog aborts them (30 min by default);
* a rank that raises while preprocessing leaves the others waiting in that collective, told nothing.

The patch ``preprocess_rank0_first`` runs ``make_loaders`` on global rank 0 first. The other ranks
wait in ``dist.monitored_barrier`` on a dedicated gloo group whose timeout is
``SAT_PATCHES_PREPROCESS_TIMEOUT`` seconds (default 7200), so no NCCL collective is open meanwhile.
Rank 0 then posts "done" or "failed: <ExcType: message>" in the default process group's store and
joins the barrier. On "done" the others run ``make_loaders`` themselves (reading what rank 0 cached);
on "failed" they raise at once, naming rank 0 and its error, and rank 0 re-raises its own exception.
A rank 0 that is killed or exceeds the timeout makes the others raise an error naming rank 0, the
stage and ``SAT_PATCHES_PREPROCESS_TIMEOUT``. One process, or no process group: SAT's code unchanged.

Interplay with the other patches:

* ``hangs``' watchdog times the ``torch.distributed`` collectives it finds a thread in with
  ``SAT_PATCHES_COLLECTIVE_TIMEOUT``, which would cut a long preprocessing wait. ``monitored_barrier`` is
  not in ``hangs.COLLECTIVES`` and calls the group's C++ ``monitored_barrier`` directly (no ``barrier``
  function inside), so this wait is bounded
  only by ``SAT_PATCHES_PREPROCESS_TIMEOUT`` (tests/test_preprocess.py checks that it stays so).
  ``hangs.start_watchdog`` shortens the timeout of the groups that exist when it runs (in SAT's
  ``initialize_distributed``); the group here is created later, at the first ``make_loaders``.
* ``faults``' heartbeat thread keeps beating on every rank meanwhile: rank 0's thread runs beside its
  preprocessing, and the waiting ranks' threads run because ``monitored_barrier`` releases the GIL.
"""
from __future__ import annotations

import functools

from ..core.registry import Patch, expect_names
from ..runtime.preprocess import rank0_first


def _make_loaders(original):
    """SAT's make_loaders (every rank at once in stock SAT), run on rank 0 first."""
    @functools.wraps(original)
    def make_loaders(*args, **kwargs):
        return rank0_first(functools.partial(original, *args, **kwargs))
    return make_loaders


PATCHES = [
    Patch("preprocess_rank0_first", "sat.data_utils.configure_data:make_loaders", _make_loaders,
          answers="stock SAT: make_loaders ran on every rank at once, so ranks done early hit the NCCL watchdog "
                  "while one preprocessed and a rank crashing in preprocessing left the others hanging; rank 0 now "
                  "goes first behind a gloo barrier (SAT_PATCHES_PREPROCESS_TIMEOUT) and its failure is reported",
          expect=expect_names("make_dataset_full", "make_data_loader")),
]
