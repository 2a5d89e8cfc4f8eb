"""The declared settings table: one strict parser per kind, the only reader of ``SAT_PATCHES_*``."""
import os
import re

import pytest

import sat_patches
from sat_patches.core import settings

PACKAGE = os.path.dirname(sat_patches.__file__)


@pytest.mark.parametrize("value", ["false", "no", "off", "False", " 0x", "yes", "true"])
def test_a_switch_takes_only_0_or_1(value):
    with pytest.raises(settings.SettingError, match=r"SAT_PATCHES_TRUST_CHECKPOINTS=.*: set it to 1 \(.*\) or 0 \(off\)"):
        settings.read("SAT_PATCHES_TRUST_CHECKPOINTS", {"SAT_PATCHES_TRUST_CHECKPOINTS": value})


def test_trust_is_off_unless_1():
    assert settings.read("SAT_PATCHES_TRUST_CHECKPOINTS", {}) is False
    assert settings.read("SAT_PATCHES_TRUST_CHECKPOINTS", {"SAT_PATCHES_TRUST_CHECKPOINTS": " 0"}) is False
    assert settings.read("SAT_PATCHES_TRUST_CHECKPOINTS", {"SAT_PATCHES_TRUST_CHECKPOINTS": "1"}) is True


@pytest.mark.parametrize("value", ["nan", "-5", "0", "inf", "64MB"])
def test_a_size_must_be_a_positive_finite_number(value):
    with pytest.raises(settings.SettingError, match=r"SAT_PATCHES_LOAD_CHUNK_MB=.*positive number of MiB"):
        settings.read("SAT_PATCHES_LOAD_CHUNK_MB", {"SAT_PATCHES_LOAD_CHUNK_MB": value})
    assert settings.read("SAT_PATCHES_LOAD_CHUNK_MB", {"SAT_PATCHES_LOAD_CHUNK_MB": "0.5"}) == 0.5


def test_zero_turns_a_timeout_off_only_where_declared():
    assert settings.read("SAT_PATCHES_HEARTBEAT_TIMEOUT", {"SAT_PATCHES_HEARTBEAT_TIMEOUT": "0"}) is None
    with pytest.raises(settings.SettingError):
        settings.read("SAT_PATCHES_LOAD_TIMEOUT", {"SAT_PATCHES_LOAD_TIMEOUT": "0"})


def test_a_choice_names_the_allowed_values():
    assert settings.read("SAT_PATCHES_BAD_RECORDS", {"SAT_PATCHES_BAD_RECORDS": "SKIP"}) == "skip"
    with pytest.raises(settings.SettingError, match="set it to refuse or skip"):
        settings.read("SAT_PATCHES_BAD_RECORDS", {"SAT_PATCHES_BAD_RECORDS": "ignore"})


def test_every_default_reads_back_through_its_own_parser():
    for s in settings.SETTINGS.values():
        if s.default is None or s.kind == "names":
            continue
        shown = s.describe_default()
        assert settings.read(s.name, {s.name: shown}) == s.default, s.name


@pytest.mark.slow  # a fresh interpreter that imports SAT and applies the patches (over 10 s)
def test_a_bad_chunk_size_is_refused_at_import_with_its_name():
    """The chunk sizes are read when their modules are imported: a bad one names itself there."""
    from multirank import run_fresh
    out = run_fresh("import sat_patches, sat", env={"SAT_PATCHES_LOAD_CHUNK_MB": "nan"})  # the patches load it
    assert out.returncode != 0
    assert "SAT_PATCHES_LOAD_CHUNK_MB='nan': set it to a positive number of MiB" in out.stderr


def _reads_outside_settings():
    """Lines of the package, outside the settings module, that read a ``SAT_PATCHES_*`` variable from the
    environment directly."""
    read = re.compile(r"(environ(\.get)?\s*[\(\[]\s*[\"']SAT_PATCHES_|getenv\(\s*[\"']SAT_PATCHES_)")
    found = []
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            path = os.path.join(folder, name)
            if not name.endswith(".py") or path == settings.__file__:
                continue
            with open(path, encoding="utf-8") as f:
                found += [f"{path}:{i}" for i, line in enumerate(f, 1) if read.search(line)]
    return found


def test_only_the_settings_module_reads_sat_patches_variables():
    assert _reads_outside_settings() == []


def test_every_variable_the_package_names_is_declared():
    named = set()
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                with open(os.path.join(folder, name), encoding="utf-8") as f:
                    named |= set(re.findall(r"\bSAT_PATCHES_[A-Z_]*[A-Z]\b", f.read()))
    assert named - set(settings.SETTINGS) == set()
