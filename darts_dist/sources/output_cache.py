"""What an unchanged model computes, kept: evaluation's held-out passes, greedy answers and the router's
prompt features of the base, the experts and the merge, read back by a repeat run instead of recomputed.

A model is named by `model_identity`: its weights' content hash with the device type, dtype and library
versions it ran under; an entry's key adds everything else its result depends on (token ids, layer, batch
size, generation settings). So a retrained expert, another merge, a changed held-out file or another
torch misses, and only what depends on nothing that changed is reused. Corrected outputs are never cached:
they change with every calibration. Tensors are stored as safetensors (safe to load), answers as JSON, both
written under a temporary name and renamed; an entry that cannot be read is computed again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from darts_dist.fsutil import atomic_file, cache_root

LOG = logging.getLogger(__name__)
T = TypeVar("T")


def digest(*parts: object) -> str:
    """A sha256 over JSON-able parts and tensors (dtype, shape and bytes)."""
    hasher = hashlib.sha256()
    for part in parts:
        if isinstance(part, torch.Tensor):
            tensor = part.detach().cpu().contiguous()
            hasher.update(f"{tensor.dtype}{list(tensor.shape)}".encode())
            hasher.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
        else:
            hasher.update(json.dumps(part, sort_keys=True, default=str).encode())
        hasher.update(b"\0")
    return hasher.hexdigest()


class OutputCache:
    """Entries under `folder` (default: the cache folder's `outputs/`), with hit and miss counts."""

    def __init__(self, folder: Path | None = None) -> None:
        self.folder = Path(folder) if folder is not None else cache_root() / "outputs"
        self.hits = 0
        self.misses = 0

    def counts(self) -> dict[str, int]:
        return {"hits": self.hits, "misses": self.misses}

    def tensors(self, key: str, compute: Callable[[], dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """The tensors stored under `key`, else `compute()`'s, stored."""
        path = self.folder / "tensors" / f"{key}.safetensors"
        if path.is_file():
            try:
                stored = load_file(path)
                self.hits += 1
                return stored
            except (OSError, SafetensorError) as exc:
                LOG.warning("cached outputs %s unreadable (%s): computing them again", path, exc)
        self.misses += 1
        value = compute()
        with contextlib.suppress(OSError), atomic_file(path) as tmp:  # a full disk only costs the next run
            save_file({name: t.detach().cpu().contiguous() for name, t in value.items()}, str(tmp))
        return value

    def records(self, key: str, compute: Callable[[], list[T]], kind: type[T], device: torch.device) -> list[T]:
        """A list of dataclasses of tensors (one per batch) stored under `key`, on `device`."""
        names = [f.name for f in dataclasses.fields(kind)]

        def flat() -> dict[str, torch.Tensor]:
            return {f"{i}.{name}": getattr(item, name) for i, item in enumerate(compute()) for name in names}

        stored = self.tensors(key, flat)
        count = len({name.split(".", 1)[0] for name in stored})
        return [kind(**{name: stored[f"{i}.{name}"].to(device) for name in names}) for i in range(count)]

    def entries(self, key: str, items: Sequence[str], compute: Callable[[list[int]], list[Any]]) -> list[Any]:
        """One JSON value per item (an item is its own digest, e.g. a problem's): the stored ones, and
        `compute(indices)` for the items not stored yet, which are then stored beside them."""
        path = self.folder / "entries" / f"{key}.json"
        stored: dict[str, Any] = {}
        if path.is_file():
            try:
                stored = json.loads(path.read_text())
            except (OSError, ValueError) as exc:
                LOG.warning("cached entries %s unreadable (%s): computing them again", path, exc)
        missing = [i for i, item in enumerate(items) if item not in stored]
        self.hits += len(items) > len(missing)
        self.misses += bool(missing)
        if missing:
            stored |= dict(zip((items[i] for i in missing), compute(missing), strict=True))
            with contextlib.suppress(OSError), atomic_file(path) as tmp:
                tmp.write_text(json.dumps(stored))
        return [stored[item] for item in items]
