"""The `darts-dist` command line: the tiny demo end to end, and bad input refused cleanly."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from test_ablation import router_accuracy_by_hand
from tiny_configs import family_config

from darts_dist.cli import main
from darts_dist.core import read_header
from darts_dist.serve.model import resolve_model
from mlflow import MlflowClient

SUBCOMMANDS = ("demo", "merge", "calibrate", "evaluate", "validate")


def run_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "darts_dist.cli", *args], cwd=cwd, capture_output=True, text=True, env=os.environ.copy(),
        timeout=600,
    )


def test_help_lists_the_subcommands(tmp_path: Path) -> None:
    result = run_cli("--help", cwd=tmp_path)
    assert result.returncode == 0
    for name in SUBCOMMANDS:
        assert name in result.stdout


@pytest.mark.slow
def test_tiny_demo_runs_end_to_end(tmp_path: Path) -> None:
    report_path = tmp_path / "report.json"
    result = run_cli("demo", "--tiny", "--steps", "30", "--report", str(report_path), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "held-out, merged vs. DARTS" in result.stdout and "overall" in result.stdout
    report = json.loads(report_path.read_text())
    run_dir = tmp_path / "runs" / "tiny"
    assert report["corrections"] == str(run_dir / "corrections.safetensors")
    assert read_header(run_dir / "corrections.safetensors")["spec"]["tasks"] == ["code", "math", "instruct"]
    assert (run_dir / "merged" / "model.safetensors").is_file()
    assert report["calibration"]["steps"] == 30
    assert report["calibration"]["executor"] == "ray"  # the demo calibrates on a local Ray cluster
    assert report["calibration"]["job"]["stream"]["rows"] == 3 * 32  # every calibration row, once
    assert report["calibration"]["final_loss"] < report["calibration"]["first_loss"]
    darts = report["variants"]["darts"]
    assert set(darts["tasks"]) == {"code", "math", "instruct"}
    for task in darts["tasks"].values():
        assert task["bias_after"] < task["bias_before"]
        # The router the calibration fit answers the same problems: the routed model's score beside the oracle's.
        assert 0.0 <= task["score_routed"] <= 1.0 and "score_corrected" in task
        # Every score with its interval, corrected against merged on the same problems, and the base's score.
        for model in ("base", "expert", "merged", "corrected", "routed"):
            low, high = task[f"score_{model}_ci"]
            assert low <= task[f"score_{model}"] <= high
        assert task["score_wins"] + task["score_losses"] <= task["score_n"] and 0 < task["score_pvalue"] <= 1
    assert darts["overall"]["bias_reduction"] > 0.1
    # The router the run fit says its own held-out accuracy: recomputed by hand from its file and the merge.
    accuracy, per_task = router_accuracy_by_hand(report, str(run_dir / "merged"))
    assert report["router"]["accuracy"] == pytest.approx(accuracy) and report["router"]["per_task"] == pytest.approx(per_task)
    assert set(report["plots"]) >= {"loss", "entropy_weights", "bias_by_position", "task_scores"}
    for plot in report["plots"].values():
        assert Path(plot).read_bytes().startswith(b"\x89PNG")
    # Where the time went, stage by stage, on stdout and in the report.
    assert set(report["seconds"]) == {"sources", "merge", "calibration", "router", "evaluation", "registration"}
    # What the driver held, stage by stage (the head node's share of the run).
    assert set(report["driver_memory"]) == set(report["seconds"]) - {"sources"}
    assert all(v >= 0 for v in report["driver_memory"].values()) and report["driver_memory"]["merge"] > 0
    assert "time per stage: sources" in result.stdout
    assert str(report_path) in result.stdout  # says where it wrote
    # stdout is the results; darts-dist's messages are log lines on stderr, the Ray workers' included.
    assert "mlflow: run" in result.stderr and "darts_dist.calibrate.ray.worker: calibrate: step" in result.stderr
    assert "mlflow: run" not in result.stdout and "calibrate: " not in result.stdout
    # Ray's own lines stay in Ray's log files (without --verbose): no Ray Data plans, Ray Train reports or warnings.
    for ray_line in ("Execution plan of Dataset", "Reporting training result", "PlacementGroupCleaner",
                     "Started a local Ray instance", "TrainController", "PYTHON worker processes have been started"):
        assert ray_line not in result.stderr, ray_line
    # A log file's console (stderr is a pipe here): whole lines, no bar redraws, no library's own bars.
    assert "\r" not in result.stderr and max(map(len, result.stderr.splitlines())) <= 300
    assert "Generating train split" not in result.stderr and "Loading weights" not in result.stderr
    # Nor the libraries' notices to their own authors (MLflow's new tables, the dtype's old name mergekit writes).
    for notice in ("Creating initial MLflow database tables", "Validating input example", "`torch_dtype` is deprecated"):
        assert notice not in result.stderr, notice
    # The run folder is complete without its report (written elsewhere here): it serves as it is.
    source, run_config = resolve_model(str(run_dir))
    assert (source.files.merged_dir, source.files.corrections, source.files.router) == (
        run_dir / "merged", run_dir / "corrections.safetensors", run_dir / "router.safetensors")
    assert run_config.name == "tiny"
    # The command's own MLflow run carries the headline numbers, so runs can be sorted and compared by them.
    metrics = MlflowClient(report["tracking"]["uri"]).get_run(report["tracking"]["run_id"]).data.metrics
    assert metrics["eval.overall.bias_reduction"] == pytest.approx(darts["overall"]["bias_reduction"])
    assert metrics["eval.overall.nll_corrected"] == pytest.approx(darts["overall"]["nll_corrected"])
    # Retention: every model on the general instructions (the base's own replies), the routed model's as served,
    # in the report, on the console and in MLflow.
    assert set(darts["retention"]) == {"base", "experts", "merged", "corrected"}
    assert darts["retention"]["base"]["agreement"] == 1.0
    assert metrics["eval.overall.retention_nll_corrected"] == pytest.approx(darts["retention"]["corrected"]["nll"])
    assert "retention (40 general instructions" in result.stdout
    # The registered version leaves darts-dist as a Hugging Face folder whose card shows the run's held-out table.
    out = tmp_path / "exported"
    assert main(["export", "models:/darts-dist-tiny@champion", "--tracking-uri", report["tracking"]["uri"],
                 "--out", str(out)]) == 0
    card = (out / "README.md").read_text()
    assert "base_model: tiny:base" in card and "- darts" in card and "merge_method: task_arithmetic" in card
    assert f"| overall | {darts['overall']['bias_before']:.4f} |" in card
    assert json.loads((out / "config.json").read_text())["darts"]["tasks"] == ["code", "math", "instruct"]


@pytest.mark.parametrize("flags, expected", [
    (["--steps", "0"], "--steps (calibration.steps): Input should be greater than 0"),
    (["--steps", "many"], "--steps (calibration.steps): Input should be a valid integer"),
    (["--score-limit", "-3"], "--score-limit (evaluation.score_limit): Input should be greater than or equal to 0"),
    (["--score-limit", "some"], "--score-limit (evaluation.score_limit): Input should be a valid integer"),
])
def test_a_bad_flag_is_refused_like_a_bad_key(flags: list[str], expected: str, tmp_path: Path, capsys) -> None:
    """Flags are config updates validated by the config's own models: error, fix, exit 2, before any work."""
    code = main(["demo", "--tiny", "--in-process", "--output-dir", str(tmp_path / "out"), *flags])
    err = capsys.readouterr().err
    assert code == 2 and expected in err and "fix:" in err, err
    assert not (tmp_path / "out").exists()


