"""A calibration worker's feature store: streamed rows kept per task in memory up to a budget,
spilled to the worker's local disk beyond it, and read back memory-mapped.

Rows arrive in any order, from every expert at once. `arrays(task)` hands a task's rows back
sorted by row id (so a run does not depend on the order the stream delivered them) and
right-padded into one array per field: the layout training indexes minibatches from.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import BinaryIO

import numpy as np


class FeatureStore:
    """Per-task rows of per-token arrays ([L, ...], one first axis per row), within `budget_bytes` of memory."""

    def __init__(self, tasks: Sequence[str], max_length: int, budget_bytes: int, spill_dir: Path) -> None:
        self.max_length = max_length
        self.budget_bytes = budget_bytes
        self.spill_dir = Path(spill_dir)
        self._memory: dict[str, list[tuple[int, dict[str, np.ndarray]]]] = {task: [] for task in tasks}
        self._spilled: dict[str, list[int]] = {task: [] for task in tasks}  # row ids, in spill-file order
        self._files: dict[tuple[str, str], BinaryIO] = {}
        self._fields: dict[str, tuple[np.dtype, tuple[int, ...]]] = {}  # dtype and per-token shape
        self.memory_bytes = 0
        self.peak_memory_bytes = 0
        self.spilled_bytes = 0

    def add(self, task: str, row: int, arrays: Mapping[str, np.ndarray]) -> None:
        """Keep a copy of one row; past the memory budget, every row held in memory goes to disk.

        A copy, because rows from Ray Data may be views into the object store, which would stay
        pinned there for as long as the store held them.
        """
        arrays = {name: np.array(array, order="C") for name, array in arrays.items()}
        self._check(task, row, arrays)
        self._memory[task].append((row, arrays))
        self.memory_bytes += sum(array.nbytes for array in arrays.values())
        self.peak_memory_bytes = max(self.peak_memory_bytes, self.memory_bytes)
        if self.memory_bytes > self.budget_bytes:
            for name in self._memory:
                self._spill(name)

    def row_ids(self, task: str) -> list[int]:
        """The ids of the task's rows held, sorted."""
        return sorted(self._spilled[task] + [row for row, _ in self._memory[task]])

    def arrays(self, task: str) -> dict[str, np.ndarray]:
        """The task's rows sorted by row id, one [N, L, ...] array per field; call once per task.

        In memory (padded to the task's longest row) when none of its rows spilled; otherwise
        memory-mapped .npy files (padded to max_length) on the spill disk.
        """
        if not self._spilled[task]:
            return self._stack_in_memory(task)
        self._spill(task)
        order = np.argsort(self._spilled[task], kind="stable")
        count = len(order)
        out = {}
        for name, (dtype, shape) in self._fields.items():
            self._files.pop((task, name)).close()
            raw_path = self._raw_path(task, name)
            raw = np.memmap(raw_path, dtype=dtype, mode="r", shape=(count, self.max_length, *shape))
            path = self.spill_dir / f"{task}.{name}.npy"
            final = np.lib.format.open_memmap(path, mode="w+", dtype=dtype, shape=raw.shape)
            for target, source in enumerate(order):  # row by row: sorting never loads the task whole
                final[target] = raw[source]
            final.flush()
            del final, raw
            raw_path.unlink()
            # Copy-on-write: writable for torch.from_numpy, while the file itself stays as written.
            out[name] = np.load(path, mmap_mode="c")
        self._spilled[task] = []
        return out

    def _check(self, task: str, row: int, arrays: Mapping[str, np.ndarray]) -> None:
        if task not in self._memory:
            raise ValueError(f"row {row} is of task {task!r}, which this store does not hold: {list(self._memory)}")
        lengths = {len(array) for array in arrays.values()}
        if len(lengths) != 1 or max(lengths) > self.max_length:
            raise ValueError(f"row {row} of {task!r}: fields must share a length <= {self.max_length}, got {lengths}")
        fields = {name: (array.dtype, array.shape[1:]) for name, array in arrays.items()}
        if not self._fields:
            self._fields = fields
        elif fields != self._fields:
            raise ValueError(f"row {row} of {task!r} has fields {fields}, earlier rows had {self._fields}")

    def _stack_in_memory(self, task: str) -> dict[str, np.ndarray]:
        rows = sorted(self._memory[task], key=lambda item: item[0], reverse=True)
        self._memory[task] = []
        length = max((len(next(iter(arrays.values()))) for _, arrays in rows), default=0)
        out = {name: np.zeros((len(rows), length, *shape), dtype) for name, (dtype, shape) in self._fields.items()}
        for index in range(len(rows)):
            _, arrays = rows.pop()  # popped as copied, so memory holds each row once
            for name, array in arrays.items():
                out[name][index, : len(array)] = array
                self.memory_bytes -= array.nbytes
        return out

    def _spill(self, task: str) -> None:
        for row, arrays in self._memory[task]:
            for name, array in arrays.items():
                padded = np.zeros((self.max_length, *array.shape[1:]), array.dtype)
                padded[: len(array)] = array
                padded.tofile(self._file(task, name))
                self.spilled_bytes += padded.nbytes
                self.memory_bytes -= array.nbytes
            self._spilled[task].append(row)
        self._memory[task] = []

    def _file(self, task: str, name: str) -> BinaryIO:
        key = (task, name)
        if key not in self._files:
            self.spill_dir.mkdir(parents=True, exist_ok=True)
            self._files[key] = open(self._raw_path(task, name), "ab")  # noqa: SIM115 - closed in arrays()
        return self._files[key]

    def _raw_path(self, task: str, name: str) -> Path:
        return self.spill_dir / f"{task}.{name}.raw"
