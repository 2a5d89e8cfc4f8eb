import ast
import os
import re
import shutil

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

PTH = "sat_patches.pth"  # runs _sat_patches_boot at start-up: `import sat` works without triton


class BuildPyWithPth(build_py):
    """Install sat_patches.pth beside the package in site-packages (as pytest-cov does).

    An editable install (``pip install -e``) builds a wheel of path hooks only and does not ship
    ``build_lib``; there the file goes straight into that wheel's root, which is site-packages too.
    """

    def run(self):
        super().run()
        into = self.build_lib
        if getattr(self, "editable_mode", False):
            into = self.get_finalized_command("install").install_lib
        shutil.copy(PTH, os.path.join(into, PTH))

    def get_outputs(self, include_bytecode=True):
        return super().get_outputs(include_bytecode) + [os.path.join(self.build_lib, PTH)]




def version() -> str:
    """The one place the version is written: ``sat_patches.__version__``."""
    with open(os.path.join("sat_patches", "__init__.py"), encoding="utf-8") as f:
        return re.search(r'^__version__ = "([^"]+)"', f.read(), re.M).group(1)


def hf_pins() -> list:
    """The ``hf`` extra: ``PINS`` of ``sat_patches/hf_recipes.py``, the one home of that version set (read as
    text, so that setup imports neither the package nor torch)."""
    with open(os.path.join("sat_patches", "hf_recipes.py"), encoding="utf-8") as f:
        tree = ast.parse(f.read())
    [value] = [node.value for node in tree.body if isinstance(node, ast.Assign)
               and [getattr(t, "id", None) for t in node.targets] == ["PINS"]]
    return list(ast.literal_eval(value))


setup(
    name="sat_patches",
    version=version(),
    description="Make multi-GPU LoRA fine-tuning of CogVLM/CogAgent on SwissArmyTransformer work",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["sat_patches", "sat_patches.*"]),
    py_modules=["_sat_patches_boot", "_sat_patches_deferred"],
    cmdclass={"build_py": BuildPyWithPth},
    package_data={"sat_patches": ["configs/*.json"]},
    python_requires=">=3.9",
    install_requires=[
        # the SAT code the patches are verified on; each patch re-checks the code shape at import
        "SwissArmyTransformer>=0.4.12,<0.4.13",
        # a range, so that a user's own CUDA build is kept (tests install torch==2.13.0 first)
        "torch>=2.1",
        "deepspeed>=0.12",
        "bitsandbytes",
        "einops",
        # imported by SAT 0.4.12 without being declared
        "requests",
        "wandb",
        # the standalone CogVLM/CogAgent demo: real CAPTCHA images drawn locally (sat_patches.cogvlm)
        "captcha==0.7.1",
        "Pillow>=9",
    ],
    extras_require={
        # `sat-patches report` draws the memory ledger as a PNG
        "report": ["matplotlib>=3.5"],
        # the README's Hugging Face recipes (bf16 and 4-bit loads of an export, its PEFT adapter): the versions
        # they were run with (torch stays the user's own)
        "hf": hf_pins(),
        # peft: the PEFT adapter export is loaded by peft itself in the tests (0.21.2 with transformers 5.24)
        "test": ["pytest>=7", "pytest-timeout", "pytest-xdist>=3", "matplotlib>=3.5", "peft==0.21.2"],
    },
    entry_points={"console_scripts": ["sat-patches=sat_patches.cli.main:main"]},
)
