"""``sat-patches doctor``'s checks: each a function of a :class:`~.doctor_facts.Facts` snapshot (so each can be
tested with made-up facts) returning a :class:`Check` that says what to do about a problem."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, List, Optional

from .. import hf_recipes
from ..core import settings
from ..core.registry import IN_ORDER, VERIFIED_SAT
from .doctor_facts import Facts

OK, INFO, WARN, FAIL = "ok", "info", "warn", "FAIL"
# PYTORCH_CUDA_ALLOC_CONF options torch 2.x knows (c10 allocator config and the CUDA allocator's own)
ALLOC_CONF_KEYS = {"max_split_size_mb", "max_non_split_rounding_mb", "roundup_power2_divisions",
                   "garbage_collection_threshold", "expandable_segments", "large_segment_size_mb", "backend",
                   "release_lock_on_cudamalloc", "pinned_use_cuda_host_register", "pinned_num_register_threads",
                   "pinned_use_background_threads", "pinned_max_cached_size_mb", "pinned_max_round_threshold_mb",
                   "per_process_memory_fraction", "graph_capture_record_stream_reuse",
                   "pinned_reserve_segment_size_mb"}


@dataclass
class Check:
    name: str
    status: str
    summary: str
    fix: str = ""


def check_torch(f: Facts) -> Check:
    v = f.versions
    build = f"CUDA {v['torch_cuda']} build" if v.get("torch_cuda") else "CPU build"
    seen = f.smi_gpus or 0
    if seen and not v.get("torch_cuda"):
        return Check("torch", FAIL, f"torch {v['torch']} is a CPU build but nvidia-smi lists {seen} GPU(s)",
                     "install torch's CUDA build for this driver (https://pytorch.org/get-started/locally/)")
    if seen and not f.cuda_available:
        return Check("torch", FAIL, f"torch {v['torch']} ({build}) cannot use the {seen} GPU(s) nvidia-smi lists",
                     "the driver is older than torch's CUDA or CUDA_VISIBLE_DEVICES hides them: compare "
                     "`nvidia-smi` (CUDA version) with torch.version.cuda and install a matching torch build")
    if not f.cuda_available:
        return Check("torch", INFO, f"torch {v['torch']} ({build}); no GPU: ranks train on CPU over gloo")
    return Check("torch", OK, f"torch {v['torch']} ({build}), {len(f.gpus)} GPU(s) visible")


def check_nccl(f: Facts) -> Check:
    if not f.cuda_available:
        return Check("nccl", INFO, "not needed without CUDA (sat_patches gives CPU tensors gloo)")
    if not f.versions.get("nccl"):
        return Check("nccl", FAIL, "torch has no NCCL: multi-GPU collectives cannot run",
                     "install a torch CUDA build from pytorch.org (it bundles NCCL)")
    return Check("nccl", OK, f"NCCL {f.versions['nccl']}")


def check_sat(f: Facts) -> Check:
    version = f.versions.get("sat")
    if not version:
        return Check("sat", FAIL, "SwissArmyTransformer is not installed",
                     f"pip install SwissArmyTransformer=={VERIFIED_SAT}")
    if version != VERIFIED_SAT:
        return Check("sat", WARN, f"SwissArmyTransformer {version}; sat_patches is verified on {VERIFIED_SAT}",
                     f"pip install SwissArmyTransformer=={VERIFIED_SAT}, or see `sat-patches status` for "
                     f"patches skipped because SAT's code differs")
    return Check("sat", OK, f"SwissArmyTransformer {version}")


def check_deepspeed(f: Facts) -> Check:
    version = f.versions.get("deepspeed")
    if not version:
        return Check("deepspeed", FAIL, "DeepSpeed is not installed (SAT trains only through DeepSpeed)",
                     "pip install deepspeed")
    return Check("deepspeed", OK, f"DeepSpeed {version}")


def check_bitsandbytes(f: Facts) -> Check:
    version = f.versions.get("bitsandbytes")
    if not version:
        return Check("bitsandbytes", WARN, "bitsandbytes is not installed: QLoRA (--use_qlora) cannot run",
                     "pip install bitsandbytes (LoRA without quantisation does not need it)")
    if f.cuda_available and not f.bnb_cuda:
        return Check("bitsandbytes", WARN, f"bitsandbytes {version} has no working CUDA binary: QLoRA fails",
                     "pip install --force-reinstall bitsandbytes (a wheel for your CUDA); check "
                     "`python -m bitsandbytes`")
    detail = "CUDA binary loaded" if f.bnb_cuda else "CPU only"
    return Check("bitsandbytes", OK if f.cuda_available or f.bnb_cuda else INFO, f"bitsandbytes {version} ({detail})")


def check_ninja(f: Facts) -> Check:
    if f.ninja:
        return Check("ninja", OK, f"ninja found ({f.ninja})")
    if f.cuda_available:
        return Check("ninja", WARN, "ninja is missing: DeepSpeed cannot JIT-build FusedAdam/CPU-Adam",
                     "pip install ninja (or use prebuilt DeepSpeed ops: DS_BUILD_OPS=1 pip install deepspeed)")
    return Check("ninja", INFO, "ninja is missing; not needed on CPU ranks (sat_patches uses torch's Adam there)")


def check_gpus(f: Facts) -> Check:
    if not f.gpus:
        return Check("gpus", INFO, "no GPU visible")
    kinds = sorted({(g["name"], g["memory_gb"]) for g in f.gpus})
    drivers = sorted({str(g.get("driver")) for g in f.gpus if g.get("driver")})
    text = ", ".join(f"{sum(1 for g in f.gpus if (g['name'], g['memory_gb']) == k)} x {k[0]} ({k[1]} GB)" for k in kinds)
    text += f"; driver {', '.join(drivers) or 'unknown'}"
    if len(kinds) > 1 or len(drivers) > 1:
        return Check("gpus", WARN, f"mixed GPUs: {text}",
                     "the smallest card bounds every rank: make only one model visible with CUDA_VISIBLE_DEVICES, "
                     "and run one driver version")
    return Check("gpus", OK, text)


def check_host_memory(f: Facts) -> Check:
    if f.host_total_gb is None:
        return Check("host memory", WARN, "cannot read /proc/meminfo", "check free -g by hand")
    text = f"{f.host_total_gb:.0f} GB total, {f.host_available_gb:.0f} GB available"
    if f.host_needed_gb is None:
        return Check("host memory", INFO, text + "; pass --model (and --gpus/--gpu-mem) to check it against a plan")
    text += f"; the planned run needs about {f.host_needed_gb:.0f} GB{f.host_needed_note}"
    if f.host_available_gb < f.host_needed_gb:
        return Check("host memory", FAIL, text,
                     "free host memory, run fewer ranks per node, or pick a plan that needs less "
                     "(`sat-patches plan --host-mem <GB>` lists them; optimizer offload costs host memory)")
    return Check("host memory", OK, text)


def _visible(f: Facts) -> Optional[int]:
    cvd = f.env.get("CUDA_VISIBLE_DEVICES")
    if cvd is not None:
        return len([d for d in cvd.split(",") if d.strip() and d.strip() != "-1"])
    if f.cuda_available:
        return len(f.gpus)
    return None


def check_ranks_env(f: Facts) -> Check:
    env, problems, fixes = f.env, [], []

    def number(name, source=env):
        raw = source.get(name)
        if raw in (None, ""):
            return None
        try:
            return int(raw)
        except ValueError:
            problems.append(f"{name}={raw!r} is not a number")
            fixes.append(f"set {name} to a whole number or unset it")
            return None
    lws, ws, rank = number("LOCAL_WORLD_SIZE"), number("WORLD_SIZE"), number("RANK")
    ds_lws = number("LOCAL_WORLD_SIZE", f.deepspeed_env)
    visible = _visible(f)
    cvd = env.get("CUDA_VISIBLE_DEVICES")
    if cvd and f.smi_gpus:
        bad = [d for d in cvd.split(",") if d.strip().isdigit() and int(d) >= f.smi_gpus]
        if bad:
            problems.append(f"CUDA_VISIBLE_DEVICES={cvd} names GPU {', '.join(bad)} but nvidia-smi lists {f.smi_gpus}")
            fixes.append(f"use indices 0-{f.smi_gpus - 1}")
    gpu_run = f.cuda_available or bool(f.smi_gpus)
    for name, value in (("LOCAL_WORLD_SIZE", lws), (".deepspeed_env LOCAL_WORLD_SIZE", ds_lws)):
        if value is not None and gpu_run and visible is not None and value > visible:
            problems.append(f"{name}={value} but {visible} GPU(s) are visible (SAT builds no node groups: "
                            f"'node group is not initialized')")
            fixes.append(f"set LOCAL_WORLD_SIZE={visible} (NUM_GPUS_PER_WORKER in upstream's scripts writes it to "
                         f".deepspeed_env) or unset it")
    if ws is not None and lws is not None and (ws < lws or ws % lws):
        problems.append(f"WORLD_SIZE={ws} is not a multiple of LOCAL_WORLD_SIZE={lws}")
        fixes.append("give every node the same number of ranks, or fix WORLD_SIZE")
    if ws is not None and rank is not None and rank >= ws:
        problems.append(f"RANK={rank} but WORLD_SIZE={ws}")
        fixes.append("unset stale RANK/WORLD_SIZE left in the shell; the launcher sets them")
    shown = ", ".join(f"{k}={env[k]}" for k in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "RANK", "CUDA_VISIBLE_DEVICES")
                      if k in env) or "no launcher variables set"
    if f.deepspeed_env:
        shown += f"; .deepspeed_env: {', '.join(f'{k}={v}' for k, v in f.deepspeed_env.items())}"
    if problems:
        return Check("ranks env", FAIL, "; ".join(problems), "; ".join(fixes))
    return Check("ranks env", OK, shown)


_HOST_LINE = re.compile(r"^\s*(\S+)(\s+slots\s*=\s*(\d+))?\s*(#.*)?$")


def check_hostfile(f: Facts) -> Check:
    if f.hostfile_error:
        return Check("hostfile", FAIL, f"{f.hostfile} cannot be read: {f.hostfile_error}",
                     "fix its permissions, or drop --hostfile for a single node")
    if f.hostfile_text is None:
        return Check("hostfile", INFO, f"no {f.hostfile}: the DeepSpeed launcher uses every local GPU (one node)")
    hosts, bad = [], []
    for line in f.hostfile_text.splitlines():
        if not line.strip() or line.strip().startswith("#"):
            continue
        m = _HOST_LINE.match(line)
        if not m or not m.group(2):
            bad.append(line.strip())
        else:
            hosts.append((m.group(1), int(m.group(3))))
    if bad or not hosts:
        what = f"lines DeepSpeed cannot parse: {bad[:3]}" if bad else "no hosts"
        return Check("hostfile", FAIL, f"{f.hostfile}: {what}",
                     "write one 'hostname slots=<GPUs>' line per node")
    return Check("hostfile", OK, f"{f.hostfile}: {len(hosts)} host(s), {sum(s for _, s in hosts)} slots")


def _alloc_conf_problems(value: str):
    """(malformed items, unknown option names) of a PYTORCH_CUDA_ALLOC_CONF value."""
    malformed, unknown = [], []
    for item in filter(None, (p.strip() for p in value.split(","))):
        key, sep, val = item.partition(":")
        if not sep or not val.strip():
            malformed.append(f"'{item}' is not option:value")
        elif key.strip() not in ALLOC_CONF_KEYS:
            unknown.append(key.strip())
    return malformed, unknown


def _usable_interfaces(ifname: str, interfaces: List[str]) -> List[str]:
    """NCCL's reading: comma-separated prefixes; a leading ^ excludes them, a leading = matches exactly."""
    exclude = ifname.startswith("^")
    rest = ifname.lstrip("^")
    exact = rest.startswith("=")
    names = [w.strip() for w in rest.lstrip("=").split(",") if w.strip()]
    def matches(i):
        return any(i == w if exact else i.startswith(w) for w in names)
    return [i for i in interfaces if matches(i) != exclude]


