"""The run's stages in the data's order: sources → merge → calibrate → evaluate → register.

Each stage takes the validated config and plain paths and returns plain values, so the CLI
and the Ray job entry points are thin glue around these functions. With an MLflow session
(`tracking.runs.session`) each stage also records itself in its own nested run.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import yaml

from darts_dist.calibrate.coefficients import COEFFICIENTS_FILE, learned_merge
from darts_dist.calibrate.executors import executor_for
from darts_dist.calibrate.layers import with_concrete_layers
from darts_dist.calibrate.router import fit_run_router
from darts_dist.config import REGMEAN_RECORD, RUN_CONFIG_FILE, RunConfig, parse_record
from darts_dist.core import ROUTER_FILE, read_header
from darts_dist.evaluate.plots import (
    plot_bias_by_position,
    plot_coefficients,
    plot_entropy_weights,
    plot_loss,
    plot_task_scores,
)
from darts_dist.evaluate.stage import evaluate_stage
from darts_dist.fsutil import atomic_file
from darts_dist.memory import PeakMemory
from darts_dist.merge.regmean import COMPUTED_ON
from darts_dist.merge.stage import merge_stage
from darts_dist.plan.check import driver_holds_evaluation
from darts_dist.ray_cluster.placement import placement_tags
from darts_dist.redaction import redacted_json
from darts_dist.sources.output_cache import OutputCache
from darts_dist.sources.references import ResolvedSources, resolve_sources
from darts_dist.tracking.registry import (
    DECISION_TAG,
    Registration,
    log_checked_model,
    register_version,
    registered_model_name,
)
from darts_dist.tracking.runs import (
    CORRECTIONS_TAG,
    Tracking,
    evaluation_metrics,
    log_calibration,
    log_config,
    log_evaluation,
    log_merge,
    system_tags,
)
from darts_dist.tracking.step_logger import StepLogger

logger = logging.getLogger(__name__)


def write_report(path: Path, report: dict[str, object]) -> Path:
    """JSON report, written atomically, credentials redacted."""
    with atomic_file(path) as tmp:
        tmp.write_text(json.dumps(redacted_json(report), indent=2, default=str))
    return Path(path).absolute()


@dataclass
class RunState:
    """What one invocation has resolved and produced so far; the report grows stage by stage."""

    config: RunConfig
    sources: ResolvedSources
    merged_dir: Path
    report: dict[str, object]
    tracking: Tracking | None = None  # the command's MLflow session; None runs untracked

    @contextmanager
    def timed(self, stage: str) -> Iterator[None]:
        """Add the wall-clock seconds of the block to the report's `seconds[stage]`, and the most memory this
        process (the driver) held in it above what it held before to `driver_memory[stage]`: where a run's time
        goes, and what the head node must hold."""
        started, memory = time.perf_counter(), PeakMemory()
        try:
            yield
        finally:
            seconds = self.report.setdefault("seconds", {})
            seconds[stage] = round(seconds.get(stage, 0.0) + time.perf_counter() - started, 1)
            held = self.report.setdefault("driver_memory", {})
            held[stage] = max(held.get(stage, 0), memory.stop())


def merge_compute(config: RunConfig, merged_dir: Path) -> dict[str, str]:
    """Where the merge's models computed, by role: RegMean's Gram actors (their record says), none for mergekit's
    merges, which run no model."""
    if not config.merge.from_grams:
        return {}
    tasks = yaml.safe_load((merged_dir / REGMEAN_RECORD).read_text())["grams"]["tasks"]
    return {f"Gram actor ({task})": seen[COMPUTED_ON] for task, seen in tasks.items() if COMPUTED_ON in seen}


def prepare(config: RunConfig, tracking: Tracking | None = None) -> RunState:
    """sources → merge; the run folder gets the validated config (RUN_DIR/config.yaml), so it is a complete
    record that `darts-dist serve RUN_DIR` can serve. With a session, the config goes on its parent run and
    the merge gets its own run."""
    started = time.perf_counter()
    sources = resolve_sources(config)  # builds the demo's experts on first use
    config = with_concrete_layers(config, sources)
    sources_seconds = round(time.perf_counter() - started, 1)
    merge_memory = PeakMemory()
    merged_dir = merge_stage(config, sources)
    with atomic_file(config.run_dir / RUN_CONFIG_FILE) as tmp:
        tmp.write_text(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False))
    report: dict[str, object] = {
        "config": config.model_dump(mode="json"),
        "run_dir": str(config.run_dir),
        "merged": str(merged_dir),
        "plots": {},
        "seconds": {"sources": sources_seconds, "merge": round(time.perf_counter() - started - sources_seconds, 1)},
        "driver_memory": {"merge": merge_memory.stop()},
        "compute": merge_compute(config, merged_dir),
    }
    if tracking is not None:
        log_config(tracking, config)
        log_merge(tracking, merged_dir, {"base": sources.base, **sources.experts})
        # The stage runs' ids as they are opened: the dict is the session's own.
        report["tracking"] = {"uri": tracking.uri, "experiment_id": tracking.experiment_id,
                              "run_id": tracking.run_id, "stage_runs": tracking.stages}
    return RunState(config=config, sources=sources, merged_dir=merged_dir, report=report, tracking=tracking)


CALIBRATION_PLOTS = ("loss", "entropy_weights")  # the calibration run's PNGs, by their name in the report


def _stage_run(state: RunState, stage: str) -> tuple[str | None, StepLogger | None]:
    """A tracked stage's run, tagged with its executor and the device it runs on, and its per-step logger;
    (None, None) untracked."""
    if state.tracking is None:
        return None, None
    config = state.config
    run_id = state.tracking.start_stage(stage, system_tags(config, executor_for(config.cluster).device(config),
                                                           executor=config.cluster.executor))
    return run_id, state.tracking.step_logger(run_id)


def run_coefficients(state: RunState) -> Path:
    """Fit the merge coefficients (calibration.method merge_coefficients[+darts]) and write the learned merge;
    tracked, in a `coefficients` stage run: the loss per step, the coefficients, their plot, the mergekit YAML."""
    config, tracking = state.config, state.tracking
    run_id, on_step = _stage_run(state, "coefficients")
    with state.timed("coefficients"):
        fit = executor_for(config.cluster).fit_coefficients(config, state.sources, on_step)
        logger.info("merge coefficients: loss %.4f -> %.4f in %.1f s", fit.losses[0], fit.losses[-1], fit.seconds)
        learned = learned_merge(config, state.sources.base, state.sources.experts, fit, config.model_dir)
    plot = plot_coefficients(fit.table(), config.run_dir / "plots" / "coefficients.png")
    state.report["coefficients"] = {"learned_merge": str(learned), "table": fit.table(),
                                    "first_loss": fit.losses[0], "final_loss": fit.losses[-1],
                                    "seconds": fit.seconds, "task_vector_bytes": fit.task_vector_bytes}
    state.report["plots"]["coefficients"] = str(plot)
    if tracking is not None:
        on_step.flush()
        tracking.log_metrics(run_id, {"coefficients.first_loss": fit.losses[0],
                                      "coefficients.final_loss": fit.losses[-1]})
        for path in (plot, learned / "mergekit_config.yml", learned / COEFFICIENTS_FILE):
            tracking.log_file(run_id, path, "coefficients")
    return learned


def run_calibration(state: RunState) -> Path | None:
    """calibrate (on Ray or in-process, as `cluster.executor` says), save the corrections and the plots
    (tracked: per-step metrics too); returns the corrections' path. With merge coefficients, they are fitted
    first and the corrections (merge_coefficients+darts) apply to the learned merge; merge_coefficients alone
    trains no corrections (None)."""
    method = state.config.calibration_method
    if method.fits_coefficients:
        run_coefficients(state)
    if not method.trains_corrections:
        return None
    started = time.perf_counter()
    config, tracking = state.config, state.tracking
    model_dir = config.model_dir if method.fits_coefficients else state.merged_dir
    run_id, on_step = _stage_run(state, "calibration")
    with state.timed("calibration"):
        outcome = executor_for(config.cluster).calibrate(config, state.sources, model_dir, on_step)
    losses = outcome.result.losses
    state.report["corrections"] = str(outcome.corrections_path)
    state.report["model"] = str(model_dir)
    state.report.setdefault("compute", {}).update(outcome.compute)
    state.report["calibration"] = {
        "executor": config.cluster.executor,
        "steps": len(losses),
        "first_loss": losses[0],
        "final_loss": losses[-1],
        "train_seconds": outcome.result.seconds,
        "seconds": time.perf_counter() - started,
        "losses": losses,
        **({"job": outcome.job} if outcome.job is not None else {}),
    }
    # The task router (routed serving) learns from the same calibration prompts, pooled from calibration's
    # own merged forwards where it ran them.
    with state.timed("router"):
        state.report["router"] = fit_run_router(config, state.sources.data, model_dir,
                                                config.calibration.headline_layer(),
                                                calibration_features=outcome.prompt_features)
    state.report["compute"]["router"] = state.report["router"]["compute"]
    plots = {
        "loss": plot_loss(losses, config.run_dir / "plots" / "loss.png"),
        "entropy_weights": plot_entropy_weights(
            {task: w.tolist() for task, w in outcome.entropy_weights.items()},
            config.run_dir / "plots" / "entropy_weights.png",
        ),
    }
    state.report["plots"].update({name: str(path) for name, path in plots.items()})
    if tracking is not None:
        on_step.flush()
        track_calibration(tracking, run_id, config, state.report)
    return outcome.corrections_path


def track_calibration(tracking: Tracking, run_id: str, config: RunConfig, report: dict) -> None:
    """The calibration's summary metrics, corrections, plots and (on Ray) job tags, from the run's report."""
    calibration = report["calibration"]
    summary = {k: calibration[k] for k in ("first_loss", "final_loss", "train_seconds")}
    job = calibration.get("job")
    if job is not None:
        summary |= {f"job.{group}.{name}": value for group in ("stream", "seconds") for name, value in job[group].items()}
        tracking.set_tags(run_id, {"darts.ray_run_id": job["run_id"], "darts.checkpoint": job["checkpoint_path"],
                                   **placement_tags(job["placement"])})
    corrections = Path(report["corrections"])
    plots = {name: Path(report["plots"][name]) for name in CALIBRATION_PLOTS}
    log_calibration(tracking, run_id, config, Path(report.get("model", report["merged"])), corrections,
                    read_header(corrections), plots, summary)


EVALUATION_PLOTS = ("bias_by_position", "task_scores")  # the evaluation's PNGs, by their name in the report


def evaluation_plots(evaluation: dict, folder: Path) -> dict[str, Path]:
    """Bias by position, and the task scores with their intervals where there are any."""
    plots = {"bias_by_position": plot_bias_by_position(evaluation["tasks"], folder / "bias_by_position.png"),
             "task_scores": plot_task_scores(evaluation["tasks"], folder / "task_scores.png")}
    return {name: path for name, path in plots.items() if path is not None}


def _track_evaluation(tracking: Tracking, run_id: str, evaluation: dict, plots: dict[str, Path]) -> None:
    """The evaluation on its stage's run; its headline figures (eval.overall.*) on the command's own run too,
    so MLflow's runs table can sort and compare the commands themselves."""
    log_evaluation(tracking, run_id, evaluation, plots)
    tracking.log_metrics(tracking.run_id, {key: value for key, value in evaluation_metrics(evaluation).items()
                                           if key.startswith("eval.overall.")})


