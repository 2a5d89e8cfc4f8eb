"""Parts u and w of the GPU proof: the user's own path on the card, two ranks sharing it at model-parallel size 2.

u. What the README tells a user to do, on one card: a CogVLM checkout (``--checkout DIR``: the public
   THUDM/CogVLM repository, or a fork; only its ``utils/`` and ``finetune_demo/`` are read), ``sat-patches scripts``
   into its ``finetune_demo/``, and the checkout's own ``finetune_cogvlm_demo.py`` through ``finetune_cogvlm.sh``
   under DeepSpeed ZeRO-2 as the script configures it, with ``NUM_GPUS_PER_WORKER=2 MP_SIZE=2
   SAT_PATCHES_SHARED_GPU=1``: two ranks on the one card, their CUDA collectives relayed through host copies. The
   model: an MP=1 checkpoint written on the machine's disk by the checkout's own classes, every shape of
   cogvlm-base-490 (language 4096 wide, 11008 MLP, 32 heads; EVA 1792 wide, 15360 MLP; the GLU; 32000 tokens;
   490-pixel images) with :data:`LAYERS` language and EVA layers, so that it, its merge and its export fit the
   disk and the time. :data:`ITERS` steps with a save every :data:`SAVE_AT`, the run resumed from the first save
   (``RESUME``, ``RESUME_ITERATION``) giving the same later losses, ``sat-patches merge`` to MP=1,
   ``sat-patches export hf``, and the export's language weights in transformers' ``LlamaForCausalLM`` giving the
   merged model's text-only logits. Per rank: peak CUDA memory (the run's memory ledger) beside the plan's row
   for the run at MP=2; the ranks' losses equal (``loss_curve.csv``'s ``model_parallel_loss_spread``, compared
   at every step); every saved tensor in bf16.
w. The full-size CogVLM-17B through the same path at MP=2, two ranks each holding half of it on one card, when
   the card holds both ranks' planned peaks (skipped with the reason otherwise, e.g. on an 80 GB card): two
   steps, per-rank peak beside the plan's 2 x 80 GB row, the losses equal. No resume, merge or export: the
   17B checkpoint and the demo's own merged save (written where the machine has room) fill the disk.

With ``--tiny`` the same part runs two CPU ranks in the same mode (``CPU_RANKS=2 SAT_PATCHES_SHARED_GPU=1``; the
script's checkout CPU mode makes the tiny checkpoint, tokenizer and CAPTCHAs itself), the same resume, merge,
export and ``LlamaForCausalLM`` comparison in fp32; part w is skipped there. The checkout of the tests is the
synthetic one that mirrors upstream's layout (``tests/support/fake_checkout.py``).
"""
from __future__ import annotations

import csv
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time

from proof_record import Recorder, Skip, cuda, device, gb

KIND = "cogvlm"
MODEL = "cogvlm-base-490"
SCRIPT = "finetune_cogvlm.sh"
LAYERS = 2                  # language and EVA layers of part u's full-width model
ITERS, SAVE_AT = 4, 2       # steps of the run; a save every SAVE_AT (the resume starts from the first)
WHOLE_ITERS = 2             # part w's steps
MICRO_BATCH = 1
MP = 2
EQUAL_FP32 = 1e-4           # fp32 logits (tiny, CPU): as the export's tests
EQUAL_BF16 = 5e-2           # bf16: relative to the largest logit
NEEDED = "needs --checkout DIR: a CogVLM checkout (git clone https://github.com/THUDM/CogVLM), its utils/ and finetune_demo/"


def missing(checkout) -> str:
    """Why the part cannot run (empty when it can)."""
    if not checkout:
        return NEEDED
    root = os.path.abspath(checkout)
    wanted = [os.path.join("utils", "models", "__init__.py"), os.path.join("finetune_demo", "finetune_cogvlm_demo.py")]
    absent = [w for w in wanted if not os.path.isfile(os.path.join(root, w))]
    return f"{NEEDED}: {root} lacks {', '.join(absent)}" if absent else ""


def model_config(full_depth: bool = False) -> dict:
    """cogvlm-base-490's config in upstream's keys: every width, :data:`LAYERS` layers each (all with
    ``full_depth``)."""
    from sat_patches.cogvlm.shapes import upstream_config
    config = upstream_config(MODEL)
    if full_depth:
        return config
    return dict(config, num_layers=LAYERS, eva_args=dict(config["eva_args"], num_layers=LAYERS))


