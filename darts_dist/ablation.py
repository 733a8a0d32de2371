"""The ablation: merged, Surgery, +entropy weight, +position bias, DARTS, deep DARTS, learned merge
coefficients and DARTS on the learned merge, on the same data and budget, over seeds.

In mergekit's shape: a config (the run's RunConfig, the merge methods to compare, the tuning
budget) becomes a plan (`plan_ablation`: every variant's calibration settings), which
`run_ablation` executes. Every expensive pass runs once: each expert over its calibration,
validation and held-out sets once for all merge methods; each merged model over them once for
all variants. Each variant then trains on those features and is evaluated from them.

Tuning (`trials` > 0) is Ray Tune with Optuna's search (`tuning`) on a validation split carved from the
calibration data (`calibration.validation_fraction`), never on the held-out set: Surgery and DARTS get the
same number of trials, over rank, steps and learning rate, DARTS also over T and each task's β; each
Tuner's first trial is the config's own settings. It runs on the headline (first) merge method; the other
merges reuse its winners.

Seeds (`seeds` > 1): every trained variant trains once per seed (calibration.seed + i: its initial
corrections and minibatch order; the learned coefficients' minibatch order), and each reported number
is the mean over seeds with its standard deviation (`overall_sd`); `claims` says "A beats B" only where
the mean paired difference exceeds two standard deviations of the differences.
"""

from __future__ import annotations

import gc
import itertools
import logging
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from transformers import PreTrainedModel

from darts_dist.calibrate.coefficients import (
    fit_coefficients,
    fit_layers,
    initial_coefficients,
    learned_merge,
    model_tensors,
    read_task_vectors,
)
from darts_dist.calibrate.features import TaskFeatures, collect_features, collect_merged
from darts_dist.calibrate.layers import concrete_layers, with_concrete_layers
from darts_dist.calibrate.loop import train_corrections
from darts_dist.calibrate.router import fit_run_router
from darts_dist.config import GRAM_MERGES, CalibrationSection, RunConfig, format_errors, updated
from darts_dist.core import DartsCorrections, LayerKey, TaskRouter, TaskVectors, TokenizedSet, features_only
from darts_dist.core.task_masks import emr_deltas, emr_unified, mask_bytes, tall_deltas
from darts_dist.errors import DartsError
from darts_dist.evaluate.evaluator import Evaluator, ExpertSide, MergedSide
from darts_dist.evaluate.plots import plot_ablation_bias, plot_frontier
from darts_dist.evaluate.stage import base_side
from darts_dist.evaluate.statistics import paired_comparison, passes_of
from darts_dist.evaluate.tables import format_value
from darts_dist.merge.mergekit import merge_methods as known_merge_methods
from darts_dist.merge.stage import merge_stage
from darts_dist.sources.corrections import save_corrections_for
from darts_dist.sources.data import tokenized
from darts_dist.sources.models import load_causal_lm, load_tokenizer, model_dtype, resolve_device
from darts_dist.sources.references import ResolvedSources, resolve_sources
from darts_dist.tracking.runs import Tracking, evaluation_metrics, log_config, log_evaluation
from darts_dist.tuning import tune_variant, tuning_session

logger = logging.getLogger(__name__)


def _no_entropy(settings: CalibrationSection) -> CalibrationSection:
    # Per-task overrides go too: they are where a per-task β lives.
    return updated(settings, beta=0.0, tasks={})


def _no_position(settings: CalibrationSection) -> CalibrationSection:
    return updated(settings, position_bias="none", position_rank=None)


def _with_position(settings: CalibrationSection) -> CalibrationSection:
    return settings if settings.position_bias != "none" else updated(settings, position_bias="per_task")


def _paper(settings: CalibrationSection) -> CalibrationSection:
    # The paper's loss, hidden states alone: a config's logit term is the darts+logits variant's.
    return updated(settings, logit_weight=0.0) if settings.logit_weight else settings


# Each variant's calibration settings from the config's (or the tuned ones); None: no correction.
VARIANTS: dict[str, Callable[[CalibrationSection], CalibrationSection | None]] = {
    "merged": lambda settings: None,
    "surgery": lambda settings: _no_position(_no_entropy(_paper(settings))),  # β = 0, no P: Representation Surgery
    "entropy": lambda settings: _no_position(_paper(settings)),  # the entropy weight alone
    "position": lambda settings: _with_position(_no_entropy(_paper(settings))),  # the position bias alone
    "darts": _paper,
}
PAPER_VARIANTS = tuple(VARIANTS)
# DARTS at another rank than the config's (the demo's is 256: these are the frontier's cheaper corrections), routed
# as DARTS is; run when named.
RANKED = {f"rank{rank}": rank for rank in (16, 64)}
VARIANTS |= {name: (lambda settings, rank=rank: updated(_paper(settings), rank=rank)) for name, rank in RANKED.items()}
# DARTS aimed at the answer too: the logit term beside the hidden states' L1 (the config's calibration.logit_weight and
# logit_positions; weight 1 where the config sets none); routed as DARTS, run when named.
LOGITS = "darts+logits"
VARIANTS[LOGITS] = lambda settings: settings if settings.logit_weight else updated(settings, logit_weight=1.0)
ROUTED = ("darts", *RANKED, LOGITS)  # the variants the run's router serves, as DARTS
# Variants built at run time from DARTS's: deep DARTS (every merge) needs the model's layers; the learned merge
# coefficients (the headline merge only) replace the merge itself, starting from the run's task-arithmetic weights.
# Naming COEFFICIENTS runs COEFFICIENTS_DARTS too.
DEEP, COEFFICIENTS, COEFFICIENTS_DARTS = "deep", "coefficients", "coefficients+darts"
# Per-task models from the task vectors alone (core.task_masks), evaluated with the task id as DARTS's corrections
# are: TALL masks over each merge's vector (every merge), EMR-merging (merge-free: the headline merge only).
TALL, EMR = "tall", "emr"
MASKED = (TALL, EMR)
EXTENDED = (DEEP, COEFFICIENTS, *MASKED)
DEFAULT_DEEP_LAYERS = ("changed", "final")
# What `claims` compares and which way is better (+1: higher). Within a merge the gaps closed, which count from
# that merge; across merges the absolute held-out NLL and score, since each merge's gap counts from itself.
COMPARED = {"nll_gap_closed": 1, "score_gap_closed": 1}
ACROSS_MERGES = {"nll_corrected": -1, "score_corrected": 1}
SIGNIFICANCE = 0.05  # a score claim's problem-by-problem p-value must be below this in every seed
DEFAULT_MERGE_METHODS = ("task_arithmetic", "ties")
# What tuning maximises: the validation mean over tasks of one of the evaluation's results.
SELECT_METRICS = ("nll_gap_closed", "bias_reduction", "weighted_bias_reduction", "late_bias_reduction")


