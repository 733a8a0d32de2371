"""What Ray Train is handed as the training function.

Ray Train's controller unpickles the training function (by reference: it imports the function's module) only to
hand it on to the workers. This module imports nothing heavy, so the controller, which never trains, does not pay
the worker's imports (torch, transformers, DeepSpeed: about 6 s of one core per run); the worker imports them here.
"""

from __future__ import annotations


def train_loop_per_worker(config: dict) -> None:
    """One calibration worker: `worker.train_loop_per_worker`."""
    from darts_dist.calibrate.ray.worker import train_loop_per_worker as train

    train(config)
