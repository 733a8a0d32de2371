"""`darts-dist serve` in a process of its own, for the tests that serve: a free port, start-and-wait, and the
processes it started (to check that stopping it leaves none)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import psutil


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def serve_process(args: list[str], cwd: Path, port: int, env: dict[str, str] | None = None,
                  timeout_s: float = 240) -> Iterator[subprocess.Popen]:
    """`darts-dist serve ARGS --port PORT` with a Ray cluster of its own, logging to CWD/serve.log, yielded once
    /healthz answers; killed with everything in its session at the end unless a test stopped it first."""
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", **(env or {})}
    env.pop("RAY_ADDRESS", None)
    log_path = cwd / "serve.log"
    with log_path.open("w") as log:
        # A session of its own: the test's Ctrl-C is not the server's, and a leftover group can be killed whole.
        process = subprocess.Popen([sys.executable, "-m", "darts_dist.cli", "serve", *args, "--port", str(port)],
                                   cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_until_up(process, f"http://127.0.0.1:{port}/healthz", log_path, timeout_s)
        yield process
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def wait_until_up(process: subprocess.Popen, url: str, log_path: Path, timeout_s: float) -> None:
    """Return once `url` answers 200; fail (with the log's tail) if `process` exits or `timeout_s` passes first."""
    deadline = time.monotonic() + timeout_s
    while True:
        assert process.poll() is None, log_path.read_text()[-4000:]
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        assert time.monotonic() < deadline, f"{url} did not answer in {timeout_s:.0f} s:\n" + \
            log_path.read_text()[-4000:]
        time.sleep(0.3)


def started_processes(process: subprocess.Popen) -> list[psutil.Process]:
    """Every process the server started that runs now (Ray's daemons and workers among them)."""
    return psutil.Process(process.pid).children(recursive=True)


def still_running(processes: list[psutil.Process]) -> list[str]:
    """Those of `processes` still running (zombies count as gone), by command line."""
    alive = []
    for child in processes:
        with contextlib.suppress(psutil.Error):
            if child.is_running() and child.status() != psutil.STATUS_ZOMBIE:
                alive.append(" ".join(child.cmdline())[:120])
    return alive


def stops_cleanly(process: subprocess.Popen, sig: int, within_s: float) -> tuple[float, list[str]]:
    """Send `sig`; the seconds until the server exited (asserting it did, with status 0, within `within_s`) and
    what it had started that still runs 5 s later."""
    started = started_processes(process)
    sent = time.monotonic()
    process.send_signal(sig)
    assert process.wait(timeout=within_s) == 0
    took = time.monotonic() - sent
    deadline = time.monotonic() + 5
    while still_running(started) and time.monotonic() < deadline:
        time.sleep(0.2)
    return took, still_running(started)
