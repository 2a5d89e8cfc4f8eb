"""Exact resume: a LoRA run at MP=2 on 2 CPU ranks, stopped after its checkpoint at
iteration 4 (SAT's own ``--exit-interval``) and continued with ``--mode pretrain --load``, gives the
per-step losses of the uninterrupted 8-step run: same optimizer states, learning-rate schedule (cosine,
no re-warm), dropout masks and data order.

Both ranks run every variant in one process each (SAT's ``training_main`` called repeatedly):
ZeRO-2 bf16 (CogVLM's set-up) with sat_patches, with all of ``sat_patches.patches.resume`` removed (stock
SAT's resume) and with each of its patches removed in turn; and fp32 without ZeRO. With the patches the
resumed losses equal the uninterrupted run's to 1e-6 in both set-ups.
"""
import contextlib
import os

import pytest

from multirank import run_ranks
from payload import plant

pytestmark = pytest.mark.multirank

RESUME_LOAD_SIDE = ["resume_optimizer_load", "resume_lr_schedule", "resume_rng", "resume_data_position"]
RESUME_SAVE_SIDE = ["resume_optimizer_save", "resume_lr_schedule_state"]
BASE = ["--model-parallel-size", "2", "--mode", "pretrain", "--train-iters", "8", "--save-interval", "4",
        "--log-interval", "4", "--lr-decay-style", "cosine", "--lr", "0.05", "--lora-rank", "2",
        "--eval-interval", "100000"]


def train_stop_resume(root):
    import glob
    from patching import patches_removed
    import tiny_lora

    def losses(tag, extra, removed=()):
        tiny_lora._LOSSES.clear()
        args = BASE + ["--summary-dir", os.path.join(root, "summary"),
                       "--loss-log", os.path.join(root, f"{tag}-{{rank}}.json")] + extra
        with patches_removed(*removed) if removed else contextlib.nullcontext():
            try:
                tiny_lora.main(args)
            except SystemExit as exc:  # --exit-interval: SAT's exit() after the checkpoint
                if exc.code not in (None, 0):
                    raise
        return list(tiny_lora._LOSSES)

    def stopped(tag, precision, removed=()):
        save = os.path.join(root, tag)
        losses(tag, precision + ["--save", save, "--exit-interval", "4"], removed)
        (run,) = glob.glob(os.path.join(save, "*"))
        return run

    out = {}
    bf16 = ["--zero-stage", "2", "--bf16"]
    out["full"] = losses("full", bf16 + ["--save", os.path.join(root, "full"), "--save-interval", "2"])
    (full_run,) = glob.glob(os.path.join(root, "full", "*"))
    out["full_saved"] = sorted(int(d) for d in os.listdir(full_run) if d.isdigit())
    # --iteration: resume from a saved iteration other than the latest one
    out["from_4"] = losses("from-4", bf16 + ["--load", full_run, "--iteration", "4",
                                              "--save", os.path.join(root, "from-4")])
    from sat_patches.checkpoints.files import CheckpointError
    try:
        losses("from-5", bf16 + ["--load", full_run, "--iteration", "5", "--save", os.path.join(root, "from-5")])
        out["from_5"] = None
    except CheckpointError as exc:
        out["from_5"] = str(exc)
    try:
        out["from_4_stock"] = losses("from-4-stock", bf16 + ["--load", full_run, "--iteration", "4"],
                                     removed=["resume_iteration_arg"])
    except SystemExit as exc:  # argparse: unrecognized arguments
        out["from_4_stock"] = f"exit {exc.code}"
    run = stopped("stop", bf16)
    out["files"] = sorted(os.listdir(os.path.join(run, "4")))
    resume = bf16 + ["--load", run]
    out["resumed"] = losses("resumed", resume + ["--save", os.path.join(root, "resumed")])
    out["stock"] = losses("stock", resume + ["--save", os.path.join(root, "stock")],
                          removed=RESUME_LOAD_SIDE + RESUME_SAVE_SIDE)
    for name in RESUME_LOAD_SIDE:
        out[name] = losses(name, resume + ["--save", os.path.join(root, name)], removed=[name])
    for name in RESUME_SAVE_SIDE:  # saved without the patch, resumed with every patch
        other = stopped(f"stop-{name}", bf16, removed=[name])
        out[name] = losses(name, bf16 + ["--load", other, "--save", os.path.join(root, name)])

    from deepspeed.accelerator import get_accelerator
    out["fp16"] = bool(get_accelerator().is_fp16_supported())  # DeepSpeed's CPU accelerator: AVX512-FP16 CPUs only
    if out["fp16"]:
        fp16 = ["--zero-stage", "2", "--fp16"]  # DeepSpeed's dynamic loss scaler is in the optimizer shards
        out["fp16_full"] = losses("fp16-full", fp16 + ["--save", os.path.join(root, "fp16-full")])
        out["fp16_resumed"] = losses("fp16-resumed", fp16 + ["--load", stopped("fp16-stop", fp16),
                                                             "--save", os.path.join(root, "fp16-resumed")])

    fp32 = ["--zero-stage", "0"]
    out["fp32_full"] = losses("fp32-full", fp32 + ["--save", os.path.join(root, "fp32-full")])
    out["fp32_resumed"] = losses("fp32-resumed", fp32 + ["--load", stopped("fp32-stop", fp32),
                                                         "--save", os.path.join(root, "fp32-resumed")])

    # every global the real saves above refer to beyond torch's own: what safe loading allows
    from torch.serialization import get_unsafe_globals_in_checkpoint
    saved = glob.glob(os.path.join(root, "**", "*.pt"), recursive=True)
    out["unsafe_globals"] = sorted({name for f in saved for name in get_unsafe_globals_in_checkpoint(f)})

    # an optimizer shard carrying a pickle payload: resume refuses it before anything of it runs
    from sat_patches.checkpoints import safe_load
    planted = stopped("stop-payload", bf16)
    rank = int(os.environ["RANK"])
    shard = os.path.join(planted, "4", f"bf16_zero_pp_rank_0_mp_rank_{rank:02d}_optim_states.pt")
    plant(shard, os.path.join(root, f"payload-ran-{rank}"))
    try:
        losses("payload", bf16 + ["--load", planted, "--save", os.path.join(root, "payload")])
        out["payload"] = None
    except safe_load.UnsafeCheckpointError as exc:
        out["payload"] = str(exc)
    out["payload_ran"] = os.path.exists(os.path.join(root, f"payload-ran-{rank}"))
    return out



