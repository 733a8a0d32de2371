"""How a calibration job's models share a CPU node: all at once, or in turns.

On a GPU cluster each expert actor and training worker has a GPU of its own and nothing here applies. On a
CPU node they all run forward passes of models of the same size. Two ways to share the cores:
**concurrent**, every actor at once with its share of the cores (the experts niced below the workers, which
drain the stream), or **turns**, one model forward at a time on the node, each with every core (the regime of
the bare forward-pass floor). Concurrent is the default because turns were no faster (docs/cluster.md, "How
the models share a CPU node"): a forward spread over every core stalls whenever Ray's own processes take one
of them (its threads wait for each other), where one-thread actors just slow down. `turns` stays for nodes
where one forward at a time matters for other reasons (memory: only one model's activations at once).

Imports stay light (no torch at the top): the stream's Ray Data actors import this module.
"""

from __future__ import annotations

import fcntl
import getpass
import math
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from darts_dist.config import CpuSchedule


def node_cores() -> int:
    """The cores this process may run on (its affinity, which containers and taskset narrow)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@dataclass(frozen=True)
class CpuShare:
    """One model-running actor's share of its CPU node."""

    turns: bool  # forwards take turns node-wide (ForwardTurn), each with all the cores
    threads: int  # torch threads for its forwards and steps


def cpu_share(schedule: CpuSchedule, actors_per_node: int, cores: int) -> CpuShare:
    """Turns: each forward with every core; concurrent: each actor with its share of the cores, at least one."""
    turns = schedule == "turns"
    return CpuShare(turns=turns, threads=cores if turns else max(1, cores // actors_per_node))


def per_node(actors: int, num_nodes: int) -> int:
    """The actors a node holds when they spread evenly over the nodes."""
    return math.ceil(actors / max(1, num_nodes))


def training_threads(workers_on_node: int, cores: int) -> int:
    """A training worker's torch threads once the stream has ended: the experts are done, so the node's
    cores go to its workers (Ray Train's local world size)."""
    return max(1, cores // workers_on_node)


class ForwardTurn:
    """One model forward at a time on this machine: an exclusive lock (flock) on a file in the temp folder,
    shared by every process of this user (the kernel hands it to one waiter at a time). The kernel releases it
    when its holder dies: a lost actor never leaves the node locked. Disabled, it does nothing."""

    def __init__(self, enabled: bool, path: Path | None = None) -> None:
        self.enabled = enabled
        self.path = path or Path(tempfile.gettempdir()) / f"darts-dist-forward-turn-{getpass.getuser()}.lock"
        self._fd: int | None = None

    def __enter__(self) -> ForwardTurn:
        if self.enabled:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
            except BaseException:  # interrupted while waiting: nothing held, nothing left open
                os.close(fd)
                raise
            self._fd = fd
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def take_share(share: CpuShare) -> ForwardTurn:
    """Set this process's torch threads to its share; the turn its forwards take."""
    import torch

    torch.set_num_threads(share.threads)
    return ForwardTurn(share.turns)

