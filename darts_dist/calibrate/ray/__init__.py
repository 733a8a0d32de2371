"""Calibration as one Ray job: expert actors stream into DeepSpeed Ray Train workers (`job`, `stream`, `worker`)."""
