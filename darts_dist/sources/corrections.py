"""A corrections file, written by calibration and read back by evaluation, export and serving: what it records
about its merged model, and the checks on loading it."""

from __future__ import annotations

from pathlib import Path

from darts_dist.core import DartsCorrections, load_corrections, save_corrections
from darts_dist.errors import DartsError
from darts_dist.sources.models import COMPAT_FIELDS, content_hash, read_model_info

# What a corrections file records of its merged model and checks on loading: the fields experts share with their
# base, and the vocabulary (a merge has exactly one).
RECORDED_FIELDS = (*COMPAT_FIELDS, "vocab_size")


def corrections_metadata(merged_dir: Path) -> dict[str, object]:
    """What the corrections were trained against (the fields that make models compatible, and the merged
    model's content hash), so loading them onto another model is refused."""
    info = read_model_info(merged_dir)
    return {**{key: getattr(info, key) for key in RECORDED_FIELDS}, "merged_model_hash": content_hash(merged_dir)}


def load_corrections_for(path: Path, merged_dir: Path, tasks: tuple[str, ...] | None = None) -> DartsCorrections:
    """Load corrections, refusing them when they were made for a model of another shape than `merged_dir`,
    or (given `tasks`) for other tasks."""
    corrections, made_for = load_corrections(path)
    info = read_model_info(merged_dir)
    for key in RECORDED_FIELDS:
        if key in made_for and made_for[key] != getattr(info, key):
            raise DartsError(
                f"corrections {path} were made for a model with {key}={made_for[key]}, "
                f"but {merged_dir} has {key}={getattr(info, key)}",
                "calibrate against this merged model, or use the merged model the corrections came from",
            )
    if tasks is not None and tuple(corrections.spec.tasks) != tuple(tasks):
        raise DartsError(f"corrections {path} cover tasks {list(corrections.spec.tasks)}, the config has {list(tasks)}",
                         "use the corrections calibrated with this config")
    return corrections


def save_corrections_for(path: Path, corrections: DartsCorrections, merged_dir: Path) -> Path:
    """Write corrections (atomically) with the record of the merged model they were trained against."""
    return save_corrections(path, corrections.cpu(), metadata=corrections_metadata(merged_dir))
