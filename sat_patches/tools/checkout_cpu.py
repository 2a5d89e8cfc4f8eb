"""``python -m sat_patches.tools.checkout_cpu``, kept for finetune scripts already copied into CogVLM checkouts: it runs
:mod:`sat_patches.runner.checkout_cpu`."""
import runpy

if __name__ == "__main__":
    runpy.run_module("sat_patches.runner.checkout_cpu", run_name="__main__", alter_sys=True)
