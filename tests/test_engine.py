"""The continuous-batching engine: per-sequence tasks, sampling and seeds inside one running batch, checked
against transformers' own generate() and against each sequence generated alone."""

from __future__ import annotations

import math
import threading
import time

import pytest
import torch
from test_generation import PROMPTS, TASKS, strong_corrections

from darts_dist.core import CorrectionSpec, DartsCorrections, one_hot_tasks, token_batch
from darts_dist.errors import DartsError
from darts_dist.generation import (
    Completion,
    ContinuousBatcher,
    CorrectedLM,
    EngineBusy,
    EngineStopped,
    EngineThread,
    Finished,
    Sampling,
    SequenceRequest,
)
from darts_dist.generation.kv_cache import PREFIX_BLOCK, SlotCache, slot_width
from darts_dist.generation.sampling import next_tokens, top_p_probabilities
from darts_dist.generation.text import SequenceText
from darts_dist.sources.models import BUNDLED_TOKENIZER, load_tokenizer

MORE = ["def scale(values, k):", "Question: 3 + 4 =", "Instruction: Name a colour", "import numpy as"]


@pytest.fixture(scope="module")
def lm(tiny_family) -> CorrectedLM:
    merged = CorrectedLM.load(tiny_family.base)
    return CorrectedLM(merged.model, merged.tokenizer, strong_corrections(merged.model.config.hidden_size))


def reference(lm: CorrectedLM, prompts: list[str], tasks: list[str | None], max_new_tokens: int) -> list[list[int]]:
    """transformers' generate(), greedy, on a left-padded batch with each row's correction set on the hooks."""
    encoded = [lm.encode(p) for p in prompts]
    input_ids, mask = token_batch(encoded, lm.pad_id, side="left")
    weights = one_hot_tasks(torch.tensor([lm.task_index(t) for t in tasks]), len(lm.tasks))
    with lm.weighted(weights), torch.no_grad():
        out = lm.model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                                do_sample=False, pad_token_id=lm.pad_id, eos_token_id=None)
    return out[:, input_ids.shape[1]:].tolist()


class Collect:
    """A listener per sequence: its text pieces and its Finished event."""

    def __init__(self) -> None:
        self.pieces: list[str] = []
        self.finished: Finished | None = None

    def __call__(self, event) -> None:
        if isinstance(event, Exception):
            raise event
        if isinstance(event, Finished):
            self.finished = event
        else:
            self.pieces.append(event)


def greedy(max_tokens: int, **options) -> Sampling:
    return Sampling(max_tokens, **options)


def test_greedy_tokens_equal_transformers_generate_under_each_rows_correction(lm: CorrectedLM) -> None:
    prompts, tasks = PROMPTS + MORE[:1], ["code", None, "math", "math"]
    expected = reference(lm, prompts, tasks, 10)
    batcher = ContinuousBatcher(lm, max_batch_size=4)
    listeners = [Collect() for _ in prompts]
    for prompt, task, listener in zip(prompts, tasks, listeners):
        batcher.add(SequenceRequest(tuple(lm.encode(prompt)), task, greedy(10)), listener)
    batcher.run_until_idle()
    # What the engine emits: transformers' tokens as text, all ten of them (no end-of-sequence among them).
    for listener, tokens in zip(listeners, expected):
        completion = listener.finished.completion
        assert completion.text == lm.tokenizer.decode(tokens, skip_special_tokens=True)
        assert (completion.completion_tokens, completion.finish_reason) == (10, "length")


def test_a_sequence_joining_a_running_batch_gets_its_text_alone(lm: CorrectedLM) -> None:
    alone = {(p, t): lm.generate([p], [t], max_new_tokens=16)[0] for p, t in
             [(PROMPTS[0], "code"), (MORE[1], "math"), (MORE[2], None), (PROMPTS[1], "code")]}
    batcher = ContinuousBatcher(lm, max_batch_size=3)
    listeners = {}

    def add(prompt: str, task: str | None) -> None:
        listeners[prompt, task] = Collect()
        batcher.add(SequenceRequest(tuple(lm.encode(prompt)), task, greedy(16)), listeners[prompt, task])

    add(PROMPTS[0], "code")
    for _ in range(5):
        batcher.step()
    add(MORE[1], "math")  # joins mid-way, with a shorter prompt
    batcher.step()
    add(MORE[2], None)
    add(PROMPTS[1], "code")  # waits: the batch is full until someone finishes
    batcher.run_until_idle()
    for key, listener in listeners.items():
        assert listener.finished.completion == alone[key], key
    assert listeners[MORE[1], "math"].finished.batch_size >= 2


