"""The patch registry: applied once, idempotent, reversible, gated on SAT's code shape."""
import json
import os
import subprocess
import sys
import types
import warnings

import pytest

import sat_patches
from sat_patches.core.registry import Patch, Registry, SatPatchesWarning, delegate, expect_names, expect_params
from patching import patches_removed
from multirank import run_fresh

SOURCE_DIR = os.path.dirname(os.path.abspath(sat_patches.__file__))
FORK_PATCHES = ("fork_expert_routing_mlp", "fork_expert_routing_attention")  # waiting for a fork's mixin.py

# SAT's triton rotary module as a machine with triton has it (``import sat`` before ``import sat_patches`` needs it;
# here our kernel file, loaded by path, which imports nothing of sat_patches)
AS_WITH_TRITON = ("import importlib.util as u, sys, os; name = 'sat.model.position_embedding.triton_rotary'; "
                  f"spec = u.spec_from_file_location(name, {os.path.join(SOURCE_DIR, 'kernels', 'rotary.py')!r}); "
                  "m = sys.modules[name] = u.module_from_spec(spec); spec.loader.exec_module(m)")
STATUS_SNIPPET = "import json, sat_patches; print('STATUS' + json.dumps(sat_patches.status()))"


def _status_in_subprocess(code, env=None):
    out = run_fresh(code, env)
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(l for l in out.stdout.splitlines() if l.startswith("STATUS"))
    return {r["name"]: r for r in json.loads(line[len("STATUS"):])}, out


@pytest.mark.slow
@pytest.mark.parametrize("order", ["import sat, sat_patches", "import sat_patches, sat"])
def test_every_patch_applied_in_either_import_order(order):
    rows, _ = _status_in_subprocess(f"{AS_WITH_TRITON}; {order}; {STATUS_SNIPPET}")
    assert set(rows) == set(sat_patches.names())
    not_applied = {n: r for n, r in rows.items() if r["status"] != "applied"}
    assert {n: r["status"] for n, r in not_applied.items()} == {n: "waiting" for n in FORK_PATCHES}, not_applied


