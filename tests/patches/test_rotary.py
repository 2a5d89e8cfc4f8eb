"""FastRotaryEmbedding on CPU: the torch kernel against SAT's own non-triton rotary."""
import os
import subprocess
import sys

import pytest
import torch

import sat_patches  # noqa: F401
from sat.model.position_embedding.rotary_embeddings import RotaryEmbedding, apply_rotary_pos_emb_index_torch
from sat.model.position_embedding.triton_rotary_embeddings import FastRotaryEmbedding
from patching import patches_removed


def _qk(batch=2, heads=3, seq=7, dim=16, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(batch, heads, seq, dim, generator=g, dtype=dtype),
            torch.randn(batch, heads, seq, dim, generator=g, dtype=dtype))


def _sat_reference(q, k, position_ids, dim):
    # SAT's GPT-NeoX rotary works on [seq, batch, heads, dim]
    cos, sin = RotaryEmbedding(dim, precision=torch.float32)(q, seq_dim=2, seq_len=int(position_ids.max()) + 1)
    qs, ks = (t.permute(2, 0, 1, 3) for t in (q, k))
    q_ref, k_ref = apply_rotary_pos_emb_index_torch(qs, ks, cos, sin, position_ids.t())
    return q_ref.permute(1, 2, 0, 3), k_ref.permute(1, 2, 0, 3)


@pytest.mark.parametrize("shuffled", [False, True])
def test_fast_rotary_matches_sat_reference_rotary(shuffled):
    q, k = _qk()
    pos = torch.arange(7).repeat(2, 1)
    if shuffled:  # CogVLM-style position ids (image tokens share positions)
        pos = torch.tensor([[0, 1, 1, 1, 2, 3, 4], [0, 0, 1, 2, 3, 5, 6]])
    q_ref, k_ref = _sat_reference(q, k, pos, 16)
    q_out, k_out = FastRotaryEmbedding(16)(q.clone(), k.clone(), pos, max_seqlen=int(pos.max()) + 1)
    torch.testing.assert_close(q_out, q_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k_out, k_ref, rtol=1e-5, atol=1e-5)


def test_interleaved_rotary_matches_pairwise_rotation():
    from sat_patches.kernels.rotary import apply_rotary
    x = _qk(dim=8)[0]
    pos = torch.arange(7).repeat(2, 1)
    theta = pos[..., None].float() * (1.0 / 10000 ** (torch.arange(0, 8, 2).float() / 8))
    out = apply_rotary(x, theta.cos()[0], theta.sin()[0], pos, max_seqlen=7, interleaved=True)
    c, s = theta.cos()[:, None], theta.sin()[:, None]
    x0, x1 = x[..., 0::2], x[..., 1::2]
    torch.testing.assert_close(out[..., 0::2], x0 * c - x1 * s)
    torch.testing.assert_close(out[..., 1::2], x0 * s + x1 * c)


def test_rotary_backward_is_the_inverse_rotation():
    q, k = _qk()
    pos = torch.arange(7).repeat(2, 1)
    leaf = q.clone().requires_grad_()
    out, _ = FastRotaryEmbedding(16)(leaf * 1.0, k.clone(), pos, max_seqlen=7)
    (out * q).sum().backward()
    ref_leaf = q.clone().requires_grad_()
    ref, _ = _sat_reference(ref_leaf, k, pos, 16)
    (ref * q).sum().backward()
    torch.testing.assert_close(leaf.grad, ref_leaf.grad, rtol=1e-5, atol=1e-5)


