"""The package's layout holds: libraries that only define, patch modules that bind them, a CLI that starts
without torch, no import cycles, few imports hidden in functions (each with its reason)."""
import ast
import os
import subprocess
import sys

import pytest

import sat_patches

PACKAGE = os.path.dirname(os.path.abspath(sat_patches.__file__))
# folders whose modules only define: they must not reach into the patch records or the command line
LIBRARIES = ("core", "checkpoints", "runtime", "diagnostics", "lora", "planning", "cogvlm", "data", "export",
             "kernels")
MAX_LAZY_IMPORTS = 30


def _modules():
    found = {}
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                rel = os.path.relpath(path, os.path.dirname(PACKAGE))[:-3].replace(os.sep, ".")
                found[rel[:-len(".__init__")] if rel.endswith(".__init__") else rel] = path
    return found


MODULES = _modules()


def _imports(module: str):
    """(imported module of ours or None, import node, whether it sits in a function) for every import."""
    path = MODULES[module]
    tree = ast.parse(open(path, encoding="utf-8").read())
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    in_function = {id(sub) for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                   for sub in ast.walk(node) if isinstance(sub, (ast.Import, ast.ImportFrom))}
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        for name in names:
            while name not in MODULES and "." in name:
                name = name.rpartition(".")[0]
            yield (name if name in MODULES else None), node, id(node) in in_function


def _edges():
    """Every import between our modules, in functions too; importing ``a.b.c`` runs ``a.b`` as well."""
    edges = {m: set() for m in MODULES}
    for module in MODULES:
        for target, _, _ in _imports(module):
            while target and target != "sat_patches":
                if target != module and not module.startswith(target + "."):
                    edges[module].add(target)
                target = target.rpartition(".")[0]
    return edges


def _cycles(edges):
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10000))
    for v in MODULES:
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle_among_our_modules():
    assert _cycles(_edges()) == []


def test_the_cycle_check_finds_a_cycle():
    edges = {m: set() for m in MODULES}
    edges["sat_patches.core.settings"].add("sat_patches.core.registry")
    edges["sat_patches.core.registry"].add("sat_patches.core.settings")
    assert _cycles(edges) == [["sat_patches.core.registry", "sat_patches.core.settings"]]


def test_libraries_import_no_patch_module_and_no_command_line():
    bad = [f"{m} imports {t}" for m in MODULES
           if m.split(".")[1:2] and m.split(".")[1] in LIBRARIES and not m.endswith(".__main__")  # entry points
           for t, _, _ in _imports(m)
           if t and t.split(".")[1:2] and t.split(".")[1] in ("patches", "cli", "runner")]
    assert bad == []


def test_imports_inside_functions_are_few_and_each_says_why():
    lazy = []
    for module, path in MODULES.items():
        lines = open(path, encoding="utf-8").read().split("\n")
        for _, node, in_function in _imports(module):
            if in_function and node not in [n for _, n in lazy]:
                lazy.append((f"{module}:{node.lineno}: {lines[node.lineno - 1].strip()}", node))
    assert len(lazy) <= MAX_LAZY_IMPORTS, [where for where, _ in lazy]
    unexplained = [where for where, _ in lazy if "#" not in where]
    assert unexplained == []


