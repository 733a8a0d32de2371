"""What an export starts from: a run folder or a registered version, read as far as exporting needs it."""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from darts_dist.config import RunConfig, TrackingSection
from darts_dist.errors import DartsError
from darts_dist.run_folder import read_run_folder
from darts_dist.tracking.registry import ModelFiles, fetch_model, model_version
from darts_dist.tracking.runs import TRACKING_URI_ENV, connect, environment, tracking_uri

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
    """A run folder (`calibrate` or `demo` output) or models:/NAME@ALIAS, models:/NAME/VERSION."""
    if source.startswith("models:/"):
        with environment(**({TRACKING_URI_ENV: tracking} if tracking else {})):
            client = connect(tracking_uri(TrackingSection().uri))
        return ExportSource(fetch_model(client, source), _registered_evaluation(client, source), source)
    folder = Path(source)
    if not folder.is_dir():
        raise DartsError(f"{source} is neither a models:/ URI nor a folder",
                         "pass the folder a `calibrate` or `demo` run wrote (OUTPUT_DIR/NAME), or models:/NAME@ALIAS")
    run = read_run_folder(folder)
    files = ModelFiles(folder.absolute().name, run.merged_dir, run.corrections, run.router, run.config)
    return ExportSource(files, _run_evaluation(folder), str(folder))
