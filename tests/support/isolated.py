"""What a user's fresh environment starts from, for tests that install the project as a user does: the
repository's tracked files (a fresh clone), and this interpreter's installed packages without any trace of
sat_patches (a path entry for a new virtual environment)."""
from __future__ import annotations

import os
import shutil
import site
import subprocess
import sysconfig

OURS = ("sat_patches", "_sat_patches_boot", "__editable__")


def tracked_copy(root: str, dest: str) -> None:
    """The tracked files of the git checkout ``root`` (what a fresh clone has), copied to ``dest``."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, text=True, check=True).stdout
    for rel in filter(None, files.split("\0")):
        if os.path.isfile(os.path.join(root, rel)):
            os.makedirs(os.path.join(dest, os.path.dirname(rel)), exist_ok=True)
            shutil.copy2(os.path.join(root, rel), os.path.join(dest, rel))


def dependencies_without_us(dest: str) -> None:
    """Symlinks in ``dest`` to every entry of every site-packages this interpreter sees (a virtual
    environment's own and, with ``--system-site-packages``, the base one's; the first of a name wins),
    except sat_patches and the ``.pth`` start-up files: SAT, torch, DeepSpeed and pip, no trace of us."""
    os.makedirs(dest)
    seen = set()
    for directory in dict.fromkeys([sysconfig.get_paths()["purelib"], *site.getsitepackages()]):
        if not os.path.isdir(directory):
            continue
        for name in os.listdir(directory):
            if name in seen or name.startswith(OURS) or name.endswith(".pth"):
                continue
            seen.add(name)
            os.symlink(os.path.join(directory, name), os.path.join(dest, name))