@pytest.mark.slow  # a fresh interpreter
def test_import_alone_costs_no_sat_and_patches_go_on_when_sat_is_imported():
    code = ("import sys, sat_patches\n"
            "print('BEFORE', sorted(m for m in ('torch', 'sat', 'deepspeed') if m in sys.modules))\n"
            "import sat.arguments\n"
            "print('AFTER', getattr(sat.arguments.get_args, '__sat_patches__', None))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "BEFORE []" in out.stdout
    assert "AFTER get_args_cpu_device" in out.stdout  # on by the time ``import sat`` returned


@pytest.mark.slow
@pytest.mark.parametrize("first_call", ["names", "status", "is_patched"])
def test_asking_before_import_sat_registers_each_patch_once_and_applies_them(first_call):
    call = {"names": "sat_patches.names()", "status": "sat_patches.status()",
            "is_patched": "sat_patches.is_patched('lora_linear')"}[first_call]
    code = (f"import sys, sat_patches\n{call}\nassert 'sat' in sys.modules\n"
            "names = sat_patches.names()\n"
            "print('ONCE', len(names) == len(set(names)), 'APPLIED', sat_patches.is_patched('lora_linear'))\n")
    out = run_fresh(code)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "ONCE True APPLIED True" in out.stdout


@pytest.mark.slow
def test_unpatch_before_import_sat_leaves_sat_stock():
    code = ("import sat_patches\nsat_patches.unpatch()\nimport sat.arguments\n"
            "print('MARK', getattr(sat.arguments.get_args, '__sat_patches__', None))\n")
    out = run_fresh(code)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "MARK None" in out.stdout


def test_second_apply_changes_nothing():
    sat_patches.apply()  # (pytest may have reset the warnings filters, one of the log filters' parts, since)
    before = {p.name: p.current() for p in sat_patches.core.registry.REGISTRY.patches}
    rebound = {p.name: list(p.rebound) for p in sat_patches.core.registry.REGISTRY.patches}
    sat_patches.apply()
    import sat_patches as again  # a second import is the same module, nothing re-runs
    again.apply()
    after = {p.name: p.current() for p in sat_patches.core.registry.REGISTRY.patches}
    assert all(after[n] is before[n] for n in before)
    assert {p.name: list(p.rebound) for p in sat_patches.core.registry.REGISTRY.patches} == rebound


def test_replacements_are_marked_and_wrap_the_original():
    import sat.arguments
    patch = sat_patches.core.registry.REGISTRY.get("get_args_cpu_device")
    assert sat.arguments.get_args.__sat_patches__ == "get_args_cpu_device"
    assert sat.arguments.get_args.__wrapped__ is patch.original


def test_from_import_aliases_are_rebound_and_restored():
    import sat
    import sat.mpu
    import sat.mpu.data
    inner = sat_patches.core.registry.REGISTRY.get("broadcast_data_device")
    patch = sat_patches.core.registry.REGISTRY.get("hang_watch_broadcast_data")   # the outermost on that target
    # sat/mpu/__init__.py did `from .data import broadcast_data`; sat/__init__ `from .arguments import get_args`
    assert sat.mpu.broadcast_data is sat.mpu.data.broadcast_data is patch.replacement
    assert sat.get_args is sat.arguments.get_args
    with patches_removed():
        assert sat.mpu.broadcast_data is sat.mpu.data.broadcast_data is inner.original
        assert getattr(sat.get_args, "__sat_patches__", None) is None
        assert not sat_patches.is_patched("broadcast_data_device")
        assert {r["status"] for r in sat_patches.status()} == {"restored"}
    assert sat_patches.is_patched("broadcast_data_device")
    assert sat.mpu.broadcast_data is patch.replacement


@pytest.mark.slow
def test_disable_env_turns_single_patches_off():
    rows, _ = _status_in_subprocess(STATUS_SNIPPET, env={"SAT_PATCHES_DISABLE": "timers_cuda_sync,get_args_cpu_device"})
    assert rows["timers_cuda_sync"]["status"] == "disabled"
    assert rows["get_args_cpu_device"]["status"] == "disabled"
    assert rows["broadcast_data_device"]["status"] == "applied"


def _fake_target():
    module = types.ModuleType("satp_fake_target")

    def sat_function(x):
        return x + 1
    module.sat_function = sat_function
    alias_holder = types.ModuleType("sat.satp_fake_alias")  # a 'sat.*' module that did `from x import y`
    alias_holder.sat_function = sat_function
    sys.modules["satp_fake_target"] = module
    sys.modules["sat.satp_fake_alias"] = alias_holder
    return module, alias_holder


def test_unexpected_code_shape_is_skipped_with_one_warning_and_force_applies(monkeypatch):
    module, alias = _fake_target()
    reg = Registry()
    reg.add(Patch("fake", "satp_fake_target:sat_function", lambda orig: (lambda x: orig(x) * 10),
                  answers="test", expect=expect_names("torch_cuda_only_name")))
    monkeypatch.delenv("SAT_PATCHES_FORCE", raising=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        reg.apply_all()
    messages = [str(w.message) for w in caught if issubclass(w.category, SatPatchesWarning)]
    assert len(messages) == 1 and "torch_cuda_only_name" in messages[0] and "SAT_PATCHES_FORCE" in messages[0]
    assert reg.table()[0]["status"] == "skipped" and module.sat_function(1) == 2
    monkeypatch.setenv("SAT_PATCHES_FORCE", "1")
    reg.apply_all()
    assert reg.table()[0]["status"] == "applied" and module.sat_function(1) == 20
    assert alias.sat_function is module.sat_function  # alias rebound
    reg.unpatch_all()
    assert module.sat_function(1) == 2 and alias.sat_function(1) == 2


def test_delegate_passes_the_original_and_the_call_on_under_the_originals_name():
    def original(x, y=1):
        """SAT's."""
        return x + y

    def ours(sat_function, x, y=1):
        return ("ours", sat_function(x, y))
    wrapped = delegate(ours)(original)
    assert wrapped(2, y=3) == ("ours", 5) and wrapped.__name__ == "original" and wrapped.__doc__ == "SAT's."
    assert delegate(lambda x, y=1: x * y, with_original=False)(original)(2, y=3) == 6


def test_expect_params_names_missing_parameter():
    def f(a, b):
        pass
    assert expect_params("a", "b")(f) is None
    assert "parser" in expect_params("a", "parser")(f)


@pytest.mark.slow
def test_cli_status_prints_every_patch():
    out = subprocess.run([sys.executable, "-m", "sat_patches", "status", "--json"], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = json.loads(out.stdout)  # one JSON document: DeepSpeed's import-time log goes to stderr
    assert [r["name"] for r in rows] == sat_patches.names()


def test_unpatching_one_of_two_stacked_patches_keeps_the_other():
    module, _ = _fake_target()
    reg = Registry()
    reg.add(Patch("inner", "satp_fake_target:sat_function", lambda orig: (lambda x: orig(x) * 10), answers="t"),
            Patch("outer", "satp_fake_target:sat_function", lambda orig: (lambda x: orig(x) + 5), answers="t"))
    reg.apply_all()
    assert module.sat_function(1) == 25
    with pytest.raises(RuntimeError, match="'outer' wraps it"):
        reg.get("inner").restore()
    reg.restore(["inner"])
    assert module.sat_function(1) == 7  # outer alone, over the original
    assert [r["status"] for r in reg.table()] == ["restored", "applied"]
    reg.apply_all()
    assert module.sat_function(1) == 25  # registration order again: outer over inner
    reg.unpatch_all()
    assert module.sat_function(1) == 2


def _applied_stack(target):
    """The patch names on ``target`` as applied, innermost first: the marked replacements met while
    following ``__wrapped__`` down from what the target holds now."""
    from sat_patches.core.registry import MARKER
    obj, names = sat_patches.REGISTRY.get(sat_patches.REGISTRY.stacks[target][0]).current(), []
    while obj is not None:
        func = getattr(obj, "__func__", obj)
        if getattr(func, MARKER, None):
            names.append(getattr(func, MARKER))
        obj = getattr(func, "__wrapped__", None)
    return names[::-1]


def test_every_shared_target_is_applied_in_its_declared_order():
    from sat_patches.patches import STACKS
    sat_patches.apply()
    assert set(STACKS) == set(sat_patches.REGISTRY.stacks)
    for target, stack in STACKS.items():
        declared = [name for name, _ in stack]
        assert _applied_stack(target) == declared, target


def test_the_declaration_not_the_registration_decides_the_order():
    module, _ = _fake_target()
    reg = Registry()
    reg.add(Patch("times_ten", "satp_fake_target:sat_function", lambda orig: (lambda x: orig(x) * 10), answers="t"),
            Patch("plus_five", "satp_fake_target:sat_function", lambda orig: (lambda x: orig(x) + 5), answers="t"))
    reg.declare_stacks({"satp_fake_target:sat_function": ["plus_five", "times_ten"]})
    reg.apply_all()
    try:
        assert module.sat_function(1) == 70  # (1 + 1 + 5) * 10: times_ten is outermost, as declared
        reg.restore(["plus_five"])
        assert module.sat_function(1) == 20
        reg.apply_all()
        assert module.sat_function(1) == 70
    finally:
        reg.unpatch_all()
    assert module.sat_function(1) == 2


def test_a_shared_target_without_a_declared_order_is_refused():
    reg = Registry()
    reg.add(Patch("a", "satp_fake_target:sat_function", lambda orig: orig, answers="t"),
            Patch("b", "satp_fake_target:sat_function", lambda orig: orig, answers="t"))
    with pytest.raises(ValueError, match=r"patches \['a', 'b'\] share satp_fake_target:sat_function: declare"):
        reg.declare_stacks({})
    with pytest.raises(ValueError, match="declared: \\['a'\\]"):
        reg.declare_stacks({"satp_fake_target:sat_function": ["a"]})


def test_status_prints_each_declared_stack_with_its_reasons():
    from sat_patches.patches import STACKS
    text = sat_patches.format_status()
    for target, stack in STACKS.items():
        assert target in text
        for name, why in stack:
            assert f"{name}: {why}" in text


def test_aliases_in_our_own_modules_are_rebound_and_restored():
    """A module of ours that did ``from sat.x import f`` before the patches went on (the patches apply once the
    outermost of our modules being imported has run) calls the patched ``f``."""
    module, _ = _fake_target()
    ours = types.ModuleType("sat_patches._satp_fake_user")
    ours.sat_function = module.sat_function
    sys.modules[ours.__name__] = ours
    reg = Registry()
    reg.add(Patch("times_ten", "satp_fake_target:sat_function", lambda orig: (lambda x: orig(x) * 10), answers="t"))
    try:
        reg.apply_all()
        assert ours.sat_function(1) == 20
        reg.unpatch_all()
        assert ours.sat_function(1) == 2
    finally:
        del sys.modules[ours.__name__]


def test_one_index_of_aliases_serves_every_patch_and_sees_modules_imported_between_them():
    """Aliases are found by one pass over the modules for all the patches of an ``apply_all``: a stacked
    patch rebinds what the first one rebound, and a module imported between two patches (a target's import
    brings it in) is indexed before the second patch looks."""
    from sat_patches.core.registry import Aliases
    module, holder = _fake_target()
    aliases, late = Aliases(), types.ModuleType("sat_patches._satp_fake_late")
    first = aliases.rebind(module.sat_function, "first", "satp_fake_target")
    assert holder.sat_function == "first" and (holder.__dict__, "sat_function") in first
    late.sat_function = "first"                        # imported after the first patch: sees its result
    sys.modules[late.__name__] = late
    try:
        second = aliases.rebind("first", "second", "satp_fake_target")
        assert holder.sat_function == late.sat_function == module.sat_function == "second"
        assert {id(namespace) for namespace, _ in second} == {id(m.__dict__) for m in (module, holder, late)}
    finally:
        del sys.modules[late.__name__], sys.modules["sat.satp_fake_alias"], sys.modules["satp_fake_target"]
