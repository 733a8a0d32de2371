"""Calibration: features, the training loop, the corrections file, the task router; `ray/` runs it as a Ray job."""