def complete_tracking(tracking: Tracking, report: dict) -> None:
    """Log what a run could not while its MLflow store was down, from its report: the per-step losses
    the store missed, the calibration's results and the evaluation; then mark its runs finished. A run of
    merge coefficients alone has no calibration: its evaluation goes to its coefficients run."""
    config = parse_record(report["config"], origin="the run's report")
    if "calibration" in report:
        run_id = tracking.stages.get("calibration") or tracking.start_stage(
            "calibration", system_tags(config, "unknown", executor=report["calibration"]["executor"]))
        logged = {m.step for m in tracking.client.get_metric_history(run_id, "loss")}
        tracking.log_points(run_id, [("loss", loss, step)
                                     for step, loss in enumerate(report["calibration"]["losses"], 1) if step not in logged])
        track_calibration(tracking, run_id, config, report)
    else:
        run_id = tracking.stages.get("coefficients") or tracking.start_stage(
            "coefficients", system_tags(config, "unknown", executor=config.cluster.executor))
    if "variants" in report:
        _track_evaluation(tracking, run_id, report["variants"]["darts"],
                          {name: Path(report["plots"][name]) for name in EVALUATION_PLOTS if name in report["plots"]})
    report["tracking"].pop("offline", None)
    tracking.log_json(tracking.run_id, report, "report.json")
    for run in [*tracking.stages.values(), tracking.run_id]:
        tracking.client.set_terminated(run, "FINISHED")


