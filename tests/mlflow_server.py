"""A real `mlflow server` (mlflow/server.sh) on a loopback port, for the tests that need one."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

from serving import free_port, wait_until_up

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
        wait_until_up(process, f"http://127.0.0.1:{port}/health", data / "server.log", 120)
        yield process
    finally:
        stop(process)
        log.close()


def stop(process: subprocess.Popen, sig: int = signal.SIGTERM, grace_s: float = 3.0) -> None:
    """Send `sig` to the process's group (by default: stop the server and its workers at once, as a crash would,
    the data being throwaway), and SIGKILL what is left after `grace_s`."""
    try:
        os.killpg(process.pid, sig)  # the whole group, also where its leader has exited and children are left
    except ProcessLookupError:  # nothing of the group is left
        process.wait()
        return
    try:
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
