"""darts-dist's own corrected generation: a merged model, its tokenizer and per-task corrections, batched.

One `CorrectedLM` serves every task at once: each sequence of a left-padded batch names its
own task (None = the uncorrected merged model, "auto" = the task router's pick), and the
correction applies at every position, prompt and generated tokens alike (DESIGN.md §1,
Inference). The MLflow pyfunc model and the Ray Serve app both generate through this class,
so their outputs are the same; Serve streams through its `on_text` callback.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase
from transformers.generation.streamers import BaseStreamer

from darts_dist.calibrate.corrections import load_corrections_for
from darts_dist.calibrate.features import prompt_features
from darts_dist.core import (ROUTED, DartsCorrections, TaskRouter, attach_corrections, one_hot_tasks, token_batch,
                             token_nll)
from darts_dist.errors import DartsError
from darts_dist.sources.models import load_causal_lm, load_tokenizer, pad_id

logger = logging.getLogger(__name__)
# The task index of a routed sequence until the router has decided (−1 is no correction, 0..K−1 a task).
_ROUTE = -2
# on_text(deltas): each sequence's newly final text after a decoding step ("" when there is none).
TextCallback = Callable[[list[str]], None]


@dataclass(frozen=True)
class Completion:
    """One generated continuation.

    finish_reason is "stop" (an end-of-sequence token or a stop string) or "length" (max_new_tokens
    reached); completion_tokens counts the tokens generated, the end-of-sequence token included.
    task is the correction that applied (None: none); confidence is the router's, for routed sequences.
    """

    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str
    task: str | None = None
    confidence: float | None = None


def _check_router(router: TaskRouter, tasks: tuple[str, ...], hidden_size: int) -> None:
    """A router must choose among exactly these corrections' tasks, from hidden states of this model's size."""
    if not tasks:
        raise DartsError("a task router was given without corrections to choose from", "load the corrections too")
    if router.tasks != tasks:
        raise DartsError(f"the router picks among tasks {list(router.tasks)}, the corrections have {list(tasks)}",
                         "use the router fit in the same calibration as the corrections")
    if router.hidden_size != hidden_size:
        raise DartsError(f"the router reads hidden states of size {router.hidden_size}, the model's are {hidden_size}",
                         "use the router fit on this merged model")


@contextlib.contextmanager
def _seeded(seed: int | None) -> Iterator[None]:
    # Sampling draws from torch's global generator; fork it so a seeded request neither
    # depends on nor disturbs anyone else's random state.
    if seed is None:
        yield
        return
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


class CorrectedLM:
    """A merged causal LM with its DARTS corrections hooked in, generating for several tasks per batch."""

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        corrections: DartsCorrections | None = None,
        router: TaskRouter | None = None,
        threshold: float | None = None,
        soft_routing: bool = False,
    ) -> None:
        """`threshold` defaults to the router's own; `soft_routing` mixes the corrections by the router's
        probabilities instead of applying the top task's alone (below the threshold: none either way)."""
        self.model = model
        self.tokenizer = tokenizer
        self.corrections = corrections
        self.tasks: tuple[str, ...] = () if corrections is None else tuple(corrections.spec.tasks)
        if router is not None:
            _check_router(router, self.tasks, model.config.hidden_size)
        self.router = router
        self.threshold = threshold if threshold is not None else router.threshold if router is not None else 1.0
        if not 0.0 <= self.threshold <= 1.0:
            raise DartsError(f"the router threshold must be in [0, 1], got {self.threshold}")
        self.soft_routing = soft_routing
        device = next(model.parameters()).device
        self._handle = None if corrections is None else attach_corrections(model, corrections.to(device))
        eos = model.generation_config.eos_token_id if model.generation_config is not None else None
        eos = tokenizer.eos_token_id if eos is None else eos
        self._eos_ids = set(eos if isinstance(eos, list) else [eos]) - {None}
        self._pad_id = pad_id(tokenizer)

    @classmethod
    def load(
        cls,
        merged_dir: Path,
        corrections_path: Path | None = None,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        router_path: Path | None = None,
        **routing: object,
    ) -> CorrectedLM:
        """The merged model folder (weights and tokenizer) plus, optionally, its corrections and router files;
        `routing`: threshold and soft_routing as in the constructor."""
        corrections = None if corrections_path is None else load_corrections_for(corrections_path, merged_dir)
        router = None if router_path is None else TaskRouter.load(router_path)
        return cls(load_causal_lm(merged_dir, dtype=dtype, device=device), load_tokenizer(merged_dir), corrections,
                   router, **routing)

    def close(self) -> None:
        """Take the corrections' hooks off the model, so it runs plain forwards again (and knows no tasks)."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        self.tasks = ()

    def __enter__(self) -> CorrectedLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def task_index(self, task: str | None) -> int:
        """The correction index of a task name; −1 (no correction) for None; `_ROUTE` for "auto"."""
        if task is None:
            return -1
        if task == ROUTED:
            if self.router is None or self._handle is None:
                raise DartsError(f"task {ROUTED!r} asks the task router, but this model has none",
                                 "name a task, or load the model with the router its calibration wrote")
            return _ROUTE
        if task not in self.tasks:
            known = list(self.tasks) or "none: this model has no corrections"
            raise DartsError(f"unknown task {task!r}; the corrections know {known}",
                             "name one of those tasks, or none for the uncorrected merged model")
        return self.tasks.index(task)

    def chat_prompt(self, messages: Sequence[dict[str, str]]) -> str:
        """A conversation rendered with the tokenizer's chat template, ending where the assistant replies."""
        if self.tokenizer.chat_template is None:
            raise DartsError("this model's tokenizer has no chat template", "send plain prompts instead of messages")
        return self.tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)

    def encode(self, prompt: str) -> list[int]:
        """A plain prompt's tokens, with the tokenizer's default special tokens, as calibration text had."""
        return self.tokenizer(prompt, verbose=False)["input_ids"]

    def encode_chat(self, messages: Sequence[dict[str, str]]) -> list[int]:
        """A conversation's tokens up to the assistant's turn; the rendered template holds its special tokens."""
        return self.tokenizer(self.chat_prompt(messages), add_special_tokens=False, verbose=False)["input_ids"]

    def generate(
        self, prompts: Sequence[str], tasks: Sequence[str | None] | None = None, **options: object
    ) -> list[Completion]:
        """Continue each prompt under its own task's correction; options as in `generate_ids`."""
        return self.generate_ids([self.encode(p) for p in prompts], tasks, **options)

    def chat(
        self,
        conversations: Sequence[Sequence[dict[str, str]]],
        tasks: Sequence[str | None] | None = None,
        **options: object,
    ) -> list[Completion]:
        """The assistant's reply to each conversation (chat template applied); options as in `generate_ids`."""
        return self.generate_ids([self.encode_chat(c) for c in conversations], tasks, **options)

    def _task_ids(self, count: int, tasks: Sequence[str | None] | None) -> list[int]:
        """Each sequence's task index; a DartsError names a wrong count or an unknown task."""
        tasks = [None] * count if tasks is None else list(tasks)
        if len(tasks) != count:
            raise DartsError(f"{count} prompts but {len(tasks)} tasks", "give one task (or none) per prompt")
        return [self.task_index(t) for t in tasks]

    def _check(
        self, count: int, tasks: Sequence[str | None] | None, max_new_tokens: int, temperature: float, top_p: float
    ) -> list[int]:
        """Each sequence's task index, after checking the request; a DartsError names what is wrong."""
        if max_new_tokens < 1:
            raise DartsError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
        if temperature < 0 or not 0 < top_p <= 1:
            raise DartsError(f"temperature must be ≥ 0 and top_p in (0, 1], got {temperature} and {top_p}")
        return self._task_ids(count, tasks)

    @torch.inference_mode()
    def generate_ids(
        self,
        encoded: Sequence[Sequence[int]],
        tasks: Sequence[str | None] | None = None,
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        top_p: float = 1.0,
        stop: Sequence[str] | None = None,
        seed: int | None = None,
        on_text: TextCallback | None = None,
    ) -> list[Completion]:
        """Continue tokenised prompts, each under its task's correction; temperature 0 is greedy decoding.

        `on_text`, if given, hears after each decoding step every sequence's newly final text, and once
        more at the end with the rest, so that what it heard adds up to each completion's text.
        """
        if not encoded:
            return []
        if any(not ids for ids in encoded):
            raise DartsError("a prompt is empty after tokenisation", "send at least one token of text")
        task_ids = self._check(len(encoded), tasks, max_new_tokens, temperature, top_p)
        weights, applied = self._task_weights(task_ids, encoded)
        device = next(self.model.parameters()).device
        # Left padding, so every sequence's next token is at the same column; the hooks count
        # positions from each sequence's first real token, so padding does not shift P_k.
        input_ids, attention_mask = token_batch(encoded, self._pad_id, side="left")
        width = input_ids.shape[1]
        # Sampling settings only when sampling: with do_sample=False transformers warns about them.
        if temperature > 0:
            sampling = {"do_sample": True, "temperature": temperature, "top_p": top_p}
        else:
            sampling = {"do_sample": False}
        stop = list(stop or ())
        stopping = {"stop_strings": stop, "tokenizer": self.tokenizer} if stop else {}
        streamer = None if on_text is None else _TextDeltas(self, len(encoded), stop, on_text)
        with _seeded(seed), self._weighted(weights):
            output = self.model.generate(
                input_ids=input_ids.to(device),
                attention_mask=attention_mask.to(device),
                max_new_tokens=max_new_tokens,
                pad_token_id=self._pad_id,
                eos_token_id=sorted(self._eos_ids) or None,
                streamer=streamer,
                **sampling,
                **stopping,
            )
        completions = [
            replace(self._completion(len(ids), row.tolist(), stop), task=task, confidence=confidence)
            for ids, row, (task, confidence) in zip(encoded, output[:, width:].cpu(), applied)
        ]
        if streamer is not None:
            streamer.finish(completions)
        return completions

    @torch.inference_mode()
    def continuation_logprobs(
        self,
        contexts: Sequence[Sequence[int]],
        continuations: Sequence[Sequence[int]],
        tasks: Sequence[str | None] | None = None,
        route_on: Sequence[Sequence[int]] | None = None,
    ) -> list[tuple[float, bool]]:
        """log p(continuation | context) of each pair of token lists under its task's correction, and whether
        greedy decoding would have produced the continuation.

        Routed rows are routed on `route_on` (default: their contexts), as generation routes on the prompt, so
        the continuation being scored does not choose its own correction.
        """
        if any(not ids for ids in contexts):
            raise DartsError("a context is empty after tokenisation", "give at least one token of context")
        if len(continuations) != len(contexts):
            raise DartsError(f"{len(contexts)} contexts but {len(continuations)} continuations",
                             "give one continuation per context")
        weights, _ = self._task_weights(self._task_ids(len(contexts), tasks), route_on or contexts)
        # Right padding: each row's tokens sit at positions 0..n−1, as the forward numbers them without position ids.
        input_ids, attention_mask = token_batch([[*c, *x] for c, x in zip(contexts, continuations)], self._pad_id)
        scored = torch.zeros_like(attention_mask, dtype=torch.bool)
        for row, (context, continuation) in enumerate(zip(contexts, continuations)):
            scored[row, len(context):len(context) + len(continuation)] = True
        device = next(self.model.parameters()).device
        with self._weighted(weights):
            logits = self.model(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device)).logits.cpu()
        nll, counted = token_nll(logits, input_ids, attention_mask, scored)
        greedy = (logits[:, :-1].argmax(-1) == input_ids[:, 1:]) | ~counted
        return [(-row_nll.item(), bool(row_greedy)) for row_nll, row_greedy in zip(nll.sum(-1), greedy.all(-1))]

    def routes(self, encoded: Sequence[Sequence[int]]) -> list[str | None]:
        """The task whose correction the router applies to each tokenised prompt (None: none, below the
        threshold), as `generate_ids` would for the routed id."""
        return [task for task, _ in self._task_weights([_ROUTE] * len(encoded), encoded)[1]]

    def _task_weights(
        self, task_ids: list[int], encoded: Sequence[Sequence[int]]
    ) -> tuple[torch.Tensor | None, list[tuple[str | None, float | None]]]:
        """[B, K] correction weights, and per sequence (task applied, router confidence); routed rows ask the router.

        The router reads the merged model's uncorrected hidden states of the prompt: no task weights
        are set yet, so the hooks pass them through.
        """
        if self._handle is None:
            return None, [(None, None)] * len(task_ids)
        weights = one_hot_tasks(torch.tensor([max(i, -1) for i in task_ids]), len(self.tasks))
        applied: list[tuple[str | None, float | None]] = [(self.tasks[i] if i >= 0 else None, None) for i in task_ids]
        routed = [row for row, i in enumerate(task_ids) if i == _ROUTE]
        if routed:
            features = prompt_features(self.model, [encoded[row] for row in routed], self.router.layer, self._pad_id,
                                       batch_size=len(routed))
            routing = self.router.route(features, self.threshold)
            for row, task, confidence, probabilities in zip(routed, routing.task.tolist(),
                                                            routing.confidence.tolist(), routing.probabilities):
                if task >= 0:
                    weights[row] = probabilities if self.soft_routing else one_hot_tasks(torch.tensor([task]),
                                                                                          len(self.tasks))[0]
                applied[row] = (self.tasks[task] if task >= 0 else None, confidence)
        return weights, applied

    @contextlib.contextmanager
    def _weighted(self, weights: torch.Tensor | None) -> Iterator[None]:
        if self._handle is None:
            yield
            return
        with self._handle.weighted(weights):
            yield

    def _completion(self, prompt_tokens: int, generated: list[int], stop: list[str]) -> Completion:
        """Cut a generated row at its end-of-sequence token or first stop string (neither is returned)."""
        end = next((i for i, token in enumerate(generated) if token in self._eos_ids), None)
        tokens = generated if end is None else generated[:end]
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        hits = [text.find(s) for s in stop if s in text]
        if hits:
            # A row that met its stop string while others went on was filled up with padding.
            while tokens and tokens[-1] == self._pad_id:
                tokens = tokens[:-1]
            return Completion(text[: min(hits)], prompt_tokens, len(tokens), "stop")
        if end is None:
            return Completion(text, prompt_tokens, len(generated), "length")
        return Completion(text, prompt_tokens, end + 1, "stop")


