"""A CogVLM fork's own vision-expert mixins (``utils/models/mixin.py``, here the synthetic checkout's, written in
the shape of upstream's) are patched when the fork imports them: the same values and gradients as their
boolean-mask routing, without its per-layer host reads; listed while waiting; skipped when their code differs."""
import sat_patches  # noqa: F401  (first: makes ``import sat`` work here)

import importlib
import os
import sys
import types
import warnings

import pytest
import torch

from sat.model.base_model import get_model

from fake_checkout import write_fake_checkout
from fast_paths import build_cogvlm as build, cogvlm_batch as batch_for, host_reads
from fast_paths import train_step as step
from sat_patches.cogvlm import FineTuneTrainCogVLMModel, tiny_args
from sat_patches.core.registry import REGISTRY, SatPatchesWarning
from patching import patches_removed

NAMES = ("fork_expert_routing_mlp", "fork_expert_routing_attention")


def forget_fork_modules():
    for name in [n for n in sys.modules if n == "utils" or n.startswith("utils.")]:
        del sys.modules[name]


@pytest.fixture
def checkout(tmp_path):
    root = write_fake_checkout(str(tmp_path / "CogVLM"))
    forget_fork_modules()
    sys.path.insert(0, root)
    try:
        yield root
    finally:
        sys.path.remove(root)
        forget_fork_modules()


def statuses():
    return {r["name"]: r["status"] for r in sat_patches.status() if r["name"] in NAMES}


def fork_model(mixins):
    cls = type("ForkCogVLMUnderTest", (FineTuneTrainCogVLMModel,),
               {"vision_expert_mixins": (mixins.LlamaVisionExpertFCMixin, mixins.LlamaVisionExpertAttnMixin)})
    args = tiny_args("cogvlm", checkpoint_activations=True)
    torch.manual_seed(0)
    model = get_model(args, cls)
    model.train()
    return model, args


def test_waiting_until_the_fork_imports_its_mixins_then_applied(checkout):
    assert "utils.models.mixin" not in sys.modules
    assert set(statuses().values()) == {"waiting"}  # listed; nothing imported to find out
    assert "utils.models.mixin" not in sys.modules
    mixins = importlib.import_module("utils.models.mixin")
    assert set(statuses().values()) == {"applied"}
    assert getattr(mixins.LlamaVisionExpertFCMixin.mlp_forward, "__sat_patches__", None) == NAMES[0]
    assert getattr(mixins.LlamaVisionExpertAttnMixin.attention_forward, "__sat_patches__", None) == NAMES[1]


@pytest.mark.slow  # forward and backward twice with the profiler on (~3 s); the fast tier keeps the gates
def test_the_forks_mixins_patched_give_their_own_values_with_fewer_host_reads(checkout):
    mixins = importlib.import_module("utils.models.mixin")
    model, args = fork_model(mixins)
    batch = batch_for(args)
    logits, grads = step(model, batch)
    fast = host_reads(lambda: step(model, batch_for(args, seed=1)))
    with patches_removed(*NAMES):  # (SAT binds a mixin's hooks when it is added: the model is built again)
        assert mixins.LlamaVisionExpertFCMixin.mlp_forward.__qualname__.startswith("LlamaVisionExpertFCMixin")
        model, args = fork_model(mixins)
        own_logits, own_grads = step(model, batch)
        slow = host_reads(lambda: step(model, batch_for(args, seed=1)))
    assert torch.allclose(logits, own_logits, rtol=0, atol=1e-5)
    assert grads.keys() == own_grads.keys()
    for name in own_grads:
        assert torch.allclose(grads[name], own_grads[name], rtol=1e-4, atol=1e-6), name
    assert slow - fast >= 2 * args.num_layers * 4, (fast, slow)  # the fork reads its mask in every layer


def test_a_fork_whose_mixin_code_differs_is_left_alone_with_a_warning(checkout):
    path = f"{checkout}/utils/models/mixin.py"
    with open(path) as f:
        source = f.read()
    with open(path, "w") as f:  # a fork that renamed the expert's gate
        f.write(source.replace("vision_gate_proj", "vision_gate"))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        mixins = importlib.import_module("utils.models.mixin")
    assert statuses()[NAMES[0]] == "skipped" and statuses()[NAMES[1]] == "applied"
    assert "vision_gate_proj" in REGISTRY.get(NAMES[0]).reason
    assert any(issubclass(w.category, SatPatchesWarning) and NAMES[0] in str(w.message) for w in seen)
    assert not hasattr(mixins.LlamaVisionExpertFCMixin.mlp_forward, "__sat_patches__")


@pytest.mark.skipif(not os.environ.get("SAT_PATCHES_COGVLM_CHECKOUT"),
                    reason="set SAT_PATCHES_COGVLM_CHECKOUT to a CogVLM checkout (or a fork) to check its own mixins")
def test_a_real_checkouts_mixins_are_patched_and_give_their_own_values(monkeypatch):
    """Upstream's ``utils/models/mixin.py`` itself (only that file: its package's other models need timm): its
    patched methods and its own, each run on the mixins of our tiny model, give the same logits and gradients."""
    from sat_patches.cogvlm import vision_expert
    root = os.path.join(os.environ["SAT_PATCHES_COGVLM_CHECKOUT"], "utils")
    forget_fork_modules()
    for name, path in (("utils", root), ("utils.models", os.path.join(root, "models"))):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
        sys.modules[name].__path__ = [path]
    try:
        importlib.import_module("utils.models.mixin")
        assert set(statuses().values()) == {"applied"}, sat_patches.status()
        batch, results = None, []
        for use in ("patched", "upstream's own"):
            if use != "patched":
                for name, cls, attr in ((NAMES[0], vision_expert.LlamaVisionExpertFCMixin, "mlp_forward"),
                                        (NAMES[1], vision_expert.LlamaVisionExpertAttnMixin, "attention_forward")):
                    monkeypatch.setattr(cls, attr, REGISTRY.get(name).original)
            model, args = build(True)
            batch = batch or batch_for(args)
            results.append(step(model, batch))
        (logits, grads), (own_logits, own_grads) = results
        assert torch.allclose(logits, own_logits, rtol=0, atol=1e-5)
        for name in own_grads:
            assert torch.allclose(grads[name], own_grads[name], rtol=1e-4, atol=1e-6), name
    finally:
        forget_fork_modules()
