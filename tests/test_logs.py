"""The console of a Ray command: darts-dist's progress from every worker, Ray's own lines only with --verbose."""

from __future__ import annotations

import io
import logging
import os
import subprocess
import sys

import pytest

from darts_dist.logs import (DATASETS_BARS_OFF, LIBRARY_BARS_OFF, PROGRESS_ENV, PROGRESS_LINE_S, VERBOSE_ENV, own_lines, progress_bar,
                             progress_interval, quiet_library_progress, show_progress_logs)

# A Ray actor that prints a line of Ray's kind and logs a darts-dist progress line, with the driver as darts-dist
# starts it; the driver waits a moment for Ray to forward both.
SCRIPT = """
import logging, time
import ray
from darts_dist.logs import init_ray, show_progress_logs

@ray.remote(num_cpus=0)
class Worker:
    def work(self):
        show_progress_logs()
        print("Execution plan of Dataset expert-code: InputDataBuffer[Input] -> ActorPoolMapOperator", flush=True)
        logging.getLogger("darts_dist.calibrate.ray.worker").info("calibrate: step 1/1, loss 0.5")
        return True

init_ray(num_cpus=1, include_dashboard=False)
assert ray.get(Worker.remote().work.remote())
time.sleep(3)
ray.shutdown()
"""


def verbose_console() -> str:
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    env[VERBOSE_ENV] = "1"
    result = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout + result.stderr


@pytest.mark.slow  # a Ray session in a child process
def test_rays_own_lines_reach_the_console_with_verbose() -> None:
    """--verbose lets Ray's own lines through beside darts-dist's progress; without it they stay out, which
    test_cli's tiny demo checks on a whole calibration's console."""
    shown = verbose_console()
    assert "darts_dist.calibrate.ray.worker: calibrate: step 1/1, loss 0.5" in shown  # progress, always
    assert "Execution plan of Dataset" in shown


def test_own_lines_are_darts_dists_loggers_lines() -> None:
    lines = ["21:43:22 darts_dist.calibrate.ray.worker: calibrate: streamed 8 rows",
             "\x1b[32m21:43:22 darts_dist: coloured",
             "Reporting training result 1: TrainingReport(...)",
             "Failed to query Ray Train Controller actor state.",
             "[2026-12-01 21:43:02,519 E 1874 1994] core_worker.cc:2465: Actor ...",
             "x 21:43:22 darts_dist.cli: not at the start"]
    assert own_lines(lines) == lines[:2]


class _Console(io.StringIO):
    def __init__(self, terminal: bool) -> None:
        super().__init__()
        self.terminal = terminal

    def isatty(self) -> bool:
        return self.terminal


def test_outside_a_terminal_a_bar_is_whole_lines_at_its_rate(monkeypatch) -> None:
    """A log file gets a bar's status as lines (its start, at most one per PROGRESS_LINE_S, its end), never the
    carriage-return redraws that make one line of thousands of characters; a terminal keeps tqdm's bar."""
    clock = iter(range(0, 10_000, 7))  # every update 7 s after the last: a line every 5th (35 s ≥ 30 s)
    monkeypatch.setattr("tqdm.std.time", lambda: float(next(clock)))
    log = _Console(terminal=False)
    monkeypatch.setattr(sys, "stderr", log)
    with progress_bar(range(20), desc="features code", unit="batch") as bar:
        for step in bar:
            bar.set_postfix(loss=f"{1 / (step + 1):.4f}")  # as the calibration loop: no line of its own
    lines = log.getvalue().splitlines()
    assert "\r" not in log.getvalue() and all(len(line) < 200 for line in lines)
    assert not any(line.startswith("features code:   0%") for line in lines)  # a bar not yet moved says nothing
    assert lines[-1].startswith("features code: 100%|") and "20/20" in lines[-1] and "loss=0.0500" in lines[-1]
    assert 2 <= len(lines) <= 1 + 20 * 7 // PROGRESS_LINE_S + 1, lines
    tty = _Console(terminal=True)
    monkeypatch.setattr(sys, "stderr", tty)
    for _ in progress_bar(range(3), desc="x", mininterval=0):
        pass
    assert "\r" in tty.getvalue()


