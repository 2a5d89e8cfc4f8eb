"""The GPU proof kit (benchmarks/gpu/) stays ready for the next session that is lent a GPU.

* prepare.sh's wheels, pinned, none that the GPU machine's image already holds (two versions of one
  package stop the install there);
* the kit on CPU (``--tiny``, parts c and b) in a Python that sees only the image's packages and the carried
  wheels: every import the proof makes is covered, it writes the table and proof.json with every key, what
  applies to a CPU passes and the CUDA checks say ``skipped: no CUDA``.
"""
import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KIT = os.path.join(ROOT, "benchmarks", "gpu")
COLUMNS = ("part", "check", "status", "measured", "expected", "seconds", "detail")


@pytest.fixture
def kit(monkeypatch):
    """The kit's modules importable for one test (``sys.path`` put back afterwards)."""
    monkeypatch.syspath_prepend(KIT)


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def prepared_wheels() -> dict:
    """prepare.sh's ``WHEELS=( ... )`` and ``DEEPSPEED=``: {canonical name: version}."""
    with open(os.path.join(KIT, "prepare.sh"), encoding="utf-8") as f:
        text = f.read()
    block = re.search(r"^WHEELS=\(\n(.*?)^\)", text, re.M | re.S).group(1)
    pins = block.split() + [re.search(r"^DEEPSPEED=(\S+)", text, re.M).group(1)]
    assert all(re.fullmatch(r"[A-Za-z0-9_.-]+==[0-9][A-Za-z0-9.]*", p) for p in pins), pins
    return {canonical(p.split("==")[0]): p.split("==")[1] for p in pins}


def device_packages() -> set:
    with open(os.path.join(KIT, "device_packages.txt"), encoding="utf-8") as f:
        return {canonical(line.strip()) for line in f if line.strip() and not line.startswith("#")}


def test_prepared_wheels_are_pinned_and_not_on_the_gpu_image():
    wheels = prepared_wheels()
    assert {"swissarmytransformer", "deepspeed", "bitsandbytes"} <= set(wheels)
    assert not set(wheels) & device_packages(), set(wheels) & device_packages()


def image_closure(names: set) -> set:
    """``names`` and what they require, transitively (extras left out): the image's packages come with their
    own needs there, in the versions they need (this machine's versions may need other packages)."""
    import importlib.metadata as metadata
    found, todo = set(), list(names)
    while todo:
        name = todo.pop()
        if name in found:
            continue
        found.add(name)
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        todo += [canonical(re.match(r"[A-Za-z0-9_.-]+", r).group(0)) for r in requires if "extra ==" not in r]
    return found


def device_site(folder: str) -> str:
    """A folder of links to the installed distributions the GPU machine would have (its image's, with what they
    need, and the carried wheels'), each with its metadata: on ``sys.path`` under ``python -S``, nothing else
    imports. A carried wheel's own needs are not added: they must be on the image or carried too."""
    import importlib.metadata as metadata
    allowed = image_closure(device_packages()) | set(prepared_wheels())
    for dist in metadata.distributions():
        if canonical(dist.metadata["Name"] or "") not in allowed:
            continue
        for top in {f.parts[0] for f in dist.files or [] if f.parts and f.parts[0] != ".."}:
            source, link = str(dist.locate_file(top)), os.path.join(folder, top)
            if os.path.exists(source) and not os.path.lexists(link):
                os.symlink(source, link)
    return folder


@pytest.mark.slow
def test_the_tiny_run_imports_only_what_the_gpu_machine_has_and_writes_the_table(tmp_path):
    os.makedirs(tmp_path / "site")
    site = device_site(str(tmp_path / "site"))
    out = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=site, SAT_PATCHES_DEVICE="cpu")
    run = subprocess.run([sys.executable, "-S", os.path.join(KIT, "proof.py"), "--tiny", "--parts", "cb",
                          "--out", str(out), "--time-scale", "2"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=400)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-3000:]
    lines = [line for line in run.stdout.splitlines() if line.startswith("| ")]
    assert tuple(c.strip() for c in lines[0].strip("|").split("|")) == COLUMNS, run.stdout[-2000:]
    assert len(lines) == 1 + len(json.loads((out / "proof.json").read_text())["rows"])
    data = json.loads((out / "proof.json").read_text())
    assert {"tiny", "started", "machine", "parts", "rows"} <= set(data) and data["tiny"] is True
    assert list(data["parts"]) == ["c", "b"]
    for part in data["parts"].values():
        assert {"rows", "imports", "stood_in", "title", "seconds", "limit"} <= set(part)
        assert part["stood_in"] == ["datasets", "wandb"]  # not carried; `import sat` imports both, the proof calls neither
        carried = set(prepared_wheels()) & {canonical(d) for d in part["imports"]}
        assert {"swissarmytransformer", "deepspeed"} <= carried
    assert "bitsandbytes" in {canonical(d) for d in data["parts"]["b"]["imports"]}
    assert all(tuple(row) == COLUMNS for row in data["rows"])
    assert [r for r in data["rows"] if r["status"] == "FAIL"] == []
    # what applies to a CPU passes; the CUDA checks say so
    rows = {row["check"]: row for row in data["rows"]}
    cuda_only = [c for c in rows if c.startswith(("rotary:", "CUDA RNG", "world size 1: CUDA"))]
    assert len(cuda_only) == 6 and all(rows[c]["status"] == "skipped: no CUDA" for c in cuda_only)
    assert rows["world size 1 with 'gloo': CPU broadcast over gloo"]["status"] == "ok"
    assert rows["QLoRA: NF4 weights == bitsandbytes' own quantisation"]["status"] == "ok"
    assert rows["QLoRA: 2 steps at the plan's micro-batch for 1 x 24 GB"]["status"] == "ok"
    assert all(rows[f"{k}: LoRA and every mixin on cpu in bf16"]["status"] == "ok" for k in ("cogvlm", "cogagent"))