@dataclass(frozen=True)
class AblationPlan:
    """What to run: the config, the merge methods (the first is the headline), each variant's settings
    (before tuning), the number of tuning trials per method (0: none) and what tuning maximises."""

    config: RunConfig
    merge_methods: tuple[str, ...]
    variants: dict[str, CalibrationSection | None]
    trials: int = 0
    select: str = "nll_gap_closed"
    seeds: int = 1
    deep_layers: tuple[object, ...] = DEFAULT_DEEP_LAYERS  # deep DARTS's surgery layers (layer sets allowed)
    deep: bool = True  # deep DARTS on every merge
    coefficients: bool = True  # the learned coefficients, alone and with DARTS, on the headline merge
    masked: tuple[str, ...] = MASKED  # TALL masks (every merge) and EMR (the headline merge)

    def built(self, settings: CalibrationSection) -> dict[str, CalibrationSection | None]:
        """The plan's variants (by name) made from DARTS's settings `settings`."""
        return {name: VARIANTS[name](settings) for name in self.variants}


class AblationRequest(BaseModel):
    """What the ablation is asked for (the flags of `ablate` and `demo --ablate`), checked before any work; what
    depends on the config (the default merge methods, the validation fraction tuning needs) is `plan_ablation`'s."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    merge_methods: tuple[str, ...] | None = None
    trials: int = Field(default=0, ge=0)
    validation_fraction: float | None = None
    select: Literal[SELECT_METRICS] = "nll_gap_closed"
    seeds: int = Field(default=1, ge=1)
    deep_layers: tuple[object, ...] = DEFAULT_DEEP_LAYERS
    extended: bool = True  # deep DARTS and the learned coefficients too, where `variants` does not name them
    variants: tuple[str, ...] | None = None

    @field_validator("merge_methods")
    @classmethod
    def _known_methods(cls, methods: tuple[str, ...] | None) -> tuple[str, ...] | None:
        if methods is not None:
            _each_once(methods, known_merge_methods(), "merge methods")
        return methods

    @field_validator("variants")
    @classmethod
    def _known_variants(cls, names: tuple[str, ...] | None) -> tuple[str, ...] | None:
        if names is not None:
            _each_once(names, (*VARIANTS, *EXTENDED), "variants")
            if set(names) & {DEEP, COEFFICIENTS} and "darts" not in names:
                raise ValueError(f"{list(names)}: deep DARTS and the learned coefficients start from DARTS's "
                                 "settings: add darts to the variants")
        return names

    @field_validator("deep_layers")
    @classmethod
    def _layers(cls, layers: tuple[object, ...]) -> tuple[object, ...]:
        try:
            CalibrationSection(layers=list(layers))
        except ValidationError as error:
            raise ValueError(f"{list(layers)}: {error.errors()[0]['msg']}; name decoder layer indices, final, or "
                             "the sets all, every:N, changed") from None
        return layers

    @property
    def chosen(self) -> tuple[str, ...]:
        """The variants to run, in order: those named, else the paper's and the extended ones (the paper's alone,
        not `extended`); the ranked ones only when named."""
        return self.variants or ((*PAPER_VARIANTS, *EXTENDED) if self.extended else PAPER_VARIANTS)


def _each_once(names: Sequence[str], known: Sequence[str], what: str) -> None:
    unknown = sorted(set(names) - set(known))
    if unknown or len(set(names)) != len(names):
        raise ValueError(f"{what} {list(names)}: unknown or repeated {unknown or 'names'}; name each once, from "
                         f"{list(known)}")


# What the request's fields are called on the command line, for its errors.
REQUEST_FLAGS = {"merge_methods": "--merge-methods", "trials": "--tune (the tuning trials)",
                 "validation_fraction": "--validation-fraction", "select": "--select (the tuning metric)",
                 "seeds": "--seeds", "deep_layers": "--deep-layers (deep DARTS's layers)", "variants": "--variants"}


def plan_ablation(
    config: RunConfig,
    merge_methods: Sequence[str] | None = None,
    trials: int = 0,
    validation_fraction: float | None = None,
    select: str = "nll_gap_closed",
    seeds: int = 1,
    deep_layers: Sequence[object] = DEFAULT_DEEP_LAYERS,
    extended: bool = True,
    variants: Sequence[str] | None = None,
) -> AblationPlan:
    """Check the request (`AblationRequest`) and derive every variant's settings from the config's calibration
    section.

    merge_methods default: the config's method, then task_arithmetic and TIES; with tuning the
    validation fraction defaults to the config's, or 0.2 where the config holds none back. `variants`: names
    from VARIANTS and EXTENDED (default: the paper's and EXTENDED, or the paper's alone where `extended` is False;
    the ranked ones, RANKED, and LOGITS only when named).
    """
    try:
        request = AblationRequest(
            merge_methods=tuple(merge_methods) if merge_methods else None, trials=trials,
            validation_fraction=validation_fraction, select=select, seeds=seeds, deep_layers=tuple(deep_layers),
            extended=extended, variants=tuple(variants) if variants else None)
    except ValidationError as error:
        raise DartsError(f"the ablation's request is not valid:\n{format_errors(error, REQUEST_FLAGS)}",
                         "fix the flags above (`darts-dist ablate --help` lists them)") from None
    methods = request.merge_methods or tuple(dict.fromkeys((config.merge.method, *DEFAULT_MERGE_METHODS)))
    if config.merge.mergekit_yaml is not None:
        raise DartsError(f"the ablation merges with each of {list(methods)}, but merge.mergekit_yaml fixes one merge",
                         "remove merge.mergekit_yaml and set merge.method / merge.parameters instead")
    if request.merge_methods is None:  # the config's own method, which the config has checked, and the defaults
        try:
            AblationRequest(merge_methods=methods)
        except ValidationError as error:
            raise DartsError(f"the ablation's merge methods:\n{format_errors(error, REQUEST_FLAGS)}",
                             "name them with --merge-methods") from None
    settings = config.calibration
    fraction = validation_fraction if validation_fraction is not None else settings.validation_fraction
    if trials and fraction == 0:
        fraction = 0.2
    if not 0 <= fraction < 1 or (trials and fraction == 0):
        raise DartsError(f"validation fraction {fraction}: tuning needs one in (0, 1)", "e.g. --validation-fraction 0.2")
    config = updated(config, calibration=updated(settings, validation_fraction=fraction))
    settings = config.calibration
    chosen = request.chosen
    return AblationPlan(config, methods, {name: VARIANTS[name](settings) for name in chosen if name in VARIANTS},
                        trials, select, seeds, tuple(deep_layers), DEEP in chosen, COEFFICIENTS in chosen,
                        tuple(name for name in MASKED if name in chosen))


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


def task_side(index: int, ctx: Context, tune: bool, base_passes: list[bool] | None,
              layers: Sequence[LayerKey], top_k: int = 0) -> TaskSide:
    """Load task `index`'s expert, run it over every set once (its hidden states at every layer some variant
    reads, its `top_k` likeliest next tokens where a variant has a logit term), and let it go."""
    task, settings = ctx.config.tasks[index], ctx.config.calibration
    expert = load_causal_lm(ctx.sources.experts[task], dtype=ctx.dtype, device=ctx.device)
    data = tokenized(ctx.sources.data[task], task, "calibration", settings, ctx.evaluator.tokenizer)
    features = collect_features(task, index, data, expert, None, layers, settings.batch_size, ctx.progress, top_k)
    identity = ctx.evaluator.identity(ctx.sources.experts[task], ctx.dtype, ctx.device)
    side = TaskSide(calibration=data, features=features,
                    expert=ctx.evaluator.expert_side(index, expert, tune, base_passes, identity))
    logger.info("expert %s: features, held-out outputs and task score done", task)
    del expert
    gc.collect()
    return side


def with_targets(features: TaskFeatures, layers: Sequence[LayerKey]) -> TaskFeatures:
    """The features with the expert's targets at `layers` only: what one variant's loss reads."""
    return replace(features, targets={k: features.targets[k] for k in layers})


def merge_sides(merged: PreTrainedModel, merged_dir: Path, sides: Sequence[TaskSide], ctx: Context) -> MergeSides:
    """The merged model (loaded from `merged_dir`) over every task's sets, and over its calibration sets at the
    final representation (feature-mode variants train on those states)."""
    settings = ctx.config.calibration
    identity = ctx.evaluator.identity(merged_dir, ctx.dtype, ctx.device)
    features = [replace(side.features, merged=collect_merged(side.expert.task, side.calibration, merged, ["final"],
                                                             settings.batch_size, ctx.progress))
                for side in sides]
    plain = [ctx.evaluator.merged_side(merged, side.expert.index, bool(side.expert.validation), identity)
             for side in sides]
    return MergeSides(features, [(side.expert, outputs) for side, outputs in zip(sides, plain)])


def variant_features(features: Sequence[TaskFeatures], settings: CalibrationSection) -> list[TaskFeatures]:
    """What a variant trains on: its loss layers' targets, and the merged states only in feature mode."""
    mode = features_only(settings.layers)
    return [replace(with_targets(f, settings.loss_layers()), merged=f.merged if mode else {}) for f in features]