@pytest.fixture
def user_config(tiny_family, tmp_path: Path):
    """A darts-dist config over the tiny family with local data files, and a writer for variants."""
    config = family_config(tiny_family, tmp_path, "user", lambda task, i: f"def f_{task}_{i}(x):\n    return x + {i}\n",
                           12, heldout=False,
                           calibration={"rank": 4, "max_positions": 16, "num_samples": 8, "max_length": 16, "steps": 3})

    def write(patch=None) -> Path:
        path = tmp_path / "run.yaml"
        path.write_text(yaml.safe_dump(patch(config) if patch else config))
        return path

    return write


def _fails_cleanly(config_path: Path, tmp_path: Path, capsys, *expected: str) -> None:
    out = tmp_path / "out"
    code = main(["calibrate", str(config_path), "--output-dir", str(out)])
    err = capsys.readouterr().err
    assert code == 2
    for text in expected:
        assert text in err, err
    assert "fix:" in err
    # Nothing half-written: no run folder, no temp siblings.
    assert not (out / "user").exists()
    assert not out.exists() or not any(out.iterdir())


@pytest.mark.slow
def test_calibrate_with_a_user_config_writes_corrections(user_config, tmp_path: Path, capsys) -> None:
    out = tmp_path / "out"
    assert main(["calibrate", str(user_config()), "--output-dir", str(out), "--in-process"]) == 0
    assert (out / "user" / "corrections.safetensors").is_file()
    assert str(out / "user" / "corrections.safetensors") in capsys.readouterr().out
    assert json.loads((out / "user" / "calibration.json").read_text())["calibration"]["executor"] == "in-process"


