"""``python -m sat_patches.tools.finetune_check``, kept for finetune scripts already copied into CogVLM checkouts: it runs
:mod:`sat_patches.runner.finetune_check`."""
import runpy

if __name__ == "__main__":
    runpy.run_module("sat_patches.runner.finetune_check", run_name="__main__", alter_sys=True)