def sat_patches_cli(*args) -> list:
    return [sys.executable, "-m", "sat_patches", *args]


def in_process(*args, checkout: str) -> None:
    """``sat-patches ARGS`` through the console script's own entry point, in this process (which has imported SAT
    already: no interpreter start per verb), with the checkout's ``utils`` importable as from its root."""
    from sat_patches.cli.main import main
    from sat_patches.runner.checkout_cpu import checkout_on_path
    with checkout_on_path(checkout):
        code = main(list(args))
    assert code == 0, f"sat-patches {' '.join(args)} exited with {code}"


class Failed(AssertionError):
    """A command that exited with an error; ``output`` holds what it printed."""

    def __init__(self, message: str, output: str):
        super().__init__(message)
        self.output = output


def call(cmd, cwd, env=None, what="") -> str:
    """Run ``cmd``; when it fails, its output's last lines go to this part's output (the kit's log) and its last
    error line to the row."""
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    output = done.stdout + done.stderr
    if done.returncode != 0:
        tail = output.splitlines()[-150:]
        print(f"---- {what or cmd[0]} exited with {done.returncode}; the last {len(tail)} lines of its output:",
              *tail, "----", sep="\n", flush=True)
        raise Failed(f"{what or cmd[0]} exited with {done.returncode}: {last_error(output)}", output)
    return output


def last_error(output: str) -> str:
    """The last exception a rank raised in ``output`` (the launcher's own ``ChildFailedError`` says only that a
    rank failed), else the last line saying error, else the last line."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    raised = [line for line in lines if re.match(r"[\w.]+(Error|Exception)\b", line) and "ChildFailedError" not in line]
    said = [line for line in lines if "error" in line.lower()]
    return (raised or said or lines or [""])[-1][:400]


def script_env(work: str, tiny: bool, extra: dict) -> dict:
    """The environment of ``finetune_cogvlm.sh``: the shared-GPU mode, MP=2 on two ranks, the part's paths."""
    # a rank's variables of this process (its own world-size-1 group) are not the launched ranks'
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(SAT_PATCHES_SHARED_GPU="1", MP_SIZE=str(MP), TRAIN_ITERS=str(ITERS), SAVE_INTERVAL=str(SAVE_AT),
               LOG_INTERVAL="1", EVAL_INTERVAL="100000")
    if tiny:
        env.update(CPU_RANKS="2", WORK_DIR=os.path.join(work, "run"), CUDA_VISIBLE_DEVICES="")
    else:
        env.update(NUM_GPUS_PER_WORKER=str(MP), CUDA_VISIBLE_DEVICES="0", MICRO_BATCH=str(MICRO_BATCH),
                   CHECKPOINT_SKIP_LAYERS="0", MODEL_TYPE=os.path.join(work, "model"),
                   TOKENIZER=os.path.join(work, "tokenizer"), TRAIN_DATA=os.path.join(work, "data", "train"),
                   VALID_DATA=os.path.join(work, "data", "valid"), SAVE_DIR=os.path.join(work, "checkpoints"))
        launcher = deepspeed_bin()
        if launcher:  # DeepSpeed installed with --target: its launcher script is not on PATH
            env["PATH"] = os.pathsep.join([launcher, env.get("PATH", "")])
    env.update(extra)
    return env


def deepspeed_bin():
    """The folder of DeepSpeed's ``deepspeed`` launcher when it is not on PATH (a ``pip install --target`` puts it
    in ``bin/`` beside the packages)."""
    if shutil.which("deepspeed"):
        return None
    import deepspeed
    folder = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(deepspeed.__file__))), "bin")
    return folder if os.path.isfile(os.path.join(folder, "deepspeed")) else None


def saves_dir(work: str, tiny: bool) -> str:
    return os.path.join(work, "run", "checkpoints") if tiny else os.path.join(work, "checkpoints")


def run_dirs(work: str, tiny: bool) -> list:
    """The training runs' directories (each with ``latest``), oldest first; the demo's merged saves left out."""
    found = [d for d in glob.glob(os.path.join(saves_dir(work, tiny), "*"))
             if os.path.isfile(os.path.join(d, "latest")) and not os.path.basename(d).startswith("merged_lora_")]
    return sorted(found, key=os.path.getmtime)


def curve_rows(run_dir: str) -> list:
    """``loss_curve.csv`` of a run, in the order written: (iteration, loss, model-parallel spread). A resumed run
    appends to the curve of the run it continues."""
    path = os.path.join(run_dir, "loss_curve.csv")
    if not os.path.isfile(path):
        return []
    with open(path, newline="") as f:
        return [(int(r["iteration"]), float(r["loss"]), float(r["model_parallel_loss_spread"]))
                for r in csv.DictReader(f)]


