"""Fan-in: the items of several sources in the order they come, each with its source's key.

Each source's pump thread puts (key, item) on a queue, then (key, end), or (key, error) when it
fails; the reader yields items until every source has ended, and raises a pump's error as its
own. A training worker drains its Ray Data shards this way.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Iterator, Mapping
from queue import Queue
from threading import Thread
from typing import Any, TypeVar

Key = TypeVar("Key", bound=Hashable)
Item = TypeVar("Item")
_END = object()  # a pump's last message


def _ended(item: Any) -> bool:
    """Whether a message ends its source; a pump's error is raised here, in the reader."""
    if isinstance(item, BaseException):
        raise item
    return item is _END


def fan_in(sources: Mapping[Key, Iterable[Item]]) -> Iterator[tuple[Key, Item]]:
    """Start pulling every source now, each on its own thread; yield (key, item) as they arrive.

    The queue holds one item per source: a reader that stops reading stops the pumps too, so the
    sources' own back-pressure holds.
    """
    queue: Queue = Queue(maxsize=len(sources))

    def pump(key: Key, source: Iterable[Item]) -> None:
        try:
            for item in source:
                queue.put((key, item))
            queue.put((key, _END))
        except BaseException as error:  # noqa: BLE001 - handed to the reader, which raises it
            queue.put((key, error))

    for key, source in sources.items():
        Thread(target=pump, args=(key, source), name=f"fan-in-{key}", daemon=True).start()
    return _read(queue, running=len(sources))


def _read(queue: Queue, running: int) -> Iterator[tuple[Any, Any]]:
    while running:
        key, item = queue.get()
        if _ended(item):
            running -= 1
        else:
            yield key, item