def tune(
    plan: AblationPlan, merged_dir: Path, sides: MergeSides, ctx: Context, tracking: Tracking | None,
) -> tuple[dict[str, CalibrationSection | None], list[dict[str, object]]]:
    """Ray Tune on the validation split (`tuning.tune_variant`), Surgery and DARTS with the same budget: each
    trial's results, and the variants built from the winners."""
    settings = plan.config.calibration
    trials, best = [], {}
    with tuning_session(plan.config):
        for name in ("surgery", "darts"):
            features = variant_features(sides.features, VARIANTS[name](settings))
            best[name], rows = tune_variant(name, VARIANTS[name], plan.config, plan.trials, plan.select, features,
                                            merged_dir, ctx.evaluator, sides.pairs, tracking)
            trials += [row | {"settings": _knobs(row["settings"])} for row in rows]
    variants = plan.built(best["darts"])
    if "surgery" in variants:
        variants["surgery"] = best["surgery"]
    return variants, trials


def _knobs(settings: CalibrationSection) -> dict[str, object]:
    """The settings a trial varies, for the report."""
    return {
        "rank": settings.rank, "steps": settings.steps, "learning_rate": settings.learning_rate,
        "max_positions": settings.max_positions, "position_bias": settings.position_bias,
        "beta": {t: settings.beta_for(t) for t in settings.tasks} or settings.beta,
    }


