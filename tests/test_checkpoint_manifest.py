"""A calibration checkpoint is resumed only as its ranks wrote it: each rank's manifest of SHA-256 hashes, checked
before DeepSpeed's loader (which unpickles) or the finished-run reader sees the folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import ray.train

from darts_dist.calibrate.ray.checkpoint_state import PROGRESS_FILE, read_state, verify_manifest, write_manifest
from darts_dist.errors import DartsError


def written(folder: Path) -> Path:
    """A checkpoint as two ranks leave it: each wrote its files and its manifest; both wrote `engine/latest`."""
    rank0, rank1 = folder / "r0", folder / "r1"
    (rank0 / "engine").mkdir(parents=True)
    (rank1 / "engine").mkdir(parents=True)
    (rank0 / PROGRESS_FILE).write_text(json.dumps({"step": 10, "losses": [0.5] * 10}))
    (rank0 / "engine" / "zero_pp_rank_0_optim_states.pt").write_bytes(b"rank 0 state")
    (rank1 / "engine" / "zero_pp_rank_1_optim_states.pt").write_bytes(b"rank 1 state")
    (rank0 / "engine" / "latest").write_text("engine")
    (rank1 / "engine" / "latest").write_text("engine\n")  # the same name, other bytes: either is as written
    write_manifest(rank0, 0)
    write_manifest(rank1, 1)
    merged = folder / "checkpoint_000001"  # Ray Train merges the ranks' folders into one
    for rank in (rank0, rank1):
        for path in rank.rglob("*"):
            if path.is_file():
                (merged / path.relative_to(rank)).parent.mkdir(parents=True, exist_ok=True)
                (merged / path.relative_to(rank)).write_bytes(path.read_bytes())
    return merged


def test_an_unchanged_checkpoint_resumes(tmp_path: Path) -> None:
    checkpoint = written(tmp_path)
    (checkpoint / ".metadata.json").write_text("{}")  # Ray's own, added after the ranks wrote theirs
    verify_manifest(checkpoint)
    state = read_state(ray.train.Checkpoint.from_directory(checkpoint))
    assert (state.step, state.resumed_from) == (10, 10)


@pytest.mark.parametrize("change, named", [
    (lambda c: (c / "engine" / "zero_pp_rank_1_optim_states.pt").write_bytes(b"os.system('...')"),
     "engine/zero_pp_rank_1_optim_states.pt changed"),
    (lambda c: (c / "engine" / "zero_pp_rank_0_optim_states.pt").unlink(),
     "engine/zero_pp_rank_0_optim_states.pt missing"),
    (lambda c: (c / "engine" / "mp_rank_00_model_states.pt").write_bytes(b"planted"),
     "engine/mp_rank_00_model_states.pt added"),
    (lambda c: (c / PROGRESS_FILE).write_text(json.dumps({"step": 30, "losses": []})), "progress.json changed"),
    (lambda c: [p.unlink() for p in c.glob("manifest-rank*.json")], "has no manifest"),
])
def test_a_changed_checkpoint_is_refused_before_anything_reads_it(tmp_path: Path, change, named: str) -> None:
    checkpoint = written(tmp_path)
    change(checkpoint)
    with pytest.raises(DartsError) as error:
        read_state(ray.train.Checkpoint.from_directory(checkpoint))
    assert named in error.value.what and "pickle" in error.value.what and "cluster.run_id" in error.value.fix