def check_comm_env(f: Facts) -> Check:
    env = f.env
    shown = sorted(k for k in env if k.startswith(("NCCL_", "TORCH_NCCL_")) or k == "PYTORCH_CUDA_ALLOC_CONF")
    fails, warns = [], []
    conf = env.get("PYTORCH_CUDA_ALLOC_CONF")
    malformed, unknown = _alloc_conf_problems(conf or "")
    example = "use e.g. PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True or max_split_size_mb:128"
    if malformed:
        fails.append((f"PYTORCH_CUDA_ALLOC_CONF={conf}: {'; '.join(malformed)} (torch raises at the first CUDA "
                      f"allocation)", example))
    if unknown:
        warns.append((f"PYTORCH_CUDA_ALLOC_CONF={conf}: option(s) {', '.join(unknown)} unknown to torch 2.x "
                      f"(a typo raises at the first CUDA allocation)", example))
    ifname = env.get("NCCL_SOCKET_IFNAME")
    if ifname and f.net_interfaces and not _usable_interfaces(ifname, f.net_interfaces):
        fails.append((f"NCCL_SOCKET_IFNAME={ifname} matches no interface here ({', '.join(f.net_interfaces)})",
                      "set it to an interface `ip addr` lists, or unset it"))
    for name in ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING"):
        if env.get(name) == "0":
            warns.append((f"{name}=0: a timed-out NCCL collective never aborts, the job hangs",
                          f"unset {name} (sat_patches' hang watchdog still dumps stacks)"))
    if env.get("NCCL_DEBUG", "").upper() in ("INFO", "TRACE"):
        warns.append((f"NCCL_DEBUG={env['NCCL_DEBUG']}: very verbose logs", "unset NCCL_DEBUG once NCCL works"))
    text = ", ".join(f"{k}={env[k]}" for k in shown) or "no NCCL_*/PYTORCH_CUDA_ALLOC_CONF set"
    for status, found in ((FAIL, fails), (WARN, warns)):
        if found:
            return Check("nccl/alloc env", status, "; ".join(p for p, _ in found), "; ".join(x for _, x in found))
    return Check("nccl/alloc env", OK, text)


