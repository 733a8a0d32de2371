"""darts-dist's one channel for messages: the `darts_dist` loggers, written to stderr.

Progress bars are tqdm's (on stderr too), and `print` is kept for the results a command exists
to print, so a command's stdout is its results and nothing else. Ray's own lines (Ray Data's
execution plans, Ray Train's reports, its warnings) stay in Ray's log files unless `--verbose`
(`init_ray`), so that the console shows darts-dist's progress.
"""

from __future__ import annotations

import logging
import os
import re
from typing import Any

_FORMAT = logging.Formatter("%(asctime)s %(name)s: %(message)s", "%H:%M:%S")
VERBOSE_ENV = "DARTS_DIST_VERBOSE"  # set (by --verbose): Ray's own lines on the console too
# A line of a darts_dist logger, as _FORMAT writes it, possibly behind a terminal colour code.
_OWN_LINE = re.compile(r"^(\x1b\[[0-9;]*m)*\d\d:\d\d:\d\d darts_dist[\w.]*: ")


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


def verbose() -> bool:
    return bool(os.environ.get(VERBOSE_ENV))


def own_lines(lines: list[str]) -> list[str]:
    """The lines of darts-dist's loggers among lines a Ray worker or actor printed."""
    return [line for line in lines if _OWN_LINE.match(line)]


def init_ray(**options: Any) -> None:
    """`ray.init(**options)` for a darts-dist command: unless verbose, Ray's own lines stay off the console.

    This driver's Ray loggers log errors only (ray.init's `logging_level`), and of the lines Ray forwards from
    its workers and actors only darts-dist's own (their progress) are printed; everything else is still in the
    workers' log files
    (`/tmp/ray/session_latest/logs`). Ray has no public filter for forwarded lines: the handler that prints
    them is swapped for one that filters, on the dispatcher of the pinned Ray version.
    """
    import ray

    if verbose():
        ray.init(**options)
        return
    ray.init(logging_level=logging.ERROR, **options)
    from ray._private import worker

    ignore_prefix = worker._should_ignore_worker_log_prefix(worker.global_worker)

    def print_own(data: dict[str, Any]) -> None:
        lines = own_lines(data["lines"])
        if lines:
            worker.print_to_stdstream({**data, "lines": lines}, ignore_prefix=ignore_prefix)

    dispatcher = worker.global_worker_stdstream_dispatcher
    dispatcher.remove_handler("ray_print_logs")
    dispatcher.add_handler("ray_print_logs", print_own)
