"""Calibration's executors by `cluster.executor`, the one place that picks one: the Ray job (expert actors
streaming into Ray Train workers) or this one process (the reference loop)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from darts_dist.calibrate.coefficients import CoefficientFit, fit_in_process
from darts_dist.calibrate.in_process import calibrate_stage
from darts_dist.calibrate.loop import StepCallback
from darts_dist.calibrate.outcome import CalibrationOutcome
from darts_dist.calibrate.ray.job import calibrate_distributed, fit_coefficients_distributed
from darts_dist.config import ClusterSection, RunConfig
from darts_dist.sources.models import resolve_device
from darts_dist.sources.references import ResolvedSources


@dataclass(frozen=True)
class CalibrationExecutor:
    """How one executor calibrates (corrections on `model_dir`), fits merge coefficients, and names the device the
    work runs on (for the run's tags)."""

    calibrate: Callable[[RunConfig, ResolvedSources, Path, StepCallback | None], CalibrationOutcome]
    fit_coefficients: Callable[[RunConfig, ResolvedSources, StepCallback | None], CoefficientFit]
    device: Callable[[RunConfig], str]


def _on_ray_device(config: RunConfig) -> str:
    # On Ray the device is decided inside each worker: a GPU when the cluster gives it one.
    return "cuda" if config.cluster.use_gpu else "cpu"


EXECUTORS = {
    "ray": CalibrationExecutor(
        calibrate=lambda config, sources, model_dir, on_step: calibrate_distributed(config, sources, model_dir,
                                                                                   on_step=on_step),
        fit_coefficients=lambda config, sources, on_step: fit_coefficients_distributed(config, sources,
                                                                                       on_step=on_step),
        device=_on_ray_device,
    ),
    "in-process": CalibrationExecutor(
        calibrate=lambda config, sources, model_dir, on_step: calibrate_stage(config, sources, model_dir,
                                                                             on_step=on_step),
        fit_coefficients=lambda config, sources, on_step: fit_in_process(config, sources, on_step=on_step),
        device=lambda config: str(resolve_device(config.calibration.device)),
    ),
}


def executor_for(cluster: ClusterSection) -> CalibrationExecutor:
    return EXECUTORS[cluster.executor]
