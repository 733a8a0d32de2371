"""The one evaluator (FusionBench's task pool): the pipeline and the ablation judge merges and corrections with it.

Each task's expert runs once over the task's sets (`expert_side`: held-out, validation when tuning,
the reference answers' NLL sets, and its own task score); each merged model runs once over them
(`merged_side`); then any number of corrections are judged from those passes (`evaluate`), which
adds only the corrected passes and the corrected (and routed) answers. A model given with its identity
(`sources.models.model_identity`) has its passes and answers kept in the output cache, so a repeat run
judges new corrections against the same experts and merge without running them again.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from darts_dist.config import RunConfig
from darts_dist.core import DartsCorrections, LayerKey, TaskRouter, TokenizedSet
from darts_dist.evaluate.passes import Outputs, Reference, TaskTally, corrected_outputs, merged_outputs, reference
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
from darts_dist.sources.data import TaskFiles, tokenized
from darts_dist.sources.output_cache import OutputCache, digest

logger = logging.getLogger(__name__)
SPLITS = ("heldout", "validation")


def headline_layer(layers: Sequence[LayerKey]) -> LayerKey:
    """Bias is reported at the final representation when corrected there, else at the last surgery layer."""
    return "final" if "final" in layers else max(layers)


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


@dataclass
class MergedSide:
    """One merged model's outputs on one task's sets, computed once for every correction."""

    heldout: list[Outputs]
    validation: list[Outputs]
    canonical: list[Outputs]
    passes: list[bool] | None


class Evaluator:
    """Held-out bias by position, NLL and task scores of merged and corrected models against their experts."""

    def __init__(
        self, config: RunConfig, data: Mapping[str, TaskFiles], tokenizer: PreTrainedTokenizerBase,
        progress: bool = True, cache: OutputCache | None = None,
    ) -> None:
        self.config = config
        self.data = data
        self.tokenizer = tokenizer
        self.layer = headline_layer(config.calibration.layers)
        self.progress = progress
        # The output cache: the config's default folder unless given; none when the config turns it off.
        self.cache = (cache or OutputCache()) if config.evaluation.cache else None

    @property
    def scores_base(self) -> bool:
        """Whether the base model's task scores are asked for and some task has a scorer to give them."""
        evaluation = self.config.evaluation
        return evaluation.score_base and evaluation.score_limit != 0 and any(
            scorer_named(files.scorer) is not None for files in self.data.values())

    def _references(
        self, expert: PreTrainedModel, data: TokenizedSet | None, desc: str, identity: str | None,
    ) -> list[Reference]:
        if data is None:
            return []
        size = self.config.calibration.batch_size

        def compute() -> list[Reference]:
            return [reference(expert, batch, self.layer)
                    for batch in tqdm(list(data.batches(size)), desc=desc, unit="batch", disable=not self.progress)]

        if self.cache is None or identity is None:
            return compute()
        key = digest("references", identity, str(self.layer), size, data.input_ids, data.attention_mask,
                     data.response_mask)
        return self.cache.records(key, compute, Reference, next(expert.parameters()).device)

    def _outputs(self, merged: PreTrainedModel, refs: Sequence[Reference], identity: str | None) -> list[Outputs]:
        def compute() -> list[Outputs]:
            return [merged_outputs(merged, ref, self.layer) for ref in refs]

        if self.cache is None or identity is None or not refs:
            return compute()
        key = digest("outputs", identity, str(self.layer), *(t for ref in refs for t in (ref.input_ids,
                                                                                        ref.attention_mask)))
        return self.cache.records(key, compute, Outputs, next(merged.parameters()).device)

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
                     settings.generation_batch_size, settings.sandbox_timeout)

        def answer(missing: list[int]) -> list[bool]:
            return problem_passes(lm, None, [problems[i] for i in missing], scorer, settings, label, self.progress)

        # A problem is its question and what passes (answer, tests): the same question checked otherwise misses.
        return self.cache.entries(key, [digest(dataclasses.asdict(p)) for p in problems], answer)

    def _passes(self, lm: CorrectedLM, side: ExpertSide, model: str, identity: str | None) -> list[bool] | None:
        return self._answers(lm, side.scorer, side.problems, f"{model} answers {side.task}", identity)

    def scored_problems(self, task: str) -> tuple[Scorer | None, list[Problem]]:
        """A task's scorer and its held-out problems (none when the task has no scorer or the limit is 0)."""
        files, limit = self.data[task], self.config.evaluation.score_limit
        scorer = scorer_named(files.scorer) if limit != 0 else None
        return scorer, [] if scorer is None else scorer.problems(files.heldout, limit)

    def base_passes(self, base: PreTrainedModel, identity: str | None = None) -> dict[str, list[bool] | None]:
        """The base model's answers to every task's problems: what fine-tuning gave each expert. A pass of its
        own, so that the base is never in memory beside the merged model and an expert."""
        with CorrectedLM(base, self.tokenizer) as lm:
            return {task: self._answers(lm, *self.scored_problems(task), f"base answers {task}", identity)
                    for task in self.config.tasks}

    def expert_side(
        self, index: int, expert: PreTrainedModel, validation: bool = False, base_passes: list[bool] | None = None,
        identity: str | None = None,
    ) -> ExpertSide:
        """Run task `index`'s expert over its held-out set (and validation set), reference answers and problems;
        `base_passes` are the base model's answers to the same problems (`Evaluator.base_passes`), reported beside
        the expert's. `identity` (`model_identity`): the expert's passes and answers go through the output cache."""
        task = self.config.tasks[index]
        files, settings = self.data[task], self.config.calibration
        scorer, problems = self.scored_problems(task)
        canonical = (canonical_set(problems, self.tokenizer, task)
                     if scorer is not None and scorer.canonical_nll and problems else None)
        side = ExpertSide(
            task=task,
            index=index,
            heldout=self._references(expert, tokenized(files, task, "heldout", settings, self.tokenizer),
                                     f"expert {task}", identity),
            validation=self._references(expert, tokenized(files, task, "validation", settings, self.tokenizer)
                                        if validation else None, f"expert {task} validation", identity),
            scorer=scorer,
            problems=problems,
            canonical=self._references(expert, canonical, f"expert {task} solutions", identity),
            passes=None,
            base_passes=base_passes,
        )
        with CorrectedLM(expert, self.tokenizer) as lm:
            side.passes = self._passes(lm, side, "expert", identity)
        return side

    def merged_side(self, merged: PreTrainedModel, side: ExpertSide, identity: str | None = None) -> MergedSide:
        """The merged model over one task's sets, and its task score (through the output cache with `identity`)."""
        outputs = {name: self._outputs(merged, getattr(side, name), identity)
                   for name in ("heldout", "validation", "canonical")}
        with CorrectedLM(merged, self.tokenizer) as lm:
            passes = self._passes(lm, side, "merged", identity)
        return MergedSide(passes=passes, **outputs)

    def _judged(self, ref: Reference, plain: Outputs, merged: PreTrainedModel, candidate: PreTrainedModel,
                corrections: DartsCorrections | None, index: int) -> Outputs:
        """The candidate's outputs on one batch, under task `index`'s correction where there are corrections."""
        own = plain if candidate is merged else merged_outputs(candidate, ref, self.layer)
        return own if corrections is None else corrected_outputs(candidate, ref, own, corrections, index, self.layer)

    def _tally(
        self, refs: Sequence[Reference], plains: Sequence[Outputs], merged: PreTrainedModel,
        candidate: PreTrainedModel, corrections: DartsCorrections | None, side: ExpertSide,
    ) -> dict[str, object]:
        """The results on one set; without corrections and candidate the 'corrected' model is the merged one."""
        tally = TaskTally()
        for ref, plain in zip(refs, plains):
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
        tasks, scored = {}, {}
        for side, plain in sides:
            result = self._tally(getattr(side, split), getattr(plain, split), merged, candidate, corrections, side)
            if split == "heldout" and side.scorer is not None and side.problems:
                corrected, routed = plain.passes, None  # without corrections, the merged model is the 'corrected' one
                if corrections is not None or candidate is not merged:
                    with CorrectedLM(candidate, self.tokenizer, corrections,
                                     router if corrections is not None else None) as lm:
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
        return {"overall": overall(tasks) | overall_score_fields(scored), "tasks": tasks}