def test_a_seeded_sample_is_the_same_alone_and_in_a_mixed_batch(lm: CorrectedLM) -> None:
    sampled = Sampling(12, temperature=1.0, top_p=0.9, seed=7)
    [alone] = lm.generate_ids([lm.encode(PROMPTS[1])], ["math"], max_new_tokens=12, temperature=1.0, top_p=0.9,
                              seed=7)
    batcher = ContinuousBatcher(lm, max_batch_size=8)
    mine = Collect()
    batcher.add(SequenceRequest(tuple(lm.encode(MORE[0])), "code", Sampling(12, temperature=0.7, seed=3)), Collect())
    batcher.add(SequenceRequest(tuple(lm.encode(MORE[3])), None, greedy(4)), Collect())
    batcher.step()
    batcher.step()
    batcher.add(SequenceRequest(tuple(lm.encode(PROMPTS[1])), "math", sampled), mine)
    batcher.add(SequenceRequest(tuple(lm.encode(PROMPTS[2])), "code", Sampling(9, temperature=1.5, seed=7)), Collect())
    batcher.run_until_idle()
    assert mine.finished.completion == alone
    # Another seed draws another text: the seed is really used.
    [other] = lm.generate_ids([lm.encode(PROMPTS[1])], ["math"], max_new_tokens=12, temperature=1.0, top_p=0.9,
                              seed=8)
    assert other.text != alone.text


def test_streamed_pieces_add_up_to_the_text_and_stop_before_a_stop_string(lm: CorrectedLM) -> None:
    [full] = lm.generate([MORE[0]], ["code"], max_new_tokens=20)
    stop = full.text[5:8]
    batcher = ContinuousBatcher(lm, max_batch_size=2)
    listeners = [Collect(), Collect()]
    for listener, stops in zip(listeners, [(), (stop,)]):
        batcher.add(SequenceRequest(tuple(lm.encode(MORE[0])), "code", greedy(20, stop=stops), stream=True), listener)
    batcher.run_until_idle()
    plain, cut = listeners
    assert "".join(plain.pieces) == plain.finished.completion.text == full.text
    assert len([p for p in plain.pieces if p]) > 1
    assert "".join(cut.pieces) == cut.finished.completion.text == full.text[: full.text.find(stop)]
    assert cut.finished.completion.finish_reason == "stop"


def test_a_stop_string_longer_than_the_text_so_far_is_held_back_whole(lm: CorrectedLM) -> None:
    """Held back is the last len(stop) - 1 characters, and while the text is shorter than that, all of it: the
    stream never hands out the beginning of a stop string that the full answer then cuts (stream == full)."""
    [full] = lm.generate([MORE[0]], ["code"], max_new_tokens=20)
    stop = full.text[3:18]
    assert len(stop) == 15 and full.text.find(stop) == 3, full.text
    listener = Collect()
    batcher = ContinuousBatcher(lm, max_batch_size=1)
    batcher.add(SequenceRequest(tuple(lm.encode(MORE[0])), "code", greedy(20, stop=(stop,)), stream=True), listener)
    batcher.run_until_idle()
    assert listener.finished.completion.text == full.text[:3]
    assert "".join(listener.pieces) == full.text[:3]


def test_a_fast_tokenizer_decodes_each_token_once_and_the_stream_is_the_whole_text() -> None:
    """With the bundled (SmolLM2) tokenizer, characters split over several byte-level tokens included: the pieces
    handed out add up to decode(all tokens), nothing is re-decoded while the answer grows (the tokenizers library's
    streaming decoder), and a stop string far into the answer is found in its new end."""
    tokenizer = load_tokenizer(BUNDLED_TOKENIZER)
    text = "Voilà: 3 × 4 = 12 🙂, naïve café —\n" * 40 + "STOP and then more"
    tokens = tokenizer(text, add_special_tokens=False)["input_ids"]
    whole = tokenizer.decode(tokens, skip_special_tokens=True)
    for stop, expected in (((), whole), (("STOP",), whole[: whole.find("STOP")])):
        decoded = SequenceText(tokenizer, set(), stop, len(tokens), stream=True)
        calls = []
        real = tokenizer.decode
        tokenizer.decode = lambda *a, **k: (calls.append(a), real(*a, **k))[1]
        try:
            pieces, reason = [], None
            for token in tokens:
                piece, reason = decoded.add(token)
                pieces.append(piece)
                if reason is not None:
                    break
        finally:
            del tokenizer.decode
        assert calls == []
        completion = decoded.completion(0, reason)
        assert "".join(pieces) + decoded.rest() == completion.text == expected
        assert len([p for p in pieces if p]) > 100


def counts(batcher: ContinuousBatcher) -> tuple[int, int, int]:
    stats = batcher.stats()
    return stats.waiting, stats.running, stats.generated_tokens


def test_a_cancelled_sequence_frees_its_slot_at_the_next_step(lm: CorrectedLM) -> None:
    batcher = ContinuousBatcher(lm, max_batch_size=1)
    long, short = Collect(), Collect()
    ticket = batcher.add(SequenceRequest(tuple(lm.encode(PROMPTS[0])), "code", greedy(200)), long)
    batcher.add(SequenceRequest(tuple(lm.encode(MORE[1])), "math", greedy(3)), short)
    for _ in range(3):  # a prefill and a decode, then two decodes: 4 tokens
        batcher.step()
    assert counts(batcher) == (1, 1, 4)
    batcher.cancel(ticket)
    batcher.step()  # the cancelled one leaves; the waiting one joins, is prefilled and decoded in the same step
    assert counts(batcher) == (0, 1, 6)
    batcher.run_until_idle()
    assert long.finished is None
    assert short.finished.completion == lm.generate([MORE[1]], ["math"], max_new_tokens=3)[0]
    assert counts(batcher) == (0, 0, 7)


