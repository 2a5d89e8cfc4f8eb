"""``.ci/floors.py``: the oldest versions setup.py allows, as the pip constraints .ci/run's second leg installs."""
import os
import runpy
import subprocess
import sys

import pytest

from sat_patches import hf_recipes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLOORS = os.path.join(ROOT, ".ci", "floors.py")
floors = runpy.run_path(FLOORS)["floors"]

ARGUMENTS = {"install_requires": ["torch>=2.13", "SwissArmyTransformer>=0.4.12,<0.4.13", "requests", "Pillow>=9.3"],
             "extras_require": {"test": ["peft>=0.11.1", "pillow>=10"], "hf": ["peft==0.11.1"]}}


def test_each_lower_bound_becomes_a_pin_and_the_higher_of_two_wins():
    assert floors([], ARGUMENTS) == {"torch": "2.13", "swissarmytransformer": "0.4.12", "pillow": "9.3"}
    assert floors(["test"], ARGUMENTS) == {"torch": "2.13", "swissarmytransformer": "0.4.12", "pillow": "10",
                                           "peft": "0.11.1"}


def test_an_unknown_extra_is_refused():
    with pytest.raises(SystemExit, match=r"no extra \['tset'\]; it has \['hf', 'test'\]"):
        floors(["tset"], ARGUMENTS)


def test_setup_py_floors_of_the_test_install():
    out = subprocess.run([sys.executable, FLOORS, "test"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    pins = dict(line.split("==") for line in out.stdout.split())
    # the suite's second leg runs with the Hugging Face recipes' transformers and peft (the hf extra's pins)
    assert pins["transformers"] == hf_recipes.pinned("transformers") and pins["peft"] == hf_recipes.pinned("peft")
    assert {"torch", "deepspeed", "swissarmytransformer", "bitsandbytes", "captcha", "pytest"} <= set(pins)