@pytest.mark.slow  # a fresh interpreter
def test_the_command_line_starts_without_torch_or_sat():
    code = ("import sys, sat_patches.cli.main, sat_patches.runner.finetune_run, sat_patches.data.jsonl\n"
            "print(sorted(m for m in ('torch', 'sat', 'deepspeed') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


# what users and our entry points import first: the entry points, the packages, what they import by name, and
# library modules that import SAT and that the patch modules import (the patches wait until they are done)
FIRST_IMPORTS = ["sat_patches.checkpoints.merge", "sat_patches.export.hf", "sat_patches.lora.layer", "sat_patches.cogvlm.saving",
                 "sat_patches.checkpoints.loading", "sat_patches.checkpoints.saving"]


@pytest.mark.slow  # a fresh interpreter per module
@pytest.mark.parametrize("module", FIRST_IMPORTS)
def test_a_module_imported_before_sat_leaves_every_patch_applied(module):
    """SAT's first import applies the patches at once, whoever imports it (asked through the registry's table,
    which applies nothing itself)."""
    from multirank import run_fresh
    code = (f"import {module}, sat_patches\n"
            "bad = [r['name'] for r in sat_patches.REGISTRY.table() if r['status'] not in ('applied', 'waiting')]\n"
            "print('NOT APPLIED', bad, len(sat_patches.REGISTRY.table()))")
    out = run_fresh(code)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "NOT APPLIED [] " in out.stdout and "NOT APPLIED [] 0" not in out.stdout, out.stdout[-2000:]


PATCH_MODULES = sorted(m for m in MODULES if m.startswith("sat_patches.patches"))
MAX_ADAPTER_STATEMENTS = 8
"""A patch module's functions are thin adapters: the statements of each (its nested wrappers' included,
docstrings not) stay within this bound; what a patch does lives in the library function it calls."""


def _statements(body) -> int:
    """Statements in ``body``, counted recursively (nested functions and blocks included), docstrings not."""
    count = 0
    for node in body:
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            continue
        count += 1
        for field in ("body", "orelse", "finalbody"):
            count += _statements(getattr(node, field, []) or [])
        for handler in getattr(node, "handlers", []) or []:
            count += 1 + _statements(handler.body)
        for case in getattr(node, "cases", []) or []:
            count += _statements(case.body)
    return count


def _patch_module_offences(module: str):
    """(line, what) for every function over the bound and every module-level statement that is not an import,
    a function, an assignment (records, constants) or, in the package's ``__init__``, a call."""
    path = MODULES[module]
    tree = ast.parse(open(path, encoding="utf-8").read())
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            count = _statements(node.body)
            if count > MAX_ADAPTER_STATEMENTS:
                yield node.lineno, f"function {node.name} has {count} statements"
    allowed = (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.Assign, ast.AnnAssign)
    for node in tree.body[1 if ast.get_docstring(tree) else 0:]:
        is_call = isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)
        if not isinstance(node, allowed) and not (is_call and path.endswith("__init__.py")):
            yield node.lineno, f"module-level {type(node).__name__}"


def test_patch_modules_hold_records_and_thin_adapters_only():
    """A reader finds what a patch does by following its adapter's one call into a library module."""
    offences = [f"{MODULES[m]}:{line}: {what}" for m in PATCH_MODULES for line, what in _patch_module_offences(m)]
    assert offences == [], f"move these bodies into library modules (at most {MAX_ADAPTER_STATEMENTS} " \
                           f"statements per adapter):\n" + "\n".join(offences)


def test_the_adapter_check_counts_nested_statements():
    tree = ast.parse("def make(original):\n    '''doc'''\n    def wrapper(x):\n        if x:\n"
                     "            return 1\n        try:\n            pass\n        except ValueError:\n"
                     "            raise\n    return wrapper\n")
    assert _statements(tree.body[0].body) == 8  # def, if, return, try, pass, except, raise, return


def test_the_package_folder_holds_only_modules_and_the_configs_it_ships():
    """No editor or merge leftovers (``.orig``, ``.rej``, backups) inside the package: what setup.py ships is
    Python modules and ``configs/*.json``."""
    stray = []
    for folder, dirs, files in os.walk(PACKAGE):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for name in files:
            path = os.path.relpath(os.path.join(folder, name), PACKAGE)
            if not (name.endswith(".py") or (path.startswith("configs" + os.sep) and name.endswith(".json"))):
                stray.append(path)
    assert stray == [], stray


def test_the_package_holds_the_library_alone():
    """The test kit (tests/support: the ranks' launcher, tiny models, a CUDA-only backend's stand-in) is the tests'
    own: no module of the package is one of its modules or imports one."""
    kit = {name[:-3] for name in os.listdir(os.path.join(os.path.dirname(os.path.abspath(__file__)), "support"))
           if name.endswith(".py")}
    assert {"multirank", "_rank_main", "tiny_lora", "expert_llama"} <= kit
    assert not any(m == "sat_patches.testing" or m.startswith("sat_patches.testing.") for m in MODULES)
    reaching = set()
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            else:
                continue
            reaching.update((module, n) for n in names if n.split(".")[0] in kit)
    assert reaching == set(), reaching


MAX_MODULE_LINES = 450


def test_no_module_is_over_450_lines():
    """Modules stay small: a module that grows past this is split by job."""
    long = {module: n for module, path in MODULES.items()
            if (n := len(open(path, encoding="utf-8").read().splitlines())) > MAX_MODULE_LINES}
    assert long == {}
