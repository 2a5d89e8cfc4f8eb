"""Process group and argument patches: a backend for CPU tensors, and SAT's CPU device check.

SAT creates an NCCL-only process group (``--distributed-backend nccl``) and then runs collectives
on CPU tensors (parameter sync, model-parallel split): ``RuntimeError: No backend type associated
with device type cpu`` (CogVLM 328, SAT 173). The policy here gives CPU tensors gloo.
"""
from __future__ import annotations

import argparse
import functools

import torch
import torch.distributed as dist

from . import devices
from ._registry import Patch, expect_names, expect_params


def process_group_backend(requested: str = "nccl") -> str:
    """The backend string to create the process group with, so that CPU tensors have a backend.

    ``gloo``/``ucc``/``mpi`` (they serve CPU) and mapping strings that already name a CPU backend
    stay as they are. A backend that serves only CUDA (``nccl``, or one registered with
    ``devices=["cuda"]``) becomes ``cpu:gloo,cuda:<it>``; plain ``nccl`` on a machine without CUDA or
    NCCL becomes ``gloo``.
    """
    requested = (requested or "nccl").strip()
    if ":" in requested:
        devices_named = {part.split(":")[0].strip() for part in requested.split(",")}
        return requested if "cpu" in devices_named else f"cpu:gloo,{requested}"
    capability = dist.Backend.backend_capability.get(requested.lower())
    if capability is None or "cpu" in capability:
        return requested
    if requested.lower() == "nccl" and not (devices.cuda_available() and dist.is_nccl_available()):
        return "gloo"
    return f"cpu:gloo,cuda:{requested}"


def _initialize_distributed(original):
    """sat/arguments.py initialize_distributed: the group is created NCCL-only (CogVLM 328, SAT 173)."""
    @functools.wraps(original)
    def initialize_distributed(args):
        if not dist.is_initialized():
            args.distributed_backend = process_group_backend(getattr(args, "distributed_backend", "nccl"))
        return original(args)
    return initialize_distributed


def _get_args(original):
    """sat/arguments.py get_args: ``LOCAL_RANK (default 0) and args.device inconsistent`` on CPU.

    Without CUDA SAT sets ``args.device = 'cpu'``, then compares it with ``args.local_rank`` and
    refuses to train. While SAT checks (and sets up torch.distributed) both name the CPU device;
    the integer local rank is put back before ``get_args`` returns.
    """
    @functools.wraps(original)
    def get_args(args_list=None, parser=None):
        if devices.compute_device().type == "cuda":
            return original(args_list, parser)
        parser = parser if parser is not None else argparse.ArgumentParser(description="sat")
        parse, local_rank = parser.parse_args, []

        def parse_args(*a, **kw):
            ns = parse(*a, **kw)
            if getattr(ns, "device", None) == -1:
                local_rank.append(ns.local_rank if ns.local_rank is not None else devices.local_rank())
                ns.device = ns.local_rank = "cpu"
            return ns

        parser.parse_args = parse_args
        try:
            args = original(args_list, parser)
        finally:
            del parser.parse_args
        if local_rank:
            args.local_rank = local_rank[0]
        return args
    return get_args


PATCHES = [
    Patch("process_group_backend", "sat.arguments:initialize_distributed", _initialize_distributed,
          answers="CogVLM 328, SAT 173: No backend type associated with device type cpu",
          expect=expect_names("init_process_group", "distributed_backend")),
    Patch("get_args_cpu_device", "sat.arguments:get_args", _get_args,
          answers="get_args: 'LOCAL_RANK (default 0) and args.device inconsistent' without CUDA",
          expect=expect_params("args_list", "parser")),
]
