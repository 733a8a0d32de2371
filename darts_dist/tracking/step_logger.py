"""A calibration's per-step metrics, sent to its MLflow run in batches, from whichever process trains.

The logger travels inside the training function's config, so every process that unpickles that config imports
this module: Ray Train's controller too, which never logs a step. MLflow (and the rest of `tracking.runs`) is
therefore imported at the first send, not here: that saves the controller about 2 s of one core per run.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import NamedTuple

logger = logging.getLogger(__name__)

# Per-step metrics are sent in batches: one request per step would dominate a fast step.
_STEPS_PER_FLUSH = 50
_METRICS_PER_BATCH = 1000  # MLflow's limit per log_batch request
_MAX_PENDING = 100_000  # step metrics kept while the store is down (the report keeps every loss anyway)


class _Point(NamedTuple):
    key: str
    value: float
    timestamp_ms: int
    step: int


class StepLogger:
    """Per-step metrics of one run, sent in batches; a calibration loop's `on_step`.

    Built from two strings so a Ray Train worker can rebuild it; call `flush` after the last step.
    A store that stops answering never stops the training: the metrics stay pending (up to
    `_MAX_PENDING`) and go with the next flush that gets through. What never does is still in the
    run's report and checkpoint (its losses), and `darts-dist register RUN_DIR` logs it later.
    """

    def __init__(self, uri: str, run_id: str) -> None:
        self.uri = uri
        self.run_id = run_id
        self._pending: list[_Point] = []
        self._failing = False  # warned about the store already
        self._unsent_steps = 0

    def __getstate__(self) -> dict[str, str]:
        return {"uri": self.uri, "run_id": self.run_id}

    def __setstate__(self, state: dict[str, str]) -> None:
        self.__init__(state["uri"], state["run_id"])

    def __call__(self, step: int, metrics: Mapping[str, float]) -> None:
        now = int(time.time() * 1000)
        self._pending += [_Point(key, float(value), now, step) for key, value in metrics.items()]
        self._unsent_steps += 1
        # While the store is down this tries again every _STEPS_PER_FLUSH steps, not every step.
        if self._unsent_steps >= _STEPS_PER_FLUSH:
            self._unsent_steps = 0
            self.flush()

    def flush(self) -> bool:
        """Send the pending metrics; False (and they stay pending) when the store does not answer."""
        from mlflow import MlflowClient
        from mlflow.entities import Metric

        from darts_dist.tracking.store import QUICK_REQUESTS, STORE_ERRORS, environment

        start = 0
        try:
            for start in range(0, len(self._pending), _METRICS_PER_BATCH):
                batch = [Metric(*point) for point in self._pending[start: start + _METRICS_PER_BATCH]]
                with environment(**QUICK_REQUESTS):
                    MlflowClient(tracking_uri=self.uri).log_batch(self.run_id, metrics=batch)
        except STORE_ERRORS as error:  # the store failed; training goes on
            self._pending = self._pending[start:][-_MAX_PENDING:]
            if not self._failing:
                logger.warning("MLflow store %s did not take step metrics (%s); keeping them and going on",
                               self.uri, str(error).splitlines()[0][:200] if str(error) else type(error).__name__)
            self._failing = True
            return False
        self._pending, self._failing = [], False
        return True
