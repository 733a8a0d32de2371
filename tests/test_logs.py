"""The console of a Ray command: darts-dist's progress from every worker, Ray's own lines only with --verbose."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from darts_dist.logs import VERBOSE_ENV, own_lines

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