def _merge_config(config: RunConfig, method: str) -> RunConfig:
    """The config merging with `method`: the config's own merge as it is; RegMean(++) otherwise at its defaults; a
    mergekit method with the config's parameters (a RegMean config's: those of its other tensors' method)."""
    merge = config.merge
    output = config.run_dir / "ablation" / method / "merged"
    if method == merge.method:
        return updated(config, merge=updated(merge, output=output))
    parameters = {} if method in GRAM_MERGES else (merge.others_merge.parameters if merge.from_grams
                                                    else merge.parameters)
    return updated(config, merge=updated(merge, method=method, parameters=parameters, others=None, output=output))


@dataclass
class Setup:
    """An ablation made concrete: the plan on the concrete layers, the shared context, the task vectors and deep
    DARTS's layers (where deep DARTS or the learned coefficients run), and each task's expert side."""

    plan: AblationPlan
    ctx: Context
    vectors: TaskVectors | None
    deep_layers: list[LayerKey] | None
    experts: list[TaskSide]


def _setup(plan: AblationPlan, progress: bool) -> Setup:
    """Resolve the sources, make the layers concrete, and run each expert once over its task (every layer any
    variant needs)."""
    config = plan.config
    settings = config.calibration
    device = resolve_device(settings.device)
    sources = resolve_sources(config)
    config = with_concrete_layers(config, sources)
    settings = config.calibration
    # The variants again, from the concrete layers (the plan's may name layer sets).
    plan = replace(plan, config=config, variants=plan.built(settings))
    evaluator = Evaluator(config, sources.data, load_tokenizer(sources.base), progress)
    ctx = Context(config, sources, evaluator, device, model_dtype(settings.dtype, device), progress)
    deep_layers, vectors = None, None
    needed = set(settings.loss_layers())
    if plan.deep or plan.coefficients or plan.masked:
        vectors = read_task_vectors(sources.base, sources.experts).to(device)
        num_layers = vectors.num_layers
        deep_layers = concrete_layers(plan.deep_layers, num_layers, vectors.changed_layers)
        aligned = concrete_layers(settings.coefficients.layers, num_layers, vectors.changed_layers)
        ctx.config = updated(config, calibration=updated(settings, coefficients=updated(settings.coefficients,
                                                                                        layers=aligned)))
        needed |= {*(deep_layers if plan.deep else ()), *(fit_layers(aligned, num_layers) if plan.coefficients else ())}
    layers = [*sorted(k for k in needed if isinstance(k, int)), *(["final"] if "final" in needed else [])]
    base = base_side(evaluator, sources.base, ctx.dtype, device)
    top_k = max((variant.logit_targets() for variant in plan.variants.values() if variant is not None), default=0)
    experts = [task_side(index, ctx, plan.trials > 0, base.passes.get(task), layers, top_k)
               for index, task in enumerate(config.tasks)]
    return Setup(plan, ctx, vectors, deep_layers, experts)


def run_ablation(plan: AblationPlan, tracking: Tracking | None = None, progress: bool = True) -> dict[str, object]:
    """Execute the plan: the report's `variants` are the first merge method's, `merge_methods` holds them all."""
    started = time.perf_counter()
    if tracking is not None:
        log_config(tracking, plan.config)
    setup = _setup(plan, progress)
    plan, ctx = setup.plan, setup.ctx
    methods: dict[str, dict[str, object]] = {}
    variants, trials, router_report = plan.variants, None, None
    for method in plan.merge_methods:
        headline = method == plan.merge_methods[0]
        merged_dir = merge_stage(_merge_config(ctx.config, method), ctx.sources)
        merged = load_causal_lm(merged_dir, dtype=ctx.dtype, device=ctx.device)
        router = None
        if headline:  # the router of the headline merge: its accuracy and DARTS's routed scores
            router_report = fit_run_router(ctx.config, ctx.sources.data, merged_dir, ctx.evaluator.layer, model=merged)
            router = TaskRouter.load(Path(router_report["path"]))
        sides = merge_sides(merged, merged_dir, setup.experts, ctx)
        tuned_here = plan.trials > 0 and trials is None
        if tuned_here:  # on the headline merge; the others reuse its winners, so merges compare at equal settings
            variants, trials = tune(plan, merged_dir, sides, ctx, tracking)
        here = dict(variants)
        if plan.deep:
            here[DEEP] = updated(variants["darts"], layers=setup.deep_layers)
        results = {}
        for name, variant in here.items():
            results[name] = _run_variant(name, variant, method, merged, merged_dir, sides, ctx, tracking, plan.seeds,
                                         router if name in ROUTED else None)
        if headline and plan.coefficients:
            results |= _coefficient_variants(plan, variants["darts"], setup.vectors, merged, sides, setup.experts, ctx,
                                             tracking)
        for name in plan.masked:
            if name == TALL or headline:
                results[name] = _masked_variant(name, setup.vectors, merged_dir, method, sides, ctx, tracking)
        # Within a merge, claims compare gaps closed, which count from the merge: TALL's and EMR's models are their
        # own merges (no gap to close), so they enter the paired tests and the comparisons across merges alone.
        corrected = {name: result for name, result in results.items() if name not in MASKED}
        methods[method] = {"merged": str(merged_dir), "variants": results, "claims": claims(corrected),
                           "paired": paired_tests(results), **({"tuning": trials} if tuned_here else {})}
        del merged, sides
        gc.collect()
    report = _report(plan, ctx.config, methods, router_report, tracking)
    report["seconds"] = time.perf_counter() - started
    return report


