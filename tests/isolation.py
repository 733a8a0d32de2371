"""A Python environment holding only some distributions: for code that must run without darts-dist."""

from __future__ import annotations

import re
import sysconfig
from importlib import metadata
from pathlib import Path


def requirements_environment(requirements: list[str], folder: Path) -> Path:
    """A site-packages folder holding (as links into this environment's) exactly the distributions that
    `pip install` of `requirements` brings: them and what they require, extras left out."""
    def name(dist: str) -> str:
        return re.sub(r"[-_.]+", "-", dist).lower()

    site = Path(sysconfig.get_paths()["purelib"])
    view = folder / "site-packages"
    view.mkdir()
    seen, todo = set(), [line.split("==")[0] for line in requirements]
    while todo:
        dist = name(todo.pop())
        if dist in seen:
            continue
        seen.add(dist)
        try:
            found = metadata.distribution(dist)
        except metadata.PackageNotFoundError:
            continue  # a requirement for another platform or Python
        todo += [re.match(r"[A-Za-z0-9._-]+", r)[0] for r in found.requires or [] if "extra ==" not in r]
        for top in {file.parts[0] for file in found.files or [] if file.parts[0] not in ("..", "__pycache__")}:
            if (site / top).exists() and not (view / top).exists():
                (view / top).symlink_to(site / top)
    return view