def has_heldout(state: RunState) -> bool:
    """Whether every task has held-out data, which evaluation (and so the registry's alias) needs."""
    return all(state.sources.data[task].heldout is not None for task in state.config.tasks)


def run_evaluation(state: RunState, corrections: Path | None) -> dict[str, object]:
    """evaluate on the held-out sets; adds `variants.darts` and the bias plot to the report.

    Tracked, the results go to this session's calibration run, or to an evaluation run of their own,
    and the overall ones to the command's run as well.
    """
    # Routed scores come from the router the calibration fit next to its corrections, where there is one.
    router = state.config.run_dir / ROUTER_FILE
    router = router if corrections is not None and router.is_file() else None
    cache = OutputCache()
    with state.timed("evaluation"):
        memory: dict[str, int] = {}
        evaluation = evaluate_stage(state.config, state.sources, state.merged_dir, corrections, router, cache, memory,
                                    driver_holds_models=lambda: driver_holds_evaluation(state.config),
                                    compute=state.report.setdefault("compute", {}))
    if memory:  # each evaluation actor's peak memory: what the plan's evaluation roles hold, measured
        state.report["evaluation_memory"] = memory
    state.report["variants"] = {"darts": evaluation}
    if state.config.evaluation.cache:  # what a repeat run read back: the base's, experts' and merge's passes
        state.report["evaluation_cache"] = cache.counts()
    plots = evaluation_plots(evaluation, state.config.run_dir / "plots")
    state.report["plots"].update({name: str(path) for name, path in plots.items()})
    tracking = state.tracking
    if tracking is not None:
        run_id = tracking.stages.get("calibration")
        if run_id is None:
            run_id = tracking.start_stage("evaluation", {CORRECTIONS_TAG: corrections})
        _track_evaluation(tracking, run_id, evaluation, plots)
    return evaluation


