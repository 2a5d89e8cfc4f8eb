"""One construction context: with the device policy at meta and a bf16 run, every parameter SAT
builds (base transformer, LLaMA's mixins, CogVLM-like vision-expert mixins that default to
``device=torch.device('cpu')``/fp32, a mixin built outside the model, layers a mixin's ``reinit``
builds, CogVideoX's DiT told its dtype by keyword) is on meta in bf16.

One process: each scenario runs patched, then with one construction patch restored (it must then
leave CPU/fp32 parameters behind), then patched again.
"""
import pytest
import torch

from multirank import run_ranks

pytestmark = pytest.mark.multirank

PATCHES = ("build_models_on_device", "add_mixin_on_device", "reinit_on_device")


def _scenarios(device="meta"):
    import torch.nn as nn
    from sat.model.base_model import BaseMixin, get_model
    from sat.mpu import ColumnParallelLinear
    import expert_llama as el

    class CpuDefaultMixin(BaseMixin):  # CogVLM's mixins: device/params_dtype defaults
        def __init__(self, params_dtype=torch.float, device=torch.device("cpu")):
            super().__init__()
            self.proj = ColumnParallelLinear(64, 128, bias=True, gather_output=False, params_dtype=params_dtype,
                                             skip_init=True, device=device)
            self.norm = nn.LayerNorm(64)

    class ReinitMixin(BaseMixin):  # builds its layer in reinit, as LoRA does
        def reinit(self, parent_model=None):
            self.layer = ColumnParallelLinear(64, 64, bias=False, gather_output=False)

    cls = el.model_class()

    def args():
        a = el.build_args(el.config(), bf16=True)
        a.device = device  # get_model's final .to(args.device)
        return a

    def direct():
        return cls(args())

    def via_get_model():
        return get_model(args(), cls)

    def mixin_built_outside():
        model = direct()
        model.add_mixin("outside", CpuDefaultMixin())
        return model.get_mixin("outside")

    def mixin_reinit():
        model = direct()
        model.add_mixin("late", ReinitMixin())
        model.reinit(["late"])
        return model.get_mixin("late")

    def dtype_keyword():  # CogVideoX's DiT: told dtype="bf16" by keyword, its transformer_args naming none
        import tiny_cogvideo
        return tiny_cogvideo.dit("bf16")

    return {"direct": direct, "get_model": via_get_model, "mixin_built_outside": mixin_built_outside,
            "mixin_reinit": mixin_reinit, "dtype_keyword": dtype_keyword}


def construction_report(device="meta"):
    """{scenario: {"patched" or a restored patch's name: {"created"/"final": [(device, dtype)]}}}."""
    import torch
    import torch.distributed as dist
    from sat import mpu
    import sat_patches
    from sat_patches.runtime import devices
    from patching import patches_removed
    dist.init_process_group("gloo")
    mpu.initialize_model_parallel(1)

    def kinds(build):
        """(device, dtype) of parameters as created (registration hook) and as they end up."""
        created = set()

        def seen(module, name, param):
            if param is not None:
                created.add((param.device.type, str(param.dtype)))
        handle = torch.nn.modules.module.register_module_parameter_registration_hook(seen)
        try:
            with devices.use_device(device):
                module = build()
        finally:
            handle.remove()
        final = {(p.device.type, str(p.dtype)) for p in module.parameters()}
        return {"created": sorted(created), "final": sorted(final)}

    report = {}
    for scenario, build in _scenarios(device).items():
        report[scenario] = {"patched": kinds(build)}
        for name in PATCHES:
            with patches_removed(name):  # patches stacked on the same target (ledger's) stay on
                report[scenario][name] = kinds(build)
        assert all(sat_patches.is_patched(n) for n in PATCHES)
    return report


@pytest.fixture(scope="module")
def report():
    [r] = run_ranks(construction_report, 1, timeout=120)
    assert r.ok, r.output[-3000:]
    return r.result


META_BF16 = [("meta", "torch.bfloat16")]
# a mixin built before add_mixin is created on CPU by its own code: what counts is where it ends up
WHEN = {"direct": "created", "get_model": "created", "mixin_built_outside": "final", "mixin_reinit": "created",
        "dtype_keyword": "created"}


@pytest.mark.parametrize("scenario", list(WHEN))
def test_every_parameter_on_meta_in_run_dtype(report, scenario):
    assert report[scenario]["patched"][WHEN[scenario]] == META_BF16, report[scenario]["patched"]
    assert report[scenario]["patched"]["final"] == META_BF16, report[scenario]["patched"]


@pytest.mark.parametrize("patch, scenario", [
    ("build_models_on_device", "direct"),
    ("build_models_on_device", "get_model"),  # stock builds a CPU fp32 model, then casts and moves it
    ("add_mixin_on_device", "mixin_built_outside"),
    ("reinit_on_device", "mixin_reinit"),
    ("build_models_on_device", "dtype_keyword"),
])
def test_without_the_patch_parameters_land_on_cpu(report, patch, scenario):
    assert ("cpu", "torch.float32") in report[scenario][patch][WHEN[scenario]], report[scenario]


def test_build_on_keeps_explicit_accelerator_devices_and_integer_dtypes():
    from sat_patches.runtime.construction import build_on
    with build_on("meta", torch.bfloat16):
        floats = torch.empty(3, device=torch.device("cpu"))
        ints = torch.zeros(3, dtype=torch.long)
        full_int = torch.full((2,), 7)
        ramp = torch.arange(4).float()  # index arithmetic / buffers: not a factory here
        with build_on("cpu", torch.float16):  # nested: the outer context decides
            inner = torch.ones(2)
    assert (floats.device.type, floats.dtype) == ("meta", torch.bfloat16)
    assert (ints.device.type, ints.dtype) == ("meta", torch.long)
    assert full_int.dtype == torch.long
    assert ramp.device.type == "cpu" and ramp.dtype == torch.float32
    assert (inner.device.type, inner.dtype) == ("meta", torch.bfloat16)
    assert torch.empty(1).device.type == "cpu"  # outside: untouched


def test_a_normal_draw_on_meta_is_skipped_and_a_real_one_is_not():
    """torch runs ``normal_`` on a meta tensor through a Python reference that imports its compiler (seconds per
    process): inside a construction the draw is skipped on meta, where it has no values to fill and advances no
    generator; a draw on a real device is as before."""
    from sat_patches.runtime import construction
    torch.manual_seed(0)
    with construction.build_on("meta"):
        weight = torch.nn.Embedding(10, 4).weight  # reset_parameters: nn.init.normal_(weight)
        same = weight.normal_(0, 0.02)
    assert weight.is_meta and same is weight
    after_meta = torch.rand(3)
    torch.manual_seed(0)
    assert torch.equal(after_meta, torch.rand(3))  # no generator advanced on meta
    torch.manual_seed(0)
    with construction.build_on("cpu"):
        real = torch.nn.Embedding(10, 4).weight
    torch.manual_seed(0)
    assert torch.equal(real, torch.nn.Embedding(10, 4).weight) and real.std() > 0


@pytest.mark.gpu
def test_every_parameter_on_the_gpu_in_run_dtype():
    """The same scenarios with the policy's real CUDA device (GPU-only)."""
    [r] = run_ranks(construction_report, 1, args=("cuda:0",), timeout=120)
    assert r.ok, r.output[-3000:]
    for scenario, when in WHEN.items():
        assert r.result[scenario]["patched"][when] == [("cuda", "torch.bfloat16")], r.result[scenario]
