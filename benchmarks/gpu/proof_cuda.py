"""Part c of the GPU proof: the CUDA paths that CPU tests prove only by construction or simulation.

* SAT's triton rotary kernel against sat_patches' torch fallback (``sat_patches.kernels.rotary``);
* the xformers stand-in (``memory_efficient_attention`` on SDPA) against attention written out in fp32;
* LoRA parameters and every mixin of CogVLM and CogAgent on the compute device in the run's dtype;
* the CUDA RNG state and the model-parallel RNG tracker saved as sat_patches' saves hold them and restored
  by its loader, bit for bit;
* the memory ledger's CUDA figures against torch's own;
* ``cpu:gloo,cuda:nccl`` (what ``nccl`` becomes) at world size 1: a CPU broadcast over gloo beside a CUDA
  all-reduce over NCCL.

With ``tiny`` (a CPU machine) each check runs where it applies to the CPU and is skipped otherwise.
"""
from __future__ import annotations

import os

from proof_record import Recorder, Skip, cuda, device, require_cuda


def rotary(rec: Recorder) -> None:
    import torch
    from sat_patches.kernels.rotary import apply_rotary as torch_kernel
    for dtype, interleaved, offset in ((torch.float32, False, 0), (torch.bfloat16, False, 3), (torch.float32, True, 0),
                                       (torch.bfloat16, True, 5)):
        name = f"rotary: triton kernel == torch fallback ({str(dtype)[6:]}, interleaved={interleaved}, offset={offset})"
        bound = "max |diff| <= 1e-5 (fp32) / 3 units in the last place of the pair's length (bf16)"
        with rec.check(name, expected=bound) as row:
            require_cuda()
            import importlib
            triton_module = importlib.import_module("sat.model.position_embedding.triton_rotary")
            kernel = getattr(triton_module.apply_rotary, "__wrapped__", triton_module.apply_rotary)
            if getattr(kernel, "__sat_patches_kernel__", False):
                raise AssertionError("SAT's triton_rotary is sat_patches' stand-in here: triton did not import")
            gen = torch.Generator(device="cuda").manual_seed(0)
            batch, heads, tokens, head_dim, table = 2, 4, 96, 128, 256
            x = torch.randn(batch, heads, tokens, head_dim, device="cuda", dtype=dtype, generator=gen)
            angles = torch.rand(table, head_dim // 2, device="cuda", generator=gen) * 6.28
            cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
            positions = torch.randint(0, table - offset, (batch, tokens), device="cuda", generator=gen)
            got = rotary_as_sat_calls(kernel, x.clone(), cos, sin, positions, offset, interleaved)
            want = rotary_as_sat_calls(torch_kernel, x.clone(), cos, sin, positions, offset, interleaved)
            diff = (got.float() - want.float()).abs().max().item()
            row.measured = f"max |diff| {diff:.3g}"
            if dtype == torch.float32:
                assert diff <= 1e-5, diff
            else:
                units = units_apart(got, want, x, interleaved)
                row.measured += f", {units:.2f} units in the last place of the pair's length"
                assert units <= 3, f"{units:.2f} units in the last place of the pair's length"


def rotary_as_sat_calls(kernel, x, cos, sin, positions, offset, interleaved):
    """``kernel`` called as SAT's ``FastRotaryEmbedding`` calls ``apply_rotary`` (through ``ApplyRotaryEmb``): the
    offsets, no ``cu_seqlens``, ``max_seqlen`` the largest position + 1, not in place."""
    return kernel(x, cos, sin, positions, seqlen_offsets=offset, cu_seqlens=None, max_seqlen=int(positions.max()) + 1,
                  interleaved=interleaved, inplace=False)


def units_apart(got, want, x, interleaved: bool) -> float:
    """The largest difference of two bf16 rotary results in units of the last place of the rotated pair's length
    (each output is ``a*cos - b*sin`` or ``a*sin + b*cos`` of a pair ``(a, b)``, at most ``|(a, b)|`` in
    size): kernels that round their two products and the sum in another order (SAT's triton kernel, the torch
    fallback) differ by up to three such units where the sum is far smaller than its terms."""
    import torch
    x = x.float()
    a, b = (x[..., 0::2], x[..., 1::2]) if interleaved else x.chunk(2, dim=-1)
    length = (a * a + b * b).sqrt()
    length = torch.stack((length, length), dim=-1).flatten(-2) if interleaved else torch.cat((length, length), -1)
    spacing = last_place(length.to(want.dtype))
    return float(((got.float() - want.float()).abs() / spacing).max())


def last_place(t):
    """The spacing of ``t``'s dtype at each value of ``t`` (one unit in the last place), in fp32."""
    import torch
    magnitude = t.float().abs().clamp_min(torch.finfo(t.dtype).tiny)
    return torch.finfo(t.dtype).eps * torch.exp2(torch.floor(torch.log2(magnitude)))


def xformers_standin(rec: Recorder) -> None:
    import torch
    from sat_patches.standins.xformers.ops import memory_efficient_attention
    dev = device()
    for dtype in (torch.float32, torch.bfloat16):
        for biased in (False, True):
            name = f"xformers stand-in == attention in fp32 ({str(dtype)[6:]}, {dev.type}, bias={biased})"
            with rec.check(name, expected="max |diff| <= 1e-4 (fp32) / 2e-2 (bf16)") as row:
                gen = torch.Generator(device=dev).manual_seed(1)
                q, k, v = (torch.randn(2, 77, 4, 64, device=dev, dtype=dtype, generator=gen) for _ in range(3))
                bias = torch.randn(2, 4, 77, 77, device=dev, dtype=dtype, generator=gen) if biased else None
                got = memory_efficient_attention(q, k, v, attn_bias=bias)
                qf, kf, vf = (t.float().transpose(1, 2) for t in (q, k, v))  # xformers' layout: [b, tokens, heads, d]
                scores = qf @ kf.transpose(-1, -2) / 64 ** 0.5 + (bias.float() if biased else 0)
                want = (scores.softmax(-1) @ vf).transpose(1, 2)
                diff = (got.float() - want).abs().max().item()
                row.measured = f"max |diff| {diff:.3g}"
                assert got.shape == q.shape and got.dtype == dtype, (got.shape, got.dtype)
                assert diff <= (1e-4 if dtype == torch.float32 else 2e-2), diff


def placement(rec: Recorder) -> None:
    """Every parameter of tiny CogVLM/CogAgent, their mixins and LoRA on the compute device in bf16, built
    through sat_patches' construction path (where the buffers are is reported)."""
    import torch
    from proof_steps import add_lora, build_model, tiny_config
    dev = device()
    for kind in ("cogvlm", "cogagent"):
        with rec.check(f"{kind}: LoRA and every mixin on {dev.type} in bf16", expected=f"all on {dev.type}, bf16") as row:
            model, _ = build_model(tiny_config(kind), dev)
            add_lora(model, rank=4)
            tensors = list(model.named_parameters())
            wrong = [(n, str(t.device), str(t.dtype)) for n, t in tensors
                     if t.device.type != dev.type or t.dtype != torch.bfloat16]
            lora = [n for n, _ in tensors if "matrix_" in n]
            row.measured = f"{len(tensors)} parameters ({len(lora)} LoRA), {len(wrong)} elsewhere"
            buffers = {(b.device.type, str(b.dtype)) for _, b in model.named_buffers()}
            row.detail = f"buffers: {sorted(buffers)} (loading moves them to the compute device)"
            assert lora, "no LoRA parameters were added"
            assert not wrong, wrong[:5]


def rng_tracker(rec: Recorder) -> None:
    with rec.check("CUDA RNG + model-parallel tracker saved and restored bit for bit", expected="equal draws") as row:
        require_cuda()
        import random

        import numpy as np
        import torch
        from sat import mpu
        from proof_steps import model_parallel
        from sat_patches.checkpoints.state import model_parallel_rng_tracker, restore_rng
        model_parallel()  # SAT's groups and seeds (its set_random_seed seeds the tracker on CUDA)
        tracker = model_parallel_rng_tracker()
        if tracker is None:
            raise AssertionError("sat.mpu.get_cuda_rng_tracker is None although CUDA is present")
        if not tracker.get_states():
            mpu.model_parallel_cuda_manual_seed(1234)
        # the keys and getters of sat_patches' save_ds_checkpoint (patch save_rng_without_cuda)
        saved = {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
                 "torch_rng_state": torch.get_rng_state(), "cuda_rng_state": torch.cuda.get_rng_state(),
                 "rng_tracker_states": tracker.get_states()}

        def draws():
            plain = torch.rand(4096, device="cuda")
            with tracker.fork():
                forked = torch.rand(4096, device="cuda")
            return plain, forked
        first = draws()
        moved_on = draws()
        restore_rng(saved)
        again = draws()
        assert not torch.equal(first[0], moved_on[0]), "the CUDA generator did not advance"
        assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1]), "restored states draw differently"
        row.measured = f"{len(saved['rng_tracker_states'])} tracker state(s); draws equal after restore"


