"""darts-dist's own corrected generation: a merged model, its tokenizer and per-task corrections, batched.

One `CorrectedLM` serves every task at once: each sequence of a left-padded batch names its
own task (None = the uncorrected merged model), and the correction applies at every position,
prompt and generated tokens alike (DESIGN.md §1, Inference). The MLflow pyfunc model and the
Ray Serve app both generate through this class, so their outputs are the same.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from darts_dist.core import DartsCorrections, attach_corrections, load_corrections
from darts_dist.errors import DartsError
from darts_dist.models import load_causal_lm, load_tokenizer, read_model_info

# What corrections record about the model they were trained against (pipeline.corrections_metadata).
MODEL_FIELDS = ("architecture", "hidden_size", "num_layers", "vocab_size")


@dataclass(frozen=True)
class Completion:
    """One generated continuation.

    finish_reason is "stop" (an end-of-sequence token or a stop string) or "length" (max_new_tokens
    reached); completion_tokens counts the tokens generated, the end-of-sequence token included.
    """

    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str


def load_corrections_for(path: Path, merged_dir: Path) -> DartsCorrections:
    """Load corrections, refusing them when they were made for a model of another shape than `merged_dir`."""
    corrections, made_for = load_corrections(path)
    info = read_model_info(merged_dir)
    for key in MODEL_FIELDS:
        if key in made_for and made_for[key] != getattr(info, key):
            raise DartsError(
                f"corrections {path} were made for a model with {key}={made_for[key]}, "
                f"but {merged_dir} has {key}={getattr(info, key)}",
                "calibrate against this merged model, or use the merged model the corrections came from",
            )
    return corrections


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
        self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, corrections: DartsCorrections | None = None
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.corrections = corrections
        self.tasks: tuple[str, ...] = () if corrections is None else tuple(corrections.spec.tasks)
        device = next(model.parameters()).device
        self._handle = None if corrections is None else attach_corrections(model, corrections.to(device))
        eos = model.generation_config.eos_token_id if model.generation_config is not None else None
        eos = tokenizer.eos_token_id if eos is None else eos
        self._eos_ids = set(eos if isinstance(eos, list) else [eos]) - {None}
        self._pad_id = next(i for i in (tokenizer.pad_token_id, tokenizer.eos_token_id, 0) if i is not None)

    @classmethod
    def load(
        cls,
        merged_dir: Path,
        corrections_path: Path | None = None,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> CorrectedLM:
        """The merged model folder (weights and tokenizer) plus, optionally, its corrections file."""
        corrections = None if corrections_path is None else load_corrections_for(corrections_path, merged_dir)
        return cls(load_causal_lm(merged_dir, dtype=dtype, device=device), load_tokenizer(merged_dir), corrections)

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
        """The correction index of a task name; −1 (no correction) for None."""
        if task is None:
            return -1
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

    def generate(
        self,
        prompts: Sequence[str],
        tasks: Sequence[str | None] | None = None,
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        top_p: float = 1.0,
        stop: Sequence[str] | None = None,
        seed: int | None = None,
    ) -> list[Completion]:
        """Continue each prompt under its own task's correction; temperature 0 is greedy decoding.

        Plain prompts get the tokenizer's default special tokens, as calibration text did.
        """
        encoded = [self.tokenizer(p, verbose=False)["input_ids"] for p in prompts]
        return self._generate(encoded, tasks, max_new_tokens, temperature, top_p, stop, seed)

    def chat(
        self,
        conversations: Sequence[Sequence[dict[str, str]]],
        tasks: Sequence[str | None] | None = None,
        **options: object,
    ) -> list[Completion]:
        """The assistant's reply to each conversation (chat template applied); options as in `generate`."""
        # A rendered template already holds its special tokens, so none are added again.
        encoded = [
            self.tokenizer(self.chat_prompt(c), add_special_tokens=False, verbose=False)["input_ids"]
            for c in conversations
        ]
        return self._generate(encoded, tasks, **options)

    def _check(
        self, count: int, tasks: Sequence[str | None] | None, max_new_tokens: int, temperature: float, top_p: float
    ) -> list[int]:
        """Each sequence's task index, after checking the request; a DartsError names what is wrong."""
        tasks = [None] * count if tasks is None else list(tasks)
        if len(tasks) != count:
            raise DartsError(f"{count} prompts but {len(tasks)} tasks", "give one task (or none) per prompt")
        if max_new_tokens < 1:
            raise DartsError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
        if temperature < 0 or not 0 < top_p <= 1:
            raise DartsError(f"temperature must be ≥ 0 and top_p in (0, 1], got {temperature} and {top_p}")
        return [self.task_index(t) for t in tasks]

    @torch.inference_mode()
    def _generate(
        self,
        encoded: list[list[int]],
        tasks: Sequence[str | None] | None,
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        top_p: float = 1.0,
        stop: Sequence[str] | None = None,
        seed: int | None = None,
    ) -> list[Completion]:
        if not encoded:
            return []
        if any(not ids for ids in encoded):
            raise DartsError("a prompt is empty after tokenisation", "send at least one token of text")
        task_ids = self._check(len(encoded), tasks, max_new_tokens, temperature, top_p)
        device = next(self.model.parameters()).device
        width = max(len(ids) for ids in encoded)
        # Left padding, so every sequence's next token is at the same column; the hooks count
        # positions from each sequence's first real token, so padding does not shift P_k.
        input_ids = torch.full((len(encoded), width), self._pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(encoded), width), dtype=torch.long)
        for row, ids in enumerate(encoded):
            input_ids[row, width - len(ids):] = torch.tensor(ids)
            attention_mask[row, width - len(ids):] = 1
        # Sampling settings only when sampling: with do_sample=False transformers warns about them.
        if temperature > 0:
            sampling = {"do_sample": True, "temperature": temperature, "top_p": top_p}
        else:
            sampling = {"do_sample": False}
        stopping = {"stop_strings": list(stop), "tokenizer": self.tokenizer} if stop else {}
        with _seeded(seed), self._tasks(task_ids):
            output = self.model.generate(
                input_ids=input_ids.to(device),
                attention_mask=attention_mask.to(device),
                max_new_tokens=max_new_tokens,
                pad_token_id=self._pad_id,
                eos_token_id=sorted(self._eos_ids) or None,
                **sampling,
                **stopping,
            )
        return [self._completion(len(ids), row.tolist(), list(stop or ()))
                for ids, row in zip(encoded, output[:, width:].cpu())]

    @contextlib.contextmanager
    def _tasks(self, task_ids: list[int]) -> Iterator[None]:
        if self._handle is None:
            yield
            return
        with self._handle.tasks(task_ids):
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
