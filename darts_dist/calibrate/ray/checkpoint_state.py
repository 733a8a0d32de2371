"""What a calibration checkpoint restores: the steps done and their losses (rank 0's `progress.json`)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import ray.train

PROGRESS_FILE = "progress.json"  # step, losses, timings (rank 0)


@dataclass
class TrainState:
    """What a checkpoint restores: steps done and their losses; `resumed_from` is None on a fresh start."""

    step: int = 0
    losses: list[float] = field(default_factory=list)
    resumed_from: int | None = None


def read_state(checkpoint: ray.train.Checkpoint | None) -> TrainState:
    """Steps done and their losses, as the checkpoint to resume from holds them; a fresh state without one."""
    if checkpoint is None:
        return TrainState()
    with checkpoint.as_directory() as folder:
        progress = json.loads((Path(folder) / PROGRESS_FILE).read_text())
    return TrainState(step=progress["step"], losses=progress["losses"], resumed_from=progress["step"])
