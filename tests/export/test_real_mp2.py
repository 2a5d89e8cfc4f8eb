"""From an MP=2 save written by two SAT ranks (not by our split rules): the export with LoRA folded imports back
to exactly what ``python -m sat_patches merge`` writes, and the base weights import at MP=2 to exactly the
shards the ranks saved."""
import os

import pytest

from multirank import run_ranks

pytestmark = [pytest.mark.multirank, pytest.mark.slow]


def save_mp2(root, kind):
    """Each of 2 ranks: the tiny model at MP=2 with LoRA (B != 0), saved as its shard; and the base alone."""
    import torch
    import torch.distributed as dist
    from sat import mpu
    from sat.arguments import _simple_init
    from sat.model.base_model import get_model
    from sat.model.finetune.lora2 import LoraMixin

    from sat_patches.checkpoints import writer
    from sat_patches.cogvlm.config import model_config_dict
    from sat_patches.cogvlm.models import model_class_for
    from sat_patches.cogvlm.tiny import tiny_args
    _simple_init(model_parallel_size=2, seed=1)
    torch.manual_seed(0)
    args = tiny_args(kind, model_parallel_size=2)
    model = get_model(args, model_class_for(kind))
    rank, first = mpu.get_model_parallel_rank(), dist.get_rank() == 0
    config = dict(model_config_dict(args), model_parallel_size=2)
    writer.write_layout(os.path.join(root, "base"), 1, {rank: {"module": model.state_dict(), "iteration": 1}},
                        config if first else None, latest=first)
    model.add_mixin("lora", LoraMixin(args.num_layers, 2, layer_range=None), reinit=True)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "matrix_B" in name:
                p.normal_(0, 0.05)
    writer.write_layout(os.path.join(root, "lora"), 1, {rank: {"module": model.state_dict(), "iteration": 1}},
                        config if first else None, latest=first)


def export_import_and_merge(root):
    import torch

    from sat_patches.checkpoints import merge
    from sat_patches.checkpoints import files, safe_load
    from sat_patches.export.hf import export_hf
    from sat_patches.export.importer import import_hf

    def modules(directory):
        return [safe_load.load(f)["module"] for f in files.find_checkpoint(directory).files]

    def identical(a, b):
        return set(a) == set(b) and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)

    export_hf(os.path.join(root, "lora"), os.path.join(root, "hf_lora"))
    import_hf(os.path.join(root, "hf_lora"), os.path.join(root, "back_lora"))
    merge.merge(os.path.join(root, "lora"), os.path.join(root, "merged"))
    export_hf(os.path.join(root, "base"), os.path.join(root, "hf_base"))
    import_hf(os.path.join(root, "hf_base"), os.path.join(root, "back_base"), mp=2)
    return {"lora": identical(modules(os.path.join(root, "back_lora"))[0], modules(os.path.join(root, "merged"))[0]),
            "base": [identical(a, b) for a, b in zip(modules(os.path.join(root, "back_base")),
                                                     modules(os.path.join(root, "base")))]}


@pytest.mark.parametrize("kind", ["cogvlm", "cogagent"])
def test_real_mp2_save_round_trip(kind, tmp_path):
    root = str(tmp_path)
    saved = run_ranks(save_mp2, 2, args=(root, kind), timeout=240)
    assert all(r.ok for r in saved), [r.exception or r.output[-2000:] for r in saved]
    [done] = run_ranks(export_import_and_merge, 1, args=(root,), timeout=240)
    assert done.ok, done.exception or done.output[-3000:]
    assert done.result == {"lora": True, "base": [True, True]}
