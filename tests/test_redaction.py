"""Credentials in a tracking URI (`http://user:password@host`) reach no report, log line, error, MLflow param or
artifact; a record's redacted URI is refused with the fix, never used."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from darts_dist.errors import DartsError
from darts_dist.logs import show_progress_logs
from darts_dist.pipeline import write_report
from darts_dist.redaction import redacted, redacted_json
from darts_dist.tracking.runs import Tracking, connect, experiment_id, tracking_uri

SECRET_URI = "https://darts:s3cr3t-pw@mlflow.example.com:5000/path?x=1"


def test_a_urls_user_and_password_are_hidden_and_everything_else_kept() -> None:
    assert redacted(SECRET_URI) == "https://***@mlflow.example.com:5000/path?x=1"
    assert redacted(f"cannot reach {SECRET_URI}, nor git+ssh://me@host/repo") == (
        "cannot reach https://***@mlflow.example.com:5000/path?x=1, nor git+ssh://***@host/repo")
    for kept in ("sqlite:////tmp/mlflow.db", "http://127.0.0.1:5000", "user@example.com wrote", "databricks"):
        assert redacted(kept) == kept
    assert redacted_json({"uri": SECRET_URI, "n": [1, SECRET_URI], SECRET_URI: None}) == {
        "uri": redacted(SECRET_URI), "n": [1, redacted(SECRET_URI)], redacted(SECRET_URI): None}


def test_reports_and_log_lines_keep_no_password(tmp_path: Path, capfd) -> None:
    path = write_report(tmp_path / "report.json", {"tracking": {"uri": SECRET_URI, "at": tmp_path}})
    assert "s3cr3t" not in path.read_text()
    assert json.loads(path.read_text())["tracking"] == {"uri": redacted(SECRET_URI), "at": str(tmp_path)}
    show_progress_logs()
    logging.getLogger("darts_dist.cli").info("mlflow: run %s at %s", "abc", SECRET_URI)
    err = capfd.readouterr().err
    assert "mlflow: run abc at https://***@mlflow.example.com" in err and "s3cr3t" not in err


def test_the_store_gets_no_password_in_params_tags_or_json(tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = connect(uri)
    run_id = client.create_run(experiment_id(client, uri, "redaction")).info.run_id
    tracking = Tracking(client=client, uri=uri, experiment_id="0", run_id=run_id)
    tracking.log_params(run_id, {"tracking": {"uri": SECRET_URI}})
    tracking.set_tags(run_id, {"darts.store": SECRET_URI})
    tracking.log_json(run_id, {"tracking": {"uri": SECRET_URI}}, "config.json")
    run = client.get_run(run_id)
    assert run.data.params["tracking.uri"] == redacted(SECRET_URI)
    assert run.data.tags["darts.store"] == redacted(SECRET_URI)
    logged = Path(client.download_artifacts(run_id, "config.json", str(tmp_path))).read_text()
    assert "s3cr3t" not in logged and redacted(SECRET_URI) in logged


def test_a_records_redacted_uri_is_refused_with_the_fix(monkeypatch) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    with pytest.raises(DartsError) as error:
        tracking_uri(redacted(SECRET_URI))
    assert "credentials were left out" in error.value.what and "MLFLOW_TRACKING_URI" in error.value.fix
