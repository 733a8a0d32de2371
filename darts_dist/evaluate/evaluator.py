"""The one evaluator (FusionBench's task pool): the pipeline and the ablation judge merges and corrections with it.

Each task's expert runs once over the task's sets (`expert_side`: held-out, validation when tuning,
the reference answers' NLL sets, and its own task score); each merged model runs once over them
(`merged_side`); then any number of corrections are judged from those passes (`evaluate`), which
adds only the corrected passes and the corrected (and routed) answers. A model given with its identity
(`sources.models.model_identity`) has its passes and answers kept in the output cache, so a repeat run
judges new corrections against the same experts and merge without running them again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TypeVar

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from darts_dist.config import RunConfig
from darts_dist.core import DartsCorrections, TaskRouter, TokenizedSet
from darts_dist.evaluate.passes import (
    HOST,
    Outputs,
    Reference,
    TaskTally,
    corrected_outputs,
    merged_outputs,
    reference,
)
from darts_dist.evaluate.retention import RetentionRow, RetentionScore, base_rows, retention_fields, score
from darts_dist.evaluate.statistics import passes_text
from darts_dist.evaluate.tables import overall
from darts_dist.evaluate.task_scores import (
    Problem,
    Scorer,
    canonical_fields,
    canonical_set,
    overall_score_fields,
    problem_passes,
    routed_passes,
    score_fields,
    scorer_named,
)
from darts_dist.generation import CorrectedLM
from darts_dist.logs import progress_bar
from darts_dist.sources.corrections import load_corrections_for
from darts_dist.sources.data import TaskFiles, tokenized
from darts_dist.sources.models import model_identity
from darts_dist.sources.output_cache import OutputCache, digest

logger = logging.getLogger(__name__)
SPLITS = ("heldout", "validation")
T = TypeVar("T")


def judged_artifacts(
    config: RunConfig, merged_dir: Path, corrections_path: Path | None, router_path: Path | None,
) -> tuple[DartsCorrections | None, TaskRouter | None, Path]:
    """What an evaluation judges: the corrections (on the CPU) and router, and the model they apply to
    (config.model_dir: the merged model, or the learned merge of merge_coefficients methods)."""
    model_dir = config.model_dir if config.calibration_method.fits_coefficients else merged_dir
    if corrections_path is None:
        return None, None, model_dir
    corrections = load_corrections_for(corrections_path, model_dir, config.tasks)
    return corrections, None if router_path is None else TaskRouter.load(router_path), model_dir


def scores_base(config: RunConfig, data: Mapping[str, TaskFiles]) -> bool:
    """Whether the base model's task scores are asked for and some task has a scorer to give them."""
    evaluation = config.evaluation
    return evaluation.score_base and evaluation.score_limit != 0 and any(
        scorer_named(files.scorer) is not None for files in data.values())


@dataclass(frozen=True)
class BaseSide:
    """What the base model contributes, computed once: its task answers (when asked for) and the retention set
    (evaluate.retention: the instructions with its own replies, and its score on them), when asked for."""

    passes: dict[str, list[bool] | None]
    retention_rows: list[RetentionRow] | None
    retention: dict[str, object] | None


NO_BASE = BaseSide({}, None, None)  # an evaluation that asked nothing of the base


@dataclass
class ExpertSide:
    """One task and everything its expert contributes, computed once for every merge and correction."""

    task: str
    index: int
    heldout: list[Reference]
    validation: list[Reference]  # empty unless asked for (tuning)
    scorer: Scorer | None
    problems: list[Problem]
    canonical: list[Reference]  # the reference answers' batches (scorers with canonical NLL)
    passes: list[bool] | None  # the expert's own task score, problem by problem
    base_passes: list[bool] | None  # the base model's (before fine-tuning) on the same problems
    retention: dict[str, object] | None = None  # the expert on the retention set (`retention.RetentionScore.summary`)

    def with_base(self, base_passes: list[bool] | None) -> ExpertSide:
        return replace(self, base_passes=base_passes)


@dataclass
class MergedSide:
    """One merged model's outputs on one task's sets, computed once for every correction."""

    heldout: list[Outputs]
    validation: list[Outputs]
    canonical: list[Outputs]
    passes: list[bool] | None
    retention: dict[str, object] | None = None


