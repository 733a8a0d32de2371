"""darts-dist's one channel for messages: the `darts_dist` loggers, written to stderr.

Progress bars are tqdm's (on stderr too), and `print` is kept for the results a command exists
to print, so a command's stdout is its results and nothing else.
"""

from __future__ import annotations

import logging

_FORMAT = logging.Formatter("%(asctime)s %(name)s: %(message)s", "%H:%M:%S")


def show_progress_logs(level: int = logging.INFO) -> None:
    """darts-dist's own lines (downloads, conversions, stages, steps) on stderr at `level`; other libraries'
    stay with their own settings. Idempotent, so every process that does darts-dist work (the command, a
    Ray worker or actor) may call it."""
    logger = logging.getLogger("darts_dist")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(_FORMAT)
        logger.addHandler(handler)
        # Once: not again through a root handler (a Ray worker's, a Ray job driver's), which doubled every line.
        logger.propagate = False
    logger.setLevel(level)
