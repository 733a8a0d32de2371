"""darts-dist's corrected model as an lm-evaluation-harness model, `--model darts-dist`.

`--model_args run=RUN_DIR` reads a run folder (merged/, corrections.safetensors, router.safetensors, as a run writes
them); `merged=DIR,corrections=FILE,router=FILE` names the files apart. `task=` picks the correction: a task id,
`routed` (the task router's pick per request) or `merged` (none).

The model is lm-eval's own `hf` model (`HFLM`) given the merged model that `CorrectedLM` loaded, with darts-dist's
correction hooks on it: tokenisation, batching, truncation, stop strings, chat templating and the scoring of
likelihoods are lm-eval's, so it follows lm-eval's conventions (raw contexts; the chat template only with
`--apply_chat_template`), and with `task=merged` it scores exactly as `--model hf` on the merged folder does.
darts-dist decides only which correction applies to each forward: the task's, none, or the router's pick per
request, routed on the request's context tokens (generation: the prompt the model sees), as darts-dist routes.

Positions: the correction's position term reads each row's positions from the forward's attention mask or
position ids. lm-eval's likelihood batches are right-padded and run without a mask, so each row's tokens sit at
0..n−1 (as in `CorrectedLM.continuation_logprobs`); generation is left-padded with a mask, from which
transformers' generate() (and the hooks) count positions from each row's first real token.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import get_args

import lm_eval.models  # noqa: F401  lm-eval's own models first: get_model() fills only an empty registry with them
import torch
from lm_eval.api.instance import Instance
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM

from darts_dist.config import ComputeDtype
from darts_dist.core import ROUTED, one_hot_tasks
from darts_dist.errors import DartsError
from darts_dist.generation import CorrectedLM
from darts_dist.run_folder import read_run_folder
from darts_dist.sources.models import model_dtype

logger = logging.getLogger(__name__)

MODEL_NAME = "darts-dist"
# `task=` words beside the task ids: the router's pick per request, and no correction (the served `NAME:merged`).
# A task of the same name wins over a word (`merged` and `auto`, CorrectedLM's name for routing, are reserved).
ROUTED_ID = "routed"
TASK_WORDS: dict[str, str | None] = {ROUTED_ID: ROUTED, "merged": None}
DTYPES = get_args(ComputeDtype)  # as calibration.dtype: auto is bfloat16 on GPUs, float32 on CPUs
# How many contexts the router reads in one forward.
ROUTE_BATCH = 32
_NONE = -1  # CorrectedLM's task index of no correction


@register_model(MODEL_NAME)
class DartsLM(HFLM):
    """lm-eval's `hf` model on the merged model, under one correction (or the router's pick, or none)."""

    def __init__(
        self,
        run: str | None = None,
        merged: str | None = None,
        corrections: str | None = None,
        router: str | None = None,
        task: str = ROUTED_ID,
        batch_size: int | str = 1,
        max_batch_size: int = 64,
        device: str | None = None,
        dtype: str = "auto",
        max_length: int | None = None,
        add_bos_token: bool | None = None,
        logits_cache: bool = True,
    ) -> None:
        merged_dir, corrections_path, router_path = model_files(run, merged, corrections, router)
        if dtype not in DTYPES:
            raise DartsError(f"unknown dtype {dtype!r} in the darts-dist model_args", f"use one of {list(DTYPES)}")
        torch_device = _device(device)
        lm = CorrectedLM.load(merged_dir, corrections_path, torch_device, model_dtype(dtype, torch_device),
                              router_path)
        name = task if task in lm.tasks else TASK_WORDS.get(task, task)
        # Checked now, not at the first request: an unknown task id should fail before any data is read.
        try:
            index = lm.task_index(name)
        except DartsError as error:
            raise DartsError(f"model_args task={task}: {error.what}", error.fix) from error
        super().__init__(pretrained=lm.model, tokenizer=lm.tokenizer, backend="causal", batch_size=batch_size,
                         max_batch_size=max_batch_size, max_length=max_length, add_bos_token=add_bos_token,
                         logits_cache=logits_cache)
        self.lm = lm
        self.task = name
        # The task index every forward applies (−1: none); a routed model pins each group of requests in turn.
        self._pinned: int | None = None if name == ROUTED else index

    # --- which correction applies to a forward -------------------------------------------------------------------

    def _weights(self, rows: int) -> torch.Tensor | None:
        # Routed, outside a pinned group, only lm-eval's probe for the largest batch runs (batch_size=auto): its
        # speed is the same either way.
        if self._pinned is None or self.lm.corrections is None or self._pinned == _NONE:
            return None
        return one_hot_tasks(torch.full((rows,), self._pinned), len(self.lm.tasks))

    @contextlib.contextmanager
    def _pin(self, index: int) -> Iterator[None]:
        previous, self._pinned = self._pinned, index
        try:
            yield
        finally:
            self._pinned = previous

    def _route(self, encoded: Sequence[Sequence[int]]) -> list[int]:
        """The router's task index (−1: none) for each tokenised context, as CorrectedLM's routed id picks it."""
        # Each distinct context once (a multiple-choice question repeats its context for every choice), in order of
        # length, so that a routing batch pads little.
        unique = sorted(dict.fromkeys(tuple(ids)[-self.max_length:] for ids in encoded), key=len)
        picks: dict[tuple[int, ...], int] = {}
        for start in range(0, len(unique), ROUTE_BATCH):
            chunk = unique[start:start + ROUTE_BATCH]
            picks.update(zip(chunk, (self.lm.task_index(task) for task in self.lm.routes(chunk))))
        return [picks[tuple(ids)[-self.max_length:]] for ids in encoded]

    def _in_groups(self, items: list, picks: list[int], score) -> list:
        """`score` on the items of each routed task (pinned to it), the results back in the items' order."""
        results: list = [None] * len(items)
        for index in sorted(set(picks)):
            rows = [row for row, pick in enumerate(picks) if pick == index]
            with self._pin(index):
                for row, result in zip(rows, score([items[row] for row in rows])):
                    results[row] = result
        return results

    def _model_call(self, inps: torch.Tensor, attn_mask=None, labels=None) -> torch.Tensor:
        with self.lm.weighted(self._weights(inps.shape[0])):
            return super()._model_call(inps, attn_mask, labels)

    def _model_generate(self, context: torch.Tensor, max_length: int, stop: list[str], **generation_kwargs):
        if self._pinned is None:  # routed: each prompt's own pick, on the tokens the model sees
            mask = generation_kwargs.get("attention_mask")
            mask = torch.ones_like(context) if mask is None else mask
            rows = [ids[keep.bool()].tolist() for ids, keep in zip(context, mask)]
            picks = self._route(rows)
            weights = one_hot_tasks(torch.tensor(picks), len(self.lm.tasks))
        else:
            weights = self._weights(context.shape[0])
        with self.lm.weighted(weights):
            return super()._model_generate(context, max_length, stop, **generation_kwargs)

    # --- routed likelihoods: requests grouped by the router's pick on their contexts -----------------------------

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs: int | None = None):
        if self._pinned is not None:
            return super()._loglikelihood_tokens(requests, disable_tqdm=disable_tqdm, override_bs=override_bs)
        return self._in_groups(requests, self._route([context for _, context, _ in requests]),
                               lambda group: super(DartsLM, self)._loglikelihood_tokens(
                                   group, disable_tqdm=disable_tqdm, override_bs=override_bs))

    def loglikelihood_rolling(self, requests: list[Instance], disable_tqdm: bool = False) -> list[float]:
        """A routed model routes every window of a text on all of the text (from the prefix token on)."""
        if self._pinned is not None:
            return super().loglikelihood_rolling(requests, disable_tqdm=disable_tqdm)
        texts = [[self.prefix_token_id, *self.tok_encode(request.args[0])] for request in requests]
        return self._in_groups(requests, self._route(texts),
                               lambda group: super(DartsLM, self).loglikelihood_rolling(group, disable_tqdm))


