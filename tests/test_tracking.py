"""MLflow tracking and registry against a real `mlflow server`: runs, the pyfunc model, the alias, failures (the\nserver lost in the middle of the run these tests read, and back for `darts-dist register`)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import mlflow.pyfunc
import pytest
import yaml
from isolation import requirements_environment
from mlflow_server import free_port, mlflow_server, stop
from tiny_configs import family_config

from darts_dist.cli import main
from darts_dist.core import load_corrections
from darts_dist.errors import DartsError
from darts_dist.generation import CorrectedLM
from darts_dist.tracking.registry import DECISION_TAG, DECISIVE_METRIC, MODEL_URI_TAG, VERSION_TAG, register_version
from darts_dist.tracking.runs import STAGE_TAG, connect, experiment_id, tracking_uri
from mlflow import MlflowClient

MODEL = "tiny-darts"
STEPS = 6
PROMPT, TASK = "def add(a, b):", "code"


def write_config(tiny_family, folder: Path) -> Path:
    """Two tasks of the tiny family, with calibration and held-out files; a few fast steps, in this process: what
    a tracked Ray run adds (its workers' rank 0 logging each step, the job's tags) is test_fake_gpus's."""
    config = family_config(
        tiny_family, folder, "tracked", lambda task, i: f"def f_{task}_{i}(x):\n    return x * {i} + {i + 1}\n", 10,
        calibration={"rank": 4, "max_positions": 16, "num_samples": 8, "max_length": 16, "batch_size": 4,
                     "steps": STEPS, "learning_rate": 0.05},
        tracking={"experiment": "test-tracking", "registered_model": MODEL}, cluster={"executor": "in-process"})
    path = folder / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def drop_when_calibration_starts(uri: str, server: subprocess.Popen, done: threading.Event) -> None:
    """Stop the server as soon as the calibration stage has opened its run: the calibration then trains, is
    evaluated and finishes with no store to talk to."""
    client = MlflowClient(uri)
    while not done.is_set():
        experiment = client.get_experiment_by_name("test-tracking")
        if experiment and client.search_runs([experiment.experiment_id], f"tags.`{STAGE_TAG}` = 'calibration'"):
            stop(server)
            return
        time.sleep(0.1)


@pytest.fixture(scope="module")
def tracked(tiny_family, tmp_path_factory: pytest.TempPathFactory):
    """One `darts-dist calibrate` on Ray, tracked on `mlflow server` (mlflow/server.sh), which is lost as soon as
    the calibration stage has opened its run: the job finishes with nothing lost on disk, and once the server is
    back on the same store `darts-dist register RUN_DIR` logs what it missed and registers the model. The
    module's tests then read the store as a run that never lost its server would have left it (a run tracked
    without an outage: test_live_loop, test_fake_gpus)."""
    folder, store, port = tmp_path_factory.mktemp("tracked"), tmp_path_factory.mktemp("mlflow-server"), free_port()
    uri = f"http://127.0.0.1:{port}"
    config, runs = write_config(tiny_family, folder), folder / "runs"
    out, err = io.StringIO(), io.StringIO()  # what the two commands print, to read for the password
    with pytest.MonkeyPatch.context() as patch:
        # With a user and password in the URI, as a server behind basic auth takes them (this one ignores them).
        patch.setenv("MLFLOW_TRACKING_URI", uri.replace("http://", "http://darts:s3cr3t@"))
        with mlflow_server(store, port) as server:
            done = threading.Event()
            dropper = threading.Thread(target=drop_when_calibration_starts, args=(uri, server, done), daemon=True)
            dropper.start()
            try:
                with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                    code = main(["calibrate", str(config), "--output-dir", str(runs)])
            finally:
                done.set()
                dropper.join()
            assert server.poll() is not None, "the server was never dropped"
    run_dir = runs / "tracked"
    offline = json.loads((run_dir / "calibration.json").read_text())
    with mlflow_server(store, port):
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("MLFLOW_TRACKING_URI", uri.replace("http://", "http://darts:s3cr3t@"))
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                registered = main(["register", str(run_dir)])
            assert registered == 0, err.getvalue()[-3000:]
        yield SimpleNamespace(report=json.loads((run_dir / "calibration.json").read_text()), offline=offline,
                              run_dir=run_dir, client=MlflowClient(uri, uri), uri=uri,
                              outage=(code, out.getvalue(), err.getvalue()))