def test_a_vocabulary_below_the_bases_is_refused_before_loading(user_config, tiny_family, tmp_path: Path,
                                                                capsys) -> None:
    other = tmp_path / "other_vocab"
    shutil.copytree(tiny_family.experts["math"], other)
    config = json.loads((other / "config.json").read_text())
    config["vocab_size"] -= 7
    (other / "config.json").write_text(json.dumps(config))
    (other / "model.safetensors").write_bytes(b"not loaded: the check reads config.json only")

    def patch(c):
        c["sources"]["experts"][1]["path"] = str(other)
        return c

    _fails_cleanly(user_config(patch), tmp_path, capsys, "vocab", "math")


def test_missing_model_path(user_config, tmp_path: Path, capsys) -> None:
    def patch(c):
        c["sources"]["experts"][0]["path"] = "/nonexistent/expert"
        return c

    _fails_cleanly(user_config(patch), tmp_path, capsys, "/nonexistent/expert")


def test_unknown_merge_method(user_config, tmp_path: Path, capsys) -> None:
    def patch(c):
        c["merge"]["method"] = "average_vibes"
        return c

    _fails_cleanly(user_config(patch), tmp_path, capsys, "average_vibes", "task_arithmetic")


def test_bad_yaml_key(user_config, tmp_path: Path, capsys) -> None:
    def patch(c):
        c["calibration"]["lerning_rate"] = 0.1
        return c

    _fails_cleanly(user_config(patch), tmp_path, capsys, "calibration.lerning_rate", "unknown key")


def test_empty_calibration_file(user_config, tmp_path: Path, capsys) -> None:
    path = user_config()
    (tmp_path / "data" / "math.jsonl").write_text("")
    _fails_cleanly(path, tmp_path, capsys, "math.jsonl", "empty")


def test_evaluate_without_corrections_says_what_to_run(user_config, tmp_path: Path, capsys) -> None:
    assert main(["evaluate", str(user_config()), "--output-dir", str(tmp_path / "out")]) == 2
    assert "darts-dist calibrate" in capsys.readouterr().err


def test_merge_accepts_a_mergekit_yaml(tiny_family, tmp_path: Path, capsys) -> None:
    mergekit_yaml = tmp_path / "mk.yml"
    mergekit_yaml.write_text(yaml.safe_dump({
        "merge_method": "ties",
        "base_model": str(tiny_family.base),
        "models": [{"model": str(tiny_family.experts[t]), "parameters": {"weight": 0.5, "density": 0.5}}
                   for t in ("code", "math")],
        "dtype": "float32",
    }))
    out = tmp_path / "merged"
    assert main(["merge", str(mergekit_yaml), "--out", str(out)]) == 0
    assert (out / "model.safetensors").is_file() and str(out) in capsys.readouterr().out
    assert main(["merge", str(mergekit_yaml), "--out", str(out)]) == 2  # never overwritten silently
    assert "--overwrite" in capsys.readouterr().err


def test_make_experts_that_fails_writes_nothing(tiny_family, tmp_path: Path, capsys, monkeypatch) -> None:
    """`demo --make-experts` trains on the bundled base's top 8 layers: on a 4-layer base it says so, exits 2, and
    leaves the output folder as it was (the making itself is test_experts')."""
    from darts_dist.sources import references

    monkeypatch.setattr(references, "bundled_model_dir", lambda: tiny_family.base)
    out = tmp_path / "experts"
    assert main(["demo", "--make-experts", "--experts-out", str(out)]) == 2
    assert "top_layers=8 is outside 1..4" in capsys.readouterr().err
    assert not out.exists() and not list(tmp_path.iterdir())
