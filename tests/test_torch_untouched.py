"""Torch stays torch: no module of sat_patches rebinds a ``torch.distributed`` name or ``torch.compile``, and
no patch record targets torch. Read from the source (ast), so a rebinding on a path no test runs is caught too."""
import ast
import pathlib
import textwrap
from typing import Dict, List, Optional

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "sat_patches"


def _aliases(tree: ast.AST) -> Dict[str, str]:
    """Local name -> the module or object it names, from the module's absolute imports."""
    names = {"dist": "torch.distributed"}   # the usual alias, imported or not
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    names[alias.asname] = alias.name
                else:
                    top = alias.name.partition(".")[0]
                    names[top] = top
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return names


def _dotted(node: ast.AST, names: Dict[str, str]) -> Optional[str]:
    if isinstance(node, ast.Name):
        return names.get(node.id, node.id)
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value, names)
        return f"{base}.{node.attr}" if base else None
    return None


def _torch_owned(owner: Optional[str], attr: str) -> bool:
    """Whether ``owner.attr`` is a name of torch.distributed (or of its modules and objects) or torch.compile."""
    if owner is None:
        return False
    return (owner == "torch.distributed" or owner.startswith("torch.distributed.")
            or f"{owner}.{attr}" == "torch.compile")


def _assignment_targets(node: ast.AST) -> List[ast.AST]:
    if isinstance(node, ast.Assign):
        targets = []
        for target in node.targets:
            targets.extend(target.elts if isinstance(target, (ast.Tuple, ast.List)) else [target])
        return targets
    if isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        return [node.target]
    return []


def torch_rebindings(source: str, filename: str = "<source>") -> List[str]:
    """Each place in ``source`` that rebinds a name of torch.distributed or torch.compile, or registers a
    Patch whose target is in torch."""
    tree = ast.parse(source, filename)
    names = _aliases(tree)
    found = []
    for node in ast.walk(tree):
        for target in _assignment_targets(node):
            if isinstance(target, ast.Subscript) and isinstance(target.value, ast.Attribute) \
                    and target.value.attr == "__dict__":   # dist.__dict__["barrier"] = ...
                target = ast.Attribute(value=target.value.value, attr="?")
            if isinstance(target, ast.Attribute) and _torch_owned(_dotted(target.value, names), target.attr):
                found.append(f"{filename}:{node.lineno}: assigns {_dotted(target.value, names)}.{target.attr}")
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        called = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
        if called == "setattr" and len(node.args) >= 2:
            attr = node.args[1].value if isinstance(node.args[1], ast.Constant) else "?"
            owner = _dotted(node.args[0], names)
            if _torch_owned(owner, attr) or (owner == "torch" and attr == "?"):
                found.append(f"{filename}:{node.lineno}: setattr on {owner}.{attr}")
        elif called == "Patch":
            target = node.args[1] if len(node.args) >= 2 else next(
                (k.value for k in node.keywords if k.arg == "target"), None)
            if isinstance(target, ast.JoinedStr) and target.values:   # f"torch.distributed:{name}"
                target = target.values[0]
            if isinstance(target, ast.Constant) and str(target.value).startswith("torch."):
                found.append(f"{filename}:{node.lineno}: Patch target {target.value!r}")
    return found


def test_no_module_of_sat_patches_rebinds_torch():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        found += torch_rebindings(path.read_text(encoding="utf-8"), str(path.relative_to(PACKAGE.parent)))
    assert not found, ("sat_patches must leave torch's functions as they are (wrap SAT's call sites instead):\n"
                       + "\n".join(found))


@pytest.mark.parametrize("source", [
    "import torch.distributed as dist\ndist.barrier = lambda *a, **k: None",
    "import torch.distributed\ntorch.distributed.all_reduce = None",
    "from torch import distributed as d\nd.broadcast, x = None, 1",
    "from torch.distributed import distributed_c10d\ndistributed_c10d.broadcast = None",
    "from torch.distributed.distributed_c10d import barrier\nbarrier.__doc__ += 'x'",
    "import torch\ntorch.compile = None",
    "import torch\nsetattr(torch, 'compile', None)",
    "import torch.distributed as dist\nsetattr(dist, name, None)",
    "import torch.distributed as dist\ndist.__dict__['recv'] = None",
    "Patch('hang_watch_barrier', 'torch.distributed:barrier', make, answers='')",
    "Patch(f'hang_watch_{n}', f'torch.distributed:{n}', make, answers='')",
    "Patch(name='x', target='torch.nn.functional:softmax', make=make, answers='')",
])
def test_each_kind_of_torch_rebinding_is_found(source):
    assert len(torch_rebindings(source)) == 1


@pytest.mark.parametrize("source", [
    "import torch.distributed as dist\nbarrier = dist.barrier\nbarrier = None",
    "import torch\ntorch.backends.cudnn.benchmark = True",
    "import torch.distributed as dist\nx = dist.get_rank()\nself.dist = dist",
    "Patch('collective_timeout', 'sat.arguments:initialize_distributed', make, answers='')",
    "import torch.distributed as dist\nsetattr(args, 'rank', dist.get_rank())",
])
def test_sat_patches_own_names_and_settings_are_not_torch_rebindings(source):
    assert torch_rebindings(textwrap.dedent(source)) == []