def curves(work: str, tiny: bool) -> dict:
    return {d: curve_rows(d) for d in run_dirs(work, tiny)}


def rank_peaks(run_dir: str) -> dict:
    """Each rank's largest ``max_memory_allocated`` in the run's memory ledger, bytes."""
    from sat_patches.diagnostics.ledger_files import MiB, read
    peaks = {}
    for row in read(run_dir):
        peaks[row.rank] = max(peaks.get(row.rank, 0.0), row.cuda_max_alloc_mib * MiB)
    return peaks


def planned_allocated(config: dict, seq_len: int) -> float:
    """The plan's per-GPU bytes for this run at MP=2 (the script's ZeRO-2 config, micro-batch 1, every layer
    checkpointed, LoRA r=10 and what upstream's demo trains) that PyTorch's allocator holds: less the CUDA
    context."""
    from sat_patches.planning import memory, shapes
    setup = memory.Setup(gpus=MP, mp=MP, zero=2, micro_batch=MICRO_BATCH, seq_len=seq_len, lora_rank=10, train="demo",
                       checkpoint_skip_layers=0)
    est = memory.estimate(shapes.plan_config(config), setup)
    return est.per_gpu - est.device.get("CUDA context, NCCL, allocator", 0)


def shard_dtypes(run_dir: str) -> dict:
    """``{shard file: sorted floating dtypes}`` of a run's latest save."""
    from sat_patches.checkpoints import safe_load
    with open(os.path.join(run_dir, "latest")) as f:
        tag = f.read().strip()
    out = {}
    for path in sorted(glob.glob(os.path.join(run_dir, tag, "mp_rank_*_model_states.pt"))):
        module = safe_load.load(path, mmap=True)["module"]
        out[os.path.basename(path)] = sorted({str(t.dtype) for t in module.values() if t.is_floating_point()})
    return out


def with_script(checkout: str, work: str) -> str:
    """A copy of the checkout with the drop-in scripts in its ``finetune_demo/`` (``sat-patches scripts``)."""
    copy = os.path.join(work, "CogVLM")
    for sub in ("utils", "finetune_demo"):
        shutil.copytree(os.path.join(checkout, sub), os.path.join(copy, sub))
    call(sat_patches_cli("scripts", os.path.join(copy, "finetune_demo")), cwd=work, what="sat-patches scripts")
    return copy


def train(rec: Recorder, label: str, copy: str, work: str, tiny: bool, extra=None, expected="", then="") -> dict:
    """One run of the script; the run directory it wrote its steps into (a resumed run: the run it continues)
    and this run's steps, iteration -> (loss, model-parallel spread). ``then`` names what the script does after its
    last step (a row of its own): a failure there leaves the steps' row as the steps went."""
    before = {d: len(rows) for d, rows in curves(work, tiny).items()}
    last = int((extra or {}).get("TRAIN_ITERS", ITERS))
    held, after = {}, None
    with rec.check(label, expected=expected) as row:
        start = time.perf_counter()
        try:
            out = call(["bash", os.path.join(copy, "finetune_demo", SCRIPT)], cwd=work,
                       env=script_env(work, tiny, extra or {}), what=SCRIPT)
        except Failed as failed:
            if not then:
                raise
            out, after = failed.output, failed
        grown = {d: rows[before.get(d, 0):] for d, rows in curves(work, tiny).items() if len(rows) > before.get(d, 0)}
        assert len(grown) == 1, (f"expected one run's steps under {saves_dir(work, tiny)}, found {sorted(grown)}; "
                                 f"the run's output ended: {out[-3000:]}")
        [(run_dir, steps)] = grown.items()
        if after is not None and max(it for it, _, _ in steps) < last:
            raise after  # it stopped before its last step: the steps failed
        held.update(run=run_dir, curve={it: (loss, spread) for it, loss, spread in steps})
        assert "SAT_PATCHES_SHARED_GPU=1" in out, "the ranks did not say they share the GPU"
        row.measured = f"{len(held['curve'])} steps in {time.perf_counter() - start:.0f} s"
        row.detail = "losses " + ", ".join(f"{it}: {loss:.4f}" for it, (loss, _) in sorted(held["curve"].items()))
    if then:
        with rec.check(then) as row:
            if not held:
                raise Skip("needs the run (row above)")
            if after is not None:
                raise after
            row.measured = "ok"
    return held


