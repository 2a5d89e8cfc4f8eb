"""Fine-tuning data that needs neither torch nor SAT to read and check (the scripts check it before launching)."""
