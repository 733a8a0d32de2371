"""A calibration worker's feature store: streamed rows kept per task in memory up to a budget,
spilled to the worker's local disk beyond it, and read back memory-mapped.

Rows arrive in any order, from every expert at once, each cut to its real length. They stay that way:
in memory and on disk a task's field is one flat [tokens, ...] array (no padding to `max_length`, which
at 2048 tokens would multiply the disk a short row takes), and `arrays(task)` hands back `Ragged` views
in row-id order (so a run does not depend on the order the stream delivered them) without rewriting the
spill files. Hidden states keep the dtype they travelled in (bf16 as its raw 16 bits); a minibatch is
padded when training takes it (`Ragged.__getitem__`), then taken to the training device and upcast to fp32 there
(`TaskFeatures.rows`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch


def wire_tensor(array: np.ndarray) -> torch.Tensor:
    """An array of hidden states as they travel, as a tensor of their dtype: fp32, fp16, or bf16 (its bits as
    uint16)."""
    tensor = torch.from_numpy(np.ascontiguousarray(array))
    return tensor.view(torch.bfloat16) if tensor.dtype == torch.uint16 else tensor


def _starts(lengths: np.ndarray) -> np.ndarray:
    """Where each of rows laid end to end starts."""
    return np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)


@dataclass(frozen=True)
class Ragged:
    """N rows of different lengths as one flat [tokens, ...] array: row i is values[starts[i]:starts[i]+lengths[i]]."""

    values: np.ndarray
    starts: np.ndarray
    lengths: np.ndarray

    def __len__(self) -> int:
        return len(self.lengths)

    def row(self, i: int) -> np.ndarray:
        return self.values[self.starts[i]:self.starts[i] + self.lengths[i]]

    def padded(self) -> np.ndarray:
        """Every row right-padded with zeros to the longest: [N, L, ...] (for the small per-token fields)."""
        out = np.zeros((len(self), int(self.lengths.max(initial=0)), *self.values.shape[1:]), self.values.dtype)
        for i in range(len(self)):
            out[i, : self.lengths[i]] = self.row(i)
        return out

    def __getitem__(self, index: torch.Tensor) -> torch.Tensor:
        """The rows at `index` as one tensor in their travelled dtype, right-padded with zeros to their longest: a
        training minibatch (`TaskFeatures.rows` takes it to the device and upcasts it there)."""
        rows = [wire_tensor(self.row(int(i))) for i in index]
        dtype = rows[0].dtype if rows else torch.float32
        out = torch.zeros((len(rows), max(map(len, rows), default=0), *self.values.shape[1:]), dtype=dtype)
        for i, row in enumerate(rows):
            out[i, : len(row)] = row
        return out


class FeatureStore:
    """Per-task rows of per-token arrays ([L, ...], one first axis per row), within `budget_bytes` of memory."""

    def __init__(self, tasks: Sequence[str], max_length: int, budget_bytes: int, spill_dir: Path) -> None:
        self.max_length = max_length
        self.budget_bytes = budget_bytes
        self.spill_dir = Path(spill_dir)
        self._memory: dict[str, list[tuple[int, dict[str, np.ndarray]]]] = {task: [] for task in tasks}
        self._spilled: dict[str, list[tuple[int, int]]] = {task: [] for task in tasks}  # (row id, length), file order
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
        return sorted([row for row, _ in self._spilled[task]] + [row for row, _ in self._memory[task]])

    def arrays(self, task: str) -> dict[str, Ragged]:
        """The task's rows in row-id order, one `Ragged` per field; call once per task.

        In memory when none of its rows spilled; otherwise views of the memory-mapped spill files, read in place.
        """
        if not self._spilled[task]:
            return self._flatten_in_memory(task)
        self._spill(task)
        rows, lengths = (np.array(column, dtype=np.int64) for column in zip(*self._spilled[task]))
        starts = _starts(lengths)
        order = np.argsort(rows, kind="stable")
        out = {}
        for name, (dtype, shape) in self._fields.items():
            self._files.pop((task, name)).close()
            # Copy-on-write: writable for torch.from_numpy, while the file itself stays as written.
            values = np.memmap(self._path(task, name), dtype=dtype, mode="c", shape=(int(lengths.sum()), *shape))
            out[name] = Ragged(values, starts[order], lengths[order])
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

    def _flatten_in_memory(self, task: str) -> dict[str, Ragged]:
        rows = sorted(self._memory[task], key=lambda item: item[0], reverse=True)
        self._memory[task] = []
        lengths = np.array([len(next(iter(arrays.values()))) for _, arrays in reversed(rows)], dtype=np.int64)
        starts = _starts(lengths)
        flat = {name: np.empty((int(lengths.sum()), *shape), dtype) for name, (dtype, shape) in self._fields.items()}
        for start in starts:
            _, arrays = rows.pop()  # popped as copied, so memory holds each row once
            for name, array in arrays.items():
                flat[name][start:start + len(array)] = array
                self.memory_bytes -= array.nbytes
        return {name: Ragged(values, starts, lengths) for name, values in flat.items()}

    def _spill(self, task: str) -> None:
        for row, arrays in self._memory[task]:
            for name, array in arrays.items():
                array.tofile(self._file(task, name))
                self.spilled_bytes += array.nbytes
                self.memory_bytes -= array.nbytes
            self._spilled[task].append((row, len(next(iter(arrays.values())))))
        self._memory[task] = []

    def _file(self, task: str, name: str) -> BinaryIO:
        key = (task, name)
        if key not in self._files:
            self.spill_dir.mkdir(parents=True, exist_ok=True)
            self._files[key] = open(self._path(task, name), "ab")  # noqa: SIM115 - closed in arrays()
        return self._files[key]

    def _path(self, task: str, name: str) -> Path:
        return self.spill_dir / f"{task}.{name}.raw"