def accepted(losses: list[float]) -> bool:
    """A calibration worth registering: every loss finite, and the last no higher than the first."""
    return all(math.isfinite(loss) for loss in losses) and losses[-1] <= losses[0]


def register_calibration(state: RunState) -> Registration | None:
    """Log the pyfunc model of this session's accepted calibration and register it; None when not registered.

    The report's `tracking` section gets the version's `model_uri` (models:/NAME/VERSION), the alias
    and the decision about it.
    """
    tracking = state.tracking
    if tracking is None or tracking.offline is not None:
        return None  # the store went away: `darts-dist register RUN_DIR` registers it once it is back
    config = state.config
    if "calibration" not in state.report:  # merge_coefficients alone: a learned merge, no corrections
        state.report["tracking"]["decision"] = (f"not registered: merge_coefficients trains no corrections; the learned "
                                                f"merge is the model folder {config.model_dir}")
        return None
    run_id = tracking.stages["calibration"]
    if not accepted(state.report["calibration"]["losses"]):
        decision = "not registered: the calibration loss did not go down (or was not finite)"
        tracking.set_tags(run_id, {DECISION_TAG: decision})
        state.report["tracking"]["decision"] = decision
        return None
    logged, state.report["compute"]["registration check"] = log_checked_model(
        config, tracking.uri, run_id, Path(state.report["model"]), Path(state.report["corrections"]),
        Path(state.report["router"]["path"]))
    registration = register_version(
        tracking.client, registered_model_name(config), logged, run_id, config.tracking.alias
    )
    state.report["tracking"].update({"logged_model_uri": logged, **registration.to_dict()})
    return registration
