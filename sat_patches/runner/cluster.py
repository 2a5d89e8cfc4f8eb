"""Several machines: how the finetune scripts start the ranks of every node.

- DeepSpeed's hostfile (``HOST_FILE``): the script runs once, DeepSpeed starts every node over ssh (pdsh);
- torchrun's rendezvous: the script runs on every node with ``NNODES``, ``NODE_RANK`` (this node's index),
  ``MASTER_ADDR`` (node 0's address) and ``MASTER_PORT``; no hostfile, no ssh;
- Slurm: ``srun --ntasks-per-node=1 bash finetune_cogvlm.sh`` runs it once per node, and those four come from
  Slurm's variables (``SLURM_NNODES``, ``SLURM_NODEID``, the first host of ``SLURM_JOB_NODELIST``), the GPUs per
  node from ``SLURM_GPUS_ON_NODE``.

What the user sets wins over what Slurm says.
"""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from typing import Dict, List, Optional


def first_host(nodelist: str) -> str:
    """The first host of a Slurm node list (``node[01-04,07],gpu5`` -> ``node01``): ``scontrol show hostnames``
    where Slurm's tools are installed, else the list's own first entry."""
    if shutil.which("scontrol"):
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True)
        if out.returncode == 0 and out.stdout.split():
            return out.stdout.split()[0]
    entry = re.match(r"[^,\[]*(\[[^\]]*\])?[^,]*", nodelist).group(0)
    ranges = re.search(r"\[([^\]]*)\]", entry)
    if not ranges:
        return entry
    first = re.split(r"[,-]", ranges.group(1))[0]  # the first number, its zero padding kept
    return entry[:ranges.start()] + first + entry[ranges.end():]


def slurm_settings(environ: Dict[str, str]) -> Dict[str, str]:
    """``NNODES``, ``NODE_RANK``, ``MASTER_ADDR`` and ``NUM_GPUS_PER_WORKER`` from Slurm's variables, inside a
    Slurm job step (``srun``); empty elsewhere."""
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    if not (nodelist and environ.get("SLURM_NODEID") and environ.get("SLURM_STEP_ID") is not None):
        return {}
    out = {"NNODES": environ.get("SLURM_NNODES") or environ.get("SLURM_JOB_NUM_NODES") or "1",
           "NODE_RANK": environ["SLURM_NODEID"], "MASTER_ADDR": first_host(nodelist)}
    gpus = re.search(r"(\d+)$", environ.get("SLURM_GPUS_ON_NODE") or environ.get("SLURM_GPUS_PER_NODE") or "")
    if gpus:
        out["NUM_GPUS_PER_WORKER"] = gpus.group(1)
    return out


def hostfile_nodes(path: str) -> Optional[int]:
    """Hosts in a DeepSpeed hostfile (lines ``host slots=N``; ``#`` comments), None where it cannot be read."""
    try:
        with open(path) as f:
            return sum(1 for line in f if line.split("#")[0].strip())
    except OSError:
        return None


def node_settings(environ: Dict[str, str]) -> Dict[str, str]:
    """What the launcher says about this node (Slurm's variables; the hostfile's nodes), for the settings the
    user left unset."""
    found = slurm_settings(environ)
    nodes = hostfile_nodes(environ["HOST_FILE"]) if environ.get("HOST_FILE") else None
    if nodes:
        found["NNODES"] = str(nodes)
    return {k: v for k, v in found.items() if not environ.get(k)}


def slurm_errors(environ: Dict[str, str]) -> List[str]:
    """Slurm starting more than one copy of the script per node (each would start every rank of the node)."""
    tasks, nodes = environ.get("SLURM_STEP_NUM_TASKS") or environ.get("SLURM_NTASKS"), environ.get("SLURM_NNODES")
    if not slurm_settings(environ) or not tasks or not nodes or tasks == nodes:
        return []
    return [f"Slurm runs {tasks} copies of this script on {nodes} node(s): it starts every rank of its node itself, "
            f"so run one task per node: srun --nodes={nodes} --ntasks-per-node=1 bash "
            f"finetune_{environ.get('MODEL_KIND', 'cogvlm')}.sh."]


def node_errors(env: Dict[str, str], nnodes: int, per_node: int, mp: int, unit: str) -> List[str]:
    """Several nodes without a hostfile: where this node sits, and model-parallel groups within a node."""
    errors = []
    if nnodes > 1 and per_node % mp:
        fits = [d for d in range(1, per_node + 1) if per_node % d == 0]
        errors.append(f"MP_SIZE={mp} does not divide the {per_node} ranks of a node ({unit}={per_node}): a "
                      f"model-parallel group stays within a node; set MP_SIZE to one of {fits}.")
    if nnodes < 2 or (env.get("HOST_FILE") and not env.get("CPU_RANKS")):
        return errors
    rank = env.get("NODE_RANK", "")
    if not rank or not env.get("MASTER_ADDR"):
        errors.append(f"NNODES={nnodes} without HOST_FILE: start this script on every node with NODE_RANK=<0 to "
                      f"{nnodes - 1}> and MASTER_ADDR=<node 0's address> (and the same MASTER_PORT), or under "
                      f"srun --ntasks-per-node=1 (Slurm), or set HOST_FILE (DeepSpeed starts every node over ssh).")
    elif not rank.isdigit() or int(rank) >= nnodes:
        errors.append(f"NODE_RANK={rank} is out of range for NNODES={nnodes}: set NODE_RANK to this node's index, "
                      f"0 to {nnodes - 1} (0 on the node at MASTER_ADDR={env['MASTER_ADDR']}).")
    return errors


def node_line(env: Dict[str, str]) -> str:
    slurm = " (Slurm's variables)" if slurm_settings(env) else ""
    return (f"node {env['NODE_RANK']} of {env['NNODES']}{slurm}: torchrun's rendezvous at "
            f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}")


def torchrun(env: Dict[str, str], per_node: str) -> List[str]:
    """``python -m torch.distributed.run`` starting ``per_node`` ranks on this node (of ``NNODES``)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", per_node]
    if multi_node(env):
        cmd += ["--nnodes", env["NNODES"], "--node-rank", env["NODE_RANK"], "--master-addr", env["MASTER_ADDR"]]
    return cmd + ["--master-port", env["MASTER_PORT"]]


def multi_node(env: Dict[str, str]) -> bool:
    return int(env.get("NNODES") or 1) > 1


def first_node(env: Dict[str, str]) -> bool:
    """This node prepares and, after training, merges and checks (its ranks hold rank 0's saves)."""
    return not multi_node(env) or env.get("NODE_RANK", "0") == "0"
