"""darts-dist's one channel for messages: the `darts_dist` loggers, written to stderr.

Progress bars are tqdm's (on stderr too, `progress_bar`): redrawn on a terminal, one whole line per
PROGRESS_LINE_S elsewhere (a log file). `print` is kept for the results a command exists to print, so a
command's stdout is its results and nothing else. Ray's own lines (Ray Data's execution plans, Ray Train's
reports, its warnings) stay in Ray's log files unless `--verbose` (`init_ray`), and the libraries' own bars are
off (`quiet_library_progress`: datasets' everywhere, transformers', the hub's and MLflow's outside a terminal),
so that the console shows darts-dist's progress.
"""

from __future__ import annotations

import logging
import os
import re
import sys
from collections.abc import Iterable
from typing import Any, TextIO

from tqdm.auto import tqdm

from darts_dist.redaction import RedactingFilter

_FORMAT = logging.Formatter("%(asctime)s %(name)s: %(message)s", "%H:%M:%S")
VERBOSE_ENV = "DARTS_DIST_VERBOSE"  # set (by --verbose): Ray's own lines on the console too
# A line of a darts_dist logger, as _FORMAT writes it, possibly behind a terminal colour code.
_OWN_LINE = re.compile(r"^(\x1b\[[0-9;]*m)*\d\d:\d\d:\d\d darts_dist[\w.]*: ")


class _StderrHandler(logging.StreamHandler):
    """A StreamHandler on sys.stderr as it is at each record, not as it was when the handler was made: a process
    that swaps sys.stderr (a redirect, a test's capture) gets the lines where it now looks, and a handler left on a
    closed stream never answers a record with logging's error report, whose traceback carries the exception being
    handled unredacted (an MLflow error quoting the store's URI, its password included)."""

    @property  # type: ignore[override]
    def stream(self):  # noqa: ANN201
        return sys.stderr

    @stream.setter
    def stream(self, value: object) -> None:  # StreamHandler.__init__ and setStream assign it: sys.stderr wins
        pass


def show_progress_logs(level: int = logging.INFO) -> None:
    """darts-dist's own lines (downloads, conversions, stages, steps) on stderr at `level`; other libraries'
    stay with their own settings. Idempotent, so every process that does darts-dist work (the command, a
    Ray worker or actor) may call it."""
    logger = logging.getLogger("darts_dist")
    if not logger.handlers:
        handler = _StderrHandler()
        handler.setFormatter(_FORMAT)
        handler.addFilter(RedactingFilter())
        logger.addHandler(handler)
        # Once: not again through a root handler (a Ray worker's, a Ray job driver's), which doubled every line.
        logger.propagate = False
    logger.setLevel(level)


PROGRESS_LINE_S = 30.0  # outside a terminal: a progress line at most this often (and each bar's last)
PROGRESS_TTY_S = 10.0  # on a terminal: how often a stage without a bar (a Ray worker's steps) logs a line
# Set by a command whose console is not a terminal, for the Ray workers it starts (they inherit its environment
# and cannot see its console): their progress lines come at its rate.
PROGRESS_ENV = "DARTS_DIST_PROGRESS_S"
# The libraries' own switches (datasets, huggingface_hub and transformers read theirs once, at import: set before
# they load). datasets' bars (one per split it generates, ~30 a demo) are off everywhere; the hub's and
# transformers' (a load, a save) and MLflow's (an artifact download, at registration) outside a terminal.
DATASETS_BARS_OFF = "HF_DATASETS_DISABLE_PROGRESS_BARS"
LIBRARY_BARS_OFF = {DATASETS_BARS_OFF: "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1",
                    "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false"}


