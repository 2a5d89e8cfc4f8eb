"""One short line per logged step, with an ETA (``iteration 4/20 | loss 6.5213 | lr 1.00e-04 | 1.32 s/it |
ETA 0:00:21``), instead of SAT's long ``report_iteration_metrics`` line; rank 0 also appends the step to
``loss_curve.csv`` in the run directory and redraws ``loss_curve.png`` (:mod:`sat_patches.diagnostics.progress`).
"""
from __future__ import annotations

from ..core import noise
from ..core.module_patches import QuietThirdPartyPatch
from ..core.registry import Patch, delegate, expect_params
from ..diagnostics.progress import report_evaluate_metrics_float32, report_iteration_progress


PATCHES = [
    QuietThirdPartyPatch(
        noise.PATCH_NAME, "logging:" + ",".join(noise.QUIETED), make=None,
        answers="every process logged bitsandbytes' 'Failed to load CPU gemm_4bit_forward from kernels-community' "
                "and DeepSpeed's 'Setting accelerator to CPU' at import; sat_patches says the device once on rank 0"),
    Patch("progress_line", "sat.training.deepspeed_training:report_iteration_metrics", delegate(report_iteration_progress),
          answers="SAT logs a long line per log interval with no time left; here one short line with an ETA, and "
                  "the run's loss curve (loss_curve.csv/.png beside the memory ledger)",
          expect=expect_params("summary_writer", "optimizer", "lr", "loss", "elapsed_time", "step", "total_step",
                               "args", "avg_metrics")),
    Patch("evaluation_metrics_float", "sat.training.deepspeed_training:report_evaluate_metrics",
          delegate(report_evaluate_metrics_float32),
          answers="with --bf16, SAT's evaluation hands bf16 metric tensors to TensorBoard's add_scalar ('Got "
                  "unsupported ScalarType BFloat16'): a bf16 run that evaluates dies at its first evaluation",
          expect=expect_params("summary_writer", "prefix", "loss", "ppl", "step", "args", "avg_metrics")),
]
