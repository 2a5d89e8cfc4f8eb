"""The ``sat-patches`` command, one module per verb."""
