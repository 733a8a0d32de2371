"""Atomic writes: results appear under their final name only once complete."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import platformdirs


@contextlib.contextmanager
def atomic_dir(final: Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary sibling folder; rename it to `final` only if the block succeeds.

    The sibling lives in the same parent so the rename is atomic on one filesystem;
    on any exception it is deleted, so a failed run never leaves a half-written folder.
    """
    final = Path(final).absolute()
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        yield tmp
        tmp.chmod(0o777 & ~umask())  # what mkdir would have given it: mkdtemp makes it private
        if final.exists():
            if not overwrite:
                raise FileExistsError(f"{final} appeared while it was being written")
            old = final.with_name(f".{final.name}.old-{os.getpid()}")
            final.rename(old)
            tmp.rename(final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@contextlib.contextmanager
def atomic_file(final: Path, mode: int | None = None) -> Iterator[Path]:
    """Yield a temporary sibling file path; move it onto `final` only if the block succeeds, with `mode` (None: what
    open() would give it under the umask)."""
    final = Path(final).absolute()
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{final.name}.tmp-", dir=final.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        tmp.chmod(0o666 & ~umask() if mode is None else mode)  # mkstemp makes it private (0600)
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def umask() -> int:
    """The process's umask, read without changing it where Linux reports it (setting it is process-wide)."""
    with contextlib.suppress(OSError, StopIteration):
        status = Path("/proc/self/status").read_text().splitlines()
        return int(next(line for line in status if line.startswith("Umask:")).split()[1], 8)
    mask = os.umask(0)
    os.umask(mask)
    return mask


def cache_root() -> Path:
    """Where darts-dist caches converted models, demo data and experts: DARTS_DIST_CACHE, else the platform's user
    cache folder (on Linux $XDG_CACHE_HOME/darts-dist, else ~/.cache/darts-dist)."""
    env = os.environ.get("DARTS_DIST_CACHE")
    if env:
        return Path(env).expanduser().absolute()
    return Path(platformdirs.user_cache_dir("darts-dist", appauthor=False))
