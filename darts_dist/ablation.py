"""The ablation: merged, Surgery, +entropy weight, +position bias and DARTS on the same data and budget.

In mergekit's shape: a config (the run's RunConfig, the merge methods to compare, the tuning
budget) becomes a plan (`plan_ablation`: every variant's calibration settings), which
`run_ablation` executes. Every expensive pass runs once: each expert over its calibration,
validation and held-out sets once for all merge methods; each merged model over them once for
all variants. Each variant then trains on those features and is evaluated from them.

Tuning (`trials` > 0) is a random search on a validation split carved from the calibration data
(`calibration.validation_fraction`), never on the held-out set: Surgery and DARTS get the same
number of trials, paired so that trial i draws the same rank, steps and learning rate for both;
DARTS also draws T and each task's β. Trial 0 is the config's own settings. It runs on the
headline (first) merge method; the other merges reuse its winners.
"""

from __future__ import annotations

import gc
import logging
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from transformers import PreTrainedModel

from darts_dist.calibrate.corrections import save_corrections_for
from darts_dist.calibrate.features import TaskFeatures, collect_features, collect_merged, features_only
from darts_dist.calibrate.loop import train_corrections
from darts_dist.calibrate.router import fit_run_router
from darts_dist.config import CalibrationSection, RunConfig, TaskCalibration, updated
from darts_dist.core import TaskRouter, TokenizedSet
from darts_dist.errors import DartsError
from darts_dist.evaluate.evaluator import Evaluator, ExpertSide, MergedSide
from darts_dist.evaluate.plots import plot_ablation_bias
from darts_dist.evaluate.tables import format_value
from darts_dist.merge import merge_methods as known_merge_methods
from darts_dist.pipeline import base_scores, merge_stage
from darts_dist.sources.data import tokenized
from darts_dist.sources.models import load_causal_lm, load_tokenizer, model_dtype, resolve_device
from darts_dist.sources.references import ResolvedSources, resolve_sources
from darts_dist.tracking.runs import Tracking, evaluation_metrics, log_config, log_evaluation

logger = logging.getLogger(__name__)


def _no_entropy(settings: CalibrationSection) -> CalibrationSection:
    # Per-task overrides go too: they are where a per-task β lives.
    return updated(settings, beta=0.0, tasks={})


def _no_position(settings: CalibrationSection) -> CalibrationSection:
    return updated(settings, position_bias="none", position_rank=None)


def _with_position(settings: CalibrationSection) -> CalibrationSection:
    return settings if settings.position_bias != "none" else updated(settings, position_bias="per_task")


# Each variant's calibration settings from DARTS's (the config's, or the tuned ones); None: no correction.
VARIANTS: dict[str, Callable[[CalibrationSection], CalibrationSection | None]] = {
    "merged": lambda settings: None,
    "surgery": lambda settings: _no_position(_no_entropy(settings)),  # β = 0, no P: Representation Surgery
    "entropy": _no_position,  # the entropy weight alone
    "position": lambda settings: _with_position(_no_entropy(settings)),  # the position bias alone
    "darts": lambda settings: settings,
}
DEFAULT_MERGE_METHODS = ("task_arithmetic", "ties")
# What tuning maximises: the validation mean over tasks of one of the evaluation's results.
SELECT_METRICS = ("nll_gap_closed", "bias_reduction", "weighted_bias_reduction", "late_bias_reduction")
SHARED_KNOBS = ("rank", "steps", "learning_rate")  # drawn alike for Surgery and DARTS; T and β: DARTS only


