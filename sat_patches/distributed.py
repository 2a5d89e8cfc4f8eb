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
    """sat/arguments.py initialize_distributed: NCCL-only group; ``torch.cuda.set_device`` on CPU."""
    @functools.wraps(original)
    def initialize_distributed(args):
        if not dist.is_initialized():
            args.distributed_backend = process_group_backend(getattr(args, "distributed_backend", "nccl"))
            device = devices.sat_device_arg()
            # SAT calls torch.cuda.set_device(args.device) unless args.device == 'cpu'
            args.device = device if isinstance(device, int) else "cpu"
            try:
                return original(args)
            finally:
                args.device = device
        return original(args)
    return initialize_distributed


def _get_args(original):
    """sat/arguments.py get_args: ``LOCAL_RANK (default 0) and args.device inconsistent`` on CPU.

    SAT compares ``args.local_rank`` with ``args.device`` before it sets up torch.distributed. Without
    CUDA it sets ``args.device = 'cpu'`` and refuses to train. The device is the policy's; the
    consistency check is satisfied by deferring the device until ``initialize_distributed``.
    """
    @functools.wraps(original)
    def get_args(args_list=None, parser=None):
        parser = parser if parser is not None else argparse.ArgumentParser(description="sat")
        parse = parser.parse_args

        def parse_args(*a, **kw):
            ns = parse(*a, **kw)
            if getattr(ns, "device", None) == -1 and devices.compute_device().type != "cuda":
                ns.device = ns.local_rank if ns.local_rank is not None else devices.local_rank()
            return ns

        parser.parse_args = parse_args
        try:
            return original(args_list, parser)
        finally:
            del parser.parse_args
    return get_args


PATCHES = [
    Patch("process_group_backend", "sat.arguments:initialize_distributed", _initialize_distributed,
          answers="CogVLM 328, SAT 173: No backend type associated with device type cpu",
          expect=expect_names("init_process_group", "distributed_backend")),
    Patch("get_args_cpu_device", "sat.arguments:get_args", _get_args,
          answers="get_args: 'LOCAL_RANK (default 0) and args.device inconsistent' without CUDA",
          expect=expect_params("args_list", "parser")),
]
