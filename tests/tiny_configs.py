"""A darts-dist config over the tiny family (tests/conftest.py's `tiny_family`), with its tasks' rows written as
local JSONL files: what most tests that run a command start from."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path

from darts_dist.sources.demo.tiny import TinyFamily


def family_config(
    family: TinyFamily, folder: Path, name: str, text: Callable[[str, int], str], count: int, heldout: bool = True,
    tasks: Sequence[str] = ("code", "math"), **sections: object,
) -> dict:
    """The config (a dict, to change or dump) of `tasks`' experts merged by task arithmetic at 0.5, each task's
    `count` rows `text(task, i)` in FOLDER/data/TASK.jsonl, its calibration set and (`heldout`) its held-out
    set too; `sections` are added at the top level. The data paths are relative: write the config in `folder`."""
    data = folder / "data"
    data.mkdir(parents=True, exist_ok=True)
    for task in tasks:
        (data / f"{task}.jsonl").write_text("".join(json.dumps({"text": text(task, i)}) + "\n" for i in range(count)))
    return {
        "name": name,
        "sources": {"base": str(family.base), "experts": [
            {"task": t, "path": str(family.experts[t]),
             "data": {"calibration": f"data/{t}.jsonl", **({"heldout": f"data/{t}.jsonl"} if heldout else {})}}
            for t in tasks]},
        "merge": {"method": "task_arithmetic", "parameters": {"weight": 0.5}},
        **sections,
    }