def train_stop_resume_data_parallel(root, mp):
    """MP=``mp`` on 2 x ``mp`` ranks: 2 data-parallel groups, each rank with its own ZeRO-2 optimizer shard and each
    group with its own share of every batch (SAT's DistributedBatchSampler)."""
    import tiny_lora
    args = [a if a != "2" or i != 1 else str(mp) for i, a in enumerate(BASE)] + ["--zero-stage", "2", "--bf16"]
    assert args[:2] == ["--model-parallel-size", str(mp)]

    def losses(tag, extra):
        tiny_lora._LOSSES.clear()
        try:
            tiny_lora.main(args + ["--summary-dir", os.path.join(root, "summary"),
                                   "--loss-log", os.path.join(root, f"{tag}-{{rank}}.json")] + extra)
        except SystemExit:
            pass
        return list(tiny_lora._LOSSES)

    import glob
    out = {"full": losses("full", ["--save", os.path.join(root, "full")])}
    losses("stop", ["--save", os.path.join(root, "stop"), "--exit-interval", "4"])
    (run,) = glob.glob(os.path.join(root, "stop", "*"))
    out["files"] = sorted(os.listdir(os.path.join(run, "4")))
    out["resumed"] = losses("resumed", ["--load", run, "--save", os.path.join(root, "resumed")])
    from patching import patches_removed
    with patches_removed(*RESUME_LOAD_SIDE):
        out["stock"] = losses("stock", ["--load", run, "--save", os.path.join(root, "stock")])
    return out


@pytest.mark.slow
@pytest.mark.parametrize("mp", [1, 2], ids=["mp1-dp2", "mp2-dp2"])
def test_resume_at_data_parallel_2_continues_exactly(tmp_path, mp):
    results = run_ranks(train_stop_resume_data_parallel, 2 * mp, args=(str(tmp_path), mp), timeout=400,
                        env={"SAT_PATCHES_HEARTBEAT_TIMEOUT": "0"})
    for r in results:
        assert r.result is not None, (r.exception or "") + r.output[-4000:]
    ranks = [r.result for r in results]
    assert ranks[0]["files"] == sorted([f"bf16_zero_pp_rank_{d}_mp_rank_{m:02d}_optim_states.pt"
                                        for d in range(2) for m in range(mp)]
                                       + [f"mp_rank_{m:02d}_model_states.pt" for m in range(mp)])
    # SAT's groups: model-parallel ranks are consecutive; each data-parallel group trains on its own batches
    groups = [ranks[g * mp:(g + 1) * mp] for g in range(2)]
    assert all(rank["full"] == group[0]["full"] for group in groups for rank in group)
    assert groups[0][0]["full"] != groups[1][0]["full"]
    for rank in ranks:
        assert _gap(rank["resumed"], rank["full"]) < 1e-6, (rank["resumed"], rank["full"])
        assert _gap(rank["stock"], rank["full"]) > 1e-3, (rank["stock"], rank["full"])  # SAT's own resume


def _gap(resumed, full):
    assert len(resumed) == 4 and len(full) == 8, (resumed, full)
    return max(abs(a - b) for a, b in zip(resumed, full[4:]))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("resume"))
    results = run_ranks(train_stop_resume, 2, args=(root,), timeout=400, env={"SAT_PATCHES_HEARTBEAT_TIMEOUT": "0"})
    for r in results:
        assert r.result is not None, (r.exception or "") + r.output[-4000:]
    return [r.result for r in results]