def ledger(rec: Recorder) -> None:
    with rec.check("ledger's CUDA figures == torch.cuda's, non-zero", expected="equal, > 0") as row:
        import torch
        from sat_patches.diagnostics import ledger as ledger_module
        from sat_patches.diagnostics.ledger_files import MiB
        if not cuda():
            assert ledger_module.cuda_memory() == {}, "the ledger reports CUDA memory without CUDA"
            raise Skip("no CUDA (the ledger reports no CUDA figures here, as it must)")
        block = torch.empty(64 * 2 ** 20, dtype=torch.uint8, device="cuda")
        got = ledger_module.cuda_memory()
        want = {"cuda_alloc_mib": torch.cuda.memory_allocated() / MiB,
                "cuda_max_alloc_mib": torch.cuda.max_memory_allocated() / MiB,
                "cuda_reserved_mib": torch.cuda.memory_reserved() / MiB,
                "cuda_max_reserved_mib": torch.cuda.max_memory_reserved() / MiB}
        row.measured = ", ".join(f"{k} {v:.1f}" for k, v in got.items())
        assert got == want, (got, want)
        assert all(v > 0 for v in got.values()), got
        recorded = ledger_module.LEDGER.record("gpu_proof")
        assert recorded.cuda_alloc_mib == want["cuda_alloc_mib"], (recorded, want)
        del block


