"""Continuous batching: the engine every darts-dist generation runs through (serving, pyfunc, evaluation).

A running set of sequences shares one KV cache, a slot per sequence (`kv_cache.SlotCache`: a decoding step
writes one column per sequence, a join or a finish copies no other sequence's keys). Each `step` drops the
cancelled, lets waiting sequences join while the batch has room (`max_batch_size` sequences, and slots of at most
`max_batch_tokens` tokens in all: each sequence's prompt + max_tokens, rounded up to its slot's width), prefills
the joiners in one forward (a prompt prefix seen before, such as a system prompt,
is taken from the prefix cache instead of computed again), then decodes one token for every
running sequence in one forward. With `prefill_chunk_tokens`, a step prefills at most that many prompt tokens
(a quarter more, every other step, for the oldest long prompt): whole prompts up to it (the others join at the next step), and a
prompt longer than it in chunks, in a cache of its own, beside the decoding batch, joining it with its last chunk
(the prompts with the fewest tokens left first): a long prompt never stalls the running streams for its whole
prefill. Whoever arrives while the chunks prefill joins before that step's decode, on the next step's budget. Finished sequences leave at once, so a short answer never waits for a long one and a waiting
request never waits for a whole batch. A request's sequences are one group, and groups share the batch
fairly (`ContinuousBatcher`). Everything is per sequence: its task's correction (the hooks take one task weight row per sequence, and position ids count from
each sequence's own first token), temperature, top_p, stop strings, max_tokens and a random
generator of its own.

transformers' own continuous batching (`generate_batch`, a paged cache) is not used: it packs
every sequence into one flat row, so the correction hooks cannot tell which task a token belongs
to, and it draws every sequence's sample from one generator, so a seeded request would depend on
its companions.

`Engine` is the small interface a server needs; `EngineThread` runs a `ContinuousBatcher` on a
thread of its own, and a GPU engine can take its place behind the same interface.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import torch
from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase
from transformers.cache_utils import DynamicCache

from darts_dist.config import PREFIX_CACHE_TOKENS
from darts_dist.core import PromptPool, mask_positions, token_batch
from darts_dist.errors import DartsError
from darts_dist.generation.kv_cache import (
    CacheScope,
    LayerKV,
    PrefixCache,
    SlotCache,
    cache_with_past,
    check_full_attention,
    slot_width,
    use_slot_attention,
)
from darts_dist.generation.sampling import new_generator, next_tokens
from darts_dist.generation.text import Completion, SequenceText
from darts_dist.torch_thread import TorchThread

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Sampling:
    """A sequence's decoding settings; temperature 0 is greedy decoding (top_p and seed then do nothing)."""

    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False  # go on past end-of-sequence tokens, to max_tokens


@dataclass(frozen=True)
class SequenceRequest:
    """One sequence to generate: prompt tokens, its task (None: uncorrected, "auto": routed), its settings;
    `stream` asks for its text as it becomes final; `cache_salt` scopes its prompt's prefix-cache blocks (the API
    key's client: one client cannot learn from timing whether another sent a prefix; None: shared)."""

    ids: tuple[int, ...]
    task: str | None
    sampling: Sampling
    stream: bool = False
    cache_salt: str | None = None


@dataclass(frozen=True)
class Finished:
    completion: Completion
    batch_size: int  # the most sequences it was decoded with at once, itself included


# What a sequence's listener hears, on the engine's thread: text (streamed requests), then one Finished,
# or an exception if its forward failed. A sequence cancelled during a step may still hear that step's events.
Event = str | Finished | Exception
Listener = Callable[[Event], None]


class EngineBusy(DartsError):
    """The waiting room is full: the request is refused whole (none of its sequences was queued)."""


class EngineStopped(DartsError):
    """The engine closed before the sequence finished."""


@dataclass(frozen=True)
class EngineStats:
    waiting: int
    running: int
    generated_tokens: int  # since the engine started
    prompt_tokens: int  # prefilled since the engine started
    cached_prompt_tokens: int  # of which the prefix cache held the keys and values
    preempted: int  # sequences put back to wait (and recomputed) so that another request could start


