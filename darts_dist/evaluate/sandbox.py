"""Running untrusted code (model-written solutions and their tests) in an isolated, limited Python process."""

from __future__ import annotations

import os
import resource
import secrets
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class SandboxResult:
    passed: bool
    status: str  # "passed", "failed: <last line of stderr>" or "timed out"


# A check program may use this much memory and write files this large (bytes) in its sandbox.
SANDBOX_MEMORY = 2 << 30
SANDBOX_FILE_SIZE = 16 << 20


def _sandbox_limits(timeout: float) -> Callable[[], None]:
    def apply() -> None:  # runs in the child, between fork and exec
        cpu = int(timeout) + 1
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))  # a busy loop dies even if the parent's timer fails
        resource.setrlimit(resource.RLIMIT_AS, (SANDBOX_MEMORY, SANDBOX_MEMORY))
        resource.setrlimit(resource.RLIMIT_FSIZE, (SANDBOX_FILE_SIZE, SANDBOX_FILE_SIZE))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    return apply


def run_sandboxed(program: str, timeout: float) -> SandboxResult:
    """Run untrusted Python in a separate `python -I` process: a fresh temporary working folder, no
    environment, no stdin, CPU / memory / file-size limits and a wall-clock timeout that kills its
    whole process group. It passes when it runs to its end: a random marker printed after the program
    must come out, so code that exits early with status 0 (`sys.exit(0)` before the tests) fails."""
    marker = f"darts-sandbox-done-{secrets.token_hex(8)}"
    with tempfile.TemporaryDirectory(prefix="darts-sandbox-") as folder:
        script = Path(folder) / "check.py"
        script.write_text(f"{program}\n\nprint({marker!r})\n", encoding="utf-8")
        process = subprocess.Popen(
            [sys.executable, "-I", "-B", script.name],
            cwd=folder,
            env={},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            preexec_fn=_sandbox_limits(timeout),
            start_new_session=True,  # its own process group, so children it starts die with it
        )
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
            return SandboxResult(False, "timed out")
    if process.returncode == 0 and marker.encode() in stdout:
        return SandboxResult(True, "passed")
    if process.returncode == 0:
        return SandboxResult(False, "failed: exited before its end")
    lines = stderr.decode("utf-8", "replace").strip().splitlines()
    return SandboxResult(False, f"failed: {lines[-1] if lines else f'exit status {process.returncode}'}")