@pytest.mark.slow
def test_a_server_lost_mid_run_loses_nothing_on_disk_and_says_how_to_register(tracked) -> None:
    code, out, err = tracked.outage
    assert code == 2, err[-3000:]
    assert "stopped answering during the run" in err and "darts-dist register" in err
    # Neither command printed the store's password: not in darts-dist's lines, not in MLflow's "View run" links
    # (off), not in a logging error's traceback of the MLflow exception it was handling.
    assert "s3cr3t" not in out + err and "View run" not in out
    assert "http://***@127.0.0.1" in err
    # The work was complete on disk: corrections, evaluation, the report.
    offline = tracked.offline
    assert offline["tracking"]["offline"] and "darts" in offline["variants"]
    corrections, _ = load_corrections(Path(offline["corrections"]))
    assert corrections.spec.tasks == ("code", "math")
    # `register` put the run's report back as a tracked one.
    assert "offline" not in tracked.report["tracking"]


def artifact_paths(client: MlflowClient, run_id: str, folder: str | None = None) -> set[str]:
    paths = set()
    for item in client.list_artifacts(run_id, folder):
        paths |= artifact_paths(client, run_id, item.path) if item.is_dir else {item.path}
    return paths


@pytest.mark.slow
def test_a_calibration_logs_params_metrics_and_artifacts(tracked, tmp_path: Path) -> None:
    client, tracking = tracked.client, tracked.report["tracking"]
    # The store's URI as the report and the store keep it: its password left out.
    assert tracking["uri"] == tracked.uri.replace("http://", "http://***@")
    assert "s3cr3t" not in (tracked.run_dir / "calibration.json").read_text()
    parent = client.get_run(tracking["run_id"])
    merge = client.get_run(tracking["stage_runs"]["merge"])
    calibration = client.get_run(tracking["stage_runs"]["calibration"])
    for run in (merge, calibration):
        assert run.data.tags["mlflow.parentRunId"] == parent.info.run_id
    assert {run.info.status for run in (parent, merge, calibration)} == {"FINISHED"}

    # The whole validated config on the parent run.
    assert parent.data.params["name"] == "tracked"
    assert parent.data.params["calibration.rank"] == "4"
    assert parent.data.params["tracking.registered_model"] == MODEL
    assert {"config.json", "report.json"} <= artifact_paths(client, parent.info.run_id)
    logged = Path(client.download_artifacts(parent.info.run_id, "report.json", str(tmp_path))).read_text()
    assert "s3cr3t" not in logged and tracking["uri"] in logged

    # Merge: method and parameters from the resolved mergekit YAML, sources with content hashes.
    assert merge.data.params["mergekit.merge_method"] == "task_arithmetic"
    assert merge.data.params["mergekit.parameters.weight"] == "0.5"
    for role in ("base", "code", "math"):
        assert len(merge.data.params[f"source.{role}.hash"]) == 16
    assert artifact_paths(client, merge.info.run_id) == {"merged/config.json", "merged/mergekit_config.yml"}

    # Calibration: hyperparameters, system tags, per-step metrics, evaluation, artifacts.
    assert calibration.data.params["calibration.steps"] == str(STEPS)
    assert calibration.data.params["calibration.learning_rate"] == "0.05"
    tags = calibration.data.tags
    # Calibrated in this process (a Ray run's tags and its workers' step logging: test_fake_gpus).
    assert (tags["darts.executor"], tags["darts.device"]) == ("in-process", "cpu")
    assert "darts.ray_run_id" not in tags and not any(key.startswith("job.") for key in calibration.data.metrics)
    losses = client.get_metric_history(calibration.info.run_id, "loss")
    assert [m.step for m in losses] == list(range(1, STEPS + 1))
    assert [m.value for m in losses] == pytest.approx(tracked.report["calibration"]["losses"])
    assert all(m.value > 0 for m in client.get_metric_history(calibration.info.run_id, "rows_per_second"))
    metrics = calibration.data.metrics
    evaluation = tracked.report["variants"]["darts"]
    assert metrics[DECISIVE_METRIC] == pytest.approx(evaluation["overall"]["nll_corrected"])
    assert metrics["eval.math.bias_reduction"] == pytest.approx(evaluation["tasks"]["math"]["bias_reduction"])
    by_position = client.get_metric_history(calibration.info.run_id, "eval.code.bias_after_by_position")
    assert [m.step for m in by_position] == [0]  # max_length 16: only the first bucket, 0-15
    assert artifact_paths(client, calibration.info.run_id) == {
        "corrections/corrections.safetensors", "corrections/header.json", "evaluation.json",
        "plots/loss.png", "plots/entropy_weights.png", "plots/bias_by_position.png",
    }
    header = json.loads(Path(client.download_artifacts(calibration.info.run_id, "corrections/header.json",
                                                       str(tmp_path))).read_text())
    assert header["spec"]["tasks"] == ["code", "math"]
    plot = client.download_artifacts(calibration.info.run_id, "plots/entropy_weights.png", str(tmp_path))
    assert Path(plot).read_bytes().startswith(b"\x89PNG")

    # The report names the run, the registered version and the alias.
    assert tracking["model_uri"] == f"models:/{MODEL}/1"
    assert (tracking["alias"], tracking["alias_version"], tracking["promoted"]) == ("champion", "1", True)
    assert tags[VERSION_TAG] == f"{MODEL}/1" and tags[DECISION_TAG] == tracking["decision"]


