"""Atomic writes: whole or nothing, and under the permissions a plain write would have given."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from darts_dist.fsutil import atomic_dir, atomic_file, umask


@pytest.fixture
def shared_umask():
    previous = os.umask(0o022)
    yield
    os.umask(previous)


def test_results_get_the_permissions_of_a_plain_write(tmp_path: Path, shared_umask) -> None:
    """mkdtemp and mkstemp make private (0700, 0600) temporaries: a model folder others on the cluster must read
    stayed private after the rename."""
    assert umask() == 0o022
    with atomic_dir(tmp_path / "model") as folder:
        (folder / "config.json").write_text("{}")
    with atomic_file(tmp_path / "report.json") as path:
        path.write_text("{}")
    assert stat.S_IMODE((tmp_path / "model").stat().st_mode) == 0o755
    assert stat.S_IMODE((tmp_path / "report.json").stat().st_mode) == 0o644


def test_a_failed_write_leaves_nothing(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError), atomic_dir(tmp_path / "model") as folder:
        (folder / "half").write_text("x")
        raise RuntimeError("interrupted")
    with pytest.raises(RuntimeError), atomic_file(tmp_path / "report.json") as path:
        path.write_text("half")
        raise RuntimeError("interrupted")
    assert list(tmp_path.iterdir()) == []