def check_collective_timeout(f: Facts) -> Check:
    name = "SAT_PATCHES_COLLECTIVE_TIMEOUT"
    try:
        seconds = settings.read(name, f.env)
    except settings.SettingError as exc:
        return Check("hang dumps", FAIL, str(exc), f"set {name}=1800 (seconds) or unset it")
    if seconds is None:
        return Check("hang dumps", INFO, f"{name} unset: a stuck collective is dumped after torch's default 30 min")
    return Check("hang dumps", OK, f"a collective stuck {seconds:g} s dumps every rank's stacks and ends the run")


def check_settings(f: Facts) -> Check:
    """Every ``SAT_PATCHES_*`` variable set here is one sat_patches knows, with a value it can read."""
    rows = settings.table(f.env)
    bad = [r["problem"] for r in rows if r["problem"]]
    unknown = sorted(k for k in f.env if k.startswith("SAT_PATCHES_") and k not in settings.SETTINGS)
    if bad:
        return Check("settings", FAIL, "; ".join(bad), "set each as it says, or unset it")
    if unknown:
        return Check("settings", WARN, f"unknown setting(s) {', '.join(unknown)}: nothing reads them",
                     "check the spelling against the settings table below")
    chosen = [f"{r['name']}={r['value']}" for r in rows if r["value"]]
    return Check("settings", OK, ", ".join(chosen) or "all SAT_PATCHES_* settings at their defaults")


