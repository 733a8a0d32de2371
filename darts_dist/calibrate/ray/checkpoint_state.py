"""What a calibration checkpoint restores: the steps done and their losses (rank 0's `progress.json`), once the
checkpoint is found as its ranks wrote it.

A resume hands the checkpoint's DeepSpeed files to `torch.load(weights_only=False)` (DeepSpeed's own loader, which
unpickles), so whoever can change a checkpoint folder on the shared storage could run code in the workers. Each rank
writes, with its files, a manifest of their SHA-256 hashes; a resume (and a finished run read back) first checks the
folder against the manifests and refuses a changed, missing or added file. This catches a checkpoint changed in
place; it is no signature: whoever can rewrite a manifest too is trusted (docs/security.md).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import ray.train

from darts_dist.errors import DartsError

PROGRESS_FILE = "progress.json"  # step, losses, timings (rank 0)
MANIFEST_PREFIX = "manifest-rank"  # manifest-rank<r>.json: {relative path: sha256} of the files rank r wrote
_CHUNK = 1 << 20


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while chunk := file.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _files(folder: Path) -> dict[str, Path]:
    """The checkpoint's files by relative path; manifests and hidden files (Ray's own metadata, which it may add
    after the ranks wrote theirs; nothing of darts-dist's or DeepSpeed's loads one) left out."""
    return {path.relative_to(folder).as_posix(): path for path in sorted(folder.rglob("*"))
            if path.is_file() and not path.name.startswith((MANIFEST_PREFIX, "."))}


def write_manifest(folder: Path, rank: int) -> None:
    """Rank `rank`'s manifest of the files it wrote into `folder` (its part of the checkpoint)."""
    hashes = {name: _sha256(path) for name, path in _files(folder).items()}
    (folder / f"{MANIFEST_PREFIX}{rank}.json").write_text(json.dumps(hashes, indent=0))


def verify_manifest(folder: Path) -> None:
    """Refuse a checkpoint folder whose files are not those its ranks' manifests list (each file equal to what some
    rank wrote under its name: ranks may write the same file)."""
    folder = Path(folder)
    expected: dict[str, set[str]] = {}
    manifests = sorted(folder.glob(f"{MANIFEST_PREFIX}*.json"))
    for manifest in manifests:
        for name, digest in json.loads(manifest.read_text()).items():
            expected.setdefault(name, set()).add(digest)
    found = _files(folder)
    problems = [f"{name} added" for name in found if name not in expected]
    problems += [f"{name} missing" for name in expected if name not in found]
    problems += [f"{name} changed" for name, path in found.items()
                 if name in expected and _sha256(path) not in expected[name]]
    if not manifests or problems:
        what = "has no manifest of its files" if not manifests else "changed since it was written: " + ", ".join(
            sorted(problems)[:5]) + (f" (and {len(problems) - 5} more)" if len(problems) > 5 else "")
        raise DartsError(f"the calibration checkpoint {folder} {what}; resuming loads it with pickle (DeepSpeed's "
                         "loader), so it is refused",
                         "restore the checkpoint as the run wrote it, or set another cluster.run_id (or remove the "
                         "run's ray-train folder) to train from the start")


@dataclass
class TrainState:
    """What a checkpoint restores: steps done and their losses; `resumed_from` is None on a fresh start."""

    step: int = 0
    losses: list[float] = field(default_factory=list)
    resumed_from: int | None = None


def read_state(checkpoint: ray.train.Checkpoint | None) -> TrainState:
    """Steps done and their losses, as the checkpoint to resume from holds them; a fresh state without one."""
    if checkpoint is None:
        return TrainState()
    with checkpoint.as_directory() as folder:
        verify_manifest(Path(folder))
        progress = json.loads((Path(folder) / PROGRESS_FILE).read_text())
    return TrainState(step=progress["step"], losses=progress["losses"], resumed_from=progress["step"])
