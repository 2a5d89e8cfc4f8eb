"""One version everywhere a fork can pin it: the package, the wheel setup.py builds, CHANGELOG.md and README.md."""
import os
import re
import subprocess
import sys

import sat_patches

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def read(name):
    with open(os.path.join(ROOT, name), encoding="utf-8") as f:
        return f.read()


def test_version_is_semver():
    assert re.fullmatch(r"\d+\.\d+\.\d+", sat_patches.__version__), sat_patches.__version__


def test_newest_dated_changelog_section_is_the_version():
    sections = re.findall(r"^## \[([^\]]+)\](?: - (\d{4}-\d\d-\d\d))?\s*$", read("CHANGELOG.md"), re.M)
    assert sections[0] == ("Unreleased", ""), "the first section is [Unreleased], for the next changes"
    dated = [(version, date) for version, date in sections if date]
    assert dated and dated[0][0] == sat_patches.__version__, (dated[:1], sat_patches.__version__)
    versions = [tuple(map(int, v.split("."))) for v, _ in dated]
    assert versions == sorted(versions, reverse=True) and len(set(versions)) == len(versions)  # newest first
    assert [d for _, d in dated] == sorted((d for _, d in dated), reverse=True)


def test_readme_pins_the_version_and_its_tag():
    readme = read("README.md")
    assert re.findall(r"^sat_patches==(\S+)$", readme, re.M) == [sat_patches.__version__]
    tags = re.findall(r"sat_patches\.git@(v[^\s`]+)", readme)
    assert tags and set(tags) == {f"v{sat_patches.__version__}"}
    assert "sat_patches.git@<40-hex commit id>" in readme  # and how to pin a commit


def test_wheel_metadata_version_is_the_package_version():
    out = subprocess.run([sys.executable, "setup.py", "--version"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == sat_patches.__version__