def _report(plan: AblationPlan, config: RunConfig, methods: dict[str, dict[str, object]],
            router_report: dict[str, object] | None, tracking: Tracking | None) -> dict[str, object]:
    """The ablation's report from each merge's results (the headline's first), its plot, and (tracked) the
    headline's overall metrics on the command's run."""
    plot = plot_ablation_bias({m: r["variants"] for m, r in methods.items()},
                              config.run_dir / "plots" / "ablation_bias_by_position.png")
    points = frontier({"merge_methods": methods})
    frontier_plot = plot_frontier(points, config.run_dir / "plots" / "frontier.png")
    headline = methods[plan.merge_methods[0]]
    # Every variant of every merge by "method/variant", for the comparisons across merges.
    everyone = {f"{method}/{name}": summary for method, result in methods.items()
                for name, summary in result["variants"].items()}
    report = {
        "config": config.model_dump(mode="json"),
        "run_dir": str(config.run_dir),
        "headline_merge_method": plan.merge_methods[0],
        "seeds": plan.seeds,
        "variants": headline["variants"],
        "claims": headline["claims"],
        "paired": headline["paired"],
        "merge_methods": methods,
        **({"claims_across_merges": claims(everyone, ACROSS_MERGES, keep=_across_merges),
            "paired_across_merges": {key: test for key, test in paired_tests(everyone).items()
                                     if _across_merges(*key.split(" vs "))}} if len(methods) > 1 else {}),
        "router": router_report,
        "frontier": points,
        "tuning": {"trials": plan.trials, "select": plan.select, "merge_method": plan.merge_methods[0],
                   "validation_fraction": config.calibration.validation_fraction} if plan.trials else None,
        "plots": {"ablation_bias_by_position": str(plot), "frontier": str(frontier_plot)},
    }
    if tracking is not None:
        tracking.log_file(tracking.run_id, plot, "plots")
        tracking.log_file(tracking.run_id, frontier_plot, "plots")
        # The parent run's headline: DARTS's numbers, or with --variants leaving it out, the last variant run's.
        variants = report["variants"]
        metrics = evaluation_metrics(variants["darts"] if "darts" in variants else list(variants.values())[-1])
        tracking.log_metrics(tracking.run_id, {
            **{key: value for key, value in metrics.items() if key.startswith("eval.overall.")},
            **{f"router.{key}": router_report[key] for key in ("accuracy", "train_accuracy") if key in router_report},
        })
        report["tracking"] = {"uri": tracking.uri, "experiment_id": tracking.experiment_id,
                              "run_id": tracking.run_id, "stage_runs": tracking.stages}
    return report


def _seeded(settings: CalibrationSection, seed: int) -> CalibrationSection:
    return updated(settings, seed=settings.seed + seed)


def _log_variant(tracking: Tracking | None, method: str, name: str, summary: dict[str, object]) -> None:
    if tracking is None:
        return
    run_id = tracking.start_stage(f"ablation/{method}/{name}", {"darts.merge_method": method, "darts.variant": name})
    tracking.log_params(run_id, {"merge_method": method, "variant": name,
                                 "calibration": summary["settings"] or "none", "seeds": len(summary["seed_runs"])})
    for seed, run in enumerate(summary["seed_runs"]):
        if run["calibration"] is not None:
            tracking.log_metrics(run_id, run["calibration"], step=seed)
    log_evaluation(tracking, run_id, summary, {})
    tracking.log_metrics(run_id, {f"eval.overall_sd.{k}": v for k, v in summary["overall_sd"].items()
                                  if v is not None})


def _run_variant(
    name: str, settings: CalibrationSection | None, method: str, merged: PreTrainedModel, merged_dir: Path,
    sides: MergeSides, ctx: Context, tracking: Tracking | None, seeds: int = 1, router: TaskRouter | None = None,
) -> dict[str, object]:
    """Train one variant once per seed (none for `merged`), save its corrections, evaluate each on held-out data;
    the mean over seeds with its spread, logged."""
    logger.info("%s / %s: %s", method, name, "evaluating" if settings is None else "training, then evaluating")
    runs = []
    for seed in range(1 if settings is None else seeds):
        corrections = calibration = path = None
        if settings is not None:
            seeded = _seeded(settings, seed)
            result = train_corrections(variant_features(sides.features, seeded), seeded, merged, progress=ctx.progress)
            suffix = "" if seed == 0 else f"-seed{seed}"
            path = save_corrections_for(ctx.config.run_dir / "ablation" / method / f"{name}{suffix}.safetensors",
                                        result.corrections, merged_dir)
            corrections = result.corrections.to(ctx.device)
            calibration = {"first_loss": result.losses[0], "final_loss": result.losses[-1],
                           "train_seconds": result.seconds}
        evaluation = ctx.evaluator.evaluate(merged, corrections, sides.pairs, router=router)
        runs.append({"corrections": None if path is None else str(path), "calibration": calibration, **evaluation})
    summary = {"settings": None if settings is None else settings.model_dump(mode="json"),
               "bytes_per_task": 0 if corrections is None else correction_bytes_per_task(corrections),
               **over_seeds(runs)}
    _log_variant(tracking, method, name, summary)
    return summary


