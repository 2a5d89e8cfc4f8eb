"""Sizes read from a checkpoint folder are checked before anything is allocated from them: each test runs in a
rank whose address space is capped a little above what it holds after its imports."""
import json
import resource
import textwrap

import pytest
import torch

from multirank import RankResult, run_ranks

pytestmark = pytest.mark.multirank

CAP_MB = 300  # room above the rank's address space after importing torch and SAT


def capped(code: str, with_sat: bool) -> None:
    """(a rank) ``code``, with ``files`` (sat_patches.checkpoints.files) at hand, in an address space capped
    :data:`CAP_MB` above what the rank holds after its imports."""
    if with_sat:
        import sat_patches
        sat_patches.apply()
        import sat.training.model_io  # noqa: F401
    from sat_patches.checkpoints import files
    with open("/proc/self/status") as f:
        vm = next(int(line.split()[1]) for line in f if line.startswith("VmSize:")) * 1024
    cap = vm + (CAP_MB << 20)
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    exec(textwrap.dedent(code), {"files": files})


def run_capped(code: str, with_sat: bool = False) -> RankResult:
    [r] = run_ranks(capped, 1, args=(code, with_sat), timeout=120)
    return r


def checkpoint(path, config=None):
    (path / "1").mkdir(parents=True)
    (path / "latest").write_text("1")
    (path / "model_config.json").write_text(json.dumps(config or {
        "num_layers": 1, "hidden_size": 32, "num_attention_heads": 2, "vocab_size": 1024}))
    torch.save({"module": {}}, path / "1" / "mp_rank_00_model_states.pt")


def assert_refused(child, *words):
    assert child.returncode == 0 and "REFUSED" in child.stdout, (child.returncode, child.stdout, child.stderr[-3000:])
    for word in words:
        assert word in child.stdout, child.stdout


@pytest.mark.slow  # ranks that torchrun starts, each importing torch and SAT (over 10 s on 2 cores)
def test_a_huge_shard_number_or_model_parallel_size_is_refused_before_any_range_is_built(tmp_path):
    checkpoint(tmp_path / "shard")
    torch.save({"module": {}}, tmp_path / "shard" / "1" / "mp_rank_999999999999_model_states.pt")
    checkpoint(tmp_path / "config")
    config = json.loads((tmp_path / "config" / "model_config.json").read_text())
    (tmp_path / "config" / "model_config.json").write_text(json.dumps(dict(config, model_parallel_size=10 ** 12)))
    child = run_capped(f"""
        for path in {str(tmp_path / 'shard')!r}, {str(tmp_path / 'config')!r}:
            try:
                files.find_checkpoint(path)
            except files.CheckpointError as exc:
                print("REFUSED", exc)
    """)
    assert_refused(child, "mp_rank_999999999999_model_states.pt", "model-parallel rank 999999999999",
                   "model_parallel_size 1000000000000")
    assert child.stdout.count("REFUSED") == 2


@pytest.mark.slow
def test_a_config_implying_far_more_than_the_files_hold_is_refused_before_the_model_is_built(tmp_path):
    """Each size is within its limit; together they describe a model of tens of terabytes."""
    import expert_llama as el
    cfg = el.config(num_layers=4, hidden_size=1 << 16, num_attention_heads=64, vocab_size=1 << 16,
                    inner_hidden_size=1 << 18)
    checkpoint(tmp_path / "ckpt", cfg)
    child = run_capped(f"""
        from sat_patches.checkpoints.model_config import read_model_config
        import expert_llama as el
        try:
            el.model_class().from_pretrained({str(tmp_path / 'ckpt')!r}, el.build_args(read_model_config(
                {str(tmp_path / 'ckpt')!r})))
        except files.CheckpointError as exc:
            print("REFUSED", exc)
    """, with_sat=True)
    assert_refused(child, "GiB, but the checkpoint's files hold 0.000 GiB", "model_config.json")