def search_space(settings: CalibrationSection) -> dict[str, tuple]:
    """The random search's values, around the config's own: its steps ×1, 2, 4 (a trial never trains less),
    its learning rate ×0.3 to ×10, T a quarter, half or all of the calibrated length."""
    return {
        "rank": (16, 32, 64, 128, 256),
        "steps": tuple(settings.steps * factor for factor in (1, 2, 4)),
        "learning_rate": tuple(settings.learning_rate * factor for factor in (0.3, 1.0, 3.0, 10.0)),
        "max_positions": tuple(max(1, settings.max_length // part) for part in (4, 2, 1)),
        "beta": (0.0, 0.25, 0.5, 1.0),
    }


@dataclass(frozen=True)
class AblationPlan:
    """What to run: the config, the merge methods (the first is the headline), each variant's settings
    (before tuning), the number of tuning trials per method (0: none) and what tuning maximises."""

    config: RunConfig
    merge_methods: tuple[str, ...]
    variants: dict[str, CalibrationSection | None]
    trials: int = 0
    select: str = "nll_gap_closed"


def plan_ablation(
    config: RunConfig,
    merge_methods: Sequence[str] | None = None,
    trials: int = 0,
    validation_fraction: float | None = None,
    select: str = "nll_gap_closed",
) -> AblationPlan:
    """Check the request and derive every variant's settings from the config's calibration section.

    merge_methods default: the config's method, then task_arithmetic and TIES; with tuning the
    validation fraction defaults to the config's, or 0.2 where the config holds none back.
    """
    methods = tuple(merge_methods) if merge_methods else tuple(dict.fromkeys((config.merge.method, *DEFAULT_MERGE_METHODS)))
    if config.merge.mergekit_yaml is not None:
        raise DartsError(f"the ablation merges with each of {list(methods)}, but merge.mergekit_yaml fixes one merge",
                         "remove merge.mergekit_yaml and set merge.method / merge.parameters instead")
    unknown = sorted(set(methods) - set(known_merge_methods()))
    if unknown or len(set(methods)) != len(methods):
        raise DartsError(f"merge methods {list(methods)}: unknown or repeated {unknown or 'names'}",
                         f"name each once, from {list(known_merge_methods())}")
    if trials < 0:
        raise DartsError(f"the number of tuning trials must be 0 (no tuning) or more, got {trials}")
    if select not in SELECT_METRICS:
        raise DartsError(f"unknown tuning metric {select!r}", f"use one of {list(SELECT_METRICS)}")
    settings = config.calibration
    fraction = validation_fraction if validation_fraction is not None else settings.validation_fraction
    if trials and fraction == 0:
        fraction = 0.2
    if not 0 <= fraction < 1 or (trials and fraction == 0):
        raise DartsError(f"validation fraction {fraction}: tuning needs one in (0, 1)", "e.g. --validation-fraction 0.2")
    config = updated(config, calibration=updated(settings, validation_fraction=fraction))
    settings = config.calibration
    return AblationPlan(config, methods, {name: make(settings) for name, make in VARIANTS.items()}, trials, select)


def sweep_settings(
    settings: CalibrationSection, tasks: Sequence[str], trials: int, seed: int = 0
) -> list[tuple[CalibrationSection, CalibrationSection]]:
    """(Surgery, DARTS) settings of each trial: the config's own first, then paired random draws."""
    rng = random.Random(seed)
    space = search_space(settings)
    pairs = [(VARIANTS["surgery"](settings), settings)]
    for _ in range(trials - 1):
        shared = {key: rng.choice(space[key]) for key in SHARED_KNOBS}
        betas = {t: updated(settings.tasks.get(t) or TaskCalibration(), beta=rng.choice(space["beta"])) for t in tasks}
        darts = updated(settings, **shared, max_positions=rng.choice(space["max_positions"]), tasks=betas)
        pairs.append((VARIANTS["surgery"](darts), darts))
    return pairs


# --- execution --------------------------------------------------------------------------------


@dataclass
class Context:
    """What every phase of one ablation shares: the config, its sources, the evaluator, where models run."""

    config: RunConfig
    sources: ResolvedSources
    evaluator: Evaluator
    device: torch.device
    dtype: torch.dtype
    progress: bool


@dataclass
class TaskSide:
    """One task's expert passes, computed once for every merge: its calibration targets and its evaluation side."""

    calibration: TokenizedSet
    features: TaskFeatures  # the expert's targets and entropy (no merged states)
    expert: ExpertSide


@dataclass
class MergeSides:
    """One merged model's passes over every task: what each variant trains on and is judged against."""

    features: list[TaskFeatures]  # with the merged model's states in feature mode
    pairs: list[tuple[ExpertSide, MergedSide]]


def task_side(index: int, ctx: Context, tune: bool, base_passes: list[bool] | None) -> TaskSide:
    """Load task `index`'s expert, run it over every set once, and let it go."""
    task, settings = ctx.config.tasks[index], ctx.config.calibration
    expert = load_causal_lm(ctx.sources.experts[task], dtype=ctx.dtype, device=ctx.device)
    data = tokenized(ctx.sources.data[task], task, "calibration", settings, ctx.evaluator.tokenizer)
    features = collect_features(task, index, data, expert, None, settings.layers, settings.batch_size, ctx.progress)
    side = TaskSide(calibration=data, features=features, expert=ctx.evaluator.expert_side(index, expert, tune, base_passes))
    logger.info("expert %s: features, held-out outputs and task score done", task)
    del expert
    gc.collect()
    return side


def merge_sides(merged: PreTrainedModel, sides: Sequence[TaskSide], ctx: Context) -> MergeSides:
    """The merged model over every task's sets, and over its calibration sets in feature mode."""
    settings = ctx.config.calibration
    features = [
        replace(side.features, merged=collect_merged(side.expert.task, side.calibration, merged, settings.layers,
                                                     settings.batch_size, ctx.progress))
        if features_only(settings.layers) else side.features
        for side in sides
    ]
    return MergeSides(features, [(side.expert, ctx.evaluator.merged_side(merged, side.expert)) for side in sides])


def tune(
    plan: AblationPlan, merged: PreTrainedModel, sides: MergeSides, ctx: Context
) -> tuple[dict[str, CalibrationSection | None], list[dict[str, object]]]:
    """The random search on the validation split: each trial's results, and the variants built from the winners."""
    settings = plan.config.calibration
    trials = []
    best: dict[str, tuple[float, CalibrationSection]] = {}
    for number, pair in enumerate(sweep_settings(settings, plan.config.tasks, plan.trials, seed=settings.seed)):
        for name, trial in zip(("surgery", "darts"), pair):
            result = train_corrections(sides.features, trial, merged, progress=False)
            validation = ctx.evaluator.evaluate(merged, result.corrections, sides.pairs, split="validation")
            value = validation["overall"][plan.select]
            value = float("-inf") if value is None else value
            trials.append({"trial": number, "variant": name, "settings": _knobs(trial), plan.select: value,
                           "overall": validation["overall"],
                           "tasks": {t: {k: r.get(k) for k in SELECT_METRICS} for t, r in validation["tasks"].items()}})
            logger.info("tune %s trial %d: validation %s %s (%s)", name, number, plan.select,
                        format_value(plan.select, value), _knobs(trial))
            if name not in best or value > best[name][0]:
                best[name] = (value, trial)
    variants = {name: make(best["darts"][1]) for name, make in VARIANTS.items()}
    variants["surgery"] = best["surgery"][1]
    return variants, trials


def _knobs(settings: CalibrationSection) -> dict[str, object]:
    """The settings a trial varies, for the report."""
    return {
        "rank": settings.rank, "steps": settings.steps, "learning_rate": settings.learning_rate,
        "max_positions": settings.max_positions, "position_bias": settings.position_bias,
        "beta": {t: settings.beta_for(t) for t in settings.tasks} or settings.beta,
    }


def _merge_config(config: RunConfig, method: str) -> RunConfig:
    return updated(config, merge=updated(config.merge, method=method,
                                         output=config.run_dir / "ablation" / method / "merged"))


def run_ablation(plan: AblationPlan, tracking: Tracking | None = None, progress: bool = True) -> dict[str, object]:
    """Execute the plan: the report's `variants` are the first merge method's, `merge_methods` holds them all."""
    started = time.perf_counter()
    config = plan.config
    settings = config.calibration
    if tracking is not None:
        log_config(tracking, config)
    device = resolve_device(settings.device)
    sources = resolve_sources(config)
    evaluator = Evaluator(config, sources.data, load_tokenizer(sources.base), progress)
    ctx = Context(config, sources, evaluator, device, model_dtype(settings.dtype, device), progress)
    base_passes = base_scores(evaluator, sources.base, ctx.dtype, device)
    experts = [task_side(index, ctx, plan.trials > 0, base_passes.get(task)) for index, task in enumerate(config.tasks)]
    methods: dict[str, dict[str, object]] = {}
    variants, trials, router_report = plan.variants, None, None
    for method in plan.merge_methods:
        merged_dir = merge_stage(_merge_config(config, method), sources)
        merged = load_causal_lm(merged_dir, dtype=ctx.dtype, device=device)
        router = None
        if method == plan.merge_methods[0]:  # the router of the headline merge: its accuracy and DARTS's routed scores
            router_report = fit_run_router(config, sources.data, merged_dir, evaluator.layer, model=merged)
            router = TaskRouter.load(Path(router_report["path"]))
        sides = merge_sides(merged, experts, ctx)
        tuned_here = plan.trials > 0 and trials is None
        if tuned_here:  # on the headline merge; the others reuse its winners, so merges compare at equal settings
            variants, trials = tune(plan, merged, sides, ctx)
        results = {}
        for name, variant in variants.items():
            results[name] = _run_variant(name, variant, method, merged, merged_dir, sides, ctx, tracking,
                                         router if name == "darts" else None)
        methods[method] = {"merged": str(merged_dir), "variants": results, **({"tuning": trials} if tuned_here else {})}
        del merged, sides
        gc.collect()
    plot = plot_ablation_bias({m: r["variants"] for m, r in methods.items()},
                              config.run_dir / "plots" / "ablation_bias_by_position.png")
    report = {
        "config": config.model_dump(mode="json"),
        "run_dir": str(config.run_dir),
        "headline_merge_method": plan.merge_methods[0],
        "variants": methods[plan.merge_methods[0]]["variants"],
        "merge_methods": methods,
        "router": router_report,
        "tuning": {"trials": plan.trials, "select": plan.select, "merge_method": plan.merge_methods[0],
                   "validation_fraction": settings.validation_fraction} if plan.trials else None,
        "plots": {"ablation_bias_by_position": str(plot)},
        "seconds": time.perf_counter() - started,
    }
    if tracking is not None:
        tracking.log_file(tracking.run_id, plot, "plots")
        headline = evaluation_metrics(report["variants"]["darts"])
        tracking.log_metrics(tracking.run_id, {
            **{key: value for key, value in headline.items() if key.startswith("eval.overall.")},
            **{f"router.{key}": router_report[key] for key in ("accuracy", "train_accuracy") if key in router_report},
        })
        report["tracking"] = {"uri": tracking.uri, "experiment_id": tracking.experiment_id,
                              "run_id": tracking.run_id, "stage_runs": tracking.stages}
    return report


def _run_variant(
    name: str, settings: CalibrationSection | None, method: str, merged: PreTrainedModel, merged_dir: Path,
    sides: MergeSides, ctx: Context, tracking: Tracking | None, router: TaskRouter | None = None,
) -> dict[str, object]:
    """Train one variant (none for `merged`), save its corrections, evaluate it on held-out data, log it."""
    logger.info("%s / %s: %s", method, name, "evaluating" if settings is None else "training, then evaluating")
    corrections = calibration = path = None
    if settings is not None:
        result = train_corrections(sides.features, settings, merged, progress=ctx.progress)
        corrections = result.corrections
        path = save_corrections_for(ctx.config.run_dir / "ablation" / method / f"{name}.safetensors", corrections,
                                    merged_dir)
        corrections = corrections.to(ctx.device)
        calibration = {"first_loss": result.losses[0], "final_loss": result.losses[-1], "train_seconds": result.seconds}
    evaluation = ctx.evaluator.evaluate(merged, corrections, sides.pairs, router=router)
    summary = {
        "settings": None if settings is None else settings.model_dump(mode="json"),
        "corrections": None if path is None else str(path),
        "calibration": calibration,
        **evaluation,
    }
    if tracking is not None:
        run_id = tracking.start_stage(f"ablation/{method}/{name}", {"darts.merge_method": method, "darts.variant": name})
        tracking.log_params(run_id, {"merge_method": method, "variant": name,
                                     "calibration": summary["settings"] or "none"})
        if calibration is not None:
            tracking.log_metrics(run_id, calibration)
        log_evaluation(tracking, run_id, evaluation, {})
    return summary


# --- tables -------------------------------------------------------------------------------------

OVERALL_COLUMNS = {
    "bias_reduction": "bias reduction",
    "weighted_bias_reduction": "entropy-weighted",
    "late_bias_reduction": "late (t>=64)",
    "nll_corrected": "NLL",
    "nll_gap_closed": "NLL gap closed",
}
TASK_COLUMNS = {**OVERALL_COLUMNS, "score_corrected": "score", "score_routed": "routed score",
                "canonical_nll_corrected": "solution NLL"}


def ablation_tables(report: Mapping[str, object]) -> list[tuple[str, list[str], list[list[str]]]]:
    """(title, headers, rows) of the overall table and the per-task one, for every merge method and variant."""
    overall_rows, task_rows = [], []
    for method, result in report["merge_methods"].items():
        for name, variant in result["variants"].items():
            overall_rows.append([method, name, *(format_value(k, variant["overall"].get(k)) for k in OVERALL_COLUMNS)])
            for task, values in variant["tasks"].items():
                task_rows.append([method, name, task, *(format_value(k, values.get(k)) for k in TASK_COLUMNS)])
    return [
        ("ablation, held-out, mean over tasks", ["merge", "variant", *OVERALL_COLUMNS.values()], overall_rows),
        ("ablation, held-out, per task", ["merge", "variant", "task", *TASK_COLUMNS.values()], task_rows),
    ]