def test_without_fallback_fast_rotary_reaches_triton_and_fails():
    import sat.model.position_embedding.triton_rotary_embeddings as tre

    def triton_kernel(*args, **kwargs):  # what SAT's module holds on a machine with triton
        raise RuntimeError("Pointer argument (at 0) cannot be accessed from Triton (cpu tensor?)")
    q, k = _qk()
    pos = torch.arange(7).repeat(2, 1)
    with patches_removed("rotary_torch_fallback"):
        original = tre.apply_rotary
        tre.apply_rotary = triton_kernel
        try:
            with pytest.raises(RuntimeError, match="cpu tensor"):
                FastRotaryEmbedding(16)(q, k, pos, max_seqlen=7)
        finally:
            tre.apply_rotary = original
    # with the fallback applied over that kernel, CPU tensors take the torch path
    patch = sat_patches.core.registry.REGISTRY.get("rotary_torch_fallback")
    dispatch = patch.make(triton_kernel)
    assert dispatch(q, *[torch.ones(7, 8)] * 2, pos, max_seqlen=7).shape == q.shape


@pytest.mark.slow
def test_import_sat_needs_the_import_patch_without_triton():
    """Without triton, ``import sat`` works after ``import sat_patches`` (SAT's rotary module served), not before it,
    nor with the stand-in disabled: nothing is served to a process that did not import sat_patches."""
    def run(code, **env):
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                              env=dict(os.environ, **env))
    out = run("import sat_patches, sat", SAT_PATCHES_DISABLE="triton_rotary_import")
    assert out.returncode != 0 and "No module named 'triton'" in out.stderr
    out = run("import sat")
    assert out.returncode != 0 and "No module named 'triton'" in out.stderr
    out = run("import sat_patches, sat")
    assert out.returncode == 0, out.stderr[-2000:]


def _rotation_by_halves(x, cos, sin, pos, rotary_dim, conjugate=False):
    """The rotation written out per half, as the kernel computed it before its tables: the reference."""
    c, s = cos[pos].unsqueeze(1), sin[pos].unsqueeze(1)
    s = -s if conjugate else s
    half = rotary_dim // 2
    x0, x1 = x[..., :half], x[..., half:rotary_dim]
    out = torch.cat((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1).to(x.dtype)
    return torch.cat((out, x[..., rotary_dim:]), dim=-1)


@pytest.mark.parametrize("dtype, cache_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32),
                                                (torch.bfloat16, torch.float32)], ids=["bf16", "fp32", "bf16-fp32"])
@pytest.mark.parametrize("rotary_dim", [16, 8], ids=["whole-head", "part"])
@pytest.mark.parametrize("conjugate", [False, True], ids=["forward", "inverse"])
@pytest.mark.parametrize("inplace", [False, True], ids=["copy", "inplace"])
def test_the_kernel_gives_the_rotation_by_halves_bit_for_bit(dtype, cache_dtype, rotary_dim, conjugate, inplace):
    from sat_patches.kernels.rotary import apply_rotary
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 9, 16, generator=g).to(dtype)
    angle = torch.randn(12, rotary_dim // 2, generator=g)
    cos, sin = angle.cos().to(cache_dtype), angle.sin().to(cache_dtype)
    pos = torch.randint(0, 12, (2, 9), generator=g)
    expected = _rotation_by_halves(x, cos, sin, pos, rotary_dim, conjugate)
    out = apply_rotary(x.clone(), cos, sin, pos, conjugate=conjugate, inplace=inplace)
    assert torch.equal(out, expected)


def test_the_positions_cos_and_sin_are_gathered_once_for_every_layer():
    """Every layer's queries and keys (and, backward, their gradients) share one gather of the cache's rows."""
    from sat_patches.kernels.rotary import rotary_tables
    rotary = FastRotaryEmbedding(16)
    pos = torch.tensor([[0, 1, 1, 1, 2, 3, 4], [0, 0, 1, 2, 3, 5, 6]])
    before = rotary_tables.computed
    weight = _qk()[0]
    for layer in range(4):
        q, k = (t.requires_grad_() * 1.0 for t in _qk())
        q, k = rotary(q, k, pos, max_seqlen=7)
        ((q + k) * weight).sum().backward()
    assert rotary_tables.computed - before == 2  # the rotation and its inverse
    pos[0, 0] = 1  # other positions: gathered again
    rotary(*_qk(), pos, max_seqlen=7)
    assert rotary_tables.computed - before == 3
