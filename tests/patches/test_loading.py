"""Checkpoint files: clear errors for bad input before anything is built, and rank-local slices of
split tensors between any two model-parallel sizes (SAT's own ``partition()`` is the reference)."""
import hashlib
import json
import mmap
import os
import types

import pytest
import torch

from sat_patches.checkpoints import loading
from sat_patches.checkpoints.loading import Checkpoint, CheckpointError, ShardedSource
from sat_patches.checkpoints.sharding import Split, release_pages
from sat_patches.checkpoints.state import load_state, meta_tensors
from mappings import first_read, in_file, smaps_bytes


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
    monkeypatch.setattr(loading, "_build_on_meta", no_build)
    monkeypatch.setattr(loading, "get_model", no_build)
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
    with pytest.raises(CheckpointError, match="python -m sat_patches merge"):
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
    from sat_patches.runtime.construction import build_on
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
    from sat_patches.checkpoints.loading import SharedStartClock
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


# -- zero copy on the CPU ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    """A tiny CogVLM-like SAT checkpoint (fp32, as the model it loads into): (directory, config, shard file)."""
    import expert_llama as el
    path = str(tmp_path_factory.mktemp("zero_copy") / "ckpt")
    cfg = el.config()
    model = el.model_class()(el.build_args(cfg))
    el.fill_(model)
    el.write_checkpoint(model, cfg, path)
    return path, cfg, os.path.join(path, "1", "mp_rank_00_model_states.pt")


def _from_pretrained(path, cfg):
    import expert_llama as el
    model, _ = el.model_class().from_pretrained(path, el.build_args(cfg))
    return model


