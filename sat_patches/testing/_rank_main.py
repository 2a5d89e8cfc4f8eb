"""Entry point of one rank started by :mod:`sat_patches.testing.multirank`."""
import os
import pickle
import runpy
import sys
import traceback

from sat_patches.core import settings


def main(argv):
    if settings.read("SAT_PATCHES_CWD"):
        os.chdir(settings.read("SAT_PATCHES_CWD"))
    if settings.read("SAT_PATCHES_IMPORT"):
        import sat_patches  # noqa: F401  (only where the rank asks for it: SAT_PATCHES_IMPORT)
    if argv[0] == "--script":
        script = argv[1:]
        if script[0] == "-m":
            sys.argv = [script[1], *script[2:]]
            runpy.run_module(script[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(script)
            runpy.run_path(script[0], run_name="__main__")
        return 0
    payload, result_file = argv
    with open(payload, "rb") as f:
        target, args, kwargs = pickle.load(f)
    module_name, _, qualname = target.partition(":")
    obj = __import__(module_name, fromlist=["_"])
    for part in qualname.split("."):
        obj = getattr(obj, part)
    try:
        value = obj(*args, **kwargs)
        outcome, code = ("ok", value), 0
    except BaseException:  # report, then fail the rank
        outcome, code = ("error", traceback.format_exc()), 1
        sys.stderr.write(outcome[1])
    with open(result_file, "wb") as f:
        pickle.dump(outcome, f)
    return code


if __name__ == "__main__":
    sys.stdout.flush()
    code = main(sys.argv[1:])
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(code)  # skip interpreter teardown (process-group destructors can hang)
