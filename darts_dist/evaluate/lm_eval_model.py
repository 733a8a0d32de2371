"""darts-dist's corrected model as an lm-evaluation-harness model, `--model darts-dist`.

`--model_args run=RUN_DIR` reads a run folder (merged/, corrections.safetensors, router.safetensors, as a run writes
them); `merged=DIR,corrections=FILE,router=FILE` names the files apart. `task=` picks the correction: a task id,
`routed` (the task router's pick per request) or `merged` (none).

Every context lm-eval sends is ONE user message, put through the merged model's chat template and answered
greedily by `CorrectedLM`, which is what `darts-dist evaluate` asks of the model: so the darts_demo tasks score
here what they score there, problem for problem. lm-eval's own chat templating (`--apply_chat_template`) would
template each prompt a second time, and is refused.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import lm_eval.models  # noqa: F401  lm-eval's own models first: get_model() fills only an empty registry with them
import torch
from lm_eval.api.instance import Instance
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm.auto import tqdm

from darts_dist.core import ROUTED
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
# lm-eval's generation settings this model honours; `max_gen_toks` defaults to lm-eval's own default (HFLM's).
GEN_KWARGS = ("until", "max_gen_toks", "do_sample", "temperature", "top_p")
DEFAULT_MAX_GEN_TOKS = 256
DTYPES = ("float32", "bfloat16", "float16")  # on GPUs; the CPU computes fp32, as the server does


@register_model(MODEL_NAME)
class DartsLM(LM):
    """A merged model under one correction (or the router's, or none), answering lm-eval's requests."""

    def __init__(
        self,
        run: str | None = None,
        merged: str | None = None,
        corrections: str | None = None,
        router: str | None = None,
        task: str = ROUTED_ID,
        batch_size: int | str = 1,
        device: str | None = None,
        dtype: str = "float32",
    ) -> None:
        super().__init__()
        merged_dir, corrections_path, router_path = model_files(run, merged, corrections, router)
        if dtype not in DTYPES:
            raise DartsError(f"unknown dtype {dtype!r} in the darts-dist model_args", f"use one of {list(DTYPES)}")
        self._device = _device(device)
        self.lm = CorrectedLM.load(merged_dir, corrections_path, self._device, model_dtype(dtype, self._device),
                                   router_path)
        self.task = task if task in self.lm.tasks else TASK_WORDS.get(task, task)
        # Checked now, not at the first request: an unknown task id should fail before any data is read.
        try:
            self.lm.task_index(self.task)
        except DartsError as error:
            raise DartsError(f"model_args task={task}: {error.what}", error.fix) from error
        self.batch_size = _batch_size(batch_size)
        self.max_length = int(self.lm.model.config.max_position_embeddings)

    # --- generation -----------------------------------------------------------------------------------------

    def generate_until(self, requests: list[Instance], disable_tqdm: bool = False) -> list[str]:
        """Each context's reply as one user message; requests are batched with others of the same settings."""
        texts = []
        for batch in tqdm(list(self._batches(requests)), desc="darts-dist generate", disable=disable_tqdm):
            contexts = [request.args[0] for request in batch]
            done = self.lm.chat([_conversation(c) for c in contexts], tasks=[self.task] * len(batch),
                                **generation_options(batch[0].args[1]))
            for request, completion in zip(batch, done):
                self.cache_hook.add_partial("generate_until", request.args, completion.text)
                texts.append(completion.text)
        return texts

    def _batches(self, requests: Sequence[Instance]) -> Iterator[list[Instance]]:
        """Runs of requests with equal generation settings, `batch_size` at a time, in order."""
        for _, alike in itertools.groupby(requests, key=lambda request: request.args[1]):
            alike = list(alike)
            for start in range(0, len(alike), self.batch_size):
                yield alike[start:start + self.batch_size]

    # --- likelihoods -------------------------------------------------------------------------------------------

    def loglikelihood(self, requests: list[Instance], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """log p(continuation | context): the continuation as the start of the reply to the context's user message."""
        tokenizer = self.lm.tokenizer
        pairs = [self._fit(self.lm.encode_chat(_conversation(context)),
                           tokenizer(continuation, add_special_tokens=False, verbose=False)["input_ids"])
                 for context, continuation in (request.args for request in requests)]
        scores = []
        for start in tqdm(range(0, len(pairs), self.batch_size), desc="darts-dist loglikelihood",
                          disable=disable_tqdm):
            batch = pairs[start:start + self.batch_size]
            scores += self.lm.continuation_logprobs([c for c, _ in batch], [x for _, x in batch],
                                                    [self.task] * len(batch))
        for request, score in zip(requests, scores):
            self.cache_hook.add_partial("loglikelihood", request.args, score)
        return scores

    def _fit(self, context: list[int], continuation: list[int]) -> tuple[list[int], list[int]]:
        """The pair cut to the model's context length: the context loses its start, as lm-eval's HF model does."""
        if len(continuation) >= self.max_length:
            raise DartsError(f"a continuation of {len(continuation)} tokens does not fit the model's "
                             f"{self.max_length} positions", "score shorter continuations")
        return context[-(self.max_length - len(continuation)):], continuation

    def loglikelihood_rolling(self, requests: list[Instance], disable_tqdm: bool = False) -> list[float]:
        """log p(text) of whole plain texts (no chat template: perplexity is of the text itself), in windows of
        the model's context length; a routed model routes every window of a text on all of the text."""
        tokenizer = self.lm.tokenizer
        prefix = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
        totals = []
        for request in tqdm(requests, desc="darts-dist loglikelihood_rolling", disable=disable_tqdm):
            tokens = tokenizer(request.args[0], add_special_tokens=False, verbose=False)["input_ids"]
            windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
                token_list=tokens, prefix_token=prefix, max_seq_len=self.max_length, context_len=1)]
            total = 0.0
            for start in range(0, len(windows), self.batch_size):
                batch = windows[start:start + self.batch_size]
                scores = self.lm.continuation_logprobs([c for c, _ in batch], [x for _, x in batch],
                                                       [self.task] * len(batch),
                                                       route_on=[[prefix, *tokens]] * len(batch))
                total += sum(logprob for logprob, _ in scores)
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
            totals.append(total)
        return totals

    # --- lm-eval's own chat templating, refused ---------------------------------------------------------------

    @property
    def tokenizer_name(self) -> str:
        """What lm-eval reads first when it templates chats itself (--apply_chat_template)."""
        raise _chat_templating_refused()

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        raise _chat_templating_refused()