def _coefficient_variants(
    plan: AblationPlan, darts: CalibrationSection, vectors: TaskVectors, merged: PreTrainedModel,
    sides: MergeSides, experts: Sequence[TaskSide], ctx: Context, tracking: Tracking | None,
) -> dict[str, dict[str, object]]:
    """The learned merge coefficients alone and with DARTS on the learned merge, once per seed, judged against
    the headline merge."""
    config = ctx.config
    base = load_causal_lm(ctx.sources.base, dtype=ctx.dtype, device=ctx.device)
    aligned = config.calibration.coefficients.layers
    fit_features = [with_targets(f, fit_layers(aligned, vectors.num_layers)) for f in sides.features]
    alone, corrected = [], []
    for seed in range(plan.seeds):
        seeded = _seeded(darts, seed)
        logger.info("%s: fitting merge coefficients (seed %d)", COEFFICIENTS, seed)
        fit = fit_coefficients(fit_features, base, vectors, initial_coefficients(config),
                               updated(seeded, coefficients=config.calibration.coefficients), ctx.progress)
        folder = config.run_dir / "ablation" / "learned-merge" / f"seed{seed}"
        learned_dir = learned_merge(config, ctx.sources.base, ctx.sources.experts, fit, folder)
        learned = load_causal_lm(learned_dir, dtype=ctx.dtype, device=ctx.device)
        coefficients = {"learned_merge": str(learned_dir), "table": fit.table(),
                        "first_loss": fit.losses[0], "final_loss": fit.losses[-1], "fit_seconds": fit.seconds}
        alone.append({"coefficients": coefficients, "calibration": None,
                      **ctx.evaluator.evaluate(merged, None, sides.pairs, candidate=learned)})
        features = [replace(f, merged=collect_merged(f.task, side.calibration, learned, ["final"],
                                                     config.calibration.batch_size, ctx.progress))
                    for f, side in zip(sides.features, experts)]
        result = train_corrections(variant_features(features, seeded), seeded, learned, progress=ctx.progress)
        # Beside the learned merge's folder, not in it: its content hash covers every safetensors file in it.
        path = save_corrections_for(folder.parent / f"seed{seed}-darts.safetensors", result.corrections, learned_dir)
        corrected.append({"coefficients": coefficients, "corrections": str(path),
                          "calibration": {"first_loss": result.losses[0], "final_loss": result.losses[-1],
                                          "train_seconds": result.seconds},
                          **ctx.evaluator.evaluate(merged, result.corrections.to(ctx.device), sides.pairs,
                                                   candidate=learned)})
        del learned
        gc.collect()
    out = {COEFFICIENTS: {"settings": None, "bytes_per_task": 0, **over_seeds(alone)},
           COEFFICIENTS_DARTS: {"settings": darts.model_dump(mode="json"),
                                "bytes_per_task": correction_bytes_per_task(result.corrections),
                                **over_seeds(corrected)}}
    for name, summary in out.items():
        _log_variant(tracking, plan.merge_methods[0], name, summary)
    return out


def correction_bytes_per_task(corrections: DartsCorrections) -> int:
    """What serving a task's correction adds: its fp32 parameters (the corrections hold one set per task)."""
    return 4 * sum(p.numel() for p in corrections.parameters()) // len(corrections.spec.tasks)


def _masked_variant(name: str, vectors: TaskVectors, merged_dir: Path, method: str, sides: MergeSides,
                    ctx: Context, tracking: Tracking | None) -> dict[str, object]:
    """TALL masks over the merge in `merged_dir`, or EMR-merging: each task's own model (the base plus its masked
    deltas) over that task's sets and problems, judged as the merge is; no retention (a request without a task
    has no model here). Its bytes per task served: the mask's bit per changed parameter (and EMR's rescaler)."""
    logger.info("%s / %s: building each task's model, then evaluating", method, name)
    if name == TALL:
        merged = {n: t.to(ctx.device) for n, t in model_tensors(merged_dir) if n in vectors.deltas}
        deltas_for, bytes_per_task = (lambda task: tall_deltas(vectors, merged, task)), mask_bytes(vectors)
    else:
        unified = emr_unified(vectors)
        deltas_for, bytes_per_task = (lambda task: emr_deltas(vectors, unified, task)), mask_bytes(vectors, numbers=1)
    model = load_causal_lm(ctx.sources.base, dtype=ctx.dtype, device=ctx.device)
    parameters = model.state_dict(keep_vars=True)  # tied weights under each of their names, as files store them
    pairs = []
    for side, _ in sides.pairs:
        with torch.no_grad():
            for tensor, delta in deltas_for(side.index).items():
                parameters[tensor].copy_(vectors.base[tensor] + delta)
        pairs.append((side, ctx.evaluator.merged_side(model, side.index, bool(side.validation), retention=False)))
    run = {"corrections": None, "calibration": None, **ctx.evaluator.evaluate(model, None, pairs)}
    summary = {"settings": None, "bytes_per_task": bytes_per_task, **over_seeds([run])}
    _log_variant(tracking, method, name, summary)
    del model, parameters
    gc.collect()
    return summary


def _mean(values: Sequence[object]) -> object:
    """The mean over seeds of one result: numbers averaged (None if a seed has none), lists and dicts entry by
    entry, anything else (names, flags) as the first seed has it."""
    first = values[0]
    if isinstance(first, int) and not isinstance(first, bool) and all(v == first for v in values):
        return first  # a count every seed shares (tokens, problems)
    if isinstance(first, (int, float)) and not isinstance(first, bool):
        return None if any(v is None for v in values) else statistics.fmean(values)
    if isinstance(first, list) and all(isinstance(v, list) and len(v) == len(first) for v in values):
        return [_mean(column) for column in zip(*values)]
    if isinstance(first, dict):
        return {key: _mean([v.get(key) for v in values]) for key in first}
    return first