class HostMemory:
    """The host's memory while a command runs, sampled from ``/proc/meminfo`` every second: the lowest
    ``MemAvailable`` and the highest ``Shmem`` (``/dev/shm`` and other shared memory), bytes."""

    def __init__(self):
        self.lowest_available, self.highest_shared = float("inf"), 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    @staticmethod
    def read() -> dict:
        with open("/proc/meminfo") as f:
            return {line.split(":")[0]: float(line.split()[1]) * 1024 for line in f if line.split()[1:]}

    def _sample(self):
        while True:
            info = self.read()
            self.lowest_available = min(self.lowest_available, info.get("MemAvailable", float("inf")))
            self.highest_shared = max(self.highest_shared, info.get("Shmem", 0.0))
            if self._stop.wait(1.0):
                return

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def __str__(self):
        return (f"host memory available at least {gb(self.lowest_available)}, shared memory at most "
                f"{gb(self.highest_shared)}")


def ranks_agree(rec: Recorder, held: dict) -> None:
    with rec.check("the model-parallel ranks' losses are equal at every step", expected="spread 0") as row:
        if not held:
            raise Skip("needs the run (row above)")
        spreads = {it: spread for it, (_, spread) in held["curve"].items()}
        row.measured = f"largest spread {max(spreads.values()):.3g} over {len(spreads)} steps"
        assert all(s == 0.0 for s in spreads.values()), spreads


def peaks_beside_plan(rec: Recorder, held: dict, config: dict, seq_len: int, label: str) -> None:
    with rec.check(f"per-rank peak CUDA memory beside the plan's row at MP={MP} ({label})") as row:
        if not cuda():
            raise Skip("no CUDA")
        if not held:
            raise Skip("needs the run (row above)")
        planned = planned_allocated(config, seq_len)
        peaks = rank_peaks(held["run"])
        assert sorted(peaks) == list(range(MP)), f"the ledger holds ranks {sorted(peaks)}"
        row.expected = f"plan {gb(planned)} allocated per rank"
        row.measured = "; ".join(f"rank {r} {gb(p)} ({p / planned:.2f}x plan)" for r, p in sorted(peaks.items()))


