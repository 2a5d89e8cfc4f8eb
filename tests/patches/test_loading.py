"""Checkpoint files: clear errors for bad input before anything is built, and rank-local slices of
split tensors between any two model-parallel sizes (SAT's own ``partition()`` is the reference)."""
import json
import types

import pytest
import torch

from sat_patches.patches import loading
from sat_patches.patches.loading import Checkpoint, CheckpointError, ShardedSource
from sat_patches.checkpoints.sharding import Split, release_pages
from sat_patches.checkpoints.state import load_state, meta_tensors


def _write(path, state, iteration=1, shards=1, config=None):
    folder = path / str(iteration)
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(shards):
        torch.save({"module": state if shards == 1 else state[i]}, folder / f"mp_rank_{i:02d}_model_states.pt")
    (path / "latest").write_text(str(iteration))
    (path / "model_config.json").write_text(json.dumps(config or dict(
        num_layers=1, hidden_size=8, num_attention_heads=2, vocab_size=1024)))
    return path


@pytest.fixture
def ckpt_dir(tmp_path):
    return _write(tmp_path / "ckpt", {"w": torch.randn(4, 4)})


@pytest.mark.parametrize("breakage, message", [
    ("missing", "does not exist"),
    ("empty", "is empty"),
    ("no_latest", "echo 1 >"),
    ("bad_latest", "must hold an iteration number"),
    ("latest_elsewhere", "has no directory '7'"),
    ("no_shards", "holds no mp_rank_XX_model_states.pt"),
    ("gap", "lacks model-parallel shard(s) [1]"),
    ("last_shard_by_config", "lacks model-parallel shard(s) [1] of 2 (model_config.json says model_parallel_size 2): "
                             "copy the missing mp_rank_01_model_states.pt"),
    ("last_shard_by_optimizer", "lacks model-parallel shard(s) [1, 2] of 3 (optimizer shards of model-parallel rank 2 "
                                "are there): copy the missing mp_rank_01_model_states.pt, mp_rank_02_model_states.pt"),
    ("truncated", "is truncated or not a torch checkpoint"),
    ("zero_bytes", "is truncated or not a torch checkpoint"),
])
def test_bad_checkpoint_directories_say_what_to_change(tmp_path, ckpt_dir, breakage, message):
    path, shard = ckpt_dir, ckpt_dir / "1" / "mp_rank_00_model_states.pt"
    if breakage == "missing":
        path = tmp_path / "nowhere"
    elif breakage == "empty":
        path = tmp_path / "empty"
        path.mkdir()
    elif breakage == "no_latest":
        (ckpt_dir / "latest").unlink()
    elif breakage == "bad_latest":
        (ckpt_dir / "latest").write_text("best")
    elif breakage == "latest_elsewhere":
        (ckpt_dir / "latest").write_text("7")
    elif breakage == "no_shards":
        shard.rename(ckpt_dir / "1" / "something_else.pt")
    elif breakage == "gap":
        shard.rename(ckpt_dir / "1" / "mp_rank_02_model_states.pt")
        torch.save({"module": {}}, ckpt_dir / "1" / "mp_rank_00_model_states.pt")
    elif breakage == "last_shard_by_config":  # the highest shard is missing: no gap among the others
        cfg = json.loads((ckpt_dir / "model_config.json").read_text())
        (ckpt_dir / "model_config.json").write_text(json.dumps(dict(cfg, model_parallel_size=2)))
    elif breakage == "last_shard_by_optimizer":
        torch.save({}, ckpt_dir / "1" / "zero_pp_rank_0_mp_rank_02_optim_states.pt")
    elif breakage == "truncated":
        data = shard.read_bytes()
        shard.write_bytes(data[: len(data) // 2])
    elif breakage == "zero_bytes":
        shard.write_bytes(b"")
    with pytest.raises(CheckpointError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        loading.find_checkpoint(str(path))


@pytest.mark.parametrize("content, message", [
    (None, "model_config.json' not found"),
    ("{not json", "is not valid JSON"),
    (json.dumps({"num_layers": 2, "vocab_size": 1024}), "lacks hidden_size, num_attention_heads: add them"),
])
def test_bad_model_config_says_what_to_change(ckpt_dir, content, message):
    cfg = ckpt_dir / "model_config.json"
    if content is None:
        cfg.unlink()
    else:
        cfg.write_text(content)
    with pytest.raises(CheckpointError, match=message):
        loading.read_model_config(str(ckpt_dir))


def test_from_pretrained_stops_before_building(ckpt_dir, monkeypatch):
    """A truncated shard or an incomplete model_config.json stops from_pretrained before any build."""
    def no_build(*a, **kw):
        raise AssertionError("the model was built")
    monkeypatch.setattr(loading, "_build", no_build)
    monkeypatch.setattr(loading, "ensure_model_parallel", no_build)
    from sat.model.base_model import BaseModel
    shard = ckpt_dir / "1" / "mp_rank_00_model_states.pt"
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(CheckpointError, match="truncated"):
        loading.from_pretrained(BaseModel, str(ckpt_dir))
    (ckpt_dir / "model_config.json").write_text("{}")
    with pytest.raises(CheckpointError, match="lacks num_layers"):
        loading.from_pretrained(BaseModel, str(ckpt_dir))


# -- model-parallel slices -----------------------------------------------------------------

def _sat_partition(kind, full, mp, stride=1):
    """SAT's own partition() of a full tensor into ``mp`` slices (the reference)."""
    from sat.mpu.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
    if kind == "column":
        layer = types.SimpleNamespace(stride=stride, output_size=full.shape[0], input_size=full.shape[1],
                                      output_size_per_partition=full.shape[0])
        return ColumnParallelLinear.partition(layer, mp, full_weight=full)
    if kind == "row":
        layer = types.SimpleNamespace(input_size=full.shape[1], input_size_per_partition=full.shape[1])
        return RowParallelLinear.partition(layer, mp, full_weight=full)
    layer = types.SimpleNamespace(num_embeddings=full.shape[0], num_embeddings_per_partition=full.shape[0])
    return VocabParallelEmbedding.partition(layer, mp, full_weight=full)


SPLITS = {"column": lambda stride: Split(0, (1,) * stride if isinstance(stride, int) else tuple(stride)),
          "row": lambda stride: Split(1), "vocab": lambda stride: Split(0)}


@pytest.mark.parametrize("kind, stride", [("column", 1), ("column", 3), ("column", [2, 1, 1]), ("row", 1),
                                          ("vocab", 1)])
@pytest.mark.parametrize("n_src, n_dst", [(1, 2), (2, 1), (2, 2), (2, 4), (4, 2), (1, 4)])
def test_any_mp_size_to_any_other_matches_sat_partition(tmp_path, kind, stride, n_src, n_dst):
    full = torch.arange(48 * 8, dtype=torch.float32).reshape(48, 8)
    if kind == "row":
        full = full.reshape(8, 48)
    shards = _sat_partition(kind, full, n_src, stride)
    files = []
    for i, shard in enumerate(shards):
        files.append(str(tmp_path / f"mp_rank_{i:02d}_model_states.pt"))
        torch.save({"module": {"w": shard}}, files[-1])
    want = _sat_partition(kind, full, n_dst, stride)
    for rank in range(n_dst):
        source = ShardedSource(Checkpoint(str(tmp_path), 1, False, files), "", rank, n_dst)
        got = torch.empty_like(want[rank], dtype=torch.bfloat16)  # converted on the way
        source.copy_into("w", got, SPLITS[kind](stride))
        assert torch.equal(got, want[rank].to(torch.bfloat16)), (rank, got, want[rank])


def test_unknown_split_between_sizes_names_the_merge_command(tmp_path):
    files = []
    for i in range(2):
        files.append(str(tmp_path / f"mp_rank_{i:02d}_model_states.pt"))
        torch.save({"module": {"w": torch.zeros(3, 4)}}, files[-1])
    source = ShardedSource(Checkpoint(str(tmp_path), 1, False, files), "", 0, 1)
    with pytest.raises(CheckpointError, match="python -m sat_patches.merge"):
        source.copy_into("w", torch.empty(6, 4), None)  # split, but nobody says how


def test_released_pages_read_back_the_same(tmp_path):
    """Dropping a mapped chunk's pages loses nothing: touched again, they are read from the file."""
    data = torch.randn(2048, 1024)
    torch.save({"module": {"w": data}}, tmp_path / "mp_rank_00_model_states.pt")
    source = ShardedSource(Checkpoint(str(tmp_path), 1, False, [str(tmp_path / "mp_rank_00_model_states.pt")]))
    mapped = source.state[0]["w"]
    first = mapped.clone()
    release_pages(mapped)
    assert torch.equal(mapped, first) and torch.equal(first, data)


# -- materialising a model built on meta -----------------------------------------------------

class _Shared(torch.nn.Module):
    """Tied parameters, one module reachable under many names (as EVA-CLIP-E's rope), buffers."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(6, 6, bias=False)
        self.head = torch.nn.Linear(6, 6, bias=False)
        self.head.weight = self.embed.weight
        rope = torch.nn.Module()
        rope.register_buffer("table", torch.ones(5, 3))
        self.blocks = torch.nn.ModuleList(torch.nn.Module() for _ in range(6))
        for block in self.blocks:
            block.rope = rope
            block.proj = torch.nn.Linear(6, 6)
        self.embed.weight.model_parallel = False  # an attribute SAT sets: must survive


def test_meta_model_materialises_with_ties_shared_modules_and_attributes(tmp_path):
    from sat_patches.patches.construction import build_on
    real = _Shared()
    with torch.no_grad():
        for p in real.parameters():
            p.normal_()
        real.blocks[0].rope.table.mul_(3)
    torch.save({"module": real.state_dict()}, tmp_path / "mp_rank_00_model_states.pt")
    with build_on("meta", torch.bfloat16):
        model = _Shared()
    assert {p.device.type for p in model.parameters()} == {"meta"}
    source = ShardedSource(Checkpoint(str(tmp_path), 1, False, [str(tmp_path / "mp_rank_00_model_states.pt")]))
    missing, unexpected = load_state(model, source)
    assert missing == [] and unexpected == []
    assert meta_tensors(model) == []
    assert model.head.weight is model.embed.weight and model.embed.weight.model_parallel is False
    assert all(b.rope is model.blocks[0].rope for b in model.blocks)
    for key, want in real.state_dict().items():
        got = model.state_dict()[key]
        assert got.dtype == torch.bfloat16, key  # the run's dtype, converted while copying
        assert torch.equal(got.float(), want.to(got.dtype).float()), key


def test_shared_experiment_start_is_a_patch_that_unpatch_restores():
    """SAT's training module gets rank 0's start time through a registered patch on its ``datetime``:
    listed by status(), and unpatch() puts SAT's own datetime class back."""
    import datetime
    import sat.training.deepspeed_training as training
    import sat_patches
    from sat_patches.patches.loading import SharedStartClock
    row = {r["name"]: r for r in sat_patches.status()}["shared_experiment_start"]
    assert row["status"] == "applied" and row["target"] == "sat.training.deepspeed_training:datetime"
    assert "THUDM/CogVLM#269" in row["answers"]
    clock = training.datetime
    assert isinstance(clock, SharedStartClock) and sat_patches.is_patched("shared_experiment_start")
    now = clock.now()
    assert type(now) is datetime.datetime and isinstance(now, clock)         # the real clock until shared
    assert clock.fromisoformat("2020-01-02T03:04:00") == datetime.datetime(2020, 1, 2, 3, 4)
    start = datetime.datetime(2020, 1, 2, 3, 4)
    clock.share(start)
    assert clock.now() == start                       # once: experiment_name's timestamp
    assert clock.now() > start
    try:
        sat_patches.unpatch("shared_experiment_start")
        assert training.datetime is datetime.datetime
        assert not sat_patches.is_patched("shared_experiment_start")
    finally:
        sat_patches.apply()
    assert isinstance(training.datetime, SharedStartClock)
