"""What ``sat-patches doctor`` looks at, gathered from this machine: versions, GPUs, host memory, the environment,
the hostfile and ``.deepspeed_env``, the patches' status; the host memory a planned run needs."""
from __future__ import annotations

import os
import platform
import shutil
import subprocess
from dataclasses import dataclass, field
from importlib import metadata
from typing import Dict, List, Optional

import sat_patches

from ..core.registry import VERIFIED_SAT
from ..planning import memory, search, shapes


@dataclass
class Facts:
    """What the checks look at; :func:`gather` reads it from this machine."""
    env: Dict[str, str] = field(default_factory=dict)
    versions: Dict[str, Optional[str]] = field(default_factory=dict)   # torch, torch_cuda, nccl, sat, ...
    cuda_available: bool = False
    gpus: List[Dict[str, object]] = field(default_factory=list)        # name, memory_gb, driver
    smi_gpus: Optional[int] = None                                      # what nvidia-smi lists (None: no nvidia-smi)
    bnb_cuda: Optional[bool] = None                                     # bitsandbytes loaded a CUDA binary
    ninja: Optional[str] = None
    host_total_gb: Optional[float] = None
    host_available_gb: Optional[float] = None
    host_needed_gb: Optional[float] = None                              # from a plan (--model)
    host_needed_note: str = ""
    hostfile: str = "hostfile"
    hostfile_text: Optional[str] = None                                 # None: no such file
    hostfile_error: Optional[str] = None
    deepspeed_env: Dict[str, str] = field(default_factory=dict)         # .deepspeed_env (cwd, then ~)
    net_interfaces: List[str] = field(default_factory=list)
    patches: List[dict] = field(default_factory=list)



def _version(dist_name: str) -> Optional[str]:
    try:
        return metadata.version(dist_name)
    except metadata.PackageNotFoundError:
        return None


def _meminfo() -> Dict[str, float]:
    try:
        with open("/proc/meminfo") as f:
            values = {k: int(v.split()[0]) / 1e6 for k, v in (line.split(":", 1) for line in f)}
        return {"total": values["MemTotal"], "available": values.get("MemAvailable", values["MemFree"])}
    except (OSError, KeyError, ValueError):
        return {}


def _smi() -> Optional[List[List[str]]]:
    if not shutil.which("nvidia-smi"):
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [[c.strip() for c in line.split(",")] for line in out.stdout.splitlines() if line.strip()]


def _env_file(*paths: str) -> Dict[str, str]:
    for path in paths:
        if os.path.isfile(path):
            with open(path) as f:
                return dict(line.strip().split("=", 1) for line in f if "=" in line and not line.startswith("#"))
    return {}


def gather(hostfile: str = "hostfile") -> Facts:
    import torch  # the CLI starts without torch; doctor reads it only when it runs
    facts = Facts(env=dict(os.environ), hostfile=hostfile)
    v = facts.versions
    v["python"] = platform.python_version()
    v["torch"], v["torch_cuda"] = torch.__version__, torch.version.cuda
    v["sat"] = _version("SwissArmyTransformer")
    for name in ("deepspeed", "bitsandbytes", "matplotlib", "transformers", "accelerate", "sat_patches"):
        v[name] = _version(name)
    facts.cuda_available = torch.cuda.is_available()
    if facts.cuda_available:
        try:
            v["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # noqa: BLE001  (a build without NCCL)
            v["nccl"] = None
    smi = _smi()
    facts.smi_gpus = None if smi is None else len(smi)
    drivers = [row[1] for row in smi or [] if len(row) > 1]
    for i in range(torch.cuda.device_count() if facts.cuda_available else 0):
        props = torch.cuda.get_device_properties(i)
        facts.gpus.append({"name": props.name, "memory_gb": round(props.total_memory / 1e9, 1),
                           "driver": drivers[i] if i < len(drivers) else None})
    if v["bitsandbytes"]:
        try:
            import bitsandbytes.cextension as cext  # optional (the CLI starts without it); whether it loads is checked
            cuda_library = getattr(cext, "CudaBNBNativeLibrary", None)   # bitsandbytes >= 0.44
            facts.bnb_cuda = bool((cuda_library and isinstance(getattr(cext, "lib", None), cuda_library))
                                  or getattr(cext, "COMPILED_WITH_CUDA", False))
        except Exception:  # noqa: BLE001  (bitsandbytes fails to import: reported as no CUDA binary)
            facts.bnb_cuda = False
    facts.ninja = shutil.which("ninja") or (_version("ninja") and "python package ninja")
    mem = _meminfo()
    facts.host_total_gb, facts.host_available_gb = mem.get("total"), mem.get("available")
    if os.path.exists(hostfile):
        try:
            with open(hostfile) as f:
                facts.hostfile_text = f.read()
        except OSError as exc:
            facts.hostfile_error = str(exc)
    facts.deepspeed_env = _env_file(".deepspeed_env", os.path.expanduser("~/.deepspeed_env"))
    try:
        facts.net_interfaces = sorted(os.listdir("/sys/class/net"))
    except OSError:
        facts.net_interfaces = []
    try:
        facts.patches = sat_patches.status()
    except Exception as exc:  # noqa: BLE001
        facts.patches = [{"name": "import sat_patches", "status": "error", "reason": str(exc), "target": ""}]
    return facts


def plan_host_need(facts: Facts, model: str, gpus: Optional[int], gpu_mem: Optional[float]) -> None:
    """Fill ``host_needed_gb`` from the plan ``sat-patches plan`` would recommend."""
    gpus = gpus or len(facts.gpus)
    gpu_mem = gpu_mem or (min(g["memory_gb"] for g in facts.gpus) if facts.gpus else None)
    if not gpus or not gpu_mem:
        return
    config = shapes.resolve_model(model)
    best = search.recommend(search.options(config, gpus, gpu_mem, seq_len=shapes.default_seq_len(config)))
    if best is None:
        facts.host_needed_note = f" (no plan fits {gpus} x {gpu_mem:g} GB for {model})"
        return
    e = best.estimate
    facts.host_needed_gb = e.host_node / memory.GB
    facts.host_needed_note = (f" for {model} at MP_SIZE={e.setup.mp} (stock SwissArmyTransformer {VERIFIED_SAT} without sat_patches: "
                              f"~{e.host_stock_node / memory.GB:.0f} GB)")