def over_seeds(runs: Sequence[dict[str, object]]) -> dict[str, object]:
    """One variant over its seeds: `overall` and `tasks` are means over seeds, `overall_sd` the standard
    deviation of each overall number (0 with one seed), `seed_runs` each seed's own results."""
    overall = _mean([run["overall"] for run in runs])
    spread = {}
    for key, value in overall.items():
        if isinstance(value, float):
            values = [run["overall"][key] for run in runs]
            spread[key] = statistics.stdev(values) if len(values) > 1 else 0.0
    return {"overall": overall, "overall_sd": spread, "tasks": _mean([run["tasks"] for run in runs]),
            "seed_runs": list(runs)}


def _seed_run(variant: Mapping[str, object], seed: int) -> Mapping[str, object]:
    """A variant's run of seed `seed`; an untrained variant's one run stands for every seed."""
    runs = variant["seed_runs"]
    return runs[0 if len(runs) == 1 else seed]


def _corrected_passes(run: Mapping[str, object]) -> dict[str, list[bool]]:
    return {task: passes_of(models["corrected"]) for task, models in run["passes"].items()}


def mcnemar(a: Mapping[str, object], b: Mapping[str, object]) -> dict[str, object] | None:
    """Variant `a` against `b` problem by problem (McNemar's exact test), seed i against seed i: pooled over tasks
    and per task; the largest pooled p-value over seeds and whether `a` won more problems than it lost in every
    seed. None where a run has no task scores."""
    seeds = max(len(a["seed_runs"]), len(b["seed_runs"]))
    if any("passes" not in run for run in (*a["seed_runs"], *b["seed_runs"])):
        return None
    pooled, tasks = [], {}
    for seed in range(seeds):
        ours, theirs = (_corrected_passes(_seed_run(v, seed)) for v in (a, b))
        pooled.append(asdict(paired_comparison([p for t in ours for p in ours[t]],
                                               [p for t in ours for p in theirs[t]])))
        for task in ours:
            tasks.setdefault(task, []).append(asdict(paired_comparison(ours[task], theirs[task])))
    return {"seeds": pooled, "tasks": tasks, "pvalue_max": max(c["pvalue"] for c in pooled),
            "wins_every_seed": all(c["wins"] > c["losses"] for c in pooled)}


def paired_tests(variants: Mapping[str, Mapping[str, object]]) -> dict[str, dict[str, object]]:
    """McNemar (`mcnemar`) for every two variants, keyed "A vs B" (A before B in the variants' order)."""
    tests = {}
    for a, b in itertools.combinations(variants, 2):
        test = mcnemar(variants[a], variants[b])
        if test is not None:
            tests[f"{a} vs {b}"] = test
    return tests


def _paired_support(variants: Mapping[str, Mapping[str, object]], a: str, b: str) -> str | None:
    """Why the problem-by-problem test backs "a beats b" on a score, or None where it does not."""
    test = mcnemar(variants[a], variants[b])
    if test is None or not test["wins_every_seed"] or test["pvalue_max"] >= SIGNIFICANCE:
        return None
    return f"McNemar p ≤ {test['pvalue_max']:.2g} in every seed"


def _across_merges(a: str, b: str) -> bool:
    """Whether two "method/variant" names are of different merge methods."""
    return a.split("/")[0] != b.split("/")[0]


def claims(variants: Mapping[str, Mapping[str, object]], metrics: Mapping[str, int] = COMPARED,
           keep: Callable[[str, str], bool] = lambda a, b: True) -> list[str]:
    """"A beats B on M" for every pair of variants whose mean paired difference over seeds (seed i against
    seed i; an untrained variant's one result against each; signed so that better is positive, `metrics[M]`)
    exceeds two standard deviations of the differences,
    and, for a score, whose problem-by-problem test (McNemar, pooled over tasks) gives p < 0.05 in every seed
    with more wins than losses. Nothing with one seed: a spread needs two. `keep(a, b)`: which pairs to compare."""
    found = []
    for metric, better in metrics.items():
        values = {name: [run["overall"].get(metric) for run in variant["seed_runs"]] for name, variant in variants.items()}
        values = {name: v for name, v in values.items() if v and None not in v}
        seeds = max(map(len, values.values()), default=0)
        if seeds < 2:
            continue
        paired = {name: v * seeds if len(v) == 1 else v for name, v in values.items() if len(v) in (1, seeds)}
        for a, b in itertools.permutations(paired, 2):
            if not keep(a, b):
                continue
            differences = [better * (x - y) for x, y in zip(paired[a], paired[b])]
            mean, sd = statistics.fmean(differences), statistics.stdev(differences)
            if mean <= 0 or mean <= 2 * sd:
                continue
            support = _paired_support(variants, a, b) if metric.startswith("score") else ""
            if support is None:
                continue
            found.append(f"{a} beats {b} on {metric}: {format_value(metric, mean)} "
                         f"(sd of the paired differences {format_value(metric, sd)}, {seeds} seeds"
                         f"{'; ' + support if support else ''})")
    return found


# --- tables -------------------------------------------------------------------------------------