class _TextDeltas(BaseStreamer):
    """generate()'s tokens, step by step, turned into each sequence's newly *final* text.

    Text is final once no later token can change it: a possible beginning of a stop string and an
    unfinished UTF-8 character (decoded as U+FFFD) are held back until the next tokens decide them.
    """

    def __init__(self, lm: CorrectedLM, count: int, stop: list[str], on_text: TextCallback) -> None:
        self.lm = lm
        self.stop = stop
        self.on_text = on_text
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.tokens: list[list[int]] = [[] for _ in range(count)]
        self.sent = [""] * count
        self.done = [False] * count

    def put(self, value: torch.Tensor) -> None:
        if value.ndim == 2:  # generate() hands over the prompts first
            return
        self.on_text([self._advance(row, token) for row, token in enumerate(value.tolist())])

    def end(self) -> None:
        """Nothing to flush here: `finish` sends the rest, from the completions themselves."""

    def _advance(self, row: int, token: int) -> str:
        if self.done[row]:
            return ""
        if token in self.lm._eos_ids:
            self.done[row] = True
            return ""
        self.tokens[row].append(token)
        text = self.lm.tokenizer.decode(self.tokens[row], skip_special_tokens=True)
        hits = [text.find(s) for s in self.stop if s in text]
        if hits:
            self.done[row] = True
            final = text[: min(hits)]
        else:
            final = text[: len(text) - self.hold].rstrip("\ufffd")
        if len(final) <= len(self.sent[row]) or not final.startswith(self.sent[row]):
            return ""
        delta = final[len(self.sent[row]):]
        self.sent[row] = final
        return delta

    def finish(self, completions: list[Completion]) -> None:
        """The rest of each completion's text, so that the deltas add up to it."""
        rest = []
        for sent, completion in zip(self.sent, completions):
            if not completion.text.startswith(sent):
                # Only a tokenizer whose decoding of a prefix is not a prefix of the whole does this.
                logger.warning("streamed text %r is not a prefix of the completion %r", sent, completion.text)
            rest.append(completion.text[len(sent):] if completion.text.startswith(sent) else "")
        self.on_text(rest)
