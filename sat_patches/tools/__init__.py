"""Entry points kept for finetune scripts already copied into CogVLM checkouts (``python -m
sat_patches.tools.finetune_run``): the runner lives in :mod:`sat_patches.runner`, the ``sat-patches`` command in
:mod:`sat_patches.cli`."""
