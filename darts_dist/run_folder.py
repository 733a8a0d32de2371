"""What a run folder holds, found by the names the run wrote: `merged/` (or the config's merge.output, or the
`learned-merge/` of a run that fitted merge coefficients), corrections.safetensors, router.safetensors and the
config. Serving and lm-eval read run folders alike."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from darts_dist.config import (
    CORRECTIONS_FILE,
    LEARNED_FOLDER,
    MERGED_FOLDER,
    RUN_CONFIG_FILE,
    RunConfig,
    load_record,
    parse_record,
)
from darts_dist.core import ROUTER_FILE
from darts_dist.errors import DartsError

# Where a run folder of darts-dist 0.1 kept its config (newer ones write config.yaml).
_REPORTS_OF_01 = ("report.json", "calibration.json")


@dataclass(frozen=True)
class RunFolder:
    merged_dir: Path
    corrections: Path | None  # None: the run wrote none (and none was given)
    router: Path | None
    config: RunConfig | None  # None: a folder without its config


def run_config(folder: Path) -> RunConfig | None:
    """The config a run folder was made with, or None for a folder that holds none."""
    if (folder / RUN_CONFIG_FILE).is_file():
        return load_record(folder / RUN_CONFIG_FILE)
    for report in (folder / name for name in _REPORTS_OF_01):
        if report.is_file():
            return parse_record(json.loads(report.read_text())["config"], origin=f"{report}'s config")
    return None


def read_run_folder(folder: Path, corrections: Path | None = None, router: Path | None = None) -> RunFolder:
    """A run folder's merged model, corrections and router (files given apart win) and its config; a DartsError
    when it holds no merged model."""
    config = run_config(folder)
    merged = folder / MERGED_FOLDER
    if (folder / LEARNED_FOLDER).is_dir() and (config is None or config.calibration_method.fits_coefficients):
        merged = folder / LEARNED_FOLDER  # the model its corrections belong to
    elif not merged.is_dir() and config is not None and config.merge.output is not None:
        merged = config.merge.output
    if not (merged / "config.json").is_file():
        raise DartsError(f"{folder} is neither a model folder (config.json) nor a run folder ({MERGED_FOLDER}/ "
                         f"with {CORRECTIONS_FILE})",
                         "pass the folder a `calibrate` or `demo` run wrote (OUTPUT_DIR/NAME), or a merged model "
                         "folder with its corrections file")
    written = {"corrections": folder / CORRECTIONS_FILE, "router": folder / ROUTER_FILE}
    return RunFolder(
        merged_dir=merged, config=config,
        corrections=corrections or (written["corrections"] if written["corrections"].is_file() else None),
        router=router or (written["router"] if written["router"].is_file() else None),
    )