def process_groups(rec: Recorder) -> None:
    import torch
    import torch.distributed as dist
    from sat_patches.runtime.distributed import process_group_backend
    backend = process_group_backend("nccl")
    expected = "cpu:gloo,cuda:nccl" if cuda() else "gloo"
    with rec.check("nccl becomes a CPU + CUDA process group", expected=expected) as row:
        row.measured = backend
        assert backend == expected, backend
    initialised = False
    with rec.check(f"world size 1 with '{backend}': CPU broadcast over gloo", expected="[7, 7, 7, 7]") as row:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
        if cuda():
            torch.cuda.set_device(0)
        dist.init_process_group(backend, rank=0, world_size=1)
        initialised = True
        cpu = torch.full((4,), 7.0)
        dist.broadcast(cpu, src=0)
        row.measured = f"{cpu.tolist()} on {cpu.device}"
        assert cpu.tolist() == [7.0] * 4
    with rec.check("world size 1: CUDA all-reduce over NCCL", expected="[3, 3, 3, 3], backend nccl") as row:
        require_cuda()
        if not initialised:
            raise AssertionError("the process group did not initialise")
        gpu = torch.full((4,), 3.0, device="cuda")
        dist.all_reduce(gpu)
        torch.cuda.synchronize()
        row.measured = f"{gpu.tolist()} via {dist.get_backend()}"
        assert gpu.tolist() == [3.0] * 4
        assert "nccl" in str(dist.get_backend(dist.group.WORLD)), dist.get_backend()
    if initialised:
        dist.destroy_process_group()


def run(rec: Recorder, tiny: bool) -> None:
    for check in (rotary, xformers_standin, process_groups, placement, rng_tracker, ledger):  # before SAT's groups
        rec.guarded(check)
