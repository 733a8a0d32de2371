"""MLflow tracking: one run per command, a nested run per stage, with params, per-step metrics and artifacts.

A command (`demo`, `calibrate`, `evaluate`, `merge`) opens a session: a parent run
named after the config holding the whole validated config, and a nested run for each stage it
performs (merge, calibration, evaluation). Everything here takes plain values and run ids, so a
Ray Train worker can log to a run it did not create (`step_logger.StepLogger` pickles as two strings).
`MLFLOW_TRACKING_URI` wins over the config's `tracking.uri`; a relative `sqlite:///` file is
taken from the current folder, with its artifacts in `mlartifacts/` next to it.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from mlflow.entities import Metric, Param, RunTag
from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID

from darts_dist.config import REGMEAN_RECORD, RunConfig, TrackingSection
from darts_dist.core import BUCKET_LABELS, POSITION_BUCKETS
from darts_dist.errors import DartsError
from darts_dist.redaction import HIDDEN, redacted, redacted_json
from darts_dist.sources.models import content_hash
from darts_dist.tracking.step_logger import StepLogger
from darts_dist.tracking.store import QUICK_REQUESTS, STORE_ERRORS, environment
from mlflow import MlflowClient

logger = logging.getLogger(__name__)

TRACKING_URI_ENV = "MLFLOW_TRACKING_URI"
SUPPRESS_RUN_URLS_ENV = "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"
SQLITE_PREFIX = "sqlite:///"
ARTIFACT_FOLDER = "mlartifacts"
# MLflow's limits: at most 100 params per batch and 6000 characters per param value.
_PARAMS_PER_BATCH = 100
_PARAM_VALUE_LIMIT = 6000
# How long the reachability check may take: a server that does not answer in this time is down.
_CHECK_TIMEOUT_S = "5"
STAGE_TAG = "darts.stage"
CORRECTIONS_TAG = "darts.corrections"
MERGED_DIR_TAG = "darts.merged_dir"


def tracking_uri(configured: str) -> str:
    """`MLFLOW_TRACKING_URI` if set, else the config's value; a relative sqlite file becomes absolute."""
    uri = os.environ.get(TRACKING_URI_ENV) or configured
    if f"://{HIDDEN}@" in uri:
        raise DartsError(f"the tracking URI {uri} is a record's, whose credentials were left out of it",
                         f"set {TRACKING_URI_ENV} to the store's URI, credentials included")
    if uri.startswith(SQLITE_PREFIX):
        path = uri[len(SQLITE_PREFIX):]
        # sqlite:///mlflow.db names a file in the current folder; resolve it once, here, so
        # every process of the run (Ray workers included) writes to the same file.
        if path and not path.startswith("/") and ":memory:" not in path:
            return SQLITE_PREFIX + str(Path(path).absolute())
    return uri


def _sqlite_file(uri: str) -> Path | None:
    return Path(uri[len(SQLITE_PREFIX):]) if uri.startswith(SQLITE_PREFIX) else None


def connect(uri: str) -> MlflowClient:
    """A client for `uri`, after one quick request proves the store answers; else a DartsError at once."""
    sqlite = _sqlite_file(uri)
    if sqlite is not None:
        sqlite.parent.mkdir(parents=True, exist_ok=True)
    # MLflow prints "View run NAME at: URL" on stdout (the results' stream) as each run ends, with a server's
    # user:password in the URL; the command's own "mlflow: run" line says it, redacted.
    os.environ.setdefault(SUPPRESS_RUN_URLS_ENV, "true")
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    # Without this, an unreachable server is retried with back-off for minutes.
    with environment(MLFLOW_HTTP_REQUEST_MAX_RETRIES="0", MLFLOW_HTTP_REQUEST_TIMEOUT=_CHECK_TIMEOUT_S):
        try:
            client.search_experiments(max_results=1)
        except STORE_ERRORS as error:
            reason = str(error).strip().splitlines()[0][:300] if str(error).strip() else type(error).__name__
            raise DartsError(
                f"cannot reach the MLflow tracking store {uri}: {reason}",
                f"start the server (mlflow/server.sh), point {TRACKING_URI_ENV} at a running one, "
                f"or unset it to use the embedded sqlite:///mlflow.db",
            ) from None
    return client


def experiment_id(client: MlflowClient, uri: str, name: str) -> str:
    """The experiment's id, creating it on first use; a sqlite store keeps its artifacts next to the file."""
    existing = client.get_experiment_by_name(name)
    if existing is not None:
        return existing.experiment_id
    sqlite = _sqlite_file(uri)
    # Without a location MLflow would put artifacts in ./mlruns of whatever folder a process runs in.
    location = None if sqlite is None else (sqlite.parent / ARTIFACT_FOLDER / name).as_uri()
    return client.create_experiment(name, artifact_location=location)


def flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested mappings as dotted keys; lists as JSON; values cut to MLflow's length limit."""
    flat: dict[str, str] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(flatten(value, name + "."))
            continue
        text = value if isinstance(value, str) else json.dumps(value, default=str)
        flat[name] = text if len(text) <= _PARAM_VALUE_LIMIT else text[: _PARAM_VALUE_LIMIT - 3] + "..."
    return flat


def reachable(uri: str) -> bool:
    try:
        connect(uri)
    except DartsError:
        return False
    return True


def _store_call(method: Callable) -> Callable:
    """A Tracking method that survives the store going away: the first failure while the store does not
    answer turns the session offline, and from then on every call does nothing. The command still
    finishes its work; it then says so and how to log the rest (`darts-dist register RUN_DIR`)."""

    @functools.wraps(method)
    def call(self: Tracking, *args: Any, **kwargs: Any) -> Any:
        if self.offline is not None:
            return None
        try:
            return method(self, *args, **kwargs)
        except STORE_ERRORS as error:
            if reachable(self.uri):
                raise  # the store answers: a real error, not an outage
            self.offline = str(error).strip().splitlines()[0][:300] if str(error).strip() else type(error).__name__
            logger.warning("MLflow store %s stopped answering (%s): the run goes on without tracking", self.uri,
                           self.offline)
            return None

    return call


@dataclass
class Tracking:
    """One command's MLflow session: its parent run and the nested run of each stage.

    `offline` is None while the store answers, else why it stopped (see `_store_call`)."""

    client: MlflowClient
    uri: str
    experiment_id: str
    run_id: str
    stages: dict[str, str] = field(default_factory=dict)
    offline: str | None = None

    @_store_call
    def start_stage(self, stage: str, tags: Mapping[str, object] | None = None) -> str:
        """A nested run for `stage` (merge, calibration, evaluation), tied to the parent run."""
        tags = {MLFLOW_PARENT_RUN_ID: self.run_id, STAGE_TAG: stage, **{k: str(v) for k, v in (tags or {}).items()}}
        run = self.client.create_run(self.experiment_id, run_name=stage, tags=tags)
        self.stages[stage] = run.info.run_id
        return run.info.run_id

    @_store_call
    def log_params(self, run_id: str, params: Mapping[str, Any]) -> None:
        items = [Param(key, redacted(value)) for key, value in flatten(params).items()]
        for start in range(0, len(items), _PARAMS_PER_BATCH):
            self.client.log_batch(run_id, params=items[start: start + _PARAMS_PER_BATCH])

    @_store_call
    def log_metrics(self, run_id: str, metrics: Mapping[str, float], step: int = 0) -> None:
        self.log_points(run_id, [(key, value, step) for key, value in metrics.items()])

    @_store_call
    def log_points(self, run_id: str, points: Sequence[tuple[str, float, int]]) -> None:
        """(metric, value, step) triples in one request; non-finite values (undefined results) are left out."""
        now = int(time.time() * 1000)
        metrics = [Metric(key, float(value), now, step) for key, value, step in points if math.isfinite(value)]
        self.client.log_batch(run_id, metrics=metrics)

    @_store_call
    def set_tags(self, run_id: str, tags: Mapping[str, object]) -> None:
        self.client.log_batch(run_id, tags=[RunTag(k, redacted(str(v))) for k, v in tags.items()])

    @_store_call
    def log_file(self, run_id: str, path: Path, folder: str | None = None) -> None:
        self.client.log_artifact(run_id, str(path), folder)

    @_store_call
    def log_json(self, run_id: str, data: Any, name: str) -> None:
        self.client.log_text(run_id, json.dumps(redacted_json(data), indent=2, default=str), name)

    def step_logger(self, run_id: str) -> StepLogger:
        return StepLogger(self.uri, run_id)


@contextlib.contextmanager
def session(settings: TrackingSection, name: str, command: str) -> Iterator[Tracking]:
    """Open the command's parent run (failing fast if the store is unreachable); end every run with its status."""
    uri = tracking_uri(settings.uri)
    client = connect(uri)
    experiment = experiment_id(client, uri, settings.experiment)
    run = client.create_run(experiment, run_name=name, tags={"darts.command": command})
    tracking = Tracking(client=client, uri=uri, experiment_id=experiment, run_id=run.info.run_id)
    status = "FAILED"
    try:
        with environment(**QUICK_REQUESTS):
            yield tracking
        status = "FINISHED"
    finally:
        # A session whose store went away leaves its runs open: `darts-dist register` closes them later.
        for run_id in [] if tracking.offline else [*tracking.stages.values(), tracking.run_id]:
            try:
                with environment(**QUICK_REQUESTS):
                    client.set_terminated(run_id, status)
            except STORE_ERRORS:
                # After a failure, that failure is the error to report, not a store gone with it.
                if status == "FINISHED":
                    raise


