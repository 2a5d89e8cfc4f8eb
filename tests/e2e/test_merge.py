"""``python -m sat_patches merge``: an MP=2 LoRA checkpoint merged into one MP=1 checkpoint whose
logits equal the LoRA model's; errors come as exceptions from ``merge()`` and as messages from
``main()``; the output directory is written whole or not at all."""
import os

import pytest

from multirank import run_ranks

pytestmark = pytest.mark.multirank


def _config():
    return dict(model_class="BaseModel", num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=1024,
                max_sequence_length=32, model_parallel_size=2)


def _build(mp, lora):
    from sat.model.base_model import BaseModel
    from sat.model.finetune.lora2 import LoraMixin
    cfg = dict(_config(), model_parallel_size=mp, hidden_dropout=0., attention_dropout=0.)
    cfg.pop("model_class")
    model = BaseModel(BaseModel.get_args(**cfg))
    if lora:
        model.add_mixin("lora", LoraMixin(2, 4, lora_alpha=1.0), reinit=True)
    return model.eval()


def _logits(model):
    import torch
    ids = torch.arange(2, 18).view(1, -1)
    with torch.no_grad():
        return model(input_ids=ids, position_ids=torch.arange(16).view(1, -1), attention_mask=None)[0]


def save_mp2_lora_checkpoint(root):
    """Each of 2 ranks: a LoRA model at MP=2 (B != 0) saved as its shard; rank 0 also returns the logits."""
    import torch
    import torch.distributed as dist
    from sat import mpu
    from sat.arguments import _simple_init
    from sat_patches.checkpoints import writer
    _simple_init(model_parallel_size=2, seed=1)
    torch.manual_seed(0)
    model = _build(2, lora=True)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "matrix_B" in name:
                p.normal_(0, 0.05)
    writer.write_layout(root, 1, {mpu.get_model_parallel_rank(): {"module": model.state_dict(), "iteration": 1}},
                        _config() if dist.get_rank() == 0 else None, latest=dist.get_rank() == 0)
    return _logits(model)


def merge_and_compare(root, out):
    """One process: merge() errors, main()'s messages, then a real merge whose logits are returned."""
    import io
    import contextlib
    from sat_patches.checkpoints import merge
    from sat_patches.cli import merge as merge_cli
    from sat_patches.checkpoints.files import CheckpointError
    got = {}
    os.makedirs(out)
    with open(os.path.join(out, "mine.txt"), "w") as f:
        f.write("the user's")
    with pytest.raises(merge.MergeError, match="exists; choose a new OUTPUT_DIR or pass --overwrite"):
        merge.merge(root, out)
    with pytest.raises(CheckpointError, match="does not exist"):
        merge.merge(root + "-missing", out + "-new")
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        got["status"] = merge_cli.main([root, out])
    got["message"] = err.getvalue()
    got["kept"] = sorted(os.listdir(out))
    got["info"] = merge.merge(root, out, overwrite=True)
    got["written"] = sorted(os.listdir(out))
    got["siblings"] = sorted(os.listdir(os.path.dirname(out)))
    from sat.model.base_model import BaseModel
    model, _ = BaseModel.from_pretrained(out, None)
    got["logits"] = _logits(model.eval())
    return got


@pytest.mark.slow
def test_merge_mp2_lora_to_mp1(tmp_path):
    import torch
    root, out = str(tmp_path / "run"), str(tmp_path / "merged")
    saved = run_ranks(save_mp2_lora_checkpoint, 2, args=(root,), timeout=180)
    assert all(r.ok for r in saved), [r.exception or r.output[-2000:] for r in saved]
    [merged] = run_ranks(merge_and_compare, 1, args=(root, out), timeout=180)
    assert merged.ok, merged.exception or merged.output[-3000:]
    got = merged.result
    assert got["status"] == 1 and got["message"].startswith(f"error: {out} exists"), got
    assert got["kept"] == ["mine.txt"]                              # refused: the user's directory untouched
    assert got["info"] == {"shards": 2, "lora_layers": 4, "iteration": 1}
    assert got["written"] == ["1", "latest", "model_config.json"]   # replaced whole by the complete checkpoint
    assert got["siblings"] == ["merged", "run"]                     # no staging directory left behind
    assert torch.allclose(got["logits"], saved[0].result, atol=1e-4), (got["logits"] - saved[0].result).abs().max()