def test_outside_a_terminal_the_libraries_bars_are_off_for_this_process_and_its_workers(monkeypatch) -> None:
    import datasets
    import huggingface_hub
    import transformers

    for name in (*LIBRARY_BARS_OFF, PROGRESS_ENV):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(sys, "stderr", _Console(terminal=True))
    transformers.utils.logging.enable_progress_bar()  # whatever an earlier command of this process set
    try:
        quiet_library_progress()
        assert os.environ[DATASETS_BARS_OFF] == "1" and not datasets.is_progress_bar_enabled()  # noise anywhere
        assert not any(name in os.environ for name in (*list(LIBRARY_BARS_OFF)[1:], PROGRESS_ENV))  # a terminal's
        assert transformers.utils.logging.is_progress_bar_enabled()
        monkeypatch.setattr(sys, "stderr", _Console(terminal=False))
        quiet_library_progress()
        assert all(os.environ[name] == value for name, value in LIBRARY_BARS_OFF.items())
        from mlflow.environment_variables import MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR

        assert MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR.get() is False  # its downloads at registration
        assert progress_interval() == PROGRESS_LINE_S  # a Ray worker's steps, at the console's rate
        assert datasets.is_progress_bar_enabled() is False
        assert not transformers.utils.logging.is_progress_bar_enabled()
    finally:
        datasets.enable_progress_bars()
        transformers.utils.logging.enable_progress_bar()
        huggingface_hub.utils.enable_progress_bars()


def test_darts_dists_lines_go_to_stderr_as_it_is_now_and_a_closed_one_leaks_nothing(monkeypatch) -> None:
    """The handler writes to sys.stderr as it is at each record: a stream closed since (a finished redirect or test
    capture) is never written to, so logging never prints its error report, whose traceback would quote the
    exception being handled (an MLflow error with the store's password in its URL) unredacted."""
    logger = logging.getLogger("darts_dist.test")
    first, second = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "stderr", first)
    show_progress_logs()
    logger.warning("to the first")
    first.close()
    monkeypatch.setattr(sys, "stderr", second)
    try:
        raise ConnectionError("API request to http://darts:s3cr3t@127.0.0.1:5000/api failed")
    except ConnectionError as error:
        logger.warning("the store at %s stopped answering (%s)", "http://darts:s3cr3t@127.0.0.1:5000", error)
    written = second.getvalue()
    assert "stopped answering" in written and "http://***@127.0.0.1:5000" in written
    assert "s3cr3t" not in written and "Logging error" not in written


# MLflow's notes on a new sqlite store and transformers' warning of the dtype's old name (which mergekit writes), as
# a command meets them, and a line of MLflow's registration as its logger writes it (the real one: the tiny demo's
# test): quiet on the console, back with --verbose; the same loggers' other lines stay.
NOTICES = """
import logging, sys
from darts_dist.logs import quiet_library_notices, show_progress_logs
show_progress_logs()
quiet_library_notices()
import mlflow, torch
from transformers import PretrainedConfig
mlflow.MlflowClient(f"sqlite:///{sys.argv[1]}/mlflow.db").search_experiments()
PretrainedConfig().torch_dtype = torch.float32
logging.getLogger("mlflow.pyfunc").info("Validating input example against model signature")
logging.getLogger("mlflow.pyfunc").warning("another pyfunc line")
"""


@pytest.mark.slow
@pytest.mark.parametrize("verbose", [False, True])
def test_library_notices_stay_off_the_console_unless_verbose(tmp_path, verbose: bool) -> None:
    env = {key: value for key, value in os.environ.items() if key not in (VERBOSE_ENV, "MLFLOW_TRACKING_URI")}
    env.update({VERBOSE_ENV: "1"} if verbose else {})
    result = subprocess.run([sys.executable, "-c", NOTICES, str(tmp_path)], capture_output=True, text=True, env=env,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    for notice in ("Creating initial MLflow database tables", "`torch_dtype` is deprecated", "Validating input example"):
        assert (notice in result.stderr) == verbose, (notice, result.stderr[-2000:])
    assert "another pyfunc line" in result.stderr