class Evaluator:
    """Held-out bias by position, NLL and task scores of merged and corrected models against their experts."""

    def __init__(
        self, config: RunConfig, data: Mapping[str, TaskFiles], tokenizer: PreTrainedTokenizerBase,
        progress: bool = True, cache: OutputCache | None = None,
    ) -> None:
        self.config = config
        self.data = data
        self.tokenizer = tokenizer
        self.layer = config.calibration.headline_layer()
        self.progress = progress
        # The output cache: the config's default folder unless given; none when the config turns it off.
        self.cache = (cache or OutputCache()) if config.evaluation.cache else None
        self.base = NO_BASE  # `base_side`'s (`use_base`)

    @property
    def scores_base(self) -> bool:
        return scores_base(self.config, self.data)

    def identity(self, path: Path, dtype: torch.dtype, device: torch.device) -> str | None:
        """The model folder's `model_identity`, the key of its cached passes; None with the cache off (nothing
        is hashed then)."""
        return None if self.cache is None else model_identity(path, dtype, device)

    def _over_batches(
        self, model: PreTrainedModel, data: TokenizedSet | None, run: Callable[..., T], kind: type[T],
        identity: str | None, desc: str | None = None,
    ) -> list[T]:
        """`run(model, batch, layer)` on each batch of `data` (an expert's `reference`, a merged model's
        `merged_outputs`), through the output cache when the model has an identity."""
        if data is None:
            return []
        size = self.config.calibration.batch_size

        def compute() -> list[T]:
            batches = progress_bar(list(data.batches(size)), desc=desc, unit="batch", disable=not self.progress or not desc)
            return [run(model, batch, self.layer) for batch in batches]

        if self.cache is None or identity is None:
            return compute()
        key = digest(kind.__name__, identity, str(self.layer), size, data.input_ids, data.attention_mask,
                     data.response_mask)
        return self.cache.records(key, compute, kind, HOST)

    def _answers(
        self, lm: CorrectedLM, scorer: Scorer | None, problems: list[Problem], label: str, identity: str | None,
    ) -> list[bool] | None:
        """An uncorrected model's passes on `problems`; with its identity, its passes on problems it was asked
        before are read back and only new problems answered (and checked)."""
        if scorer is None or not problems:
            return None
        settings = self.config.evaluation
        if self.cache is None or identity is None:
            return problem_passes(lm, None, problems, scorer, settings, desc=label, progress=self.progress)
        key = digest("answers", identity, scorer.name, settings.max_new_tokens or scorer.max_new_tokens, scorer.stop,
                     sorted(lm.eos_ids), settings.generation_batch_size, settings.sandbox_timeout, settings.sandbox)

        def answer(missing: list[int]) -> list[bool]:
            return problem_passes(lm, None, [problems[i] for i in missing], scorer, settings, label, self.progress)

        # A problem is its question as the model reads it (token ids: the tokenizer and chat template count) and
        # what passes (answer, tests): the same question checked otherwise misses.
        items = [digest(lm.encode_chat(p.messages) if p.messages else lm.encode(p.prompt), asdict(p)) for p in problems]
        return self.cache.entries(key, items, answer)

    def scored_problems(self, task: str) -> tuple[Scorer | None, list[Problem]]:
        """A task's scorer and its held-out problems (none when the task has no scorer or the limit is 0)."""
        files, limit = self.data[task], self.config.evaluation.score_limit
        scorer = scorer_named(files.scorer) if limit != 0 else None
        return scorer, [] if scorer is None else scorer.problems(files.heldout, limit)

    @property
    def needs_base(self) -> bool:
        """Whether the base model runs at all: for its task scores or for the retention set."""
        return self.scores_base or self.config.evaluation.retention

    def base_side(self, base: PreTrainedModel, base_dir: Path, identity: str | None = None) -> BaseSide:
        """The base model's answers to every task's problems (what fine-tuning gave each expert) and the retention
        set's rows and its own score on them, as asked for; this evaluator uses them from now on (`use_base`). A
        pass of its own, so that the base is never in memory beside the merged model and an expert."""
        side = self.base_retention(base, base_dir, identity)
        return replace(side, passes=self.base_answers(base, identity))

    def base_answers(self, base: PreTrainedModel, identity: str | None = None) -> dict[str, list[bool] | None]:
        """The base model's answers to every task's problems, where asked for (else none)."""
        if not self.scores_base:
            return {}
        with CorrectedLM(base, self.tokenizer) as lm:
            return {task: self._answers(lm, *self.scored_problems(task), f"base answers {task}", identity)
                    for task in self.config.tasks}

    def base_retention(self, base: PreTrainedModel, base_dir: Path, identity: str | None = None) -> BaseSide:
        """The retention set's rows (`retention.base_rows`) and the base's own score on them, without its answers;
        this evaluator uses them from now on. NO_BASE without the retention set."""
        if not self.config.evaluation.retention:
            return NO_BASE
        with CorrectedLM(base, self.tokenizer) as lm:
            rows = base_rows(lm, identity, self.cache, base_dir, self._retention_batch)
            self.use_base(BaseSide({}, rows, self._retention(lm, identity, rows)))
        return self.base

    def use_base(self, side: BaseSide) -> None:
        """Judge with `side`'s retention rows and report its base scores (an actor given the base actor's side)."""
        self.base = side

    @property
    def _retention_batch(self) -> int:
        return self.config.evaluation.generation_batch_size

    @property
    def _routing(self) -> dict[str, object]:
        """How the server routes a request without a task (the run's serve settings), so that routed models are
        scored as served."""
        serve = self.config.serve
        return {"threshold": serve.router_threshold, "abstain_outside": serve.router_abstain_outside}

    def _retention(self, lm: CorrectedLM, identity: str | None = None,
                   rows: list[RetentionRow] | None = None) -> dict[str, object] | None:
        """`lm` on the retention set (`rows`, by default the base side's; a request without a task: the router's
        pick, else uncorrected); None without the set. An uncorrected model with its `identity` goes through the
        output cache, row by row."""
        rows, batch = rows or self.base.retention_rows, self._retention_batch
        if rows is None:
            return None
        if self.cache is None or identity is None:
            return score(lm, rows, batch).summary()

        def scored(missing: list[int]) -> list[list[float]]:
            got = score(lm, [rows[i] for i in missing], batch)
            return [list(row) for row in zip(got.nll, got.tokens, got.agreeing)]

        key = digest("retention scores", identity, batch)
        values = self.cache.entries(key, [digest(row.prompt_ids, row.reply_ids) for row in rows], scored)
        nll, tokens, agreeing = zip(*values)
        return RetentionScore(tuple(nll), tuple(map(int, tokens)), tuple(map(int, agreeing))).summary()

    def task_sets(self, index: int, validation: bool = False) -> dict[str, TokenizedSet | None]:
        """Task `index`'s token sets: held-out, validation (when asked for) and its problems' reference answers
        (scorers with canonical NLL); None where there is none."""
        task = self.config.tasks[index]
        files, settings = self.data[task], self.config.calibration
        scorer, problems = self.scored_problems(task)
        return {
            "heldout": tokenized(files, task, "heldout", settings, self.tokenizer),
            "validation": tokenized(files, task, "validation", settings, self.tokenizer) if validation else None,
            "canonical": (canonical_set(problems, self.tokenizer, task)
                          if scorer is not None and scorer.canonical_nll and problems else None),
        }

    def expert_side(
        self, index: int, expert: PreTrainedModel, validation: bool = False, base_passes: list[bool] | None = None,
        identity: str | None = None,
    ) -> ExpertSide:
        """Run task `index`'s expert over its held-out set (and validation set), reference answers and problems;
        `base_passes` are the base model's answers to the same problems (`Evaluator.base_passes`), reported beside
        the expert's. `identity` (`model_identity`): the expert's passes and answers go through the output cache."""
        task = self.config.tasks[index]
        scorer, problems = self.scored_problems(task)
        sets = self.task_sets(index, validation)
        labels = {"heldout": f"expert {task}", "validation": f"expert {task} validation",
                  "canonical": f"expert {task} solutions"}
        side = ExpertSide(task=task, index=index, scorer=scorer, problems=problems, passes=None,
                          base_passes=base_passes,
                          **{name: self._over_batches(expert, data, reference, Reference, identity, labels[name])
                             for name, data in sets.items()})
        with CorrectedLM(expert, self.tokenizer) as lm:
            side.passes = self._answers(lm, scorer, problems, f"expert answers {task}", identity)
            side.retention = self._retention(lm, identity)
        return side

    def merged_side(
        self, merged: PreTrainedModel, index: int, validation: bool = False, identity: str | None = None,
        retention: bool = True,
    ) -> MergedSide:
        """The merged model over task `index`'s sets (the expert side's rows: it does not need the expert's
        passes) and its task score, through the output cache with `identity`; with the first task's side, its
        retention (a model's, not a task's: once), unless `retention` is off."""
        task = self.config.tasks[index]
        outputs = {name: self._over_batches(merged, data, merged_outputs, Outputs, identity)
                   for name, data in self.task_sets(index, validation).items()}
        with CorrectedLM(merged, self.tokenizer) as lm:
            passes = self._answers(lm, *self.scored_problems(task), f"merged answers {task}", identity)
            retained = self._retention(lm, identity) if retention and index == 0 else None
        return MergedSide(passes=passes, retention=retained, **outputs)

    def _judged(self, ref: Reference, plain: Outputs, merged: PreTrainedModel, candidate: PreTrainedModel,
                corrections: DartsCorrections | None, index: int) -> Outputs:
        """The candidate's outputs on one batch (on its device), under task `index`'s correction where there are
        corrections."""
        own = plain if candidate is merged else merged_outputs(candidate, {"input_ids": ref.input_ids,
                                                                           "attention_mask": ref.attention_mask},
                                                               self.layer).to(ref.input_ids.device)
        return own if corrections is None else corrected_outputs(candidate, ref, own, corrections, index, self.layer)

    def _tally(
        self, refs: Sequence[Reference], plains: Sequence[Outputs], merged: PreTrainedModel,
        candidate: PreTrainedModel, corrections: DartsCorrections | None, side: ExpertSide,
    ) -> dict[str, object]:
        """The results on one set; without corrections and candidate the 'corrected' model is the merged one. Each
        kept batch is on the candidate's device while it is judged (the bias and NLL sums are taken there)."""
        tally = TaskTally()
        device = next(candidate.parameters()).device
        for ref, plain in zip(refs, plains):
            ref, plain = ref.to(device), plain.to(device)
            tally.add(ref, plain, self._judged(ref, plain, merged, candidate, corrections, side.index))
        return tally.result(side.task, self.layer)

    def evaluate(
        self,
        merged: PreTrainedModel,
        corrections: DartsCorrections | None,
        sides: Iterable[tuple[ExpertSide, MergedSide]],
        split: str = "heldout",
        router: TaskRouter | None = None,
        candidate: PreTrainedModel | None = None,
    ) -> dict[str, object]:
        """{"overall", "tasks"} of the merged model under `corrections` (None: the merged model is its own
        'corrected' one) on the held-out or validation split; held-out adds task scores, and with a router the
        routed model's (the task left to the router, as for served requests to the routed model id).

        `candidate`: the model the corrections apply to, judged against the merged one (a learned merge); by
        default the merged model itself. `sides` may be a generator: each task's passes are then held only while
        that task is judged.
        """
        candidate = merged if candidate is None else candidate
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        tasks, scored, retained = {}, {}, {"base": self.base.retention, "experts": {}}
        for side, plain in sides:
            retained["experts"][side.task] = side.retention
            retained["merged"] = retained.get("merged") or plain.retention
            result = self._tally(getattr(side, split), getattr(plain, split), merged, candidate, corrections, side)
            if split == "heldout" and side.scorer is not None and side.problems:
                corrected, routed = plain.passes, None  # without corrections, the merged model is the 'corrected' one
                if corrections is not None or candidate is not merged:
                    with CorrectedLM(candidate, self.tokenizer, corrections,
                                     router if corrections is not None else None, **self._routing) as lm:
                        corrected = problem_passes(lm, None if corrections is None else side.task, side.problems,
                                                   side.scorer, self.config.evaluation,
                                                   f"corrected answers {side.task}", self.progress)
                        if router is not None and corrections is not None:
                            routed = routed_passes(lm, side.task, side.problems, side.scorer, self.config.evaluation,
                                                   corrected, f"routed answers {side.task}", self.progress)
                scored[side.task] = {"base": side.base_passes, "expert": side.passes, "merged": plain.passes,
                                     "corrected": corrected, "routed": routed}
                result |= score_fields(side.scorer, scored[side.task])
                if side.canonical:
                    result |= canonical_fields(self._tally(side.canonical, plain.canonical, merged, candidate,
                                                           corrections, side))
            tasks[side.task] = result
        # Each problem's pass or fail, so that runs and variants on the same problems can be paired later.
        passes = {task: {model: passes_text(outcome) for model, outcome in models.items() if outcome is not None}
                  for task, models in scored.items()}
        summary = overall(tasks) | overall_score_fields(scored)
        if self.base.retention_rows is not None:
            retained["corrected"] = self._served_retention(merged, candidate, corrections, router,
                                                           retained["merged"])
            summary |= retention_fields(retained)
        return {"overall": summary, "tasks": tasks, **({"passes": passes} if passes else {}),
                **({"retention": retained} if self.base.retention_rows is not None else {})}

    def _served_retention(self, merged: PreTrainedModel, candidate: PreTrainedModel,
                          corrections: DartsCorrections | None, router: TaskRouter | None,
                          merged_retention: dict[str, object] | None) -> dict[str, object] | None:
        """The retention of what a request without a task gets: the router's pick of the corrections (and where it
        sent each instruction: `routes`), or without a router the uncorrected model (the merged model's own score,
        unless a learned merge is judged)."""
        routed = router is not None and corrections is not None
        if not routed and candidate is merged:
            return merged_retention
        with CorrectedLM(candidate, self.tokenizer, corrections if routed else None, router if routed else None,
                         **self._routing) as lm:
            return self._retention(lm)
