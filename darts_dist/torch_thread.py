"""One thread for all of a process's torch work: its model's load, its thread count and its forwards.

libgomp (torch's OpenMP on CPUs) gives each thread that starts a parallel region a team of threads of its own (and
`set_num_threads` sets the count of the calling thread's team only); once a process holds more team threads than it
has cores, every team's threads sleep between parallel regions instead of spinning. A model loaded on one thread
and run on another then runs at about one core's speed, whatever its thread count: a serving replica decoded at
0.55x the model's own rate on 2 cores (benchmarks/serve_decode.py). Ray runs an actor's constructor and its calls
on different threads (Ray Data's map workers call from a pool), and a server's engine steps on a thread of its own:
both put their torch work here.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")


class TorchThread:
    """A thread that runs the work handed to it, one piece after another."""

    def __init__(self, name: str) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=name)

    def run(self, work: Callable[..., T], *args: object) -> T:
        """`work(*args)` on this thread; its exception is raised here."""
        return self.start(work, *args).result()

    def start(self, work: Callable[..., T], *args: object) -> Future[T]:
        """`work(*args)` on this thread, after what was handed to it before; its future."""
        return self._pool.submit(work, *args)

    def close(self) -> None:
        """Wait for the work handed to it, then end the thread."""
        self._pool.shutdown(wait=True)