@pytest.mark.slow
def test_resumed_losses_equal_the_uninterrupted_run(runs):
    for rank in runs:
        assert rank["full"][:4] != rank["full"][4:]                        # the run does move
        assert _gap(rank["resumed"], rank["full"]) < 1e-6, (rank["resumed"], rank["full"])   # ZeRO-2 bf16
        assert _gap(rank["fp32_resumed"], rank["fp32_full"]) < 1e-6, (rank["fp32_resumed"], rank["fp32_full"])
        if rank["fp16"]:  # else DeepSpeed refuses fp16 on this CPU ("Type fp16 is not supported on your device")
            assert _gap(rank["fp16_resumed"], rank["fp16_full"]) < 1e-6, (rank["fp16_resumed"], rank["fp16_full"])
    assert runs[0]["full"] == runs[1]["full"]                              # MP ranks see one loss


@pytest.mark.slow  # the module's resumed runs (about 40 s alone)
def test_resume_from_a_chosen_saved_iteration_continues_exactly(runs):
    """Iterations 2, 4, 6 and 8 saved ('latest' names 8): ``--iteration 4`` resumes from 4 and gives the
    uninterrupted run's last four losses; an iteration that was not saved is refused with the saved ones;
    without the patch SAT's parser does not know the option."""
    for rank in runs:
        assert rank["full_saved"] == [2, 4, 6, 8]
        assert _gap(rank["from_4"], rank["full"]) < 1e-6, (rank["from_4"], rank["full"])
        assert "no directory '5'" in rank["from_5"] and "saved iterations: 2, 4, 6, 8" in rank["from_5"]
        assert rank["from_4_stock"] == "exit 2"


@pytest.mark.slow  # the module's resumed runs (about 40 s alone)
def test_every_rank_saves_its_zero_optimizer_shard(runs):
    files = runs[0]["files"]
    assert [f for f in files if f.endswith("optim_states.pt")] == [
        "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", "bf16_zero_pp_rank_0_mp_rank_01_optim_states.pt"], files


@pytest.mark.slow  # the module's resumed runs (about 40 s alone)
@pytest.mark.parametrize("variant", ["stock"] + RESUME_LOAD_SIDE + RESUME_SAVE_SIDE)
def test_without_each_patch_the_resumed_losses_differ(runs, variant):
    """Stock SAT's resume, and each patch of sat_patches.patches.resume removed: the losses leave the
    uninterrupted run's by far more than the tolerance above."""
    for rank in runs:
        assert _gap(rank[variant], rank["full"]) > 1e-3, (variant, rank[variant], rank["full"])


@pytest.mark.slow
def test_real_saves_need_only_the_allow_list_and_a_payload_in_an_optimizer_shard_is_refused(runs):
    from sat_patches.checkpoints import safe_load
    import numpy
    numpy_core = "numpy._core" if int(numpy.__version__.split(".")[0]) >= 2 else "numpy.core"
    for rank in runs:
        # every saved file (ZeRO-2 bf16 and fp16, fp32 without ZeRO, LoRA, MP=2, RNG states) was loaded safely by the
        # resumes above; these are exactly the types it needed, and exactly the allow-list for this numpy (fp16's
        # dynamic loss scaler only where fp16 ran: test_safe_load covers it on any CPU)
        fp16_only = set() if rank["fp16"] else {"deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"}
        assert rank["unsafe_globals"] == sorted(
            n for n in safe_load.ALLOWED if (not n.startswith(("numpy.core", "numpy._core")) or n.startswith(numpy_core))
            and n not in fp16_only)
        assert rank["payload"] and "system" in rank["payload"] and "optim_states.pt" in rank["payload"]
        assert not rank["payload_ran"]


def test_resume_refuses_an_iteration_missing_one_ranks_optimizer_shard(tmp_path):
    """Some ZeRO shards there, one not: the checkpoint is damaged (a stock-SAT save has none at all and
    resumes with a fresh optimizer, with a warning)."""
    import argparse
    import types
    import torch
    from sat_patches.checkpoints.files import CheckpointError
    from sat_patches.checkpoints import resume
    names = [str(tmp_path / f"bf16_zero_pp_rank_{d}_mp_rank_00_optim_states.pt") for d in range(2)]
    torch.save({}, names[0])
    engine = types.SimpleNamespace(optimizer=types.SimpleNamespace(dp_process_group=None),
                                   _save_zero_checkpoint=None, dp_world_size=2, mp_world_size=1,
                                   _get_all_zero_checkpoint_names=lambda *a: names, bfloat16_enabled=lambda: True)
    args = argparse.Namespace(load=str(tmp_path), iteration=4)
    with pytest.raises(CheckpointError, match="lacks .*bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"):
        resume._load_optimizer(engine, args, {})
    os.unlink(names[0])
    with pytest.warns(Warning, match="no ZeRO optimizer shards"):
        assert resume._load_optimizer(engine, args, {}) is False