def check_patches(f: Facts) -> Check:
    bad = [p for p in f.patches if p.get("status") not in IN_ORDER]
    disabled = [p["name"] for p in f.patches if p.get("status") == "disabled"]
    applied = sum(1 for p in f.patches if p.get("status") == "applied")
    if bad:
        return Check("patches", WARN, f"{len(bad)} not applied: " + "; ".join(f"{p['name']} ({p['status']}: "
                                                                            f"{p.get('reason', '')[:80]})" for p in bad[:3]),
                     "see `sat-patches status`; a skipped patch means SAT's code differs from " + VERIFIED_SAT)
    waiting = sum(1 for p in f.patches if p.get("status") == "waiting")
    text = (f"{applied} applied" + (f", {waiting} waiting for a CogVLM fork's model code" if waiting else "")
            + (f", disabled: {', '.join(disabled)}" if disabled else ""))
    return Check("patches", OK, text)


def check_report_deps(f: Facts) -> Check:
    if f.versions.get("matplotlib"):
        return Check("report", OK, f"matplotlib {f.versions['matplotlib']} (sat-patches report draws PNGs)")
    return Check("report", WARN, "matplotlib is missing: sat-patches report cannot draw the memory ledger",
                 "pip install 'sat_patches[report]'")


def check_hf_recipes(f: Facts) -> Check:
    """The installed transformers/accelerate against the version set the README's Hugging Face recipes were run
    with (:mod:`sat_patches.hf_recipes`): a pair known to break the 4-bit load is a warning, with the fix; other
    versions outside the set are information (the recipes are optional)."""
    transformers, accelerate = f.versions.get("transformers"), f.versions.get("accelerate")
    fix = f"{hf_recipes.EXTRA} (the tested set: {' '.join(hf_recipes.PINS)})"
    if not transformers:
        return Check("hf recipes", INFO, f"no transformers; the README's Hugging Face recipes: {hf_recipes.EXTRA}")
    t = hf_recipes.release(transformers)
    if t >= hf_recipes.FIRST_TRANSFORMERS_WITHOUT_REMOTE_CODE:
        return Check("hf recipes", INFO, f"transformers {transformers}: the released CogVLM code needs 4.x; for the "
                     f"README's Hugging Face recipes: {hf_recipes.EXTRA}")
    a = hf_recipes.release(accelerate) if accelerate else ()
    broken_t, broken_a = hf_recipes.BROKEN_4BIT
    if t[:2] <= hf_recipes.LAST_TRANSFORMERS_OF_THE_PAIR and a >= hf_recipes.FIRST_ACCELERATE_OF_THE_PAIR:
        return Check("hf recipes", WARN, f"transformers {transformers} with accelerate {accelerate}: the 4-bit load "
                     f"fails ('.to is not supported for 4-bit or 8-bit bitsandbytes models'; measured with "
                     f"transformers {broken_t} and accelerate {broken_a})", fix)
    tested = (hf_recipes.pinned("transformers"), hf_recipes.pinned("accelerate"))
    if (transformers, accelerate) == tested:
        return Check("hf recipes", OK, f"transformers {transformers}, accelerate {accelerate} (the tested set)")
    return Check("hf recipes", INFO, f"transformers {transformers}, accelerate {accelerate or '-'}; the Hugging Face "
                 f"recipes were run with {tested[0]} and {tested[1]}: {hf_recipes.EXTRA}")


CHECKS: List[Callable[[Facts], Check]] = [
    check_torch, check_nccl, check_sat, check_deepspeed, check_bitsandbytes, check_ninja, check_gpus,
    check_host_memory, check_ranks_env, check_hostfile, check_comm_env, check_collective_timeout, check_settings,
    check_patches,
    check_report_deps, check_hf_recipes,
]


def run(facts: Facts) -> List[Check]:
    return [check(facts) for check in CHECKS]
