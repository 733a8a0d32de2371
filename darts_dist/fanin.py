"""Fan-in: the items of several sources in the order they come, each with its source's key.

One protocol in two forms: each source's pump puts (key, item) on a queue, then (key, end), or
(key, error) when it fails; the reader yields items until every source has ended, and raises a
pump's error as its own. `fan_in` pumps with threads (the Ray Data shards a training worker
drains); `fan_in_async` with asyncio tasks (the token streams of one HTTP request's sequences).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable, AsyncIterator, Hashable, Iterable, Iterator, Mapping
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


async def fan_in_async(sources: Mapping[Key, AsyncIterable[Item]]) -> AsyncIterator[tuple[Key, Item]]:
    """The asyncio form: every source pumped by its own task; the pumps are cancelled when the reader stops."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(key: Key, source: AsyncIterable[Item]) -> None:
        try:
            async for item in source:
                await queue.put((key, item))
            await queue.put((key, _END))
        except Exception as error:  # noqa: BLE001 - handed to the reader, which raises it
            await queue.put((key, error))

    tasks = [asyncio.create_task(pump(key, source)) for key, source in sources.items()]
    try:
        running = len(tasks)
        while running:
            key, item = await queue.get()
            if _ended(item):
                running -= 1
            else:
                yield key, item
    finally:
        for task in tasks:
            task.cancel()
