"""`ablate --tune N`: Ray Tune searches Surgery's and DARTS's settings on the validation split, never on the
held-out set.

Each variant gets a Tuner of its own with the same budget, N trials: Surgery over rank, steps and learning
rate; DARTS over those, the position table's length T and each task's β. Optuna's TPE (Ray Tune's
OptunaSearch, seeded) proposes the trials, and the first trial is the config's own settings. A trial is a Ray
actor: it trains the variant on the features the ablation computed once (shared through the object store,
`tune.with_parameters`) and reports the validation mean over tasks of the selected metric. With a tracking
session each trial is an MLflow run nested under the command's (Ray Tune's MLflowLoggerCallback).
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

from ray import tune
from ray.air.integrations.mlflow import MLflowLoggerCallback
from ray.tune.search.optuna import OptunaSearch

from darts_dist.calibrate.features import TaskFeatures
from darts_dist.calibrate.loop import train_corrections
from darts_dist.config import CalibrationSection, RunConfig, TaskCalibration, updated
from darts_dist.errors import DartsError
from darts_dist.evaluate.evaluator import Evaluator, ExpertSide, MergedSide
from darts_dist.ray_cluster.remote import ray_session
from darts_dist.sources.models import load_causal_lm, model_dtype, resolve_device
from darts_dist.tracking.runs import STAGE_TAG, Tracking

logger = logging.getLogger(__name__)
RANKS = (16, 32, 64, 128, 256)
STEP_FACTORS = (1, 2, 4)  # a trial never trains less than the config says
LEARNING_RATE_RANGE = (0.3, 10.0)  # × the config's, searched on a log scale
POSITION_PARTS = (4, 2, 1)  # T: a quarter, half or all of the calibrated length


def search_space(settings: CalibrationSection, tasks: Sequence[str], darts: bool) -> dict[str, object]:
    """The Tuner's space around the config's settings (the config's own values always among the choices)."""
    low, high = LEARNING_RATE_RANGE
    space: dict[str, object] = {
        "rank": tune.choice(sorted({*RANKS, settings.rank})),
        "steps": tune.choice(sorted({settings.steps * factor for factor in STEP_FACTORS})),
        "learning_rate": tune.loguniform(settings.learning_rate * low, settings.learning_rate * high),
    }
    if darts:
        lengths = {max(1, settings.max_length // part) for part in POSITION_PARTS} | {settings.max_positions}
        space["max_positions"] = tune.choice(sorted(lengths))
        space |= {f"beta.{task}": tune.uniform(0.0, 1.0) for task in tasks}
    return space


def own_point(settings: CalibrationSection, tasks: Sequence[str], darts: bool) -> dict[str, object]:
    """The config's own settings as a point of the space: the first trial."""
    point: dict[str, object] = {"rank": settings.rank, "steps": settings.steps, "learning_rate": settings.learning_rate}
    if darts:
        point["max_positions"] = settings.max_positions
        point |= {f"beta.{task}": settings.beta_for(task) for task in tasks}
    return point


def trial_settings(settings: CalibrationSection, params: Mapping[str, object], tasks: Sequence[str],
                   variant: Callable[[CalibrationSection], CalibrationSection]) -> CalibrationSection:
    """A trial's calibration settings: the config's with the drawn values, then made into the variant."""
    drawn = updated(settings, rank=int(params["rank"]), steps=int(params["steps"]),
                    learning_rate=float(params["learning_rate"]),
                    max_positions=int(params.get("max_positions", settings.max_positions)))
    if f"beta.{tasks[0]}" in params:
        drawn = updated(drawn, tasks={task: updated(settings.tasks.get(task) or TaskCalibration(),
                                                    beta=float(params[f"beta.{task}"])) for task in tasks})
    return variant(drawn)


def _trial(params: dict[str, object], *, settings: CalibrationSection, tasks: Sequence[str],
           variant: Callable[[CalibrationSection], CalibrationSection], select: str, features: list[TaskFeatures],
           merged_dir: Path, evaluator: Evaluator, pairs: list[tuple[ExpertSide, MergedSide]]) -> None:
    """One Tune trial: train the variant at `params`, report its validation results (the selected one first)."""
    chosen = trial_settings(settings, params, tasks, variant)
    device = resolve_device(settings.device)  # "auto" inside the trial: a GPU where Tune gave it one
    merged = load_causal_lm(merged_dir, dtype=model_dtype(settings.dtype, device), device=device)
    result = train_corrections(features, chosen, merged, progress=False)
    validation = evaluator.evaluate(merged, result.corrections.to(device), pairs, split="validation")
    value = validation["overall"].get(select)
    numbers = {f"validation.{key}": value for key, value in validation["overall"].items()
               if isinstance(value, (int, float)) and not isinstance(value, bool)}
    tune.report({select: -math.inf if value is None else value, **numbers,
                 "final_loss": result.losses[-1]})


@contextmanager
def _mlflow_uris_kept() -> Iterator[None]:
    """MLflow's process-wide tracking and registry URIs (and their environment variables) as they were before:
    Ray Tune's MLflowLoggerCallback sets them with mlflow.set_tracking_uri, which would send every later
    fluent MLflow call of this process (the registry's log_model) to the tuning's store."""
    from mlflow.tracking._model_registry import utils as registry_uri
    from mlflow.tracking._tracking_service import utils as tracking_uri

    names = ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI")
    saved = tracking_uri._tracking_uri, registry_uri._registry_uri, {name: os.environ.get(name) for name in names}
    try:
        yield
    finally:
        tracking_uri._tracking_uri, registry_uri._registry_uri = saved[0], saved[1]
        for name, value in saved[2].items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _mlflow(tracking: Tracking | None, name: str) -> list[MLflowLoggerCallback]:
    """Each trial as an MLflow run under the command's run (none without a session)."""
    if tracking is None or tracking.offline is not None:
        return []
    experiment = tracking.client.get_experiment(tracking.experiment_id).name
    return [MLflowLoggerCallback(tracking_uri=tracking.uri, experiment_name=experiment,
                                 tags={"mlflow.parentRunId": tracking.run_id, STAGE_TAG: f"tune/{name}"})]


def tuning_session(config: RunConfig) -> AbstractContextManager[None]:
    """The Ray cluster the trials run on: the one this process joined, the config's (or RAY_ADDRESS's), else a
    local one with every core. Held around several `tune_variant` calls, they share it: one cluster start and one
    set of trial processes (Tune reuses a function trial's actor) instead of one per variant."""
    return ray_session(config.cluster.address or os.environ.get("RAY_ADDRESS"), {"num_cpus": os.cpu_count() or 1})


def tune_variant(
    name: str, variant: Callable[[CalibrationSection], CalibrationSection], config: RunConfig, trials: int,
    select: str, features: list[TaskFeatures], merged_dir: Path, evaluator: Evaluator,
    pairs: list[tuple[ExpertSide, MergedSide]], tracking: Tracking | None = None,
) -> tuple[CalibrationSection, list[dict[str, object]]]:
    """Tune one variant with `trials` trials; its best settings and every trial's (in the order they ran)."""
    settings, tasks, darts = config.calibration, list(config.tasks), name == "darts"
    trainable = tune.with_parameters(_trial, settings=settings, tasks=tasks, variant=variant, select=select,
                                     features=features, merged_dir=merged_dir, evaluator=evaluator, pairs=pairs)
    cluster = config.cluster
    resources = {"cpu": cluster.cpus_per_worker, "gpu": 1.0 if cluster.use_gpu else 0.0}
    searcher = OptunaSearch(metric=select, mode="max", seed=settings.seed,
                            points_to_evaluate=[own_point(settings, tasks, darts)])
    with tuning_session(config), _mlflow_uris_kept():
        tuner = tune.Tuner(
            tune.with_resources(trainable, resources),
            param_space=search_space(settings, tasks, darts),
            tune_config=tune.TuneConfig(search_alg=searcher, num_samples=trials, metric=select, mode="max"),
            run_config=tune.RunConfig(name=name, storage_path=str((config.run_dir / "ablation" / "tune").absolute()),
                                      callbacks=_mlflow(tracking, name), verbose=0),
        )
        grid = tuner.fit()
    failed = [result.error for result in grid if result.error is not None]
    if len(failed) == len(grid):
        raise DartsError(f"every {name} tuning trial failed; the first: {failed[0]}",
                         "fix the error above (its trial's log is under the run folder's ablation/tune)")
    for error in failed:
        logger.warning("tune %s: a trial failed (left out): %s", name, error)
    # Trial ids are random: the config's own trial first, then the others in the order they reported.
    own = own_point(settings, tasks, darts)
    finished = sorted((r for r in grid if r.error is None),
                      key=lambda r: (r.config != own, r.metrics.get("timestamp", 0)))
    rows = []
    for number, result in enumerate(finished):
        chosen = trial_settings(settings, result.config, tasks, variant)
        rows.append({"trial": number, "variant": name, "settings": chosen, select: result.metrics[select],
                     "overall": {key.removeprefix("validation."): value for key, value in result.metrics.items()
                                 if key.startswith("validation.")}})
        logger.info("tune %s trial %d: validation %s %.4g", name, number, select, result.metrics[select])
    # The best, the earlier trial on a tie: with nothing to tell trials apart (a metric undefined in every trial,
    # -inf), the config's own settings win.
    best = max(rows, key=lambda row: (row[select], -row["trial"]))
    return best["settings"], rows
