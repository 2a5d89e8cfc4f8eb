"""``sat-patches scripts``: the drop-in scripts come from the installed package, equal to finetune_examples/."""
import os
import stat

import pytest

from sat_patches.cli import scripts
from sat_patches.cli.main import main

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                        "finetune_examples")


def test_repository_scripts_are_what_the_package_writes():
    for name, text in scripts.scripts().items():
        with open(os.path.join(EXAMPLES, name)) as f:
            assert f.read() == text, f"finetune_examples/{name} is stale: run `sat-patches scripts finetune_examples --force`"


def test_writes_executable_scripts_and_keeps_a_users_own_file(tmp_path, capsys):
    dest = tmp_path / "CogVLM" / "finetune_demo"
    assert main(["scripts", str(dest)]) == 0
    for name in ("finetune_cogvlm.sh", "finetune_cogagent.sh"):
        assert os.stat(dest / name).st_mode & stat.S_IXUSR
    assert main(["scripts", str(dest)]) == 0  # the same text again: nothing to protect
    (dest / "finetune_cogvlm.sh").write_text("# my own edits\n")
    assert main(["scripts", str(dest)]) == 2
    assert "finetune_cogvlm.sh already in" in capsys.readouterr().err
    assert (dest / "finetune_cogvlm.sh").read_text() == "# my own edits\n"
    assert main(["scripts", str(dest), "--force"]) == 0
    assert (dest / "finetune_cogvlm.sh").read_text() == scripts.script_text("cogvlm")


@pytest.mark.parametrize("kind", ["cogvlm", "cogagent"])
def test_script_defaults_are_the_runners(kind):
    from sat_patches.runner.finetune_run import KIND_DEFAULTS
    text = scripts.script_text(kind)
    assert f"export MODEL_KIND={kind}\n" in text
    assert f"MODEL_TYPE={KIND_DEFAULTS[kind]['MODEL_TYPE']} " in text
