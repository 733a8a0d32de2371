"""What an export starts from: a run folder or a registered version, read as far as exporting needs it."""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from darts_dist.config import RunConfig
from darts_dist.serve.model import resolve_model
from darts_dist.tracking.registry import ModelFiles, model_version
from darts_dist.tracking.runs import TRACKING_URI_ENV, connect
from darts_dist.tracking.store import environment

REPORT_NAMES = ("report.json", "calibration.json")  # what a demo and a calibrate run write


@dataclass(frozen=True)
class ExportSource:
    files: ModelFiles
    evaluation: dict[str, Any] | None  # the run's held-out evaluation, where it made one
    origin: str  # the folder or models:/ URI, for the model card

    @property
    def config(self) -> RunConfig | None:
        return self.files.config


def _run_evaluation(folder: Path) -> dict[str, Any] | None:
    for report in (folder / name for name in REPORT_NAMES):
        if report.is_file():
            return json.loads(report.read_text()).get("variants", {}).get("darts")
    return None


def _registered_evaluation(client: Any, uri: str) -> dict[str, Any] | None:
    """The evaluation.json the version's calibration logged, if it logged one."""
    import mlflow

    version = model_version(client, uri)
    if not version.run_id:
        return None
    with tempfile.TemporaryDirectory() as scratch, environment(**{TRACKING_URI_ENV: client.tracking_uri}):
        try:
            path = mlflow.artifacts.download_artifacts(run_id=version.run_id, artifact_path="evaluation.json",
                                                       dst_path=scratch)
        except (mlflow.exceptions.MlflowException, OSError):
            return None
        return json.loads(Path(path).read_text())


def read_source(source: str, tracking: str | None = None) -> ExportSource:
    """A run folder (`calibrate` or `demo` output) or models:/NAME@ALIAS, models:/NAME/VERSION, found as
    `darts-dist serve` finds what it serves."""
    served, _ = resolve_model(source, tracking=tracking)
    if served.registered is not None:
        return ExportSource(served.fetch(), _registered_evaluation(connect(served.tracking_uri), served.registered),
                            source)
    return ExportSource(served.fetch(), _run_evaluation(Path(source)), source)