def log_config(tracking: Tracking, config: RunConfig) -> None:
    """The whole validated config: as params on the parent run, and as a JSON artifact."""
    dumped = config.model_dump(mode="json")
    tracking.log_params(tracking.run_id, dumped)
    tracking.log_json(tracking.run_id, dumped, "config.json")


def log_merge(tracking: Tracking, merged_dir: Path, sources: Mapping[str, Path]) -> str:
    """The merge stage: the resolved mergekit YAML (and a RegMean merge's record) as params and artifacts, the
    sources with content hashes.

    The YAML rather than the config's `merge` section, because a config may name a mergekit YAML of its own.
    """
    run_id = tracking.start_stage("merge", {MERGED_DIR_TAG: merged_dir})
    resolved = merged_dir / "mergekit_config.yml"
    params = flatten(yaml.safe_load(resolved.read_text()), "mergekit.")
    regmean = merged_dir / REGMEAN_RECORD  # a RegMean merge: mergekit merged the other tensors
    if regmean.is_file():
        params |= flatten(yaml.safe_load(regmean.read_text()), "regmean.")
        tracking.log_file(run_id, regmean, "merged")
    params["merged.hash"] = content_hash(merged_dir)
    for role, path in sources.items():
        params[f"source.{role}"] = str(path)
        params[f"source.{role}.hash"] = content_hash(path)
    tracking.log_params(run_id, params)
    tracking.log_file(run_id, resolved, "merged")
    tracking.log_file(run_id, merged_dir / "config.json", "merged")
    return run_id


def system_tags(config: RunConfig, device: str, executor: str) -> dict[str, str]:
    """Where a calibration ran: Ray address, workers, ZeRO stage, device and which loop ran it."""
    cluster = config.cluster
    return {
        "darts.executor": executor,
        "darts.device": device,
        "darts.ray_address": cluster.address or "local",
        "darts.num_workers": str(cluster.num_workers),
        "darts.zero_stage": str(cluster.zero_stage),
        "darts.use_gpu": str(cluster.use_gpu),
    }


def log_calibration(
    tracking: Tracking, run_id: str, config: RunConfig, merged_dir: Path, corrections: Path,
    header: Mapping[str, Any], plots: Mapping[str, Path], summary: Mapping[str, float],
) -> None:
    """The calibration stage's hyperparameters, summary metrics, corrections (file and header) and plots."""
    tracking.log_params(run_id, {"calibration": config.calibration.model_dump(mode="json"),
                                 "tasks": list(config.tasks)})
    tracking.log_metrics(run_id, summary)
    tracking.log_file(run_id, corrections, "corrections")
    tracking.log_json(run_id, dict(header), "corrections/header.json")
    for path in plots.values():
        tracking.log_file(run_id, path, "plots")
    # Local paths, so `darts-dist register RUN` can log the model later without re-running anything.
    tracking.set_tags(run_id, {CORRECTIONS_TAG: corrections, MERGED_DIR_TAG: merged_dir})


def evaluation_metrics(evaluation: Mapping[str, Any]) -> dict[str, float]:
    """Scalar evaluation results as metric names, eval.<task or overall>.<metric>; undefined ones left out."""
    metrics = {}
    for scope, values in [("overall", evaluation["overall"]), *evaluation["tasks"].items()]:
        for key, value in values.items():
            if isinstance(value, (int, float)) and key != "tokens":  # a flag (nll_no_gap) as 0 or 1
                metrics[f"eval.{scope}.{key}"] = float(value)
            elif key.endswith("_ci") and value is not None:  # a score's interval: its two ends
                metrics |= {f"eval.{scope}.{key}.{end}": float(v) for end, v in zip(("low", "high"), value)}
    return metrics


def log_evaluation(tracking: Tracking, run_id: str, evaluation: Mapping[str, Any], plots: Mapping[str, Path]) -> None:
    """Evaluation metrics (bias by position as a series over position buckets), the full result, the plots."""
    points = [(key, value, 0) for key, value in evaluation_metrics(evaluation).items()]
    # Each bucket at its first position as the step, so MLflow draws bias against position.
    bucket_start = {label: start for label, (start, _) in zip(BUCKET_LABELS, POSITION_BUCKETS)}
    for task, result in evaluation["tasks"].items():
        for key in ("bias_before_by_position", "bias_after_by_position"):
            points += [(f"eval.{task}.{key}", value, bucket_start[label])
                       for label, value in (result.get(key) or {}).items()]
    tracking.log_points(run_id, points)
    tracking.log_json(run_id, evaluation, "evaluation.json")
    for path in plots.values():
        tracking.log_file(run_id, path, "plots")