def test_the_token_budget_bounds_the_sum_of_the_sequences_slots(lm: CorrectedLM) -> None:
    prompts = [lm.encode(p) for p in MORE[:3]]
    slot = slot_width(max(len(ids) for ids in prompts) + 8, None)
    batcher = ContinuousBatcher(lm, max_batch_size=8, max_batch_tokens=2 * slot)
    listeners = [Collect() for _ in prompts]
    for ids, listener in zip(prompts, listeners):  # each fills a slot of that width exactly
        batcher.add(SequenceRequest(tuple(ids), None, greedy(slot - len(ids))), listener)
    batcher.step()
    assert counts(batcher)[:2] == (1, 2)  # two slots fit, a third would not
    assert batcher.cache.allocated() <= 2 * slot  # the slots allocated stay within the budget
    batcher.run_until_idle()
    assert [listener.finished.batch_size for listener in listeners][:2] == [2, 2]
    assert all(listener.finished.batch_size <= 2 for listener in listeners)
    with pytest.raises(DartsError, match="token budget"):
        batcher.add(SequenceRequest(tuple(prompts[0]), None, greedy(4 * slot)), Collect())


def test_a_long_prompt_takes_a_slot_of_its_own_width_and_no_step_copies_the_others(lm: CorrectedLM) -> None:
    """Short streams decode in their band's slots; a long prompt joins a band of its own, beside them within a budget
    that rows × its width would exceed; then every step writes in place (no band is copied); every answer equals its
    sequence generated alone."""
    short = [MORE[0], MORE[1], PROMPTS[0]]
    long_prompt = " ".join(["Question: what is 12 times 13, and why?"] * 12)
    long_ids = lm.encode(long_prompt)
    short_slot, long_slot = slot_width(max(len(lm.encode(p)) for p in short) + 12, None), slot_width(len(long_ids) + 8, None)
    assert long_slot >= 4 * short_slot
    budget = 3 * short_slot + long_slot
    assert 4 * long_slot > budget  # a rectangular cache of 4 rows of the long one's width would not fit
    batcher = ContinuousBatcher(lm, max_batch_size=4, max_batch_tokens=budget)
    listeners = [Collect() for _ in short]
    for prompt, listener in zip(short, listeners):
        batcher.add(SequenceRequest(tuple(lm.encode(prompt)), "code", greedy(12)), listener)
    batcher.step()
    long_listener = Collect()
    batcher.add(SequenceRequest(tuple(long_ids), "math", greedy(8)), long_listener)
    batcher.step()
    assert sorted(batcher.cache.bands) == [short_slot, long_slot] and len(batcher.running) == 4
    assert batcher.cache.allocated() <= budget
    where = {width: [keys.data_ptr() for keys in band.keys] for width, band in batcher.cache.bands.items()}
    for _ in range(3):
        batcher.step()
        assert {width: [keys.data_ptr() for keys in band.keys] for width, band in batcher.cache.bands.items()} == where
    batcher.run_until_idle()
    assert [listener.finished.completion for listener in listeners] == lm.generate(short, ["code"] * 3,
                                                                                   max_new_tokens=12)
    assert long_listener.finished.completion == lm.generate([long_prompt], ["math"], max_new_tokens=8)[0]
    assert long_listener.finished.batch_size == 4
    assert batcher.cache.bands == {}  # every slot freed


def test_a_band_gives_back_its_unused_rows_when_another_width_needs_the_budget(lm: CorrectedLM) -> None:
    config = lm.model.config
    layers, heads = config.num_hidden_layers, config.num_key_value_heads
    head_dim = config.hidden_size // config.num_attention_heads

    def tokens(length: int, value: float) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(torch.full((heads, length, head_dim), value), torch.full((heads, length, head_dim), -value))
                for _ in range(layers)]

    cache = SlotCache(config, budget=3 * 16 + 64)
    for owner in range(3):
        cache.add(owner, tokens(5, owner + 1.0), 16)
    assert cache.bands[16].capacity == 7  # its first rows, as many as the budget allows
    cache.add("long", tokens(40, 9.0), 64)
    assert cache.bands[16].capacity == 3 and cache.bands[64].capacity == 1 and cache.allocated() == 3 * 16 + 64
    assert cache.order() == [0, 1, 2, "long"]
    cache.remove(0)  # the band's last row moves into the freed one
    assert cache.order() == [2, 1, "long"]
    band = cache.bands[16]
    assert torch.equal(band.keys[0][0, :, :5], torch.full((heads, 5, head_dim), 3.0))
    assert torch.equal(band.values[-1][1, :, :5], torch.full((heads, 5, head_dim), -2.0))
    with pytest.raises(RuntimeError, match="no room"):  # the batcher admits by the same budget: never by input
        cache.add("too many", tokens(40, 1.0), 64)
    assert sorted(cache.bands) == [16, 64] and cache.order() == [2, 1, "long"]


