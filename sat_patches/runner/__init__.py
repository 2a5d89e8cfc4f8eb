"""What the finetune scripts run: the settings check, checkout mode (a CogVLM fork's own demo) and its CPU
smoke run."""