def _chat_templating_refused() -> DartsError:
    return DartsError("the darts-dist model puts every request through the merged model's chat template itself, as "
                      "one user message (as `darts-dist evaluate` does), so lm-eval must not template it first",
                      "drop --apply_chat_template")


def generation_options(gen_kwargs: Mapping[str, object]) -> dict[str, object]:
    """CorrectedLM's options for a request's lm-eval gen_kwargs: `until` is the stop strings, `max_gen_toks` the
    length; greedy unless `do_sample` with a temperature above 0."""
    unknown = sorted(set(gen_kwargs) - set(GEN_KWARGS))
    if unknown:
        raise DartsError(f"the darts-dist model does not know the generation settings {unknown}",
                         f"use only {list(GEN_KWARGS)} in --gen_kwargs and the task's generation_kwargs")
    until = gen_kwargs.get("until") or []
    temperature = float(gen_kwargs.get("temperature", 1.0)) if gen_kwargs.get("do_sample") else 0.0
    return {
        "stop": [until] if isinstance(until, str) else list(until),
        "max_new_tokens": int(gen_kwargs.get("max_gen_toks", DEFAULT_MAX_GEN_TOKS)),
        "temperature": temperature,
        "top_p": float(gen_kwargs.get("top_p", 1.0)),
    }


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


def _conversation(context: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": context}]


def _device(name: str | None) -> torch.device:
    """The device asked for, else CUDA where there is one; lm-eval's CLI asks for cuda:0 by default, so without CUDA
    the CPU stands in, as it does for lm-eval's own HF model."""
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        logger.warning("device %s asked for, but CUDA is not available: running on the CPU", name)
        return torch.device("cpu")
    return torch.device(name)


def _batch_size(value: int | str) -> int:
    """lm-eval passes --batch_size as given, perhaps "auto"; this model batches a fixed number of requests."""
    try:
        size = int(value)
    except ValueError:
        size = 0
    if size < 1:
        raise DartsError(f"the darts-dist model takes a fixed batch size, got {value!r}",
                         "pass --batch_size N, N ≥ 1")
    return size