def run(rec: Recorder, tiny: bool, checkout, scratch: str) -> None:
    """Part u."""
    why = missing(checkout)
    if why:
        with rec.check("the user's path at MP=2 on one card"):
            raise Skip(why)
        return
    if not tiny and not cuda():
        with rec.check("the user's path at MP=2 on one card"):
            raise Skip("no CUDA")
        return
    work = tempfile.mkdtemp(prefix="sat-patches-fork-", dir=scratch)
    try:
        _user_path(rec, tiny, os.path.abspath(checkout), work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def prepare_model(rec: Recorder, checkout: str, work: str, config: dict) -> bool:
    """The MP=1 checkpoint (bf16), tokenizer and CAPTCHAs, made by the checkout's own classes (on the GPU; the
    script's CPU mode makes its own)."""
    import torch
    from sat_patches.runner import checkout_cpu
    with rec.check(f"MP=1 checkpoint by the checkout's classes: {config['num_layers']} language and "
                   f"{config['eva_args']['num_layers']} EVA layers at full width") as row:
        start = time.perf_counter()
        checkout_cpu.prepare(checkout, KIND, work, n_train=16, n_valid=4, config=config, dtype=torch.bfloat16)
        size = sum(os.path.getsize(p) for p in glob.glob(os.path.join(work, "model", "1", "*")))
        row.measured = f"{gb(size)} written in {time.perf_counter() - start:.0f} s"
        return True
    return False


def _user_path(rec: Recorder, tiny: bool, checkout: str, work: str) -> None:
    from sat_patches.planning.shapes import default_seq_len, plan_config
    with rec.check("sat-patches scripts CHECKOUT/finetune_demo") as row:
        copy = with_script(checkout, work)
        row.measured = os.path.join("finetune_demo", SCRIPT)
    if not tiny:
        config = model_config()
        if not prepare_model(rec, copy, work, config):
            return
    else:
        from sat_patches.cogvlm.config import tiny_config
        config = tiny_config(KIND, upstream_classes=True)
    seq_len = default_seq_len(plan_config(config))
    where = "2 CPU ranks" if tiny else "2 ranks sharing cuda:0"
    held = train(rec, f"the checkout's demo through {SCRIPT}: MP={MP}, {where}, {ITERS} steps, a save every "
                      f"{SAVE_AT}", copy, work, tiny)
    ranks_agree(rec, held)
    peaks_beside_plan(rec, held, config, seq_len, f"{LAYERS}+{LAYERS} layers, {seq_len} tokens")
    with rec.check("every saved tensor of each rank's shard in the run's dtype",
                   expected="torch.float32" if tiny else "torch.bfloat16") as row:
        if not held:
            raise Skip("needs the run (row above)")
        dtypes = shard_dtypes(held["run"])
        assert sorted(dtypes) == [f"mp_rank_{r:02d}_model_states.pt" for r in range(MP)], sorted(dtypes)
        assert all(d == [row.expected] for d in dtypes.values()), dtypes
        row.measured = "; ".join(f"{k}: {', '.join(v)}" for k, v in dtypes.items())
    resumed = train(rec, f"the run resumed from iteration {SAVE_AT} (RESUME, RESUME_ITERATION)", copy, work, tiny,
                    extra={"RESUME": held.get("run", ""), "RESUME_ITERATION": str(SAVE_AT)}) if held else {}
    with rec.check(f"the resumed run's losses at iterations {SAVE_AT + 1}..{ITERS} equal the uninterrupted run's",
                   expected="equal") as row:
        if not resumed:
            raise Skip("needs both runs (rows above)")
        later = range(SAVE_AT + 1, ITERS + 1)
        pairs = {it: (held["curve"][it][0], resumed["curve"][it][0]) for it in later}
        row.measured = "; ".join(f"{it}: {a:.6f} / {b:.6f}" for it, (a, b) in pairs.items())
        assert sorted(resumed["curve"]) == list(later), sorted(resumed["curve"])
        assert all(a == b for a, b in pairs.values()), pairs
    merged, hf = os.path.join(work, "merged_mp1"), os.path.join(work, "hf")
    with rec.check("sat-patches merge RUN merged_mp1 (LoRA folded, MP=2 -> 1)") as row:
        if not held:
            raise Skip("needs the run (row above)")
        in_process("merge", held["run"], merged, "--import", "utils.models", checkout=copy)
        row.measured = ", ".join(sorted(os.listdir(os.path.join(merged, "1"))))
    with rec.check("sat-patches export hf merged_mp1 hf") as row:
        if not os.path.isdir(merged):
            raise Skip("needs the merge (row above)")
        in_process("export", "hf", merged, hf, checkout=copy)
        row.measured = f"{len(glob.glob(os.path.join(hf, '*.safetensors')))} safetensors files"
    with rec.check("the export's language weights in transformers' LlamaForCausalLM: the merged model's text-only "
                   "logits", expected="equal (fp32)" if tiny else f"within {EQUAL_BF16:g} of the largest (bf16)") as row:
        if not os.path.isdir(hf):
            raise Skip("needs the export (row above)")
        row.measured = llama_beside_sat(copy, merged, hf, tiny)


def text_ids(vocab: int, seq: int = 24):
    import torch
    generator = torch.Generator().manual_seed(1)
    return torch.randint(3, vocab, (2, seq), generator=generator)


def llama_beside_sat(checkout: str, merged: str, hf: str, tiny: bool) -> str:
    """``max |Llama - SAT|`` on text-only input; raises over the tolerance."""
    import torch
    import transformers
    from exported_llama import llama_config_kwargs, llama_state_dict  # tests/support: on sys.path (proof.run_part)
    from sat_patches.export.stream import mapped_tensors, read_header
    dev, dtype = device(), (torch.float32 if tiny else torch.bfloat16)
    with open(os.path.join(hf, "config.json"), encoding="utf-8") as f:
        hf_config = json.load(f)
    tensors = {}
    for path in sorted(glob.glob(os.path.join(hf, "*.safetensors"))):
        tensors.update(mapped_tensors(path, read_header(path)))
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(**llama_config_kwargs(hf_config)))
    missing_keys, unexpected = llama.load_state_dict(llama_state_dict(tensors, hf_config["hidden_size"]), strict=False)
    assert not unexpected and all("rotary" in k for k in missing_keys), (missing_keys, unexpected)
    llama = llama.to(dev, dtype).eval()
    ids = text_ids(hf_config["vocab_size"]).to(dev)
    with torch.no_grad():
        theirs = llama(input_ids=ids).logits.float().cpu()
    del llama, tensors
    ours = merged_text_logits(checkout, merged, ids, dev, dtype)
    diff, largest = float((ours - theirs).abs().max()), float(ours.abs().max())
    bound = EQUAL_FP32 if tiny else EQUAL_BF16 * largest
    assert largest > 100 * EQUAL_FP32, "the merged model's logits are near zero: nothing to compare"
    assert diff <= bound, f"max |Llama - SAT| {diff:.3g} > {bound:.3g}"
    return f"max |Llama - SAT| {diff:.2g} (<= {bound:.2g}), largest logit {largest:.3g}, transformers {transformers.__version__}"


