"""What Ray Train is handed as the training function: it starts the experts, then imports the worker.

Ray Train's controller unpickles the training function (by reference: it imports the function's module) only to
hand it on to the workers, so this module imports nothing heavy: the controller, which never trains, does not pay
the worker's imports (torch, transformers, DeepSpeed: about 5 s of one core). On the worker, the experts' streams
start before those imports, so the expert actors load their models while the worker imports and loads its own.
"""

from __future__ import annotations

import time

import ray.train

from darts_dist.calibrate.ray.checkpoint_state import read_state
from darts_dist.calibrate.ray.stream import arrivals


def train_loop_per_worker(config: dict) -> None:
    """One calibration worker (`worker.train_worker`), its experts already streaming unless the run is finished."""
    started = time.time()
    checkpoint = ray.train.get_checkpoint()
    state = read_state(checkpoint)
    stream = None
    if state.step < config["settings"].steps:
        stream = arrivals({task: ray.train.get_dataset_shard(task) for task in config["tasks"]},
                          config["settings"].batch_size)
    from darts_dist.calibrate.ray.worker import train_worker

    train_worker(config, checkpoint, state, stream, started)