def model_files(
    run: str | None, merged: str | None, corrections: str | None, router: str | None
) -> tuple[Path, Path | None, Path | None]:
    """The merged model folder, corrections and router that the model_args name: a run folder's own (read as
    `darts-dist serve` reads one; files given apart win), or a merged folder with the files given apart."""
    if (run is None) == (merged is None):
        raise DartsError("the darts-dist model needs exactly one of run= and merged= in its model_args",
                         "pass --model_args run=RUN_DIR,task=TASK (or merged=DIR,corrections=FILE,task=TASK)")
    given = [None if path is None else Path(path) for path in (corrections, router)]
    if run is not None:
        if not Path(run).is_dir():
            raise DartsError(f"run folder {run} does not exist",
                             "pass run= the folder a `calibrate` or `demo` run wrote (OUTPUT_DIR/NAME)")
        folder = read_run_folder(Path(run), *given)
        files = (folder.merged_dir, folder.corrections, folder.router)
    else:
        files = (Path(merged), *given)
    missing = [str(path) for path in files if path is not None and not path.exists()]
    if missing:
        raise DartsError(f"files of the darts-dist model are missing: {missing}", "check the paths in --model_args")
    return files


def _device(name: str | None) -> torch.device:
    """The device asked for, else CUDA where there is one; lm-eval's CLI asks for cuda:0 by default, so without CUDA
    the CPU stands in, as it does for lm-eval's own HF model."""
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        logger.warning("device %s asked for, but CUDA is not available: running on the CPU", name)
        return torch.device("cpu")
    return torch.device(name)
