import ast
import os
import re

from setuptools import find_packages, setup


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


# the CPU demos' generated data: the checkout smoke run draws CAPTCHA images (sat_patches.cogvlm.captcha_data)
DEMO = ["captcha==0.7.1"]
# `sat-patches report` draws the memory ledger as a PNG
REPORT = ["matplotlib>=3.8.4"]

setup(
    name="sat_patches",
    version=version(),
    description="Make multi-GPU LoRA fine-tuning of CogVLM/CogAgent on SwissArmyTransformer work",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["sat_patches", "sat_patches.*"]),
    package_data={"sat_patches": ["configs/*.json"]},
    python_requires=">=3.9",
    # what sat_patches imports, and what SAT imports without declaring it; each floor is the oldest release the
    # fast tier ran with (.ci/run's second leg installs these floors: .ci/floors.py)
    install_requires=[
        # the SAT code the patches are verified on; each patch re-checks the code shape at import
        "SwissArmyTransformer>=0.4.12,<0.4.13",
        # a range, so that a user's own CUDA build is kept (tests install torch==2.13.0 first)
        "torch>=2.13",
        "deepspeed>=0.19.0",
        "bitsandbytes>=0.49.0",
        "numpy>=2.0",
        "sentencepiece>=0.1.99",
        "transformers>=4.41.2",
        # imported by sat_patches, and by SAT 0.4.12 without being declared (sat/data_utils/webds.py)
        "Pillow>=9.3",
        # imported by SAT 0.4.12 without being declared: sat/resources/download.py
        "requests>=2.28",
        # imported by SAT 0.4.12 without being declared: sat/training/deepspeed_training.py
        "wandb>=0.17.2",
        # reads a CogVideoX run's training_config.yaml (merge, export diffusers)
        "PyYAML>=6.0.1",
    ],
    extras_require={
        "demo": DEMO,
        "report": REPORT,
        # the README's Hugging Face recipes (bf16 and 4-bit loads of an export, its PEFT adapter): the versions
        # they were run with (torch stays the user's own)
        "hf": hf_pins(),
        # peft loads the PEFT adapter export in the tests; its floor is the hf extra's pin, so the two install
        # together (.ci/run runs the suite with the newest peft and with this floor); diffusers loads the CogVideoX
        # LoRA export (0.31.0: its first release with CogVideoX LoRA, run with that peft and transformers 4.41.2)
        "test": ["pytest>=7", "pytest-timeout>=2.1", "pytest-xdist>=3.8", "peft>=0.11.1", "diffusers>=0.31.0"]
        + DEMO + REPORT,
    },
    entry_points={"console_scripts": ["sat-patches=sat_patches.cli.main:main"]},
)
