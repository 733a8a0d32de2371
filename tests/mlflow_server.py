"""A real `mlflow server` (mlflow/server.sh) on a loopback port, for the tests that need one."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from serving import free_port

__all__ = ["free_port", "mlflow_server", "stop"]
REPO = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def mlflow_server(data: Path, port: int) -> Iterator[subprocess.Popen]:
    """The server with its store in `data`, answering on http://127.0.0.1:PORT; stopped (hard) on exit,
    or earlier by the caller with `stop(process)`."""
    env = {**os.environ, "DARTS_MLFLOW_DATA": str(data), "DARTS_MLFLOW_PORT": str(port), "DARTS_MLFLOW_WORKERS": "1"}
    log = (data / "server.log").open("a")
    # A session of its own, so the server's worker processes are stopped with it.
    process = subprocess.Popen(["bash", str(REPO / "mlflow" / "server.sh")], env=env, stdout=log,
                               stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None, (data / "server.log").read_text()[-2000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "mlflow server did not come up in 120 s"
            time.sleep(0.3)
        yield process
    finally:
        stop(process)
        log.close()


def stop(process: subprocess.Popen) -> None:
    """Stop the server and its workers at once, as a crash would (the data is throwaway)."""
    if process.poll() is not None:
        return
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=3)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
