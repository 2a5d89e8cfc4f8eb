"""``merge``, ``evaluate`` and ``finetune`` are ``sat-patches`` verbs, and ``python -m sat_patches.<verb>`` runs the
same command."""
import importlib
import os

import pytest

from sat_patches.cli import main as cli


@pytest.mark.parametrize("verb", ["merge", "evaluate", "finetune"])
def test_the_python_m_alias_runs_the_verbs_command(verb):
    alias = importlib.import_module(f"sat_patches.{verb}")
    assert alias.main is importlib.import_module(f"sat_patches.cli.{verb}").main is cli.OWN_PARSER[verb]
    assert verb in [name for name, _ in cli.COMMANDS]                          # listed in sat-patches --help


def test_merge_of_a_missing_checkpoint_says_so_and_writes_nothing(tmp_path, capsys):
    missing, out = str(tmp_path / "no-such-run"), str(tmp_path / "merged")
    assert cli.main(["merge", missing, out]) == 2
    said = capsys.readouterr().err
    assert said.startswith("error: ") and "no-such-run" in said and not os.path.exists(out)


def test_finetune_without_a_subcommand_names_them(capsys):
    assert cli.main(["finetune"]) == 2
    assert "usage: sat-patches finetune {prepare,train,verify}" in capsys.readouterr().err
