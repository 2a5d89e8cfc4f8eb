"""One version set for the README's Hugging Face recipes: ``sat_patches/hf_recipes.py`` holds it, setup.py's ``hf``
extra installs it, the README states it."""
import os
import re
import runpy

import pytest
import setuptools
from packaging.requirements import Requirement

from sat_patches import hf_recipes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def setup_kwargs(monkeypatch):
    """What setup.py hands setuptools' ``setup`` (run with a stand-in ``setup`` that builds nothing)."""
    seen = {}
    monkeypatch.setattr(setuptools, "setup", lambda **kw: seen.update(kw))
    monkeypatch.chdir(ROOT)
    runpy.run_path(os.path.join(ROOT, "setup.py"), run_name="__main__")
    return seen


def readme_section(title):
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        text = f.read()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end]


def test_the_hf_extra_pins_the_set_and_never_torch(monkeypatch):
    extra = setup_kwargs(monkeypatch)["extras_require"]["hf"]
    assert extra == list(hf_recipes.PINS)
    assert {pin.split("==")[0] for pin in extra} == {"transformers", "accelerate", "peft", "bitsandbytes"}
    assert all(re.fullmatch(r"[a-z_]+==\d+\.\d+\.\d+", pin) for pin in extra), extra
    assert not [pin for pin in extra if pin.startswith("torch")]


def test_readme_states_the_extras_pins(monkeypatch):
    extra = setup_kwargs(monkeypatch)["extras_require"]["hf"]
    section = readme_section("Use your fine-tuned model elsewhere")
    [line] = [line for line in section.splitlines() if line.startswith(hf_recipes.EXTRA)]
    assert line.split("#", 1)[1].split() == extra
    assert hf_recipes.TORCH_MEASURED in section.replace("\n", " ")
    # what breaks outside the set: the measured pair, with the error it raises, and transformers 5
    transformers, accelerate = hf_recipes.BROKEN_4BIT
    assert f"accelerate {accelerate}" in section and f"transformers {transformers}" in section
    assert "`ValueError: .to is not supported for 4-bit or 8-bit bitsandbytes models`" in section
    assert "transformers 5.x" in section


@pytest.mark.parametrize("version, numbers", [("4.41.2", (4, 41, 2)), ("1.0.0rc1", (1, 0, 0)),
                                              ("2.13.0+cpu", (2, 13, 0)), ("unknown", ())])
def test_release_numbers(version, numbers):
    assert hf_recipes.release(version) == numbers


def test_pinned():
    assert hf_recipes.pinned("accelerate") == "0.30.1" and hf_recipes.pinned("transformers") == "4.41.2"


def test_every_pin_is_allowed_by_every_other_requirement_of_its_name(monkeypatch):
    """Any extras install together (``pip install ".[hf,test]"``): a version pinned anywhere in setup.py is allowed
    by every other requirement of that name."""
    kwargs = setup_kwargs(monkeypatch)
    groups = {"install_requires": kwargs["install_requires"], **kwargs["extras_require"]}
    requirements = [(group, Requirement(line)) for group, lines in groups.items() for line in lines]
    clashes = [f"{group} {pin} vs {other_group} {other}"
               for group, pin in requirements for spec in pin.specifier if spec.operator == "=="
               for other_group, other in requirements
               if other.name.lower() == pin.name.lower() and not other.specifier.contains(spec.version)]
    assert clashes == []
    assert "peft" in [Requirement(line).name for line in groups["test"]]  # the tests load the PEFT export with peft
