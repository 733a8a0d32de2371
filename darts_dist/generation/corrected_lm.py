"""A merged model, its tokenizer and per-task corrections (and router): the model darts-dist generates with.

One `CorrectedLM` serves every task at once: each sequence of a batch names its own task (None =
the uncorrected merged model, "auto" = the task router's pick), and the correction applies at
every position, prompt and generated tokens alike (DESIGN.md §1, Inference). Generation runs
through the continuous-batching engine (`engine.py`), which the Serve app, the pyfunc model and
evaluation all share, so their outputs are the same.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from darts_dist.core import (
    ROUTED,
    DartsCorrections,
    TaskRouter,
    attach_corrections,
    one_hot_tasks,
    PromptPool,
    prompt_features,
    surgery_module,
    token_batch,
    token_nll,
)
from darts_dist.errors import DartsError
from darts_dist.generation.engine import ContinuousBatcher, Event, Finished, Listener, Sampling, SequenceRequest
from darts_dist.generation.text import Completion
from darts_dist.sources.corrections import load_corrections_for
from darts_dist.sources.models import (
    chat_prompt,
    encode_prompt,
    encode_user_chat,
    encode_user_prompt,
    load_causal_lm,
    load_tokenizer,
    pad_id,
)

@dataclass(frozen=True)
class ContinuationScore:
    """A continuation teacher-forced after its context (`CorrectedLM.continuation_scores`)."""

    logprob: float  # log p(continuation | context)
    tokens: int
    agreeing: int  # its tokens that are the model's greedy choice at their position
    task: str | None = None  # the correction it was scored under (a routed row: the router's pick); None: none


# The task index of a routed sequence until the router has decided (−1 is no correction, 0..K−1 a task).
_ROUTE = -2


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
        abstain_outside: bool | None = None,
    ) -> None:
        """`threshold` defaults to the router's own; `soft_routing` mixes the corrections by the router's
        probabilities instead of applying the top task's alone (below the threshold: none either way);
        `abstain_outside` (default: the router's own) gives a prompt outside its top task's envelope none too."""
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
        self.abstain_outside = abstain_outside if abstain_outside is not None else (
            router.abstain_outside if router is not None else True)
        # A correction of the final norm's output changes no layer's keys and values; one of a decoder layer's does.
        self.corrects_kv = corrections is not None and any(layer != "final" for layer in corrections.layer_keys)
        device = next(model.parameters()).device
        self._handle = None if corrections is None else attach_corrections(model, corrections.to(device))
        eos = model.generation_config.eos_token_id if model.generation_config is not None else None
        eos = tokenizer.eos_token_id if eos is None else eos
        self.eos_ids = set(eos if isinstance(eos, list) else [eos]) - {None}
        self.pad_id = pad_id(tokenizer)

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
        `routing`: threshold, soft_routing and abstain_outside as in the constructor."""
        corrections = None if corrections_path is None else load_corrections_for(corrections_path, merged_dir)
        router = None if router_path is None else TaskRouter.load(router_path)
        return cls(load_causal_lm(merged_dir, dtype=dtype, device=device), load_tokenizer(merged_dir), corrections,
                   router, **routing)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the model computes in (the corrections stay fp32)."""
        return next(self.model.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

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
        return chat_prompt(self.tokenizer, messages)

    def encode_text(self, prompt: str) -> list[int]:
        """A user's plain prompt (`encode_user_prompt`): a special token's text in it is text."""
        return encode_user_prompt(self.tokenizer, prompt)

    def chat_text(self, messages: Sequence[dict[str, str]]) -> tuple[str, list[int]]:
        """A user's conversation, rendered and tokenised (`encode_user_chat`)."""
        return encode_user_chat(self.tokenizer, messages)

    def encode(self, prompt: str, rendered: bool = False) -> list[int]:
        """A plain prompt's tokens, with the tokenizer's default special tokens, as calibration text had; a
        `rendered` chat prompt (`chat_prompt`) holds its special tokens already."""
        return encode_prompt(self.tokenizer, prompt, rendered)

    def encode_chat(self, messages: Sequence[dict[str, str]]) -> list[int]:
        """A conversation's tokens up to the assistant's turn."""
        return self.encode(self.chat_prompt(messages), rendered=True)

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

    def _task_names(self, count: int, tasks: Sequence[str | None] | None) -> list[str | None]:
        """One task per prompt (None: uncorrected), each one the corrections know; a DartsError names a wrong count
        or an unknown task before anything runs."""
        tasks = [None] * count if tasks is None else list(tasks)
        if len(tasks) != count:
            raise DartsError(f"{count} prompts but {len(tasks)} tasks", "give one task (or none) per prompt")
        for task in tasks:
            self.task_index(task)
        return tasks

    def generate_ids(
        self,
        encoded: Sequence[Sequence[int]],
        tasks: Sequence[str | None] | None = None,
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        top_p: float = 1.0,
        stop: Sequence[str] | None = None,
        seed: int | None = None,
        max_batch_size: int | None = None,
        on_finished: Callable[[int], None] | None = None,
    ) -> list[Completion]:
        """Continue tokenised prompts, each under its task's correction; temperature 0 is greedy decoding.

        Generated by continuous batching, up to `max_batch_size` sequences at once (default: all): a
        finished sequence's place goes to the next prompt at once. A seed seeds each sequence's own
        generator, so a seeded prompt gives the same text whatever it is generated with.
        `on_finished(count)` hears each time sequences finish (a progress bar's update).
        """
        if not encoded:
            return []
        sampling = Sampling(max_new_tokens, temperature, top_p, tuple(stop or ()), seed)
        task_names = self._task_names(len(encoded), tasks)
        batcher = ContinuousBatcher(self, len(encoded) if max_batch_size is None else max_batch_size)
        events: dict[int, Event] = {}

        def listener(row: int) -> Listener:
            def hear(event: Event) -> None:
                if isinstance(event, (Finished, Exception)):
                    events[row] = event
                    if on_finished is not None:
                        on_finished(1)
            return hear

        for row, (ids, task) in enumerate(zip(encoded, task_names)):
            batcher.add(SequenceRequest(tuple(ids), task, sampling), listener(row))
        batcher.run_until_idle()
        failed = next((e for e in events.values() if isinstance(e, Exception)), None)
        if failed is not None:
            raise failed
        return [events[row].completion for row in range(len(encoded))]

    def continuation_logprobs(
        self,
        contexts: Sequence[Sequence[int]],
        continuations: Sequence[Sequence[int]],
        tasks: Sequence[str | None] | None = None,
        route_on: Sequence[Sequence[int]] | None = None,
    ) -> list[tuple[float, bool]]:
        """log p(continuation | context) of each pair of token lists under its task's correction, and whether
        greedy decoding would have produced the continuation (`continuation_scores`)."""
        return [(score.logprob, score.agreeing == score.tokens)
                for score in self.continuation_scores(contexts, continuations, tasks, route_on)]

    @torch.inference_mode()
    def continuation_scores(
        self,
        contexts: Sequence[Sequence[int]],
        continuations: Sequence[Sequence[int]],
        tasks: Sequence[str | None] | None = None,
        route_on: Sequence[Sequence[int]] | None = None,
    ) -> list[ContinuationScore]:
        """Each continuation teacher-forced after its context, under its task's correction, in one forward: its
        log-probability, its token count, how many of its tokens are the model's own greedy choice there, and the
        correction applied.

        Routed rows are routed on `route_on` (default: their contexts), as generation routes on the prompt, so
        the continuation being scored does not choose its own correction.
        """
        if any(not ids for ids in contexts):
            raise DartsError("a context is empty after tokenisation", "give at least one token of context")
        if len(continuations) != len(contexts):
            raise DartsError(f"{len(contexts)} contexts but {len(continuations)} continuations",
                             "give one continuation per context")
        task_ids = [self.task_index(task) for task in self._task_names(len(contexts), tasks)]
        weights, applied = self.task_weights(task_ids, route_on or contexts)
        # Right padding: each row's tokens sit at positions 0..n−1, as the forward numbers them without position ids.
        input_ids, attention_mask = token_batch([[*c, *x] for c, x in zip(contexts, continuations)], self.pad_id)
        scored = torch.zeros_like(attention_mask, dtype=torch.bool)
        for row, (context, continuation) in enumerate(zip(contexts, continuations)):
            scored[row, len(context):len(context) + len(continuation)] = True
        device = self.device
        with self.weighted(weights):
            logits = self.model(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device)).logits.cpu()
        nll, counted = token_nll(logits, input_ids, attention_mask, scored)
        agreeing = (logits[:, :-1].argmax(-1) == input_ids[:, 1:]) & counted
        return [ContinuationScore(-float(row_nll), int(row_tokens), int(row_agreeing), task)
                for row_nll, row_tokens, row_agreeing, (task, _) in zip(nll.sum(-1), counted.sum(-1),
                                                                        agreeing.sum(-1), applied)]

    @property
    def routes_in_prefill(self) -> bool:
        """Whether a routed prompt can be routed inside its own prefill (`routing_in_forward`): the router reads the
        merged model's uncorrected states at its layer, so no correction may come before it, and none may change the
        keys and values (one of a decoder layer's would, for the chunks and cached prefixes prefilled before the
        pick). True for corrections of the final norm's output, the default."""
        return self.router is not None and self._handle is not None and not self.corrects_kv

    @contextlib.contextmanager
    def routing_in_forward(self, weights: torch.Tensor | None, pools: dict[int, PromptPool], mask: torch.Tensor,
                           final: bool) -> Iterator[dict[int, tuple[torch.Tensor, tuple[str | None, float | None]]]]:
        """Inside the block, the forward adds each pooled row's states at the router's layer (its real tokens: `mask`
        [B, S] over the forward's input) to its pool; in a `final` forward (the prompt's last tokens) it routes them
        there, writing their correction weights into `weights` (the forward's, in place) before any correction reads
        them. Yields row -> (weights row, (task applied, confidence)), filled by the forward."""
        decided: dict[int, tuple[torch.Tensor, tuple[str | None, float | None]]] = {}
        if not pools:
            yield decided
            return

        def route(module: torch.nn.Module, args: tuple, output: object) -> None:
            states = output if isinstance(output, torch.Tensor) else output[0]
            for row, pool in pools.items():
                pool.add(states[row], mask[row])
            if final:
                rows = list(pools)
                picked, applied = self._routed(torch.stack([pools[row].mean() for row in rows]))
                for row, row_weights, row_applied in zip(rows, picked, applied):
                    weights[row] = row_weights
                    decided[row] = (row_weights, row_applied)

        hook = surgery_module(self.model, self.router.layer).register_forward_hook(route, prepend=True)
        try:
            yield decided
        finally:
            hook.remove()

    def routes(self, encoded: Sequence[Sequence[int]]) -> list[str | None]:
        """The task whose correction the router applies to each tokenised prompt (None: none, below the
        threshold or outside the envelope), as `generate_ids` would for the routed id."""
        return [task for task, _ in self.task_weights([_ROUTE] * len(encoded), encoded)[1]]

    def task_weights(
        self, task_ids: list[int], encoded: Sequence[Sequence[int]], route: bool = True
    ) -> tuple[torch.Tensor | None, list[tuple[str | None, float | None] | None]]:
        """[B, K] correction weights, and per sequence (task applied, router confidence); routed rows ask the router,
        in a pass of their own over their prompts, or with `route` False are left to `routing_in_forward` (no
        correction yet, and None for what was applied).

        The router reads the merged model's uncorrected hidden states of the prompt: no task weights
        are set yet, so the hooks pass them through.
        """
        if self._handle is None:
            return None, [(None, None)] * len(task_ids)
        weights = one_hot_tasks(torch.tensor([max(i, -1) for i in task_ids]), len(self.tasks))
        applied: list[tuple[str | None, float | None] | None] = [(self.tasks[i] if i >= 0 else None, None)
                                                                 for i in task_ids]
        routed = [row for row, i in enumerate(task_ids) if i == _ROUTE]
        if routed and not route:
            for row in routed:
                applied[row] = None
        elif routed:
            features = prompt_features(self.model, [encoded[row] for row in routed], self.router.layer, self.pad_id,
                                       batch_size=len(routed))
            for row, row_weights, row_applied in zip(routed, *self._routed(features)):
                weights[row], applied[row] = row_weights, row_applied
        return weights, applied

    def _routed(self, features: torch.Tensor) -> tuple[list[torch.Tensor], list[tuple[str | None, float]]]:
        """The router's pick for prompts' features [N, d]: each one's correction weights [K] (none below the
        threshold or, abstaining there, outside the envelope; the probabilities themselves with soft routing) and
        (task applied, confidence)."""
        routing = self.router.route(features, self.threshold, self.abstain_outside)
        picked, applied = [], []
        for task, confidence, probabilities in zip(routing.task.tolist(), routing.confidence.tolist(),
                                                   routing.probabilities):
            if task < 0:
                picked.append(torch.zeros(len(self.tasks)))
            else:
                picked.append(probabilities.float() if self.soft_routing else
                              one_hot_tasks(torch.tensor([task]), len(self.tasks))[0])
            applied.append((self.tasks[task] if task >= 0 else None, confidence))
        return picked, applied

    @contextlib.contextmanager
    def weighted(self, weights: torch.Tensor | None) -> Iterator[None]:
        if self._handle is None:
            yield
            return
        with self._handle.weighted(weights):
            yield