class Ticket:
    """A submitted sequence, to cancel it."""

    def __init__(self) -> None:
        self.cancelled = False


class Engine(Protocol):
    """What a server needs of a generation engine: a request's sequences are submitted together, as one group."""

    def submit(self, requests: Sequence[SequenceRequest], listeners: Sequence[Listener]) -> list[Ticket]: ...

    def admits(self, count: int) -> bool: ...

    def cancel(self, ticket: Ticket) -> None: ...

    def stats(self) -> EngineStats: ...

    def close(self) -> None: ...


class CorrectedModel(Protocol):
    """What the batcher uses of a `CorrectedLM`: the model with its correction hooks, the tokenizer, and
    each sequence's task weights (the router's pick for routed ones)."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    eos_ids: set[int]
    pad_id: int
    corrects_kv: bool  # whether a correction changes keys and values (one below the final norm does)

    def task_index(self, task: str | None) -> int: ...

    routes_in_prefill: bool  # whether a routed prompt is routed inside its own prefill (`routing_in_forward`)

    def task_weights(self, task_ids: list[int], encoded: Sequence[Sequence[int]], route: bool = True
                     ) -> tuple[torch.Tensor | None, list[tuple[str | None, float | None] | None]]: ...

    def weighted(self, weights: torch.Tensor | None) -> contextlib.AbstractContextManager[None]: ...

    def routing_in_forward(self, weights: torch.Tensor | None, pools: dict[int, PromptPool], mask: torch.Tensor,
                           final: bool) -> contextlib.AbstractContextManager[dict[int, tuple]]: ...


class _Sequence:
    """A sequence in the batcher: its request, listener, group (the request it came in), correction, generator
    and text so far."""

    def __init__(self, request: SequenceRequest, listener: Listener, ticket: Ticket, group: object, task_index: int,
                 generator: torch.Generator, text: SequenceText) -> None:
        self.request = request
        self.group = group
        self.listener = listener
        self.ticket = ticket
        self.task_index = task_index
        self.generator = generator
        self.text = text
        self.weights: torch.Tensor | None = None  # [K] correction weights, set at prefill (routing decides)
        self.pool: PromptPool | None = None  # a routed prompt's states until its own prefill routes it
        self.applied: tuple[str | None, float | None] = (None, None)  # the task applied, the router's confidence
        self.length = len(request.ids)  # tokens in the KV cache
        self.pending = -1  # the last token drawn, not in the cache yet
        self.started = False  # prefilled once: routed, its prompt counted
        self.joined = 0  # when it last joined the running batch (the batcher's count of joins)
        self.batch_size = 0
        self.done = False  # Finished or failed: it hears nothing more

    def tell(self, event: Event) -> None:
        """Hand the listener an event. A listener that fails (its request's event loop is gone) cancels its
        sequence instead of failing the batch."""
        if self.done:
            return
        self.done = isinstance(event, (Finished, Exception))
        try:
            self.listener(event)
        except Exception:
            logger.exception("a listener failed; its sequence is cancelled")
            self.ticket.cancelled = True

    @property
    def reserved(self) -> int:
        return len(self.request.ids) + self.request.sampling.max_tokens

    @property
    def prompt(self) -> tuple[int, ...]:
        """What its prefill computes: the prompt, and once preempted the tokens it generated since (the last
        one drawn included, so the prefill's logits draw the next)."""
        return self.request.ids + tuple(self.text.tokens)


_Joiner = tuple[_Sequence, CacheScope, LayerKV | None]  # a sequence, its prefix-cache scope, its cached KV


class _Prefilling:
    """A long prompt prefilled a chunk per step: its cache so far (from its cached prefix, if any) and how many of
    its tokens that cache holds."""

    def __init__(self, sequence: _Sequence, scope: CacheScope, cached: int, kv: LayerKV | None, fresh: bool,
                 config: PretrainedConfig) -> None:
        self.sequence = sequence
        self.scope = scope
        self.done = cached
        self.fresh = fresh  # its first prefill (its prompt's blocks go to the prefix cache), not a preempted one's
        self.last_chunk = 0  # the tokens it prefilled in the last step
        past = None if kv is None else [(keys[None], values[None]) for keys, values in kv]
        self.cache = cache_with_past(config, past)

    def left(self) -> int:
        """Its prompt's tokens not prefilled yet."""
        return len(self.sequence.prompt) - self.done


class ContinuousBatcher:
    """The scheduler and the batch state; `step` runs one iteration. Not thread-safe except `add`, `add_group`
    and `cancel`.

    Sequences come in groups (a request's prompts). The waiting room holds at most `max_waiting` sequences; a group
    is queued only while the room left after it is at least its own size, so that large groups are refused first
    and never fill the room single prompts need. Admission is fair across groups: the group holding the fewest
    running sequences goes first, and a group with none yet may preempt a sequence of the group holding the most
    (which keeps at least one), so one request's prompts never hold every slot while another waits. A preempted
    sequence is recomputed when it rejoins: its prompt and the tokens it had generated are prefilled again.
    """

    def __init__(self, lm: CorrectedModel, max_batch_size: int, max_batch_tokens: int | None = None,
                 prefix_cache_tokens: int = PREFIX_CACHE_TOKENS, max_waiting: int | None = None,
                 prefill_chunk_tokens: int | None = None) -> None:
        if max_batch_size < 1:
            raise DartsError(f"max_batch_size must be at least 1, got {max_batch_size}")
        if prefill_chunk_tokens is not None and prefill_chunk_tokens < 1:
            raise DartsError(f"prefill_chunk_tokens must be at least 1, got {prefill_chunk_tokens}")
        check_full_attention(lm.model.config)  # before any request, not at the first join
        use_slot_attention(lm.model)
        self.lm = lm
        self.max_batch_size = max_batch_size
        self.max_batch_tokens = max_batch_tokens
        self.max_waiting = max_waiting
        self.device = next(lm.model.parameters()).device
        # Waiting sequences by group, groups in turn order (a group that had a turn goes to the end).
        self.waiting: dict[object, deque[_Sequence]] = {}
        self.running: list[_Sequence] = []
        # Long prompts prefilling a chunk per step (None: a prompt prefills whole), each with its cache so far.
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.prefilling: list[_Prefilling] = []
        self.borrowed = 0  # prompt tokens of the next step's budget that joiners arriving mid-step prefilled
        self.cache = self._new_cache()
        self.joins = 0
        self.prefixes = PrefixCache(prefix_cache_tokens)
        self.generated_tokens = 0
        self.prompt_tokens = 0
        self.cached_prompt_tokens = 0  # prompt tokens whose keys and values came from the prefix cache
        self.preempted = 0  # sequences put back to wait for a fairer share of the batch
        self._lock = threading.Lock()

    def add(self, request: SequenceRequest, listener: Listener) -> Ticket:
        """Queue one sequence, a group of its own; a DartsError names a request that can never run."""
        return self.add_group([request], [listener])[0]

    def add_group(self, requests: Sequence[SequenceRequest], listeners: Sequence[Listener]) -> list[Ticket]:
        """Queue a request's sequences together; a DartsError names one that can never run (unknown task, too
        long, ...), EngineBusy a full waiting room. Either way none of them is queued."""
        group = object()
        sequences = [self._sequence(request, listener, group) for request, listener in zip(requests, listeners,
                                                                                            strict=True)]
        with self._lock:
            if not self._admits(len(sequences)):
                raise EngineBusy(f"{self.waiting_count()} sequences are waiting; this request's {len(sequences)} do "
                                 f"not fit the waiting room of {self.max_waiting} (serve.max_waiting_sequences)",
                                 "retry in a moment, or send fewer prompts per request")
            self.waiting[group] = deque(sequences)
        return [s.ticket for s in sequences]

    def admits(self, count: int) -> bool:
        """Whether a group of `count` sequences would be queued now."""
        with self._lock:
            return self._admits(count)

    def _admits(self, count: int) -> bool:
        # The room left after the group must be at least its own size: large groups are refused first.
        return self.max_waiting is None or self.waiting_count() + 2 * count <= self.max_waiting

    def _sequence(self, request: SequenceRequest, listener: Listener, group: object) -> _Sequence:
        if not request.ids:
            raise DartsError("a prompt is empty after tokenisation", "send at least one token of text")
        sampling = request.sampling
        if sampling.max_tokens < 1:
            raise DartsError(f"max_new_tokens must be at least 1, got {sampling.max_tokens}")
        if any(not stop for stop in sampling.stop):
            raise DartsError("a stop string is empty", "give stop strings of at least one character")
        if sampling.temperature < 0 or not 0 < sampling.top_p <= 1:
            raise DartsError(f"temperature must be ≥ 0 and top_p in (0, 1], got {sampling.temperature} and "
                             f"{sampling.top_p}")
        if self.max_batch_tokens is not None and len(request.ids) + sampling.max_tokens > self.max_batch_tokens:
            raise DartsError(f"the prompt's {len(request.ids)} tokens and max_tokens {sampling.max_tokens} exceed the "
                             f"batch's token budget of {self.max_batch_tokens}",
                             "shorten the prompt, lower max_tokens, or raise serve.max_batch_tokens")
        eos_ids = set() if sampling.ignore_eos else self.lm.eos_ids
        text = SequenceText(self.lm.tokenizer, eos_ids, sampling.stop, sampling.max_tokens, request.stream)
        return _Sequence(request, listener, Ticket(), group, self.lm.task_index(request.task),
                         new_generator(sampling.seed, self.device), text)

    def waiting_count(self) -> int:
        """Sequences waiting; call it holding the lock (or on the engine's thread alone)."""
        return sum(len(queue) for queue in self.waiting.values())

    def cancel(self, ticket: Ticket) -> None:
        """The sequence leaves at the next step; its listener hears nothing more."""
        ticket.cancelled = True

    def has_work(self) -> bool:
        return bool(self.running or self.waiting or self.prefilling)

    def stats(self) -> EngineStats:
        with self._lock:  # other threads ask (metrics, the event loop) while the engine's thread changes the queue
            waiting = self.waiting_count()
        return EngineStats(waiting, len(self.running) + len(self.prefilling), self.generated_tokens,
                           self.prompt_tokens, self.cached_prompt_tokens, self.preempted)

    @torch.inference_mode()
    def step(self) -> None:
        """Drop the cancelled, let waiting sequences join, prefill them (a long prompt's next chunk, then whoever
        arrived during it), decode one token for every sequence.

        A failed forward fails the sequences it ran (their listeners hear the exception); the batcher goes on.
        """
        self._leave([s for s in self.running if s.ticket.cancelled])
        self.prefilling = [p for p in self.prefilling if not p.sequence.ticket.cancelled]
        spent, self.borrowed = self._admit_and_prefill(self.borrowed), 0
        chunks = self._chunks(spent)
        for chunk, size in chunks:
            self._guarded(self._prefill_chunk, [chunk.sequence], chunk, size)
        if chunks:
            # Who arrived while the chunks prefilled joins before this step's decode, on the next step's budget: its
            # first token waits for the chunk's forward, not for the chunk's and the decode's both.
            self.borrowed = self._admit_and_prefill(0)
        if self.running:
            self._guarded(self._decode, self.running)

    def _admit_and_prefill(self, spent: int) -> int:
        """Admit and prefill whom the batch has room for, with `spent` of the step's prefill budget gone; returns
        the budget spent after them."""
        joining, spent = self._admit(spent)
        if joining:
            # A failed prefill fails its joiners only: the running batch's cache is joined after it succeeds.
            self._guarded(self._prefill, joining, joining)
        return spent

    def _guarded(self, work: Callable[..., None], sequences: list[_Sequence], *args: object) -> None:
        """Run `work`; if it fails, the sequences it ran that had not finished hear the error and leave, the
        running batch's cache is dropped if they were in it, and the engine goes on."""
        try:
            work(*args)
        except Exception as error:
            logger.exception("generation failed for %d sequences", len(sequences))
            failed = [s for s in sequences if not s.done]
            self.prefilling = [p for p in self.prefilling if p.sequence not in sequences]
            if any(s in self.running for s in sequences):
                self.running, self.cache = [s for s in self.running if s not in sequences], self._new_cache()
                # Whoever is left lost its cache with the others': it fails too, rather than decode without it.
                failed += [s for s in self.running if not s.done]
                self.running = []
            for sequence in failed:
                sequence.tell(error)

    def run_until_idle(self) -> None:
        while self.has_work():
            self.step()

    def _admit(self, spent: int) -> tuple[list[_Sequence], int]:
        """Waiting sequences that join now, while the batch has room and the step's prefill budget (`spent` of it
        gone) takes their whole prompts: the group holding the fewest running sequences first (ties: turn order); a
        group with none running may preempt one to get in. Returns them and the budget spent after them."""
        joining: list[_Sequence] = []
        with self._lock:
            # Requests given up while waiting leave the queue (and its count) at once.
            for group, queue in list(self.waiting.items()):
                queue = deque(s for s in queue if not s.ticket.cancelled)
                if queue:
                    self.waiting[group] = queue
                else:
                    del self.waiting[group]
            held = Counter(s.group for s in [*self.running, *(p.sequence for p in self.prefilling)])
            budget = self.prefill_chunk_tokens
            while self.waiting:
                group = min(self.waiting, key=lambda g: held[g])  # min keeps the first of equals: turn order
                sequence = self.waiting[group][0]
                if not self._fits(joining, sequence):
                    if held[group] == 0 and self._preempt(held):
                        continue
                    break  # it waits for room; the others wait behind it, so long prompts never starve
                if budget is not None:  # the step's prefill: whole prompts up to the budget; longer ones in chunks
                    cost = len(sequence.prompt)  # at most: a cached prefix costs nothing
                    if cost <= budget:
                        if spent + cost > budget:
                            break  # the step's prefill is full: it joins at the next
                        spent += cost
                joining.append(self.waiting[group].popleft())
                held[group] += 1
                queue = self.waiting.pop(group)
                if queue:
                    self.waiting[group] = queue  # its turn is over: to the end
        return joining, spent

    def _new_cache(self) -> SlotCache:
        return SlotCache(self.lm.model.config, self.max_batch_tokens)

    def _slot(self, sequence: _Sequence) -> int:
        """The width of its slot: it never grows past its prompt + max_tokens."""
        return slot_width(sequence.reserved, self.max_batch_tokens)

    def _fits(self, joining: list[_Sequence], sequence: _Sequence) -> bool:
        """Whether `sequence` fits beside the running and joining ones: their slots within the token budget."""
        admitted = [*self.running, *(p.sequence for p in self.prefilling), *joining, sequence]
        if len(admitted) > self.max_batch_size:
            return False
        return self.max_batch_tokens is None or sum(map(self._slot, admitted)) <= self.max_batch_tokens

    def _preempt(self, held: Counter) -> bool:
        """Put back one running sequence of the group running the most (if it runs more than one): the newest of
        them, at the front of its group's queue. False when no group can give one up."""
        running = Counter(s.group for s in self.running)
        group, count = max(running.items(), key=lambda item: item[1], default=(None, 0))
        if count < 2:
            return False
        victim = max((s for s in self.running if s.group is group), key=lambda s: s.joined)
        self._leave([victim])
        held[group] -= 1
        self.preempted += 1
        self.waiting.setdefault(group, deque()).appendleft(victim)
        return True

    def _prefill(self, joining: list[_Sequence]) -> None:
        """The joiners' prompts, their KV cache joined to the batch's and their first tokens drawn: one forward per
        length of cached prefix among them.

        Routed sequences are routed first, on the merged model's hidden states of their prompts. A prompt's
        cached prefix is not computed again: its keys and values sit before the rest of the prompt. Joiners whose
        cached prefixes differ in length go in separate forwards: in one, every row would carry the longest prefix
        and the longest rest, up to twice its prompt, past `max_batch_tokens`.
        """
        fresh = [s for s in joining if not s.started]  # a preempted sequence keeps its routing
        if fresh:
            in_prefill = self.lm.routes_in_prefill  # else a pass of the router's own over the prompts first
            weights, applied = self.lm.task_weights([s.task_index for s in fresh], [s.request.ids for s in fresh],
                                                    route=not in_prefill)
            for row, sequence in enumerate(fresh):
                sequence.weights = None if weights is None else weights[row]
                if applied[row] is None:  # routed by its own prefill, which computes its whole prompt
                    sequence.pool = PromptPool()
                else:
                    sequence.applied = applied[row]
                sequence.started = True
            self.prompt_tokens += sum(len(s.request.ids) for s in fresh)
        groups: dict[int, list[_Joiner]] = {}
        for sequence in joining:
            sequence.length = len(sequence.prompt)
            # The prefix cache's scope: the client's salt, and the correction where it changes the keys and values.
            correction = (tuple(sequence.weights.tolist()) if sequence.weights is not None and self.lm.corrects_kv
                          else None)
            scope = (sequence.request.cache_salt, correction)
            # A prompt routed in its prefill is computed whole: the router pools every token's states.
            cached, kv = (0, None) if sequence.pool is not None else self.prefixes.lookup(scope, sequence.prompt)
            if sequence in fresh:
                self.cached_prompt_tokens += cached
            if self.prefill_chunk_tokens is not None and sequence.length - cached > self.prefill_chunk_tokens:
                self.prefilling.append(_Prefilling(sequence, scope, cached, kv, sequence in fresh,
                                                   self.lm.model.config))
                continue
            groups.setdefault(cached, []).append((sequence, scope, kv))
        for cached, group in groups.items():  # a failed forward fails its own group only
            self._guarded(self._prefill_group, [sequence for sequence, _, _ in group], cached, group, fresh)

    def _prefill_group(self, cached: int, group: list[_Joiner], fresh: list[_Sequence]) -> None:
        """One forward over joiners whose first `cached` prompt tokens are in the prefix cache: the rest of each
        prompt left-padded after the cached keys and values; the mask and position ids say where each token is."""
        sequences = [sequence for sequence, _, _ in group]
        input_ids, mask = token_batch([s.prompt[cached:] for s in sequences], self.lm.pad_id, side="left")
        positions = mask_positions(mask) + cached * mask
        past = self._past([kv for _, _, kv in group])
        if past is not None:
            mask = torch.cat([mask.new_ones(len(group), cached), mask], dim=1)
        cache = cache_with_past(self.lm.model.config, past)
        logits = self._forward(input_ids, mask, positions, cache, sequences)
        for row, (sequence, scope, _) in enumerate(group):
            if sequence in fresh:
                self._store_prefix(scope, sequence, cache, row, mask[row])
        self._join(sequences, cache, mask, logits)

    def _chunks(self, spent: int) -> list[tuple[_Prefilling, int]]:
        """This step's chunks: what is left of `prefill_chunk_tokens` after the joiners' whole prompts, to the prompts
        with the fewest tokens left first (so a prompt just over the budget is not held behind a very long one), and
        a quarter of the budget to the oldest when it had less the step before: nothing holds it back for ever, and a
        short prompt arriving beside it prefills as fast as alone every other step (a chunk of the long one each step
        made every step of the short one's prefill dearer)."""
        if not self.prefilling:
            return []
        left = max(0, self.prefill_chunk_tokens - spent)
        sizes: dict[_Prefilling, int] = {}
        for chunk in sorted(self.prefilling, key=_Prefilling.left):
            if left == 0:
                break
            sizes[chunk] = min(left, chunk.left())
            left -= sizes[chunk]
        oldest, quarter = self.prefilling[0], max(1, self.prefill_chunk_tokens // 4)
        if oldest.last_chunk < quarter:
            sizes[oldest] = max(sizes.get(oldest, 0), min(oldest.left(), quarter))
        for chunk in self.prefilling:
            chunk.last_chunk = sizes.get(chunk, 0)
        return list(sizes.items())

    def _prefill_chunk(self, chunk: _Prefilling, size: int) -> None:
        """The next `size` tokens of a long prompt, on its own cache; with its last chunk it joins the batch and draws
        its first token."""
        sequence, prompt = chunk.sequence, chunk.sequence.prompt
        end = min(len(prompt), chunk.done + size)
        input_ids = torch.tensor([prompt[chunk.done:end]])
        positions = torch.arange(chunk.done, end)[None]
        mask = torch.ones(1, end, dtype=torch.long)
        logits = self._forward(input_ids, mask, positions, chunk.cache, [sequence], last=end == len(prompt))
        chunk.done = end
        if end < len(prompt):
            return
        self.prefilling.remove(chunk)
        if chunk.fresh:
            self._store_prefix(chunk.scope, sequence, chunk.cache, 0, mask[0])
        self._join([sequence], chunk.cache, mask, logits)

    def _store_prefix(self, scope: CacheScope, sequence: _Sequence, cache: DynamicCache, row: int,
                      mask: torch.Tensor) -> None:
        """Keep a prefilled prompt's blocks in the prefix cache (prompts only, not what was generated)."""
        if self.prefixes.keeps(sequence.prompt):
            columns = mask.nonzero().squeeze(1).to(self.device)
            self.prefixes.store(scope, sequence.prompt, [(layer.keys[row][:, columns], layer.values[row][:, columns])
                                                         for layer in cache.layers])

    def _join(self, sequences: list[_Sequence], cache: DynamicCache, mask: torch.Tensor,
              logits: torch.Tensor) -> None:
        """Prefilled sequences join the running batch, their tokens (the mask's columns) copied into their slots, and
        draw their first tokens."""
        mask = mask.to(self.device)
        try:
            for row, sequence in enumerate(sequences):
                columns = mask[row].nonzero().squeeze(1)
                self.cache.add(sequence, [(layer.keys[row][:, columns], layer.values[row][:, columns])
                                          for layer in cache.layers], self._slot(sequence))
                self.joins += 1
                sequence.joined = self.joins
        finally:  # a join that failed half-way leaves the batch as the cache holds it, for `_guarded` to fail
            self.running = self.cache.order()
        self._advance(sequences, logits)

    @staticmethod
    def _past(found: list[LayerKV | None]) -> LayerKV | None:
        """The joiners' cached prefixes, all of one length, as one batch past [B, heads, P, head_dim] per layer."""
        if found[0] is None:
            return None
        return [(torch.stack([kv[layer][0] for kv in found]), torch.stack([kv[layer][1] for kv in found]))
                for layer in range(len(found[0]))]

    def _decode(self) -> None:
        running = self.running
        input_ids = torch.tensor([[s.pending] for s in running])
        positions = torch.tensor([[s.length] for s in running])
        mask = self.cache.begin_decode([s.length for s in running], self.device)
        logits = self._forward(input_ids, mask, positions, self.cache, running)
        for sequence in running:
            sequence.length += 1
        self._advance(running, logits)

    def _forward(self, input_ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor,
                 cache: DynamicCache | SlotCache, sequences: list[_Sequence], last: bool = True) -> torch.Tensor:
        """Last-position logits [B, V] of one forward, each row under its own sequence's correction; prompts routed
        in their prefill are routed in it (`last`: it holds their prompts' last tokens) before any correction."""
        weights = None if sequences[0].weights is None else torch.stack([s.weights for s in sequences])
        pools = {row: s.pool for row, s in enumerate(sequences) if s.pool is not None}
        tokens = mask[:, -input_ids.shape[1]:] if mask.ndim == 2 else mask  # the input's columns of a prefill's mask
        with self.lm.weighted(weights), self.lm.routing_in_forward(weights, pools, tokens, last) as decided:
            output = self.lm.model(input_ids=input_ids.to(self.device), attention_mask=mask.to(self.device),
                                   position_ids=positions.to(self.device), cache=cache, use_cache=True,
                                   logits_to_keep=1)
        for row, (row_weights, applied) in decided.items():
            sequences[row].weights, sequences[row].applied, sequences[row].pool = row_weights, applied, None
        return output.logits[:, -1]

    def _advance(self, sequences: list[_Sequence], logits: torch.Tensor) -> None:
        """Draw each sequence's next token (the joiners' after a prefill, everyone's after a decode); hand out
        its text; finished sequences leave the batch."""
        settings = [s.request.sampling for s in sequences]
        tokens = next_tokens(logits, [s.temperature for s in settings], [s.top_p for s in settings],
                             [s.generator for s in sequences])
        self.generated_tokens += len(tokens)
        finished = []
        for sequence, token in zip(sequences, tokens):
            sequence.batch_size = max(sequence.batch_size, len(self.running))
            delta, reason = sequence.text.add(token)
            if delta and sequence.request.stream:
                sequence.tell(delta)
            if reason is None:
                sequence.pending = token
                continue
            task, confidence = sequence.applied
            completion = sequence.text.completion(len(sequence.request.ids), reason)
            if sequence.request.stream and sequence.text.rest():
                sequence.tell(sequence.text.rest())
            sequence.tell(Finished(replace(completion, task=task, confidence=confidence), sequence.batch_size))
            finished.append(sequence)
        self._leave(finished)

    def _leave(self, leaving: list[_Sequence]) -> None:
        if not leaving:
            return
        for sequence in leaving:
            self.cache.remove(sequence)
        self.running = self.cache.order()


class EngineThread:
    """A `ContinuousBatcher` stepping on a thread of its own while it has work: the `Engine` of a server.

    `build` makes the batcher (its model loaded) on that same thread, before the first step, so that one thread does
    the process's torch work (`darts_dist.torch_thread`: a model loaded on another thread decoded at one core's
    speed); its error is raised here.
    """

    def __init__(self, build: Callable[[], ContinuousBatcher]) -> None:
        self._wake = threading.Condition()
        self._closed = False
        self._thread = TorchThread("darts-engine")
        try:
            self.batcher = self._thread.run(build)
        except BaseException:
            self._thread.close()
            raise
        self._loop_done = self._thread.start(self._loop)

    def submit(self, requests: Sequence[SequenceRequest], listeners: Sequence[Listener]) -> list[Ticket]:
        with self._wake:
            if self._closed:  # nothing would ever answer it
                raise EngineStopped("the generation engine stopped", "send the request again")
            tickets = self.batcher.add_group(requests, listeners)
            self._wake.notify()
        return tickets

    def cancel(self, ticket: Ticket) -> None:
        self.batcher.cancel(ticket)

    def admits(self, count: int) -> bool:
        return self.batcher.admits(count)

    def stats(self) -> EngineStats:
        return self.batcher.stats()

    def close(self) -> None:
        """Stop stepping; sequences still waiting or running hear that the engine stopped."""
        with self._wake:
            self._closed = True
            self._wake.notify()
        self._loop_done.result()
        self._thread.close()
        stopped = EngineStopped("the generation engine stopped", "send the request again")
        batcher = self.batcher
        for sequence in [*batcher.running, *(p.sequence for p in batcher.prefilling),
                         *(s for queue in batcher.waiting.values() for s in queue)]:
            sequence.tell(stopped)

    def _loop(self) -> None:
        while True:
            with self._wake:
                self._wake.wait_for(lambda: self._closed or self.batcher.has_work())
                if self._closed:
                    return
            try:
                self.batcher.step()
            except Exception:  # a bug outside any forward: logged, and the thread serves on
                logger.exception("an engine step failed")