def test_a_request_arriving_behind_a_large_one_joins_at_once_and_every_answer_stays_exact(lm: CorrectedLM) -> None:
    """Fairness: a request of many prompts holds the whole batch; a one-prompt request arriving later preempts one
    of them at the next step instead of waiting for them to finish. The preempted sequence is recomputed when it
    rejoins, and every greedy answer still equals the sequence generated alone."""
    batcher = ContinuousBatcher(lm, max_batch_size=4)
    bulk = [Collect() for _ in range(6)]
    prompts = (MORE + PROMPTS)[:6]
    batcher.add_group([SequenceRequest(tuple(lm.encode(p)), "code", greedy(24)) for p in prompts], bulk)
    for _ in range(5):
        batcher.step()
    assert counts(batcher)[:2] == (2, 4)  # the large request holds every slot
    late = Collect()
    batcher.add(SequenceRequest(tuple(lm.encode(MORE[1])), "math", greedy(5)), late)
    batcher.step()
    assert batcher.stats().preempted == 1
    assert any(s.request.ids == tuple(lm.encode(MORE[1])) for s in batcher.running)  # it joined at once
    for _ in range(4):
        batcher.step()
    assert late.finished is not None and all(c.finished is None for c in bulk)  # done long before the others
    batcher.run_until_idle()
    assert late.finished.completion == lm.generate([MORE[1]], ["math"], max_new_tokens=5)[0]
    assert [c.finished.completion for c in bulk] == lm.generate(prompts, ["code"] * 6, max_new_tokens=24)


def test_groups_take_turns(lm: CorrectedLM) -> None:
    batcher = ContinuousBatcher(lm, max_batch_size=2)
    first, second = [Collect() for _ in range(3)], [Collect() for _ in range(3)]
    batcher.add_group([SequenceRequest(tuple(lm.encode(p)), None, greedy(3)) for p in MORE[:3]], first)
    batcher.add_group([SequenceRequest(tuple(lm.encode(p)), None, greedy(3)) for p in MORE[1:]], second)
    batcher.step()
    assert {s.group for s in batcher.running} == set(batcher.waiting)  # one of each group runs, the rest wait
    assert batcher.stats().preempted == 0  # each group holds one: neither gives it up
    batcher.run_until_idle()
    assert all(c.finished is not None for c in first + second)


def test_a_full_waiting_room_refuses_the_whole_request_larger_ones_first(lm: CorrectedLM) -> None:
    batcher = ContinuousBatcher(lm, max_batch_size=1, max_waiting=8)
    request = SequenceRequest(tuple(lm.encode(MORE[0])), None, greedy(2))
    batcher.add_group([request] * 3, [Collect() for _ in range(3)])  # 3 waiting: room for 5 more
    with pytest.raises(EngineBusy, match="max_waiting_sequences"):
        batcher.add_group([request] * 3, [Collect() for _ in range(3)])  # 6 would leave less room than it takes
    assert batcher.stats().waiting == 3  # none of the refused request's sequences was queued
    batcher.add_group([request] * 2, [Collect() for _ in range(2)])  # 5 waiting: room for 3
    with pytest.raises(EngineBusy):
        batcher.add_group([request] * 2, [Collect() for _ in range(2)])  # would leave 1, less than its 2
    batcher.add(request, Collect())  # leaves 2, at least its 1
    batcher.add(request, Collect())  # leaves 1
    with pytest.raises(EngineBusy):
        batcher.add(request, Collect())  # would leave none
    batcher.run_until_idle()
    assert batcher.stats().waiting == 0


def test_a_long_prompt_prefills_a_chunk_per_step_beside_the_streams_and_answers_as_prefilled_whole(
        lm: CorrectedLM) -> None:
    """With prefill_chunk_tokens, a prompt longer than a chunk takes one chunk a step in a cache of its own while the
    running stream decodes a token every step; it joins with its last chunk and answers as transformers' generate
    does on the whole prompt; sent again, its cached prefix is taken and only the rest chunked, same answer."""
    long_text = " ".join(MORE * 3)
    chunk = len(lm.encode(MORE[0]))  # the short prompt prefills whole
    chunks = math.ceil(len(lm.encode(long_text)) / chunk)
    assert chunks >= 4
    batcher = ContinuousBatcher(lm, max_batch_size=4, prefill_chunk_tokens=chunk)
    stream = Collect()
    batcher.add(SequenceRequest(tuple(lm.encode(MORE[0])), "code", greedy(chunks + 8)), stream)
    batcher.step()  # the short prompt prefilled whole: it decodes from now on
    joiner = Collect()
    batcher.add(SequenceRequest(tuple(lm.encode(long_text)), "math", greedy(5)), joiner)
    for _ in range(chunks - 1):
        generated = batcher.stats().generated_tokens
        batcher.step()
        assert batcher.stats().generated_tokens == generated + 1  # the stream's token; none yet for the long prompt
        assert batcher.stats().running == 2 and len(batcher.running) == 1
    batcher.step()  # the last chunk: the long prompt joins, draws its first token, and both decode
    assert len(batcher.running) == 2 and not batcher.prefilling
    batcher.run_until_idle()
    for listener, prompt, task, tokens in ((joiner, long_text, "math", 5), (stream, MORE[0], "code", chunks + 8)):
        expected = reference(lm, [prompt], [task], tokens)[0]
        assert listener.finished.completion.text == lm.tokenizer.decode(expected, skip_special_tokens=True)
    again = Collect()
    cached_before = batcher.stats().cached_prompt_tokens
    batcher.add(SequenceRequest(tuple(lm.encode(long_text)), "math", greedy(5)), again)
    batcher.run_until_idle()
    assert batcher.stats().cached_prompt_tokens > cached_before
    assert again.finished.completion == joiner.finished.completion