class _Lines:
    """A stream that turns tqdm's redraws ("\r" + status, padded) into whole lines: what a log file can hold."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream

    def write(self, text: str) -> None:
        line = text.replace("\r", "").strip()
        if line:
            self.stream.write(line + "\n")

    def flush(self) -> None:
        self.stream.flush()


class _LineBar(tqdm):
    """tqdm for a log file: no line for a bar that has not moved yet (its 0% would double every stage's lines)."""

    def display(self, msg: str | None = None, pos: int | None = None) -> bool:
        if msg is None and self.n == 0:
            return True
        return super().display(msg, pos)

    def set_postfix(self, ordered_dict: Any = None, refresh: bool = True, **kwargs: Any) -> None:
        """The postfix (a loss) shows in the next line at the bar's own rate: tqdm's default refresh would write a
        line at every update (800 lines for an 800-step calibration)."""
        super().set_postfix(ordered_dict, refresh=False, **kwargs)


def on_terminal() -> bool:
    return sys.stderr.isatty()


def progress_interval() -> float:
    """Seconds between two progress lines of a stage that logs its progress (no bar): the console's rate."""
    return float(os.environ.get(PROGRESS_ENV) or (PROGRESS_TTY_S if on_terminal() else PROGRESS_LINE_S))


def progress_bar(iterable: Iterable | None = None, **options: Any) -> tqdm:
    """tqdm on stderr: a bar on a terminal; elsewhere its status as a line at most every PROGRESS_LINE_S seconds
    while it runs, and when it ends."""
    if on_terminal():
        return tqdm(iterable, **options)
    # maxinterval too: tqdm's monitor thread otherwise redraws a slow bar every 10 s whatever mininterval says.
    return _LineBar(iterable, file=_Lines(sys.stderr), mininterval=PROGRESS_LINE_S, maxinterval=PROGRESS_LINE_S,
                    **options)


def quiet_library_progress() -> None:
    """The libraries' own bars off (datasets' always; transformers' and the hub's outside a terminal), in this
    process and, through the environment, in the Ray workers and programs it starts. darts-dist's own progress
    (`progress_bar`, the `darts_dist` loggers) stays."""
    os.environ.setdefault(DATASETS_BARS_OFF, "1")
    # Modules loaded before this read their setting already (a test process; a command importing early).
    if "datasets" in sys.modules:
        sys.modules["datasets"].disable_progress_bars()
    if on_terminal():
        return
    for name, value in LIBRARY_BARS_OFF.items():
        os.environ.setdefault(name, value)
    os.environ.setdefault(PROGRESS_ENV, str(PROGRESS_LINE_S))
    if "transformers" in sys.modules:
        sys.modules["transformers"].utils.logging.disable_progress_bar()
    if "huggingface_hub" in sys.modules:
        sys.modules["huggingface_hub"].utils.disable_progress_bars()


class _Notices(logging.Filter):
    """Drops a library logger's records that begin with one of `messages`, and no other."""

    def __init__(self, *messages: str) -> None:
        super().__init__()
        self.messages = messages

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.messages)


# Library notices that tell a darts-dist user nothing, by logger: transformers' warning of the dtype's old name,
# which mergekit writes into every merged config (`config.torch_dtype = ...`: a notice for mergekit's authors);
# MLflow's notes that it made a new sqlite store's tables (the command's own "mlflow: run ... at URI" line says where
# it tracks) and that it validates a registered model's input example (a check darts-dist asks for: a failure is an
# error, and "registered: ..." says it passed). Their loggers' other lines stay.
_NOTICES = {
    "transformers.configuration_utils": _Notices("`torch_dtype` is deprecated"),
    "mlflow.store.db.utils": _Notices("Creating initial MLflow database tables", "Updating database tables"),
    "mlflow.pyfunc": _Notices("Validating input example against model signature"),
}


def quiet_library_notices() -> None:
    """The libraries' notices above off in this process (the command's console), unless --verbose. Idempotent."""
    if verbose():
        return
    for name, notices in _NOTICES.items():
        logging.getLogger(name).addFilter(notices)  # a filter already there is not added twice


def verbose() -> bool:
    return bool(os.environ.get(VERBOSE_ENV))


def own_lines(lines: list[str]) -> list[str]:
    """The lines of darts-dist's loggers among lines a Ray worker or actor printed."""
    return [line for line in lines if _OWN_LINE.match(line)]


# Ray's switch for a node of one machine, named for the laptops it was made for: set to 0 before Ray loads, a local
# node takes 127.0.0.1 as its address, so its GCS, raylet, object manager, agents and Prometheus exporters listen
# there; on Linux Ray otherwise turns a loopback node IP back into the machine's reachable address and they listen
# where other machines reach them (ray._private.services.get_node_ip_address).
LOOPBACK_RAY_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def keep_local_ray_on_loopback() -> None:
    """Before Ray loads in this process: a Ray node it starts listens on 127.0.0.1 alone (LOOPBACK_RAY_ENV)."""
    if "ray" in sys.modules:
        raise RuntimeError("keep_local_ray_on_loopback() after Ray loaded: its node address is already decided")
    os.environ.setdefault(LOOPBACK_RAY_ENV, "0")


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
    # The raylet's warnings to the driver ("8 PYTHON worker processes have been started…", sized for a
    # cluster, not for 2 CPUs running a dozen actors) come through print_to_stdstream, not the dispatcher:
    # kept in the raylet's log, at debug level here. Its errors (a worker killed, out of memory) still print.
    print_any = getattr(worker.print_to_stdstream, "__wrapped__", worker.print_to_stdstream)

    def print_unless_warning(data: dict[str, Any], ignore_prefix: bool) -> None:
        if data.get("pid") == "raylet" and all(line.lstrip().startswith("WARNING") for line in data["lines"]):
            logging.getLogger("darts_dist.ray").debug("%s", " ".join(data["lines"]))
            return
        print_any(data, ignore_prefix=ignore_prefix)

    print_unless_warning.__wrapped__ = print_any  # type: ignore[attr-defined]  # a later init_ray wraps Ray's own
    worker.print_to_stdstream = print_unless_warning
