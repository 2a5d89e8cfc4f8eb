"""A CogVideoX-shaped LoRA run (one ``--load`` of a released-style checkpoint, never ``from_pretrained``), its DiT
built in bf16 from the ``dtype="bf16"`` keyword: its save holds the adapters only (no T5, no VAE), resumes through one
``--load`` to the same parameters, merges (from the run's folder alone) into a checkpoint that ``--load`` puts into the
DiT without LoRA as the trained DiT folded, exports in diffusers' names, and a base that changed since is refused with
a message naming the adapter and the base. With ``SAT_PATCHES_COGVIDEO_CHECKOUT`` (a THUDM/CogVideo v1.0 checkout's
``sat/`` folder), the same on upstream's own ``SATVideoDiffusionEngine`` and ``DiffusionTransformer``."""
import os

import pytest

from multirank import run_ranks

pytestmark = [pytest.mark.multirank, pytest.mark.slow]


def train_resume_refuse(root, kind):
    """One rank: the base written as CogVideoX releases it (the DiT's weights only, bf16, no LoRA), a bf16 ZeRO-2 LoRA run
    from it, the run resumed through ``--load`` alone, merged and loaded, then refused once the base changed."""
    import glob
    import safetensors.torch
    import torch
    import torch.distributed as dist
    from sat import mpu
    from sat_patches.checkpoints import cogvideo, files, merge, writer
    from sat_patches.lora.layer import is_lora_layer
    from sat_patches.checkpoints.adapter import AdapterError
    import importlib
    tc = importlib.import_module(kind)  # the model's module: tiny_cogvideo, or cogvideo_checkout (upstream's code)
    dist.init_process_group("gloo")
    mpu.initialize_model_parallel(1)
    from sat_patches.runtime import devices
    config, plain = tc.model_config(), tc.model_config(lora=False)
    built = set()  # (device, dtype) of every parameter as the DiT creates it, told dtype="bf16", on meta
    hook = torch.nn.modules.module.register_module_parameter_registration_hook(
        lambda module, name, p: built.add((p.device.type, str(p.dtype))))
    with devices.use_device("meta"):
        tc.dit("bf16")
    hook.remove()
    torch.manual_seed(0)
    engine = tc.engine(plain)
    released = {k: v.bfloat16() for k, v in engine.state_dict().items() if k.startswith("model.diffusion_model.")}
    base = os.path.join(root, "transformer")
    writer.write_layout(base, 1000, {0: {"module": released}})
    precision = ["--bf16", "--zero-stage", "2"]
    trained = tc.main(["--load", base, "--save", os.path.join(root, "run"), *precision], config).module
    (run,) = glob.glob(os.path.join(root, "run", "*"))
    saved = files.find_checkpoint(run).open(0)["module"]
    resumed = tc.main(["--load", run, "--train-iters", "0", *precision], config)
    mine, theirs = {k: v.clone() for k, v in trained.state_dict().items()}, resumed.state_dict()
    # merged (LoRA folded, no T5 or VAE) and loaded through --load into the DiT without LoRA: the trained DiT folded
    cogvideo.merge(run, os.path.join(root, "merged"))
    merged = tc.main(["--load", os.path.join(root, "merged"), "--train-iters", "0", *precision], plain)
    dit = trained.model.diffusion_model
    merge.fold_lora(dit, [n for n, m in dit.named_modules() if is_lora_layer(m)])
    folded, loaded = dit.state_dict(), merged.model.diffusion_model.state_dict()
    cogvideo.export_diffusers(run, os.path.join(root, "diffusers"))
    exported = safetensors.torch.load_file(os.path.join(root, "diffusers", cogvideo.DIFFUSERS_FILE))
    got = {"built": sorted(built), "exported": sorted(exported), "run": run, "base": base, "saved": {k: tuple(v.shape) for k, v in saved.items()},
           "merged_same": sorted(folded) == sorted(loaded) and all(torch.equal(folded[k], loaded[k]) for k in folded),
           "same": sorted(k for k in mine if torch.equal(mine[k], theirs[k])), "keys": sorted(mine),
           "dtypes": sorted({str(v.dtype) for k, v in theirs.items() if k.startswith("model.")}),
           "lora_trained": any(float(v.abs().sum()) > 0 for k, v in mine.items() if "matrix_B" in k)}
    [shard] = files.find_checkpoint(base).files
    changed = torch.load(shard, weights_only=False)
    first = next(k for k in changed["module"] if k.endswith("query_key_value.weight"))
    changed["module"][first] = changed["module"][first] + 1
    torch.save(changed, shard + ".new")
    os.replace(shard + ".new", shard)  # a new file: what the models above mapped of the old one stays as it was
    try:
        tc.main(["--load", run, "--train-iters", "0", *precision], config)
        refused = None
    except AdapterError as exc:
        refused = str(exc)
    return dict(got, refused=refused)


CHECKOUT = os.environ.get("SAT_PATCHES_COGVIDEO_CHECKOUT")


@pytest.mark.parametrize("kind", [
    "tiny_cogvideo",
    pytest.param("cogvideo_checkout", marks=pytest.mark.skipif(
        not CHECKOUT, reason="SAT_PATCHES_COGVIDEO_CHECKOUT (a THUDM/CogVideo v1.0 checkout's sat/ folder) not set")),
])
def test_an_adapter_only_save_resumes_through_one_load_merges_and_refuses_a_changed_base(tmp_path, kind):
    [r] = run_ranks(train_resume_refuse, 1, args=(str(tmp_path), kind), timeout=240,
                    env={"SAT_PATCHES_HEARTBEAT_TIMEOUT": "0"})
    assert r.ok and r.result is not None, (r.exception or "") + r.output[-4000:]
    got = r.result
    # 2 layers x (query_key_value: A and B for Q, K, V; dense: one A and one B): LoRA's 16 tensors, nothing else
    assert len(got["saved"]) == 16, got["saved"]
    assert all(".matrix_A." in k or ".matrix_B." in k for k in got["saved"])
    assert got["lora_trained"]
    assert got["same"] == got["keys"]            # every parameter and buffer, base and adapters
    assert got["built"] == [("meta", "torch.bfloat16")] and got["dtypes"] == ["torch.bfloat16"]  # the run's dtype
    assert got["merged_same"]
    assert got["exported"] == sorted(f"transformer.transformer_blocks.{i}.attn1.{t}.lora_{f}.weight" for i in range(2)
                                     for t in ("to_q", "to_k", "to_v", "to_out.0") for f in "AB")
    refused = got["refused"]
    assert refused and f"the adapter in {got['run']} was trained on {got['base']}" in refused, refused
    assert f"but that folder now holds {got['base']}" in refused and refused.count("sha256") == 2