def _digest(file):
    with open(file, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


@pytest.mark.parametrize("default_mapping", [pytest.param("MAP_PRIVATE", marks=pytest.mark.slow), "MAP_SHARED"])
def test_cpu_parameters_are_the_mapped_file_and_training_never_writes_it(tiny_checkpoint, default_mapping):
    """On a CPU rank every parameter is the mapped checkpoint's own memory (no copy); a training step
    writes private copy-on-write pages: the file is unchanged, also when the program set torch's
    default mapping to MAP_SHARED."""
    path, cfg, shard = tiny_checkpoint
    before, saved = _digest(shard), torch.load(shard)["module"]
    with torch.serialization.set_default_mmap_options(getattr(mmap, default_mapping)):
        model = _from_pretrained(path, cfg)
    params = dict(model.named_parameters())
    assert [n for n, p in params.items() if not in_file(p, shard)] == []
    assert all(torch.equal(p.detach(), saved[n]) for n, p in params.items())
    optimizer = torch.optim.SGD(params.values(), lr=0.1)
    sum(p.square().sum() for p in params.values()).backward()  # gradient 2p: every weight moves
    optimizer.step()
    assert [n for n, p in params.items() if torch.equal(p.detach(), saved[n])] == []
    assert _digest(shard) == before


def test_two_loads_of_one_file_share_its_pages(tiny_checkpoint):
    """Two models loaded from one file (two ranks of a node) hold the weights once: each page of the
    file is mapped by both (its proportional share, Pss, is half its resident size), none is copied."""
    path, cfg, shard = tiny_checkpoint
    models = [_from_pretrained(path, cfg) for _ in range(2)]
    for model in models:
        first_read(model.parameters())  # faults the pages in
    weights = sum(p.numel() * p.element_size() for p in models[0].parameters())
    theirs = [p for model in models for p in model.parameters()]  # not other tests' mappings of the file
    rss, pss = smaps_bytes(shard, "Rss", theirs), smaps_bytes(shard, "Pss", theirs)
    assert rss >= 2 * weights and pss <= 0.55 * rss, (weights, rss, pss)
    assert smaps_bytes(shard, "Anonymous", theirs) == 0
    first, second = (dict(m.named_parameters()) for m in models)
    assert all(torch.equal(first[n], second[n]) and first[n].data_ptr() != second[n].data_ptr() for n in first)


@pytest.mark.slow  # a load compared tensor by tensor (~2 s)
def test_zero_copy_off_copies_every_tensor(tiny_checkpoint, monkeypatch):
    """``SAT_PATCHES_LOAD_ZERO_COPY=0``: every tensor is copied into new memory (the loader before zero
    copy); a value other than 0 or 1 stops the load, saying what to set."""
    path, cfg, shard = tiny_checkpoint
    saved = torch.load(shard)["module"]
    monkeypatch.setenv("SAT_PATCHES_LOAD_ZERO_COPY", "0")
    params = dict(_from_pretrained(path, cfg).named_parameters())
    assert [n for n, p in params.items() if in_file(p, shard)] == []
    assert all(torch.equal(p.detach(), saved[n]) for n, p in params.items())
    monkeypatch.setenv("SAT_PATCHES_LOAD_ZERO_COPY", "yes")
    with pytest.raises(ValueError, match=r"SAT_PATCHES_LOAD_ZERO_COPY='yes': set it to 1 \(.*\) or 0 \(off\)"):
        _from_pretrained(path, cfg)


def _checkpoint(tmp_path, shards):
    """The Checkpoint of ``shards`` (one ``module`` state dict per model-parallel shard) saved in ``tmp_path``."""
    files = []
    for i, state in enumerate(shards):
        files.append(str(tmp_path / f"mp_rank_{i:02d}_model_states.pt"))
        torch.save({"module": state}, files[-1])
    return Checkpoint(str(tmp_path), 1, False, files)


def test_lent_tensors_never_alias_and_keep_their_writes(tmp_path):
    """A tensor lent from the mapped file keeps what is written to it while its neighbour (sharing a
    page with it) and a second key of its own storage (tied in the file, not in the model) are copied
    and their pages released; that second key gets memory of its own."""
    tied = torch.randn(3 * mmap.PAGESIZE // 4)  # three pages of float32: whole pages inside it
    ckpt = _checkpoint(tmp_path, [{"a": tied, "b": torch.randn(4 * mmap.PAGESIZE), "c": tied}])
    source, cpu = ShardedSource(ckpt), torch.device("cpu")
    a = source.materialised("a", torch.empty_like(tied), None, cpu)
    assert in_file(a, ckpt.files[0])
    b_mapped = source.state[0]["b"]
    assert (a.data_ptr() + a.nbytes - 1) // mmap.PAGESIZE == b_mapped.data_ptr() // mmap.PAGESIZE  # one page
    a.fill_(7.0)  # as training would
    b = source.materialised("b", torch.empty_like(b_mapped, dtype=torch.float64), None, cpu)  # converted: copied
    c = source.materialised("c", torch.empty_like(tied), None, cpu)
    assert not in_file(b, ckpt.files[0]) and not in_file(c, ckpt.files[0])
    assert torch.equal(a, torch.full_like(tied, 7.0)) and torch.equal(c, a)
    assert torch.equal(b, b_mapped.double())
    c.fill_(5.0)
    assert torch.equal(a, torch.full_like(tied, 7.0))


def test_own_shard_whole_is_lent_and_a_slice_is_copied(tmp_path):
    """At the checkpoint's own model-parallel size a rank's slice is its shard, whole: lent (a fused QKV
    too); at another size it is assembled from slices into new memory."""
    full = torch.arange(48 * 8, dtype=torch.float32).reshape(48, 8)
    ckpt = _checkpoint(tmp_path, [{"w": shard} for shard in _sat_partition("column", full, 2, 3)])
    split, cpu = SPLITS["column"](3), torch.device("cpu")
    own = ShardedSource(ckpt, "", 1, 2)
    lent = own.materialised("w", torch.empty(24, 8), split, cpu)
    assert lent.data_ptr() == own.state[1]["w"].data_ptr()
    merged = ShardedSource(ckpt, "", 0, 1).materialised("w", torch.empty(48, 8), split, cpu)
    assert torch.equal(merged, full) and not any(in_file(merged, f) for f in ckpt.files)


@pytest.mark.parametrize("load", ["the run", "the base itself", "none"])
def test_a_base_loaded_before_the_run_it_continues_says_nothing_of_random_states(tiny_checkpoint, tmp_path, load):
    """A resumed run (``--mode pretrain --load RUN``) first loads its base with ``from_pretrained``: a model-only
    checkpoint, no random states, which the run's own checkpoint restores right after. Only a missing state in the
    checkpoint being continued is said (its advice, ``--no-load-rng``, would also skip the run's states)."""
    import warnings
    import expert_llama as el
    path, cfg, _ = tiny_checkpoint
    args = el.build_args(cfg)
    args.mode, args.no_load_rng = "pretrain", False
    args.load = {"the run": str(tmp_path / "run"), "the base itself": path, "none": None}[load]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        el.model_class().from_pretrained(path, args)
    said = [str(w.message) for w in seen if "checkpoint has no" in str(w.message)]
    assert bool(said) == (load != "the run"), said
