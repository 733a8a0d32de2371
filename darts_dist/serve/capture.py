"""Opt-in traffic capture (`serve.capture`): the prompts a server answers, kept in a bounded folder of segments.

Each replica buffers its prompts and writes them out, one segment per task, `capture-<ms>-<task>-<writer>-<n>.jsonl`
(`none` for prompts no correction applied to), every `flush_s` seconds or `segment_bytes`, under a temporary name
first and renamed when complete, so a reader never sees half a segment. After each write the task's oldest segments
go until it holds at most its share of `max_bytes` (an equal share per task in the folder), so a flood of one model
id cannot evict the others' traffic. Segments are 0600 in a 0700 folder: prompts are other people's text. A record
is the prompt's text (a chat's rendered with the chat template), the task whose correction applied, whether it
was a chat, the model version, the time and the client (the name its API key has in the server's key file, so that
one client's share of a recalibration can be capped): never the response, a key or a header. Capture never fails a
request: a segment that cannot be written is logged and dropped.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import threading
import time
import uuid
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path

from darts_dist.config import CaptureSection
from darts_dist.errors import DartsError

logger = logging.getLogger(__name__)
SEGMENT_GLOB = "capture-*.jsonl"
NO_TASK = "none"  # the segments of prompts no correction applied to
OTHER = "*"  # segments not named by this version: no task can be called this


@dataclass(frozen=True)
class CapturedPrompt:
    """One served prompt. `task`: the correction that applied (None: none); `routed`: the router chose it;
    `chat`: the prompt is a rendered chat, holding its special tokens already; `messages`: a chat's messages, so
    that recalibration tokenises them as the server did (special-token text in them as text); `client`: the name of
    the API key that sent it (None: a server without keys, whose clients cannot be told apart)."""

    prompt: str
    task: str | None
    routed: bool
    chat: bool
    model_version: str | None
    time: float
    messages: list[dict[str, str]] | None = None
    client: str | None = None


def segments(folder: Path) -> list[Path]:
    """The folder's complete segments, oldest first (their names start with the time they were written)."""
    return sorted(folder.glob(SEGMENT_GLOB))


_SEGMENT_NAME = re.compile(r"capture-\d{13}-(?P<task>[A-Za-z0-9_-]+)-[0-9a-f]{8}-\d{6}")


def segment_task(path: Path) -> str:
    """The task a segment holds (capture-<ms>-<task>-<writer>-<n>.jsonl; a task name may hold '-'); segments of
    other names (an older darts-dist's, capture-<ms>-<writer>-<n>.jsonl) share one share, as OTHER."""
    found = _SEGMENT_NAME.fullmatch(path.stem)
    return OTHER if found is None else found["task"]


class TrafficCapture:
    """One replica's writer: `record` is cheap (a buffer append); a thread of its own writes the segments."""

    def __init__(self, settings: CaptureSection) -> None:
        self.settings = settings
        self.folder = settings.dir
        self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.folder.chmod(0o700)
        self.writer = uuid.uuid4().hex[:8]
        self.written = 0  # segments written by this writer
        self.dropped = 0  # records lost: failed writes, or a buffer full while writes lag
        self._lines: dict[str, list[str]] = defaultdict(list)  # per task
        self._size = 0
        self._lock = threading.Lock()
        self._full = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="darts-capture", daemon=True)
        self._thread.start()

    def record(self, prompt: CapturedPrompt) -> None:
        """Buffer one prompt; beyond two segments' worth (the writer lagging: a slow or hung disk) it is dropped."""
        line = json.dumps(asdict(prompt)) + "\n"  # ASCII: any string, lone surrogates too, writes as UTF-8
        with self._lock:
            if self._size + len(line) > 2 * self.settings.segment_bytes:
                self.dropped += 1
                return
            self._lines[prompt.task or NO_TASK].append(line)
            self._size += len(line)
            if self._size >= self.settings.segment_bytes:
                self._full.set()

    def flush(self) -> None:
        """Write what is buffered as one segment per task, then trim each task's segments to its share."""
        with self._lock:
            buffered, self._lines, self._size = self._lines, defaultdict(list), 0
            self._full.clear()
        for task, lines in buffered.items():
            self._write(task, lines)

    def _write(self, task: str, lines: list[str]) -> None:
        name = f"capture-{time.time_ns() // 1_000_000:013d}-{task}-{self.writer}-{self.written:06d}.jsonl"
        tmp = self.folder / f".{name}.tmp"
        try:
            with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w", encoding="ascii") as out:
                out.write("".join(lines))
            os.replace(tmp, self.folder / name)
        except OSError as error:
            with contextlib.suppress(OSError):  # the folder itself may be what is gone
                tmp.unlink(missing_ok=True)
            self.dropped += len(lines)
            logger.error("traffic capture: %d prompts not written to %s: %s", len(lines), self.folder, error)
            return
        self.written += 1
        try:
            self._trim(keep=self.folder / name)
        except OSError as error:
            logger.error("traffic capture: could not trim %s to %d bytes: %s", self.folder, self.settings.max_bytes,
                         error)

    def _trim(self, keep: Path) -> None:
        """Delete each task's oldest segments until it holds at most its share of max_bytes (equal shares among the
        tasks in the folder); never `keep`, the one just written."""
        found: dict[str, list[tuple[Path, int]]] = defaultdict(list)
        for path in segments(self.folder):
            try:
                found[segment_task(path)].append((path, path.stat().st_size))
            except FileNotFoundError:  # another replica trimmed it
                pass
        share = self.settings.max_bytes // max(1, len(found))
        for kept in found.values():
            total = sum(size for _, size in kept)
            for path, size in kept:
                if total <= share:
                    break
                if path != keep:
                    path.unlink(missing_ok=True)
                    total -= size

    def _run(self) -> None:
        while not self._stop.is_set():
            self._full.wait(self.settings.flush_s)
            try:
                self.flush()
            except Exception:  # noqa: BLE001 - the writer must outlive any one segment
                logger.exception("traffic capture: a segment failed")

    def close(self) -> None:
        """Write what is left and stop the thread."""
        self._stop.set()
        self._full.set()
        self._thread.join(timeout=30)
        self.flush()


def read_traffic(folder: Path, tasks: tuple[str, ...]) -> dict[str, list[CapturedPrompt]]:
    """Every task's captured prompts in `folder`, oldest first; prompts without a task (no correction applied,
    or the router below its threshold) and of tasks the config does not have are left out."""
    folder = Path(folder)
    if not folder.is_dir():
        raise DartsError(f"the traffic folder {folder} does not exist",
                         "pass the folder a server captured into (its serve.capture.dir)")
    found = segments(folder)
    if not found:
        raise DartsError(f"{folder} holds no captured traffic ({SEGMENT_GLOB})",
                         "serve with serve.capture.enabled: true and send requests first")
    prompts: dict[str, list[CapturedPrompt]] = defaultdict(list)
    for path in found:
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:  # a capturing server trimmed it meanwhile
            continue
        for number, line in enumerate(text.splitlines(), 1):
            try:
                prompt = CapturedPrompt(**json.loads(line))
            except (ValueError, TypeError) as error:
                raise DartsError(f"{path}, line {number}, is not a captured prompt: {error}",
                                 "remove the file; darts-dist writes only whole segments") from None
            if prompt.task in tasks:
                prompts[prompt.task].append(prompt)
    by_time = {task: sorted(rows, key=lambda p: p.time) for task, rows in prompts.items()}
    return {task: by_time[task] for task in tasks if task in by_time}
