"""The oldest versions setup.py allows, as pip constraints: ``python .ci/floors.py test > floors.txt``, then
``pip install ".[test]" -c floors.txt``.

One line ``name==floor`` for each requirement of ``install_requires`` and of the extras named on the command line
that has a lower bound (``>=``, ``==``, ``~=``); where a name appears twice, the higher floor. Read from setup.py
itself (its ``setup`` call replaced by one that records the arguments), so the floors never drift from it.
"""
import os
import runpy
import sys

import setuptools
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def setup_arguments(root: str = ROOT) -> dict:
    """What setup.py hands setuptools' ``setup`` (nothing is built)."""
    seen = {}
    real, cwd = setuptools.setup, os.getcwd()
    setuptools.setup = lambda **kw: seen.update(kw)
    try:
        os.chdir(root)
        runpy.run_path(os.path.join(root, "setup.py"), run_name="__main__")
    finally:
        setuptools.setup = real
        os.chdir(cwd)
    return seen


def floors(extras=(), arguments=None) -> dict:
    """``{name: floor}`` of ``install_requires`` and ``extras`` (an unknown extra is an error)."""
    arguments = setup_arguments() if arguments is None else arguments
    known = arguments.get("extras_require", {})
    unknown = [extra for extra in extras if extra not in known]
    if unknown:
        raise SystemExit(f"setup.py has no extra {unknown}; it has {sorted(known)}")
    found = {}  # name -> Version
    for line in list(arguments["install_requires"]) + [r for extra in extras for r in known[extra]]:
        requirement = Requirement(line)
        lows = [Version(s.version) for s in requirement.specifier if s.operator in (">=", "==", "~=")]
        if lows:
            name = requirement.name.lower()
            found[name] = max([max(lows)] + ([found[name]] if name in found else []))
    return {name: str(version) for name, version in found.items()}


def main(argv) -> int:
    for name, version in sorted(floors(argv).items()):
        print(f"{name}=={version}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