def test_a_step_that_fails_in_the_triton_kernel_runs_again_on_the_torch_kernel(kit, monkeypatch):
    """Part a's figures must not be lost to SAT's triton kernel on a triton release it was not written for."""
    import sat.model.position_embedding.triton_rotary_embeddings as rotary_embeddings
    import proof_steps as steps
    from proof_record import Recorder, Row
    from sat_patches.kernels.rotary import apply_rotary
    kernels = []

    def one_step(rec, label, *args):
        kernels.append(rotary_embeddings.apply_rotary)
        failed = len(kernels) == 1
        return Row("a", label, "FAIL" if failed else "ok", detail="CompilationError: triton ..." if failed else "")
    monkeypatch.setattr(steps, "_one_step", one_step)
    row = steps._step_row(Recorder("a"), "cogvlm step", {}, 8, 1, 1.0, build=None)
    assert row.status == "ok" and "torch rotary kernel" in row.check
    assert kernels[0] is not apply_rotary and kernels[1] is apply_rotary
    assert rotary_embeddings.apply_rotary is kernels[0]  # put back afterwards


def test_the_rotary_check_calls_the_kernel_as_sats_rotary_embedding_does(kit, monkeypatch):
    """SAT's triton kernel asserts on ``max_seqlen`` (a call without it raises TypeError): the kit's call passes what
    SAT's ``FastRotaryEmbedding`` passes, by the same names, and the same values for the same positions."""
    import torch
    import proof_cuda
    import sat.model.position_embedding.triton_rotary_embeddings as rotary_embeddings
    calls = []

    def recorder(x, cos, sin, position_ids, **kwargs):
        calls.append(kwargs)
        return x
    monkeypatch.setattr(rotary_embeddings, "apply_rotary", recorder)
    positions = torch.tensor([[0, 1, 2, 5]])
    q = k = torch.randn(1, 2, 4, 8)
    rotary_embeddings.FastRotaryEmbedding(8)(q, k, positions, max_seqlen=positions.max() + 1, layer_id=0)
    cos = sin = torch.zeros(16, 4)
    proof_cuda.rotary_as_sat_calls(recorder, q, cos, sin, positions, 0, False)
    sat_call, kit_call = calls[0], calls[-1]
    assert set(kit_call) == set(sat_call)
    assert int(kit_call["max_seqlen"]) == int(sat_call["max_seqlen"]) == 6


def test_one_unit_in_the_last_place_is_bf16s_spacing(kit):
    import torch
    from proof_cuda import last_place
    values = torch.tensor([1.0, 3.0, 4.0, 6.5, -0.3], dtype=torch.bfloat16)
    assert last_place(values).tolist() == [2 ** -7, 2 ** -6, 2 ** -5, 2 ** -5, 2 ** -9]
    assert float(last_place(torch.tensor([4.0], dtype=torch.bfloat16))) == 0.03125  # the 0.031 seen at |x| ~ 4


def test_the_kit_says_what_its_parts_cost_before_running_and_when_one_call_cannot_hold_them(kit):
    import proof
    quick = proof.cost_preview("c")
    assert quick.splitlines()[0] == "parts c: up to 60 s of device time in all (machine start not counted)"
    assert "more than one device call" not in quick
    everything = proof.cost_preview("csabp")
    assert f"up to {sum(proof.PARTS[p][1] for p in 'csabp'):.0f} s" in everything
    assert "more than one device call allows (600 s)" in everything


def test_the_shared_gpu_part_skips_with_the_reason_without_cuda(kit):
    import proof_record
    import proof_shared
    rec = proof_record.Recorder("s")
    proof_shared.run(rec, True)
    [row] = rec.rows
    assert row.check.startswith("2 ranks share one card") and row.status == "skipped: no CUDA", row


@pytest.mark.parametrize("interleaved", [False, True])
def test_the_bf16_rotary_bound_holds_for_another_rounding_order_and_not_for_another_rotation(kit, interleaved):
    """Part c's bf16 rotary check: the torch fallback (products and sum rounded to bf16 apart) beside the same
    rotation rounded once from fp32 (as a kernel computing in fp32 does) is within 3 units of the pair's length;
    the rotation of the next position is not."""
    import torch
    from proof_cuda import units_apart
    from sat_patches.kernels.rotary import apply_rotary
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 4, 64, 128, generator=gen).to(torch.bfloat16)
    angles = torch.rand(96, 64, generator=gen) * 6.28
    cos, sin = angles.cos().to(torch.bfloat16), angles.sin().to(torch.bfloat16)
    positions = torch.randint(0, 90, (2, 64), generator=gen)
    want = apply_rotary(x, cos, sin, positions, interleaved=interleaved)
    once = apply_rotary(x.float(), cos.float(), sin.float(), positions, interleaved=interleaved).to(torch.bfloat16)
    assert (once != want).any()  # the two orders do round apart here
    assert units_apart(once, want, x, interleaved) <= 3
    shifted = apply_rotary(x, cos, sin, positions + 1, interleaved=interleaved)
    assert units_apart(shifted, want, x, interleaved) > 30