def merged_text_logits(checkout: str, merged: str, ids, dev, dtype):
    """The merged MP=1 model, in the checkout's own class, on text-only input (every token a language token)."""
    import argparse
    import torch
    from sat_patches.runner import checkout_cpu
    with open(os.path.join(merged, "model_config.json"), encoding="utf-8") as f:
        name = json.load(f)["model_class"]
    cls = checkout_cpu.checkout_class(checkout, name)
    run_args = argparse.Namespace(deepspeed=None, local_rank=0, rank=0, world_size=1, model_parallel_size=1,
                                  mode="inference", skip_init=True, use_gpu_initialization=False, device=dev.type,
                                  bf16=dtype == torch.bfloat16, fp16=False)
    with checkout_cpu.checkout_on_path(checkout):
        checkout_cpu._single_process()
        model = cls.from_pretrained(merged, run_args)[0]
    model = model.to(dev, dtype).eval()
    seq = ids.shape[1]
    language = torch.zeros_like(ids)
    with torch.no_grad():
        return model(input_ids=ids, vision_expert_mask=language, image_embed_mask=language,
                     position_ids=torch.arange(seq, device=dev).expand_as(ids),
                     attention_mask=torch.ones(1, 1, seq, seq, device=dev, dtype=dtype).tril())[0].float().cpu()


def whole(rec: Recorder, tiny: bool, checkout, scratch: str) -> None:
    """Part w."""
    label = f"full-size {MODEL} at MP={MP}, 2 ranks sharing one card"
    with rec.check(f"{label}: does the card hold both ranks?") as row:
        why = missing(checkout) or ("" if cuda() else "no CUDA")
        if why:
            raise Skip(why)
        import torch
        from sat_patches.planning.shapes import default_seq_len, plan_config
        config = model_config(full_depth=True)
        seq_len = default_seq_len(plan_config(config))
        planned = planned_allocated(config, seq_len)
        card = torch.cuda.get_device_properties(0).total_memory
        row.expected = f"2 x {gb(planned)} planned"
        row.measured = f"card {gb(card)}"
        if 2 * planned > 0.95 * card:
            raise Skip(f"2 ranks x {gb(planned)} planned do not fit the card's {gb(card)}")
    if not row.status == "ok":
        return
    work = tempfile.mkdtemp(prefix="sat-patches-whole-", dir=scratch)
    try:
        copy = with_script(os.path.abspath(checkout), work)
        if prepare_model(rec, copy, work, config):
            # the demo saves its merged model (17B, bf16) under ./checkpoints: where the machine has more room
            room = max([work] + [d for d in ("/dev/shm",) if os.path.isdir(d)],
                       key=lambda d: shutil.disk_usage(d).free)
            print(f"[w] the demo's saves go to {room}: {gb(shutil.disk_usage(room).free)} free; "
                  f"{gb(HostMemory.read().get('MemAvailable', 0))} of host memory available", flush=True)
            cwd = tempfile.mkdtemp(prefix="demo-", dir=room)
            with HostMemory() as memory:
                held = train(rec, f"{label}: {WHOLE_ITERS} steps", copy, cwd, False,
                             then=f"the demo's own merged save after the steps (in {room})",
                             extra={"TRAIN_ITERS": str(WHOLE_ITERS), "SAVE_INTERVAL": "100000",
                                    "MODEL_TYPE": os.path.join(work, "model"),
                                    "TOKENIZER": os.path.join(work, "tokenizer"),
                                    "TRAIN_DATA": os.path.join(work, "data", "train"),
                                    "VALID_DATA": os.path.join(work, "data", "valid"),
                                    "SAVE_DIR": os.path.join(cwd, "checkpoints")})
            with rec.check("host memory while the demo ran (sampled every second)") as row:
                row.measured = str(memory)
            ranks_agree(rec, held)
            peaks_beside_plan(rec, held, config, seq_len, f"{MODEL}, {seq_len} tokens")
            shutil.rmtree(cwd, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)

