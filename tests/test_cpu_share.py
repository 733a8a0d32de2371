"""How a calibration job's models share a CPU node: the rule, and turns that really exclude each other."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from pathlib import Path

import pytest
from pydantic import ValidationError

from darts_dist.config import ClusterSection
from darts_dist.ray_cluster.cpu_share import CpuShare, ForwardTurn, cpu_share, per_node, training_threads


def test_the_rule_shares_the_cores_and_takes_turns_only_when_asked():
    # 3 experts + 1 worker on this 2-core kind of machine: all at once, a thread each (measured faster than turns).
    assert cpu_share("concurrent", per_node(3 + 1, 1), 2) == CpuShare(turns=False, threads=1)
    # The same job on a 64-core node: 16 cores each.
    assert cpu_share("concurrent", per_node(3 + 1, 1), 64) == CpuShare(turns=False, threads=16)
    # Spread over 4 nodes of 1 core each: one actor per node, nothing to share.
    assert per_node(3 + 1, 4) == 1
    assert cpu_share("concurrent", 1, 1) == CpuShare(turns=False, threads=1)
    # Turns, asked for: every forward gets every core.
    assert cpu_share("turns", 4, 2) == CpuShare(turns=True, threads=2)
    # Once the stream has ended the workers get the node: one worker, every core; two on 2 cores, one each.
    assert training_threads(1, 2) == 2 and training_threads(2, 2) == 1


def _hold(path: str, seconds: float, record: multiprocessing.Queue, start: multiprocessing.Barrier) -> None:
    start.wait(60)  # all three ask for the turn at once, however slowly they started
    with ForwardTurn(True, Path(path)):
        record.put(("in", time.monotonic()))
        time.sleep(seconds)
        record.put(("out", time.monotonic()))


def test_turns_exclude_each_other_across_processes(tmp_path):
    spawn = multiprocessing.get_context("spawn")
    record = spawn.Queue()
    lock = str(tmp_path / "turn.lock")
    start = spawn.Barrier(3)
    processes = [spawn.Process(target=_hold, args=(lock, 0.3, record, start)) for _ in range(3)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(60)
        assert process.exitcode == 0
    events = sorted((record.get(timeout=5) for _ in range(6)), key=lambda event: event[1])
    # Strictly alternating: nobody entered while another held the turn.
    assert [kind for kind, _ in events] == ["in", "out"] * 3


def test_a_disabled_turn_excludes_nobody(tmp_path):
    lock = tmp_path / "turn.lock"
    with ForwardTurn(False, lock), ForwardTurn(False, lock):
        pass  # the second would block forever if the first held the lock
    assert not lock.exists()


def _hold_forever(path: str, ready: multiprocessing.Event) -> None:
    with ForwardTurn(True, Path(path)):
        ready.set()
        time.sleep(600)


def test_a_killed_holder_frees_the_turn(tmp_path):
    spawn = multiprocessing.get_context("spawn")
    ready = spawn.Event()
    lock = str(tmp_path / "turn.lock")
    holder = spawn.Process(target=_hold_forever, args=(lock, ready))
    holder.start()
    assert ready.wait(60)
    os.kill(holder.pid, signal.SIGKILL)  # as a lost actor dies
    holder.join(10)
    started = time.monotonic()
    with ForwardTurn(True, Path(lock)):
        assert time.monotonic() - started < 5


@pytest.mark.parametrize("schedule", ["sometimes", "", None])
def test_a_bad_cpu_schedule_is_refused(schedule):
    with pytest.raises(ValidationError, match="cpu_schedule"):
        ClusterSection(cpu_schedule=schedule)