HELDOUT_COLUMNS = {
    "bias_reduction": "bias reduction",
    "weighted_bias_reduction": "entropy-weighted",
    "late_bias_reduction": "late (t>=64)",
    "nll_corrected": "NLL",
    "nll_gap_closed": "NLL gap closed",
    "score_gap_closed": "score gap closed",
}
# Retention (evaluate.retention) of what a request without a task gets: the router's pick (darts), else the merge.
OVERALL_COLUMNS = {**HELDOUT_COLUMNS, "retention_nll_corrected": "retention NLL",
                   "retention_agreement_corrected": "retention agreement"}
TASK_COLUMNS = {**HELDOUT_COLUMNS, "score_corrected": "score", "score_routed": "routed score",
                "canonical_nll_corrected": "solution NLL"}


def _with_spread(key: str, value: object, sd: object) -> str:
    shown = format_value(key, value)
    return shown if not sd or shown == "-" else f"{shown} ± {format_value(key, sd)}"


def _calibration_seconds(run: Mapping[str, object]) -> float | None:
    """A seed run's training seconds: its corrections' and, on a learned merge, the coefficients' fit."""
    parts = [(run.get("calibration") or {}).get("train_seconds"), (run.get("coefficients") or {}).get("fit_seconds")]
    parts = [p for p in parts if p is not None]
    return sum(parts) if parts else None


def frontier(report: Mapping[str, object]) -> list[dict[str, object]]:
    """Every merge's variants as points of the cost/quality frontier: extra bytes per task served, calibration
    seconds (mean over seeds), the held-out score with its sd over seeds, and the retention of what a request
    without a task gets."""
    points = []
    for method, result in report["merge_methods"].items():
        for name, variant in result["variants"].items():
            seconds = [s for s in map(_calibration_seconds, variant["seed_runs"]) if s is not None]
            overall, spread = variant["overall"], variant.get("overall_sd", {})
            points.append({"merge": method, "variant": name, "bytes_per_task": variant.get("bytes_per_task"),
                           "calibration_seconds": statistics.fmean(seconds) if seconds else 0.0,
                           "score": overall.get("score_corrected"), "score_sd": spread.get("score_corrected"),
                           "retention_nll": overall.get("retention_nll_corrected"),
                           "retention_agreement": overall.get("retention_agreement_corrected")})
    return points


FRONTIER_COLUMNS = ["merge", "variant", "bytes per task", "calibration s", "score", "retention NLL",
                    "retention agreement"]


def frontier_rows(points: Sequence[Mapping[str, object]]) -> list[list[str]]:
    return [[p["merge"], p["variant"], "-" if p["bytes_per_task"] is None else f"{p['bytes_per_task']:,}",
             f"{p['calibration_seconds']:.0f}", _with_spread("score_corrected", p["score"], p["score_sd"]),
             format_value("retention_nll_corrected", p["retention_nll"]),
             format_value("retention_agreement_corrected", p["retention_agreement"])] for p in points]


def ablation_tables(report: Mapping[str, object]) -> list[tuple[str, list[str], list[list[str]]]]:
    """(title, headers, rows) of the overall table (means over seeds ± their standard deviation), the per-task
    one, and the claims that hold beyond two standard deviations, for every merge method and variant."""
    overall_rows, task_rows = [], []
    for method, result in report["merge_methods"].items():
        for name, variant in result["variants"].items():
            spread = variant.get("overall_sd", {})
            overall_rows.append([method, name, *(_with_spread(k, variant["overall"].get(k), spread.get(k))
                                                 for k in OVERALL_COLUMNS)])
            for task, values in variant["tasks"].items():
                task_rows.append([method, name, task, *(format_value(k, values.get(k)) for k in TASK_COLUMNS)])
    seeds = report.get("seeds", 1)
    methods = report["merge_methods"]
    claimed = [[method, claim] for method, result in methods.items() for claim in result.get("claims", [])]
    claimed += [["across merges", claim] for claim in report.get("claims_across_merges", [])]
    claimed = claimed or [["-", "none: one seed gives no spread" if seeds < 2 else "none beyond two standard deviations"]]
    tests = {**{(f"{method}: {key}" if len(methods) > 1 else key): test for method, result in methods.items()
                for key, test in result.get("paired", {}).items()}, **report.get("paired_across_merges", {})}
    paired_rows = [[key, ", ".join(f"{c['wins']}/{c['losses']}" for c in test["seeds"]),
                    f"{test['pvalue_max']:.3g}", *(", ".join(f"{c['wins']}/{c['losses']} p {c['pvalue']:.2g}"
                                                             for c in per_seed) for per_seed in test["tasks"].values())]
                   for key, test in tests.items()]
    task_names = list(next(iter(tests.values()))["tasks"]) if tests else []
    return [
        (f"ablation, held-out, mean over tasks ({seeds} seed{'s' if seeds > 1 else ''}: mean ± sd)",
         ["merge", "variant", *OVERALL_COLUMNS.values()], overall_rows),
        ("ablation, held-out, per task (mean over seeds)", ["merge", "variant", "task", *TASK_COLUMNS.values()],
         task_rows),
        ("ablation: differences beyond two standard deviations over seeds (scores: and McNemar p < 0.05 in every "
         "seed); within a merge its gaps closed, across merges the held-out NLL and score", ["merge", "claim"],
         claimed),
        ("ablation: the frontier, what each variant adds per task served and costs to calibrate against its "
         "held-out score (mean ± sd over seeds) and retention (a request without a task)", FRONTIER_COLUMNS,
         frontier_rows(frontier(report))),
        *([("ablation: problem by problem, A vs B (wins/losses of A per seed, pooled over tasks; McNemar's exact "
            "test, the largest p over seeds; then per task)", ["A vs B", "wins/losses", "p (max)", *task_names],
            paired_rows)] if paired_rows else []),
    ]
