"""``merge``, ``evaluate`` and ``finetune`` are ``sat-patches`` verbs (also ``python -m sat_patches <verb>``)."""
import os

from sat_patches.cli import main as cli


def test_merge_of_a_missing_checkpoint_says_so_and_writes_nothing(tmp_path, capsys):
    missing, out = str(tmp_path / "no-such-run"), str(tmp_path / "merged")
    assert cli.main(["merge", missing, out]) == 2
    said = capsys.readouterr().err
    assert said.startswith("error: ") and "no-such-run" in said and not os.path.exists(out)


def test_finetune_without_a_subcommand_names_them(capsys):
    assert cli.main(["finetune"]) == 2
    assert "usage: sat-patches finetune {prepare,train,verify}" in capsys.readouterr().err
