"""The MLflow server dropped during a run: the calibration finishes, nothing is lost, and one command
(`darts-dist register RUN_DIR`) logs the rest and registers the model once the server is back."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import yaml
from mlflow_server import free_port, mlflow_server, stop
from tiny_configs import family_config

from darts_dist.cli import main
from darts_dist.core import load_corrections
from darts_dist.tracking.registry import VERSION_TAG
from darts_dist.tracking.runs import STAGE_TAG
from mlflow import MlflowClient

pytestmark = pytest.mark.slow  # a tracking server and a calibration on Ray

MODEL = "outage-darts"


def write_config(tiny_family, folder: Path) -> Path:
    config = family_config(
        tiny_family, folder, "outage", lambda task, i: f"def g_{task}_{i}(x):\n    return x - {i}\n", 10,
        calibration={"rank": 4, "max_positions": 16, "num_samples": 8, "max_length": 16, "batch_size": 4,
                     "steps": 8, "learning_rate": 0.05},
        evaluation={"score_limit": 0}, tracking={"experiment": "test-outage", "registered_model": MODEL})
    path = folder / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def drop_when_calibration_starts(uri: str, server, done: threading.Event) -> None:
    """Stop the server as soon as the calibration stage has opened its run: the Ray job then starts,
    trains and finishes with no store to talk to."""
    client = MlflowClient(uri)
    while not done.is_set():
        experiment = client.get_experiment_by_name("test-outage")
        if experiment and client.search_runs([experiment.experiment_id], f"tags.`{STAGE_TAG}` = 'calibration'"):
            stop(server)
            return
        time.sleep(0.1)


def test_a_server_lost_mid_run_loses_nothing(ray_cluster, tiny_family, tmp_path, monkeypatch, capsys) -> None:
    port, store = free_port(), tmp_path / "store"
    store.mkdir()
    uri = f"http://127.0.0.1:{port}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    config, out = write_config(tiny_family, tmp_path), tmp_path / "runs"
    with mlflow_server(store, port) as server:
        done = threading.Event()
        dropper = threading.Thread(target=drop_when_calibration_starts, args=(uri, server, done), daemon=True)
        dropper.start()
        try:
            code = main(["calibrate", str(config), "--output-dir", str(out)])
        finally:
            done.set()
            dropper.join()
        assert server.poll() is not None, "the server was never dropped"
    err = capsys.readouterr().err
    assert code == 2, err
    assert "stopped answering during the run" in err and "darts-dist register" in err

    # The work is complete on disk: corrections (also in the Ray checkpoint), evaluation, the report.
    run_dir = out / "outage"
    report = json.loads((run_dir / "calibration.json").read_text())
    assert report["tracking"]["offline"]
    corrections, _ = load_corrections(Path(report["corrections"]))
    assert corrections.spec.tasks == ("code", "math")
    assert Path(report["calibration"]["job"]["checkpoint_path"]).is_dir()
    assert "darts" in report["variants"]

    # The server is back, on the same store: one command logs what was missing and registers.
    with mlflow_server(store, port):
        assert main(["register", str(run_dir)]) == 0
        client = MlflowClient(uri, uri)
        calibration = client.get_run(report["tracking"]["stage_runs"]["calibration"])
        losses = client.get_metric_history(calibration.info.run_id, "loss")
        assert sorted(m.step for m in losses) == list(range(1, len(report["calibration"]["losses"]) + 1))
        assert [m.value for m in sorted(losses, key=lambda m: m.step)] == pytest.approx(report["calibration"]["losses"])
        assert calibration.data.metrics["eval.overall.nll_corrected"] == pytest.approx(
            report["variants"]["darts"]["overall"]["nll_corrected"])
        assert calibration.data.tags[VERSION_TAG]
        assert client.get_run(report["tracking"]["run_id"]).info.status == "FINISHED"
        assert client.get_latest_versions(MODEL)
    assert "offline" not in json.loads((run_dir / "calibration.json").read_text())["tracking"]