def test_a_steps_prefill_takes_whole_prompts_up_to_the_chunk_budget_and_the_rest_wait_a_step(lm: CorrectedLM) -> None:
    prompt = tuple(lm.encode(MORE[1]))
    batcher = ContinuousBatcher(lm, max_batch_size=8, prefill_chunk_tokens=2 * len(prompt))
    listeners = [Collect() for _ in range(3)]
    for listener in listeners:
        batcher.add(SequenceRequest(prompt, "math", greedy(4)), listener)
    batcher.step()
    assert (len(batcher.running), batcher.stats().waiting) == (2, 1)  # two prompts fill the step's budget
    batcher.step()
    assert (len(batcher.running), batcher.stats().waiting) == (3, 0)
    batcher.run_until_idle()
    assert len({listener.finished.completion.text for listener in listeners}) == 1


def test_a_prompt_just_over_the_budget_is_not_held_behind_a_very_long_one(lm: CorrectedLM) -> None:
    """Chunks go to the prompts with the fewest tokens left first; the oldest still gets a quarter of the budget
    every other step, however many shorter prompts keep coming."""
    medium = tuple(lm.encode(" ".join(MORE)))
    budget = len(medium) - 2
    long = tuple(lm.encode(" ".join(MORE * 8)))
    assert len(long) > 6 * budget
    batcher = ContinuousBatcher(lm, max_batch_size=4, prefill_chunk_tokens=budget)
    first, second = Collect(), Collect()
    batcher.add(SequenceRequest(long, "code", greedy(2)), first)
    batcher.step()
    batcher.add(SequenceRequest(medium, "math", greedy(5)), second)
    batcher.step()  # the medium prompt takes the budget (the long one had a whole chunk the step before)
    batcher.step()  # the medium prompt's last 2 tokens: it joins and draws its first token
    assert [s.request.ids for s in batcher.running] == [medium] and batcher.prefilling[0].sequence.request.ids == long
    assert batcher.prefilling[0].done == budget + (budget - 2)  # then what the medium one left
    # A medium prompt arriving every step takes the budget first; the long one still gets a quarter every other step.
    others = [Collect() for _ in range(6)]
    for index, listener in enumerate(others):
        before = batcher.prefilling[0].done
        other = tuple(lm.encode(f"{index} " + " ".join(MORE)))  # no prefix cached: each prefills in chunks
        assert len(other) > budget
        batcher.add(SequenceRequest(other, "math", greedy(1)), listener)
        batcher.step()
        progress = batcher.prefilling[0].done - before
        assert progress in (0, budget // 4)
    assert batcher.prefilling[0].done == 2 * budget - 2 + 3 * (budget // 4)
    batcher.run_until_idle()
    assert second.finished.completion == lm.generate([" ".join(MORE)], ["math"], max_new_tokens=5)[0]
    assert first.finished.completion == lm.generate([" ".join(MORE * 8)], ["code"], max_new_tokens=2)[0]
    assert all(listener.finished is not None for listener in others)


def test_a_prompt_arriving_while_a_chunk_prefills_joins_before_the_steps_decode_on_the_next_steps_budget(
        lm: CorrectedLM) -> None:
    """Its first token waits for the chunk's forward, not for the chunk's and the decode's both; the tokens it
    prefilled come out of the next step's budget, so the long prompt's next chunk is smaller by them."""
    short, long = tuple(lm.encode(MORE[1])), tuple(lm.encode(" ".join(MORE * 8)))
    budget = 2 * len(short)
    assert len(long) > 4 * budget
    batcher = ContinuousBatcher(lm, max_batch_size=4, prefill_chunk_tokens=budget)
    stream, first, late = Collect(), Collect(), Collect()
    batcher.add(SequenceRequest(tuple(lm.encode(MORE[0])), "code", greedy(40)), stream)
    batcher.step()
    batcher.add(SequenceRequest(long, "code", greedy(2)), first)
    batcher.step()  # the long prompt's first chunk (after its cached prefix): the whole budget
    done = batcher.prefilling[0].done
    chunk_forward = batcher._prefill_chunk

    def arriving_during(chunk, size) -> None:  # as a request from the event loop's thread would, mid-forward
        chunk_forward(chunk, size)
        batcher.add(SequenceRequest(short, "math", greedy(3)), late)

    batcher._prefill_chunk = arriving_during
    batcher.step()
    del batcher._prefill_chunk
    joined = [s for s in batcher.running if s.request.ids == short]
    assert joined and len(joined[0].text.tokens) == 2  # its first token at its prefill, its second at the decode
    assert batcher.prefilling[0].done == done + budget
    batcher.step()
    assert batcher.prefilling[0].done == done + budget + (budget - len(short))  # less what the late one took
    batcher.run_until_idle()
    assert late.finished.completion == lm.generate([MORE[1]], ["math"], max_new_tokens=3)[0]
    assert first.finished.completion == lm.generate([" ".join(MORE * 8)], ["code"], max_new_tokens=2)[0]
    assert stream.finished.completion == lm.generate([MORE[0]], ["code"], max_new_tokens=40)[0]


def test_bad_settings_are_refused(lm: CorrectedLM) -> None:
    with pytest.raises(DartsError, match="max_batch_size"):
        ContinuousBatcher(lm, max_batch_size=0)
    with pytest.raises(DartsError, match="stop string is empty"):
        ContinuousBatcher(lm, 1).add(SequenceRequest((1, 2), None, Sampling(4, stop=("",))), Collect())


def test_the_engine_thread_serves_submissions_from_other_threads(lm: CorrectedLM) -> None:
    threads = {}

    def build() -> ContinuousBatcher:
        threads["build"] = threading.current_thread()
        batcher = ContinuousBatcher(lm, max_batch_size=4)
        step = batcher.step
        batcher.step = lambda: (threads.setdefault("step", set()).add(threading.current_thread()), step())[1]
        return batcher

    engine = EngineThread(build)
    try:
        # The batcher (a server's model load) is built on the thread that steps it: one thread does the torch work.
        assert threads["build"].name.startswith("darts-engine") and threads["build"] is not threading.current_thread()
        listeners = [Collect() for _ in MORE]
        for prompt, listener in zip(MORE, listeners):
            engine.submit([SequenceRequest(tuple(lm.encode(prompt)), "math", greedy(6))], [listener])
        deadline = time.monotonic() + 120
        while any(listener.finished is None for listener in listeners):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert [listener.finished.completion for listener in listeners] == lm.generate(MORE, ["math"] * 4,
                                                                                        max_new_tokens=6)
        assert engine.stats().running == 0 and threads["step"] == {threads["build"]}
    finally:
        engine.close()
    with pytest.raises(EngineStopped):  # nothing would ever answer it
        engine.submit([SequenceRequest(tuple(lm.encode(MORE[0])), None, greedy(2))], [Collect()])


def test_an_engine_whose_model_fails_to_load_raises_where_it_was_started() -> None:
    def build() -> ContinuousBatcher:
        raise DartsError("no such model")

    before = threading.active_count()
    with pytest.raises(DartsError, match="no such model"):
        EngineThread(build)
    assert threading.active_count() == before  # its thread ended


def test_top_p_keeps_the_smallest_set_of_tokens_reaching_the_mass() -> None:
    logits = torch.log(torch.tensor([0.1, 0.5, 0.15, 0.25]))
    kept = top_p_probabilities(logits, temperature=1.0, top_p=0.7)
    # 0.5 alone is short of 0.7; 0.5 + 0.25 reaches it: the two kept, the rest zero.
    assert torch.allclose(kept, torch.tensor([0.0, 0.5, 0.0, 0.25]))
    assert torch.allclose(top_p_probabilities(logits, 2.0, 1.0), torch.softmax(logits / 2.0, -1))


def test_batched_draws_follow_each_rows_nucleus_and_do_not_depend_on_the_batch() -> None:
    """One pass for every sampled row (the exponential race, each row's noise from its own generator): each row's
    frequencies are its own nucleus's probabilities (within 4 standard errors over 4,000 draws), zero outside it,
    and a row draws the same token alone as beside a greedy row and a differently-set one."""
    logits = torch.log(torch.tensor([[0.1, 0.5, 0.15, 0.25], [0.4, 0.3, 0.2, 0.1]]))
    generators = [torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)]
    draws = 4000
    counts = torch.zeros(2, 4)
    for _ in range(draws):
        for row, token in enumerate(next_tokens(logits, [1.0, 0.5], [0.7, 1.0], generators)):
            counts[row, token] += 1
    nucleus = top_p_probabilities(logits[0], 1.0, 0.7)  # the kept tokens' probabilities, not renormalised
    expected = torch.stack([nucleus / nucleus.sum(), torch.softmax(logits[1] / 0.5, -1)])
    assert torch.allclose(expected[0], torch.tensor([0.0, 2 / 3, 0.0, 1 / 3]))
    assert (counts[expected == 0] == 0).all()
    frequency = counts / draws
    assert ((frequency - expected).abs() <= 4 * (expected * (1 - expected) / draws).sqrt() + 1e-9).all(), frequency
    alone = [next_tokens(logits[1:], [0.5], [1.0], [torch.Generator().manual_seed(seed)])[0] for seed in range(20)]
    beside = [next_tokens(logits, [0.0, 0.5], [1.0, 1.0], [torch.Generator(), torch.Generator().manual_seed(seed)])[1]
              for seed in range(20)]
    assert alone == beside and len(set(alone)) > 1


def test_a_vanishing_temperature_is_greedy_not_a_failure_of_the_batch(lm: CorrectedLM) -> None:
    """5e-324 passes the API's temperature ≥ 0: logits / T overflowed to inf, the draw raised, and every sequence
    of the running batch failed with it."""
    batcher = ContinuousBatcher(lm, max_batch_size=4)
    tiny, other = Collect(), Collect()
    batcher.add(SequenceRequest(tuple(lm.encode(MORE[0])), "code", Sampling(6, temperature=5e-324, seed=1)), tiny)
    batcher.add(SequenceRequest(tuple(lm.encode(MORE[1])), "math", Sampling(6, temperature=0.8, seed=2)), other)
    batcher.run_until_idle()
    assert tiny.finished.completion == lm.generate([MORE[0]], ["code"], max_new_tokens=6)[0]  # the greedy text
    assert other.finished is not None


@pytest.mark.parametrize("layers", [["final"], [1, "final"]])
def test_a_cached_prompt_prefix_gives_the_same_text_as_computing_it(lm: CorrectedLM, layers: list) -> None:
    """A final-norm correction shares the uncorrected prefix blocks; one at decoder layer 1 keeps its own."""
    hidden_size = lm.model.config.hidden_size
    corrections = DartsCorrections(CorrectionSpec(TASKS, hidden_size, rank=4, max_positions=32), layers)
    with torch.no_grad():
        for parameter in corrections.parameters():
            parameter.copy_(torch.randn_like(parameter))
    corrected = CorrectedLM(lm.model, lm.tokenizer, corrections)
    system = "You are a careful assistant. Answer briefly and exactly. " * 3
    tasks = ["code", None, "math", "code", "math", None, "code"]
    requests = [SequenceRequest(tuple(lm.encode(system + prompt)), task, Sampling(8))
                for prompt, task in zip(PROMPTS + MORE, tasks)]
    shared = len(lm.encode(system)) // PREFIX_BLOCK * PREFIX_BLOCK  # whole blocks of the shared prefix

    def generate(prefix_cache_tokens: int) -> tuple[list[Completion], int]:
        batcher = ContinuousBatcher(corrected, max_batch_size=3, prefix_cache_tokens=prefix_cache_tokens)
        listeners = [Collect() for _ in requests]
        for request, listener in zip(requests, listeners):
            batcher.add(request, listener)
        batcher.run_until_idle()
        return [listener.finished.completion for listener in listeners], batcher.stats().cached_prompt_tokens

    try:
        cached, hits = generate(4096)
        uncached, none = generate(0)
    finally:
        corrected.close()
    assert cached == uncached and none == 0
    assert hits % PREFIX_BLOCK == 0
    # The first three prefill together; of the four that join later, all find the shared prefix when the keys
    # and values do not depend on the correction, and those whose correction was seen before (code twice,
    # math, none) when they do.
    assert hits >= (4 if layers == ["final"] else 3) * shared
    assert corrected.corrects_kv == (layers != ["final"])


def test_a_clients_cached_prefix_is_its_own(lm: CorrectedLM) -> None:
    """With a cache salt per client (the server's API key names), a prompt prefix one client sent is found again
    for that client only: another client's same prompt computes it (no hit its timing could show), and gives the
    same text."""
    prompt = tuple(lm.encode("You are a careful assistant. Answer briefly and exactly. " * 3 + MORE[0]))
    batcher = ContinuousBatcher(lm, max_batch_size=1)
    hits, texts = [], []
    for salt in ("alice", "alice", "bob", None, None):
        listener = Collect()
        before = batcher.stats().cached_prompt_tokens
        batcher.add(SequenceRequest(prompt, "code", greedy(4), cache_salt=salt), listener)
        batcher.run_until_idle()
        hits.append(batcher.stats().cached_prompt_tokens - before)
        texts.append(listener.finished.completion.text)
    whole = (len(prompt) - 1) // PREFIX_BLOCK * PREFIX_BLOCK  # every block short of the last token
    assert hits == [0, whole, 0, 0, whole]  # bob's first, and the keyless first, computed their own
    assert len(set(texts)) == 1


def test_joiners_with_cached_prefixes_of_other_lengths_prefill_apart_within_their_prompts(lm: CorrectedLM) -> None:
    """One forward per cached length: a row never carries another's cached prefix or rest, so no prefill is wider
    than its longest prompt (one forward for all was up to twice that, past the token budget); texts are exact."""
    system = "You are a careful assistant. Answer briefly and exactly. " * 3
    first = SequenceRequest(tuple(lm.encode(system + PROMPTS[0])), None, Sampling(4))
    joiners = [SequenceRequest(tuple(lm.encode(system + PROMPTS[1])), None, Sampling(4)),  # the prefix cached
               SequenceRequest(tuple(lm.encode(" ".join(MORE * 3))), None, Sampling(4)),  # nothing cached, long
               SequenceRequest(tuple(lm.encode(PROMPTS[2])), None, Sampling(4))]

    def generate(prefix_cache_tokens: int) -> tuple[list[Completion], list[int], int]:
        batcher = ContinuousBatcher(lm, max_batch_size=4, prefix_cache_tokens=prefix_cache_tokens)
        overshoot, forward = [], batcher._forward

        def watched(input_ids, mask, positions, cache, sequences):
            overshoot.append(mask.shape[1] - max(len(s.prompt) for s in sequences))
            return forward(input_ids, mask, positions, cache, sequences)

        batcher._forward = watched
        listeners = [Collect() for _ in range(4)]
        batcher.add(first, listeners[0])
        batcher.step()  # the first prompt's blocks are stored
        for request, listener in zip(joiners, listeners[1:]):
            batcher.add(request, listener)
        batcher.run_until_idle()
        return [listener.finished.completion for listener in listeners], overshoot, batcher.stats().cached_prompt_tokens

    cached, overshoot, hits = generate(4096)
    uncached, _, _ = generate(0)
    assert hits >= PREFIX_BLOCK and cached == uncached
    assert max(overshoot) <= 0, overshoot


def test_ignore_eos_generates_max_tokens(lm: CorrectedLM) -> None:
    ids = tuple(lm.encode(PROMPTS[0]))
    with lm.weighted(one_hot_tasks(torch.tensor([lm.task_index("code")]), len(TASKS))), torch.no_grad():
        first = int(lm.model(torch.tensor([ids])).logits[0, -1].argmax())
    eos_ids = lm.eos_ids
    lm.eos_ids = {first}  # the greedy first token ends the sequence
    try:
        stopped, going = Collect(), Collect()
        batcher = ContinuousBatcher(lm, max_batch_size=2)
        batcher.add(SequenceRequest(ids, "code", Sampling(6)), stopped)
        batcher.add(SequenceRequest(ids, "code", Sampling(6, ignore_eos=True)), going)
        batcher.run_until_idle()
    finally:
        lm.eos_ids = eos_ids
    assert (stopped.finished.completion.completion_tokens, stopped.finished.completion.finish_reason) == (1, "stop")
    assert (going.finished.completion.completion_tokens, going.finished.completion.finish_reason) == (6, "length")


def test_a_failing_listener_cancels_its_own_sequence_only(lm: CorrectedLM) -> None:
    batcher = ContinuousBatcher(lm, max_batch_size=2)

    def gone(event) -> None:
        raise RuntimeError("the request's event loop is closed")

    kept = Collect()
    batcher.add(SequenceRequest(tuple(lm.encode(PROMPTS[0])), "code", greedy(6), stream=True), gone)
    batcher.add(SequenceRequest(tuple(lm.encode(PROMPTS[1])), "math", greedy(6), stream=True), kept)
    batcher.run_until_idle()
    assert kept.finished.completion == lm.generate(PROMPTS[1:2], ["math"], max_new_tokens=6)[0]
    assert counts(batcher)[:2] == (0, 0)


def test_a_failed_prefill_fails_its_joiners_and_the_batch_runs_on(lm: CorrectedLM) -> None:
    batcher = ContinuousBatcher(lm, max_batch_size=4)
    running, joiner = Collect(), []
    batcher.add(SequenceRequest(tuple(lm.encode(PROMPTS[0])), "code", greedy(10)), running)
    batcher.step()
    prefill = batcher._prefill

    def out_of_memory(joining):
        raise RuntimeError("out of memory")

    batcher._prefill = out_of_memory
    batcher.add(SequenceRequest(tuple(lm.encode(PROMPTS[1])), "math", greedy(10)), joiner.append)
    batcher.step()
    batcher._prefill = prefill
    assert [str(e) for e in joiner] == ["out of memory"]
    batcher.run_until_idle()
    assert running.finished.completion == lm.generate(PROMPTS[:1], ["code"], max_new_tokens=10)[0]


def test_a_failed_forward_fails_its_sequences_and_the_engine_goes_on(lm: CorrectedLM) -> None:
    batcher = ContinuousBatcher(lm, max_batch_size=4)
    heard: list[list] = [[], []]
    for prompt, events in zip(PROMPTS[:2], heard):
        batcher.add(SequenceRequest(tuple(lm.encode(prompt)), "code", Sampling(4)), events.append)
    forward = batcher._forward

    def out_of_memory(*args, **kwargs):
        raise RuntimeError("out of memory")

    batcher._forward = out_of_memory
    batcher.step()
    assert [[str(e) for e in events] for events in heard] == [["out of memory"]] * 2
    assert counts(batcher)[:2] == (0, 0)
    batcher._forward = forward
    after = Collect()
    batcher.add(SequenceRequest(tuple(lm.encode(PROMPTS[2])), "math", Sampling(4)), after)
    batcher.run_until_idle()
    assert after.finished.completion == lm.generate(PROMPTS[2:], ["math"], max_new_tokens=4)[0]


@pytest.mark.parametrize("top_p", [1e-300, 1e-45, 1e-8])
def test_a_vanishing_top_p_keeps_the_most_likely_token(top_p: float) -> None:
    """A positive top_p below fp32's range (the fuzzer sent 3.9e-220) is 0 against fp32 probabilities: the nucleus
    must still hold the most likely token, not nothing (which made the draw fail with a 500)."""
    logits = torch.tensor([0.5, 2.0, -1.0, 1.0])
    kept = top_p_probabilities(logits, temperature=1.0, top_p=top_p)
    assert kept.tolist() == [0.0, pytest.approx(float(torch.softmax(logits, -1)[1])), 0.0, 0.0]
    generator = torch.Generator().manual_seed(0)
    assert next_tokens(logits[None], [1.0], [top_p], [generator]) == [1]
