"""The merge a user would pick: every candidate merge scored on the validation split, the best one named.

A candidate is a merge method with its parameters (`task_arithmetic:weight=0.5`, `regmean:alpha=0.5`). Each is merged
(an identical earlier merge is reused) and its greedy answers to every task's validation problems
are checked with the task's scorer; the best mean score over tasks wins. The validation split is the
calibration rows `calibration.validation_fraction` holds back, never the held-out set, so the
choice does not peek at what the reported numbers are computed on.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from darts_dist.config import GRAM_MERGES, RunConfig, updated
from darts_dist.errors import DartsError
from darts_dist.evaluate.tables import format_value
from darts_dist.evaluate.task_scores import Problem, Scorer, problem_passes, score_fields, scorer_named
from darts_dist.generation import CorrectedLM
from darts_dist.merge.mergekit import merge_methods
from darts_dist.merge.stage import merge_stage
from darts_dist.sources.data import split_rows
from darts_dist.sources.models import load_causal_lm, load_tokenizer, model_dtype, resolve_device
from darts_dist.sources.references import ResolvedSources, resolve_sources
from darts_dist.tracking.runs import Tracking, log_config

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class MergeCandidate:
    """One merge to try: a merge method (mergekit's, or regmean) and its parameters (for mergekit's, every expert
    gets them)."""

    method: str
    parameters: Mapping[str, float] = field(default_factory=dict)

    @property
    def name(self) -> str:
        values = ",".join(f"{key}={value:g}" for key, value in sorted(self.parameters.items()))
        return f"{self.method}:{values}" if values else self.method

    @classmethod
    def parse(cls, text: str) -> MergeCandidate:
        """`method` or `method:key=value,key=value`, e.g. `ties:weight=1,density=0.5`."""
        method, _, values = text.strip().partition(":")
        if method not in merge_methods():
            raise DartsError(f"unknown merge method {method!r} in {text!r}", f"use one of {list(merge_methods())}")
        parameters = {}
        for item in filter(None, (part.strip() for part in values.split(","))):
            key, sep, value = item.partition("=")
            try:
                parameters[key.strip()] = float(value)
            except ValueError:
                sep = ""
            if not sep:
                raise DartsError(f"merge candidate {text!r}: {item!r} is not key=number",
                                 "write candidates as method:key=value,key=value, e.g. task_arithmetic:weight=0.5")
        return cls(method, parameters)


# Task arithmetic at the scales people use, and TIES at its paper's density.
DEFAULT_CANDIDATES = tuple(MergeCandidate.parse(text) for text in (
    "task_arithmetic:weight=0.3", "task_arithmetic:weight=0.5", "task_arithmetic:weight=0.7",
    "task_arithmetic:weight=1.0", "ties:weight=1.0,density=0.5",
))


def validation_problems(config: RunConfig, sources: ResolvedSources) -> dict[str, tuple[Scorer, list[Problem]]]:
    """Each scored task's validation problems (at most `evaluation.score_limit`); tasks whose scorer has a fixed
    problem set (HumanEval) are left out: they have no validation split."""
    if config.evaluation.score_limit == 0:
        raise DartsError("the merge sweep compares task scores, and evaluation.score_limit is 0 (no task scores)",
                         "drop --score-limit 0, or give a positive limit")
    if config.calibration.validation_fraction == 0:
        raise DartsError("the merge sweep scores the validation split, and calibration.validation_fraction is 0",
                         "set calibration.validation_fraction (e.g. 0.5) to hold calibration rows back for it")
    problems = {}
    for task in config.tasks:
        files = sources.data[task]
        scorer = scorer_named(files.scorer)
        if scorer is None or not scorer.reads_rows:
            continue
        rows = split_rows(files, "validation", config.calibration)
        problems[task] = (scorer, scorer.problems_of(rows, f"{files.calibration} (validation split)", "validation",
                                                     config.evaluation.score_limit))
    if not problems:
        raise DartsError("no task has a scorer that reads its own rows, so no merge can be scored on validation data",
                         "give the tasks data with answers and a scorer (data.scorer), e.g. the demo tasks")
    return problems


def sweep_merges(
    config: RunConfig, candidates: Sequence[MergeCandidate] = DEFAULT_CANDIDATES, tracking: Tracking | None = None,
    progress: bool = True,
) -> dict[str, object]:
    """Merge and score every candidate on the validation split; the report names the best (`best`)."""
    if not candidates or len({c.name for c in candidates}) != len(candidates):
        raise DartsError(f"merge candidates {[c.name for c in candidates]}: none, or one named twice",
                         "name each candidate once")
    if config.merge.mergekit_yaml is not None:
        raise DartsError("the merge sweep builds each candidate's merge, but merge.mergekit_yaml fixes one merge",
                         "remove merge.mergekit_yaml and set merge.method / merge.parameters instead")
    sources = resolve_sources(config)
    problems = validation_problems(config, sources)
    tokenizer = load_tokenizer(sources.base)
    device = resolve_device(config.calibration.device)
    dtype = model_dtype(config.calibration.dtype, device)
    if tracking is not None:
        log_config(tracking, config)
    results = {}
    for candidate in candidates:
        folder = candidate.name.replace(":", "-").replace(",", "-").replace("=", "")
        # RegMean(++) keeps the config's merge.others (its other tensors' method); a mergekit method has none.
        merge = updated(config.merge, method=candidate.method, parameters=dict(candidate.parameters),
                        others=config.merge.others if candidate.method in GRAM_MERGES else None,
                        output=config.run_dir / "merge_sweep" / folder / "merged")
        merged_dir = merge_stage(updated(config, merge=merge), sources)
        model = load_causal_lm(merged_dir, dtype=dtype, device=device)
        tasks = {}
        with CorrectedLM(model, tokenizer) as lm:
            for task, (scorer, task_problems) in problems.items():
                passes = problem_passes(lm, None, task_problems, scorer, config.evaluation,
                                        desc=f"{candidate.name} answers {task}", progress=progress)
                tasks[task] = score_fields(scorer, {"merged": passes})
        mean = sum(t["score_merged"] for t in tasks.values()) / len(tasks)
        results[candidate.name] = {"method": candidate.method, "parameters": dict(candidate.parameters),
                                   "merged": str(merged_dir), "score_mean": mean, "tasks": tasks}
        logger.info("merge sweep: %s scores %s on validation (mean over tasks)", candidate.name,
                    format_value("score_merged", mean))
        if tracking is not None:
            run_id = tracking.start_stage(f"merge-sweep/{candidate.name}", {"darts.merge_method": candidate.method})
            tracking.log_params(run_id, {"merge_method": candidate.method, **dict(candidate.parameters)})
            tracking.log_metrics(run_id, {"validation.score_mean": mean, **{
                f"validation.{task}.score_merged": t["score_merged"] for task, t in tasks.items()}})
        del model
        gc.collect()
    best = max(results, key=lambda name: results[name]["score_mean"])
    report = {"config": config.model_dump(mode="json"), "split": "validation",
              "validation_fraction": config.calibration.validation_fraction, "candidates": results, "best": best,
              "best_merge": {"method": results[best]["method"], "parameters": results[best]["parameters"]}}
    if tracking is not None:
        tracking.log_params(tracking.run_id, {"best_merge": best})
        tracking.log_metrics(tracking.run_id, {"validation.best_score_mean": results[best]["score_mean"]})
    return report


def sweep_table(report: Mapping[str, object]) -> tuple[str, list[str], list[list[str]]]:
    """(title, headers, rows): each candidate's validation score per task with its interval, and the mean."""
    candidates = report["candidates"]
    tasks = list(next(iter(candidates.values()))["tasks"])
    rows = []
    for name, result in candidates.items():
        cells = [f"{format_value('score_merged', t['score_merged'])} ({format_value('', t['score_merged_ci'])})"
                 for t in (result["tasks"][task] for task in tasks)]
        rows.append([name + ("  (best)" if name == report["best"] else ""), *cells,
                     format_value("score_merged", result["score_mean"])])
    n = {task: candidates[next(iter(candidates))]["tasks"][task]["score_n"] for task in tasks}
    return ("merge sweep: merged model's task scores on the validation split (95% Wilson intervals)",
            ["merge", *(f"{task} (n={n[task]})" for task in tasks), "mean"], rows)