# The model loaded in a fresh process whose only packages are its logged requirements and what they require:
# Python started without its site (-S), so the venv and this checkout's editable install are out of reach, and
# a folder of links to just those distributions as its path.
ISOLATED_LOAD = """
import importlib.util, json, sys
assert importlib.util.find_spec("darts_dist") is None, "darts_dist is importable without the model's code"
import mlflow, pandas as pd
model = mlflow.pyfunc.load_model({uri!r})
frame = pd.DataFrame({{"prompt": {prompts!r}, "task": {tasks!r}}})
out = model.predict(frame, params={{"max_new_tokens": 10, "max_batch_size": 2}})
import darts_dist
print(json.dumps({{"records": out.to_dict(orient="records"), "code": darts_dist.__file__}}))
"""


@pytest.mark.slow
def test_the_champion_loads_with_only_its_requirements_and_generates_like_darts_dist(tracked, tmp_path: Path) -> None:
    uri = f"models:/{MODEL}@champion"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MLFLOW_TRACKING_URI", tracked.uri)
        logged = Path(mlflow.pyfunc.get_model_dependencies(uri)).read_text().split()
    assert not any(line.lower().startswith("darts-dist") for line in logged)  # no package index serves it
    assert all("==" in line and "+" not in line for line in logged)  # pinned, without local build labels (+cpu)
    env = {**os.environ, "MLFLOW_TRACKING_URI": tracked.uri,
           "PYTHONPATH": str(requirements_environment(logged, tmp_path))}
    # More rows than the engine's batch: later rows join as earlier ones finish.
    prompts, tasks = [PROMPT, "Question: 3 + 4 =", "import numpy as", "x = "], [TASK, None, TASK, None]
    script = ISOLATED_LOAD.format(uri=uri, prompts=prompts, tasks=tasks)
    result = subprocess.run([sys.executable, "-S", "-c", script], cwd=tmp_path, capture_output=True, text=True,
                            env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    loaded = json.loads(result.stdout.strip().splitlines()[-1])
    assert "/code/darts_dist/" in loaded["code"]  # the copy the model carries
    lm = CorrectedLM.load(tracked.run_dir / "merged", tracked.run_dir / "corrections.safetensors")
    own = [lm.generate([prompt], [task], max_new_tokens=10)[0] for prompt, task in zip(prompts, tasks)]
    assert loaded["records"] == [{"text": c.text, "finish_reason": c.finish_reason, "prompt_tokens": c.prompt_tokens,
                                  "completion_tokens": c.completion_tokens} for c in own]


def _evaluated_run(tracked, value: float) -> str:
    """A run whose held-out evaluation scored `value` on the decisive metric."""
    client = tracked.client
    experiment = client.get_experiment_by_name("test-tracking").experiment_id
    run_id = client.create_run(experiment, run_name=f"scored {value}").info.run_id
    client.log_metric(run_id, DECISIVE_METRIC, value)
    client.set_terminated(run_id)
    return run_id


def _champion(tracked) -> tuple[str, float]:
    holder = tracked.client.get_model_version_by_alias(MODEL, "champion")
    return holder.version, tracked.client.get_run(holder.run_id).data.metrics[DECISIVE_METRIC]


@pytest.mark.slow
def test_the_alias_moves_only_to_an_evaluation_at_least_as_good(tracked) -> None:
    client, logged = tracked.client, tracked.report["tracking"]["logged_model_uri"]
    holder, score = _champion(tracked)
    worse = register_version(client, MODEL, logged, _evaluated_run(tracked, score + 0.5), "champion")
    assert not worse.promoted and worse.alias_version == holder
    assert _champion(tracked)[0] == holder
    assert "kept 'champion'" in client.get_model_version(MODEL, worse.version).tags[DECISION_TAG]
    better = register_version(client, MODEL, logged, _evaluated_run(tracked, score - 0.5), "champion")
    assert better.promoted and _champion(tracked)[0] == better.version
    tie = register_version(client, MODEL, logged, _evaluated_run(tracked, score - 0.5), "champion")
    assert tie.promoted and _champion(tracked)[0] == tie.version  # "at least as good"


@pytest.mark.slow
def test_a_failed_registration_leaves_nothing_half_registered(tracked, monkeypatch: pytest.MonkeyPatch) -> None:
    client, logged = tracked.client, tracked.report["tracking"]["logged_model_uri"]
    holder, score = _champion(tracked)
    versions = {v.version for v in client.search_model_versions(f"name = '{MODEL}'")}

    def broken(*args, **kwargs):
        raise ConnectionError("tracking server went away")

    monkeypatch.setattr(MlflowClient, "set_registered_model_alias", broken)
    run_id = _evaluated_run(tracked, score - 1.0)  # better: registration would move the alias
    with pytest.raises(ConnectionError):
        register_version(client, MODEL, logged, run_id, "champion")
    assert {v.version for v in client.search_model_versions(f"name = '{MODEL}'")} == versions
    assert _champion(tracked)[0] == holder
    assert VERSION_TAG not in client.get_run(run_id).data.tags


@pytest.mark.slow
def test_register_command_registers_a_tracked_run_once(tracked, capsys, tmp_path: Path) -> None:
    run_dir, client = tracked.run_dir, tracked.client
    calibration = tracked.report["tracking"]["stage_runs"]["calibration"]
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MLFLOW_TRACKING_URI", tracked.uri)
        assert main(["register", str(run_dir)]) == 2
        assert "already registered" in capsys.readouterr().err
        # As if registration had never happened (e.g. the server was down): the command logs and registers it.
        client.delete_tag(calibration, VERSION_TAG)
        client.delete_tag(calibration, MODEL_URI_TAG)
        report = tmp_path / "register.json"
        assert main(["register", tracked.report["tracking"]["run_id"], "--report", str(report)]) == 0
    registered = json.loads(report.read_text())["tracking"]
    assert registered["model_uri"] == f"models:/{MODEL}/{registered['version']}"
    assert client.get_run(calibration).data.tags[VERSION_TAG] == f"{MODEL}/{registered['version']}"
    assert client.get_model_version(MODEL, registered["version"]).run_id == calibration


def test_an_unreachable_tracking_server_fails_fast(tiny_family, tmp_path: Path, capsys,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    port = free_port()  # nothing listens there once the probe socket is closed
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://darts:s3cr3t@127.0.0.1:{port}")
    config = write_config(tiny_family, tmp_path)
    started = time.monotonic()
    assert main(["calibrate", str(config), "--output-dir", str(tmp_path / "runs")]) == 2
    assert time.monotonic() - started < 15
    err = capsys.readouterr().err
    # The error names the store, its password left out.
    assert f"cannot reach the MLflow tracking store http://***@127.0.0.1:{port}" in err and "fix:" in err
    assert "s3cr3t" not in err
    assert not (tmp_path / "runs").exists()  # stopped before the merge, so before any model was loaded


def test_the_environment_wins_and_a_sqlite_store_is_local(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    embedded = os.environ["MLFLOW_TRACKING_URI"]  # the test session's sqlite file (conftest)
    assert tracking_uri("sqlite:///mlflow.db") == embedded
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    monkeypatch.chdir(tmp_path)
    assert tracking_uri("sqlite:///mlflow.db") == f"sqlite:///{tmp_path}/mlflow.db"
    with pytest.raises(DartsError, match="cannot reach"):
        connect("http://127.0.0.1:1")
    client = connect(embedded)
    experiment = client.get_experiment(experiment_id(client, embedded, "local-artifacts"))
    folder = Path(embedded.removeprefix("sqlite:///")).parent / "mlartifacts" / "local-artifacts"
    assert experiment.artifact_location == folder.as_uri()


def test_a_version_registers_in_a_sqlite_store_other_than_the_environments(tmp_path: Path) -> None:
    """A config's own sqlite store (tracking.uri) while MLFLOW_TRACKING_URI names another: MLflow's registry looks
    the logged model up through the process-wide URI, so registration must point it at the config's store."""
    uri = f"sqlite:///{tmp_path}/own.db"
    assert os.environ["MLFLOW_TRACKING_URI"] != uri
    client = connect(uri)
    experiment = experiment_id(client, uri, "own-store")
    run_id = client.create_run(experiment).info.run_id
    logged = client.create_logged_model(experiment, source_run_id=run_id)
    registration = register_version(client, "own-store-model", f"models:/{logged.model_id}", run_id, "champion")
    assert client.get_model_version("own-store-model", registration.version).run_id == run_id
