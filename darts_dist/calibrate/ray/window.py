"""The stream's window: how many tokens of a task's rows its expert may have made that no training worker has
kept yet.

Ray Data's object-store budget (`cluster.stream_buffer_mb`, the stream's ExecutionOptions) stops counting a
block once the `streaming_split` coordinator holds it for the workers (ray-project/ray#39595: no back-pressure
from the consumers to the coordinator), so experts that outpace the workers filled the object store with rows
waiting for them, more the longer the stream. Here the experts ask before each batch (`enter`) and the workers
say what they have kept (`leave`; until then a batch's arrays are views into the object store, also while it
waits in a worker's prefetch or fan-in queue): an expert waits while its task has `limit` tokens in flight.
Tokens, not rows: a row's hidden states are its length times a fixed size, so the window holds the same bytes
whatever rows the data has (counted in rows, a longer set drew more long rows into it and peaked higher). A
batch retried after its actor died enters again with the same row ids and is not counted twice; a batch larger
than the limit still enters an empty window, so the stream always moves.

Imports stay light (no torch): the stream's Ray Data actors import this module.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import ray


@ray.remote(num_cpus=0)
class StreamWindow:
    """Tokens in flight per task (rows made by the expert, not yet kept by a worker), at most `limit`."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.in_flight: dict[str, dict[int, int]] = {}  # task -> row -> its tokens
        self.changed = asyncio.Condition()

    async def enter(self, task: str, rows: Sequence[int], lengths: Sequence[int]) -> None:
        """Return once `rows` (of `lengths` tokens) fit in the task's window (at once for rows already in it)."""
        entering = dict(zip(rows, lengths))
        async with self.changed:
            flying = self.in_flight.setdefault(task, {})
            await self.changed.wait_for(lambda: not flying or sum({**flying, **entering}.values()) <= self.limit)
            flying.update(entering)

    async def leave(self, task: str, rows: Sequence[int]) -> None:
        async with self.changed:
            flying = self.in_flight.setdefault(task, {})
            for row in rows:
                flying.pop(row, None)
            self.changed.notify_all()

    def tokens_in_flight(self) -> dict[str, int]:
        return {task: sum(rows.values()) for task, rows in self.in_flight.items()}


# Ray Data's OutputSplitter may hold back up to RAY_DATA_DEFAULT_OUTPUT_SPLITTER_MAX_BUFFERING_FACTOR (2) blocks per
# worker while it looks for one on a worker's node: a window of fewer batches would never see them delivered (a
# window of one batch hung a one-worker job here; three ran).
SPLITTER_BLOCKS_PER_WORKER = 2


def window_tokens(
    buffer_mb: int, token_bytes: int, lengths: Sequence[Sequence[int]], batch_size: int, workers: int
) -> int:
    """The tokens of one task's window: `buffer_mb` of hidden states (at `token_bytes` a token), and at least the
    batches the split may hold back plus one, so that the stream always moves: their rows can be no longer than
    that many longest rows of any task (`lengths`: each task's row lengths)."""
    rows = batch_size * (SPLITTER_BLOCKS_PER_WORKER * workers + 1)
    least = max(sum(sorted(task, reverse=True)[:rows]) for task in lengths)
    return max(least, (buffer_mb << 20) // max(token_bytes, 1))
