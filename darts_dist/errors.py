"""User-facing errors: each says what is wrong, what was expected, and how to fix it."""

from __future__ import annotations


class DartsError(Exception):
    """An error caused by the user's input; the CLI prints it without a traceback and exits 2."""

    def __init__(self, what: str, fix: str | None = None) -> None:
        self.what = what
        self.fix = fix
        super().__init__(what if fix is None else f"{what}\n  fix: {fix}")
