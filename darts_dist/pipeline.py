"""The run's stages in the data's order: sources → merge → calibrate → evaluate → register.

Each stage takes the validated config and plain paths and returns plain values, so the CLI
and the Ray job entry points are thin glue around these functions. With an MLflow session
(`tracking.session`) each stage also records itself in its own nested run.
"""

from __future__ import annotations

import gc
import json
import math
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from darts_dist.calibrate import (
    CalibrationResult,
    StepCallback,
    TaskFeatures,
    collect_features,
    features_only,
    model_dtype,
    resolve_device,
    train_corrections,
)
from darts_dist.config import CalibrationSection, RunConfig
from darts_dist.core import DartsCorrections, entropy_weights, read_header, save_corrections
from darts_dist.data import TokenizedSet, calibration_split, load_rows, tokenize_rows
from darts_dist.errors import DartsError
from darts_dist.evaluate import evaluate_task, overall
from darts_dist.fsutil import atomic_file
from darts_dist.generation import load_corrections_for
from darts_dist.merge import build_mergekit_config, load_mergekit_yaml, run_merge
from darts_dist.models import content_hash, load_causal_lm, load_tokenizer, non_finite_tensors, read_model_info
from darts_dist.placement import placement_tags
from darts_dist.plots import plot_bias_by_position, plot_entropy_weights, plot_loss
from darts_dist.registry import (
    DECISION_TAG,
    Registration,
    log_pyfunc_model,
    register_version,
    registered_model_name,
)
from darts_dist.router import ROUTER_FILE, TaskRouter, fit_run_router
from darts_dist.sources import ResolvedSources, resolve_sources
from darts_dist.task_scores import score_task, scorer_for
from darts_dist.tracking import (
    CORRECTIONS_TAG,
    Tracking,
    log_calibration,
    log_config,
    log_evaluation,
    log_merge,
    system_tags,
)


def mergekit_config_for(config: RunConfig, sources: ResolvedSources) -> dict:
    """The mergekit YAML this run merges with: the user's own file as it is, or one built from `merge`."""
    if config.merge.mergekit_yaml is not None:
        return load_mergekit_yaml(config.merge.mergekit_yaml)
    return build_mergekit_config(
        base=sources.base,
        experts=sources.experts,
        method=config.merge.method,
        parameters=config.merge.parameters,
        expert_parameters={e.task: e.merge_parameters for e in config.sources.experts if e.merge_parameters},
        dtype=config.merge.dtype,
    )


def merge_stage(config: RunConfig, sources: ResolvedSources) -> Path:
    """Merge into `merge.output` (default RUN_DIR/merged); an identical earlier merge is reused."""
    mergekit_config = mergekit_config_for(config, sources)
    out_dir = config.merge.output or config.run_dir / "merged"
    written = out_dir / "mergekit_config.yml"
    if written.is_file() and yaml.safe_load(written.read_text()) == mergekit_config:
        print(f"merge: reusing {out_dir} (same mergekit config)")
        return out_dir
    merged = run_merge(mergekit_config, out_dir, overwrite=True)
    # NaN or inf weights in a source pass through the merge and would poison every later number.
    bad = non_finite_tensors(merged)
    if bad:
        shutil.rmtree(merged)
        if not any(merged.parent.iterdir()):  # the run folder this merge started
            merged.parent.rmdir()
        culprits = {role: non_finite_tensors(path, limit=1)
                    for role, path in {"base": sources.base, **sources.experts}.items()}
        named = "; ".join(f"{role}: {found[0]}" for role, found in culprits.items() if found) or "none of them alone"
        raise DartsError(f"the merged model has NaN or infinite weights ({', '.join(bad)}); from the sources: {named}",
                         "replace the source model named above with a finite copy of its weights")
    return merged


def tokenized(config: RunConfig, sources: ResolvedSources, task: str, split: str, tokenizer) -> TokenizedSet:
    """A task's calibration, validation or held-out set, tokenised with the base's tokenizer.

    Validation rows (`calibration.validation_fraction` of the calibration file, for tuning) are
    never calibrated on; calibration takes the first `num_samples` of the others.
    """
    expert = next(e for e in config.sources.experts if e.task == task)
    files = sources.data[task]
    rows = load_rows(files.heldout if split == "heldout" else files.calibration, text_field=expert.data.text_field)
    if split != "heldout":
        rows = calibration_split(rows, config.calibration.validation_fraction, split)
    limit = config.calibration.num_samples if split == "calibration" else None
    return tokenize_rows(
        rows,
        tokenizer,
        task,
        max_length=config.calibration.max_length,
        max_samples=limit,
        fmt=expert.data.format,
        text_field=expert.data.text_field,
    )


@dataclass
class CalibrationOutcome:
    corrections_path: Path
    result: CalibrationResult
    entropy_weights: dict[str, torch.Tensor]  # each task's w_t on its real calibration tokens
    # The Ray job's run id, stream statistics and where its seconds went; None for the in-process loop.
    job: dict[str, object] | None = None


def token_weights(features: TaskFeatures, settings: CalibrationSection) -> torch.Tensor:
    """A task's entropy weights over its whole calibration set, as the loss weighs its tokens."""
    weight_mask = features.response_mask if settings.weight_on_for(features.task) == "response" else None
    weights = entropy_weights(features.entropy, features.attention_mask, settings.beta_for(features.task), weight_mask)
    return weights[features.attention_mask.bool()]


def _release(model: torch.nn.Module) -> None:
    # Experts are loaded one at a time; free each before the next so peak memory is
    # the merged model plus one expert.
    del model
    gc.collect()


def calibrate_stage(
    config: RunConfig, sources: ResolvedSources, merged_dir: Path, on_step: StepCallback | None = None
) -> CalibrationOutcome:
    """Collect each expert's targets once, train the corrections in-process, save them."""
    settings = config.calibration
    device = resolve_device(settings.device)
    dtype = model_dtype(settings.dtype, device)
    tokenizer = load_tokenizer(sources.base)
    merged = load_causal_lm(merged_dir, dtype=dtype, device=device)
    tasks = config.tasks
    features = []
    for index, task in enumerate(tasks):
        data = tokenized(config, sources, task, "calibration", tokenizer)
        if data.num_truncated:
            print(f"calibrate: {data.num_truncated} {task} samples cut to max_length={settings.max_length}")
        expert = load_causal_lm(sources.experts[task], dtype=dtype, device=device)
        merged_for_features = merged if features_only(settings.layers) else None
        features.append(
            collect_features(task, index, data, expert, merged_for_features, settings.layers, settings.batch_size)
        )
        _release(expert)
    result = train_corrections(features, settings, merged, on_step=on_step)
    corrections = result.corrections
    path = save_corrections(
        config.run_dir / "corrections.safetensors",
        corrections.cpu(),
        metadata=corrections_metadata(merged_dir),
    )
    return CalibrationOutcome(
        corrections_path=path, result=result, entropy_weights={f.task: token_weights(f, settings) for f in features}
    )


def corrections_metadata(merged_dir: Path) -> dict[str, object]:
    """What the corrections were trained against, so loading them onto another model is refused."""
    info = read_model_info(merged_dir)
    return {
        "architecture": info.architecture,
        "hidden_size": info.hidden_size,
        "num_layers": info.num_layers,
        "vocab_size": info.vocab_size,
        "merged_model_hash": content_hash(merged_dir),
    }


def load_matching_corrections(path: Path, merged_dir: Path, tasks: tuple[str, ...]) -> DartsCorrections:
    """Load corrections and refuse them when they were made for another model or other tasks."""
    corrections = load_corrections_for(path, merged_dir)
    if tuple(corrections.spec.tasks) != tuple(tasks):
        raise DartsError(f"corrections {path} cover tasks {list(corrections.spec.tasks)}, the config has {list(tasks)}",
                         "use the corrections calibrated with this config")
    return corrections


def headline_layer(layers: list) -> str | int:
    """Bias is reported at the final representation when corrected there, else at the last surgery layer."""
    return "final" if "final" in layers else max(layers)


def evaluate_stage(
    config: RunConfig, sources: ResolvedSources, merged_dir: Path, corrections_path: Path | None,
    router_path: Path | None = None,
) -> dict[str, object]:
    """Held-out bias, NLL and task scores per task, merged vs. corrected vs. expert (and routed, with a router)."""
    settings = config.calibration
    device = resolve_device(settings.device)
    dtype = model_dtype(settings.dtype, device)
    tasks = config.tasks
    missing = [t for t in tasks if sources.data[t].heldout is None]
    if missing:
        raise DartsError(f"tasks {missing} have no held-out data to evaluate on",
                         "set sources.experts[...].data.heldout for each task")
    corrections = None
    if corrections_path is not None:
        corrections = load_matching_corrections(corrections_path, merged_dir, tasks).to(device)
    tokenizer = load_tokenizer(sources.base)
    merged = load_causal_lm(merged_dir, dtype=dtype, device=device)
    layer = headline_layer(settings.layers)
    router = None if router_path is None or corrections is None else TaskRouter.load(router_path)
    results = {}
    for index, spec in enumerate(config.sources.experts):
        task = spec.task
        data = tokenized(config, sources, task, "heldout", tokenizer)
        expert = load_causal_lm(sources.experts[task], dtype=dtype, device=device)
        results[task] = evaluate_task(task, index, data, expert, merged, corrections, layer, settings.batch_size)
        results[task] |= score_task(scorer_for(spec), sources.data[task].heldout, task, index, expert, merged,
                                    corrections, tokenizer, layer, config.evaluation, router)
        _release(expert)
    return {"overall": overall(results), "tasks": results}


def write_report(path: Path, report: dict[str, object]) -> Path:
    """JSON report, written atomically."""
    with atomic_file(path) as tmp:
        tmp.write_text(json.dumps(report, indent=2, default=str))
    return Path(path).absolute()


@dataclass
class RunState:
    """What one invocation has resolved and produced so far; the report grows stage by stage."""

    config: RunConfig
    sources: ResolvedSources
    merged_dir: Path
    report: dict[str, object]
    tracking: Tracking | None = None  # the command's MLflow session; None runs untracked


def prepare(config: RunConfig, tracking: Tracking | None = None) -> RunState:
    """sources → merge; with a session, the config goes on its parent run and the merge gets its own run."""
    sources = resolve_sources(config)
    merged_dir = merge_stage(config, sources)
    report: dict[str, object] = {
        "config": config.model_dump(mode="json"),
        "run_dir": str(config.run_dir),
        "merged": str(merged_dir),
        "plots": {},
    }
    if tracking is not None:
        log_config(tracking, config)
        log_merge(tracking, merged_dir, {"base": sources.base, **sources.experts})
        # The stage runs' ids as they are opened: the dict is the session's own.
        report["tracking"] = {"uri": tracking.uri, "experiment_id": tracking.experiment_id,
                              "run_id": tracking.run_id, "stage_runs": tracking.stages}
    return RunState(config=config, sources=sources, merged_dir=merged_dir, report=report, tracking=tracking)


CALIBRATION_PLOTS = ("loss", "entropy_weights")  # the calibration run's PNGs, by their name in the report


def run_calibration(state: RunState) -> Path:
    """calibrate (on Ray or in-process, as `cluster.executor` says), save the corrections and the plots
    (tracked: per-step metrics too); returns the corrections' path."""
    started = time.perf_counter()
    config, tracking = state.config, state.tracking
    executor = config.cluster.executor
    run_id = on_step = None
    if tracking is not None:
        # On Ray the device is decided inside each worker: a GPU when the cluster gives it one.
        device = ("cuda" if config.cluster.use_gpu else "cpu") if executor == "ray" else str(
            resolve_device(config.calibration.device))
        run_id = tracking.start_stage("calibration", system_tags(config, device, executor=executor))
        on_step = tracking.step_logger(run_id)
    if executor == "ray":
        from darts_dist.distributed import calibrate_distributed  # it imports this module

        outcome = calibrate_distributed(config, state.sources, state.merged_dir, on_step=on_step)
    else:
        outcome = calibrate_stage(config, state.sources, state.merged_dir, on_step=on_step)
    losses = outcome.result.losses
    state.report["corrections"] = str(outcome.corrections_path)
    state.report["calibration"] = {
        "executor": executor,
        "steps": len(losses),
        "first_loss": losses[0],
        "final_loss": losses[-1],
        "train_seconds": outcome.result.seconds,
        "seconds": time.perf_counter() - started,
        "losses": losses,
        **({"job": outcome.job} if outcome.job is not None else {}),
    }
    # The task router (routed serving) learns from the same calibration prompts.
    state.report["router"] = fit_run_router(config, state.sources, state.merged_dir,
                                            headline_layer(config.calibration.layers))
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
    log_calibration(tracking, run_id, config, Path(report["merged"]), corrections, read_header(corrections), plots,
                    summary)


def complete_tracking(tracking: Tracking, report: dict) -> None:
    """Log what a run could not while its MLflow store was down, from its report: the per-step losses
    the store missed, the calibration's results and the evaluation; then mark its runs finished."""
    config = RunConfig.model_validate(report["config"])
    run_id = tracking.stages.get("calibration") or tracking.start_stage(
        "calibration", system_tags(config, "unknown", executor=report["calibration"]["executor"]))
    logged = {m.step for m in tracking.client.get_metric_history(run_id, "loss")}
    tracking.log_points(run_id, [("loss", loss, step) for step, loss in enumerate(report["calibration"]["losses"], 1)
                                 if step not in logged])
    track_calibration(tracking, run_id, config, report)
    if "variants" in report:
        log_evaluation(tracking, run_id, report["variants"]["darts"],
                       {"bias_by_position": Path(report["plots"]["bias_by_position"])})
    report["tracking"].pop("offline", None)
    tracking.log_json(tracking.run_id, report, "report.json")
    for run in [*tracking.stages.values(), tracking.run_id]:
        tracking.client.set_terminated(run, "FINISHED")


def has_heldout(state: RunState) -> bool:
    """Whether every task has held-out data, which evaluation (and so the registry's alias) needs."""
    return all(state.sources.data[task].heldout is not None for task in state.config.tasks)


def run_evaluation(state: RunState, corrections: Path | None) -> dict[str, object]:
    """evaluate on the held-out sets; adds `variants.darts` and the bias plot to the report.

    Tracked, the results go to this session's calibration run, or to an evaluation run of their own.
    """
    # Routed scores come from the router the calibration fit next to its corrections, where there is one.
    router = state.config.run_dir / ROUTER_FILE
    router = router if corrections is not None and router.is_file() else None
    evaluation = evaluate_stage(state.config, state.sources, state.merged_dir, corrections, router)
    state.report["variants"] = {"darts": evaluation}
    plot = plot_bias_by_position(evaluation["tasks"], state.config.run_dir / "plots" / "bias_by_position.png")
    state.report["plots"]["bias_by_position"] = str(plot)
    tracking = state.tracking
    if tracking is not None:
        run_id = tracking.stages.get("calibration")
        if run_id is None:
            run_id = tracking.start_stage("evaluation", {CORRECTIONS_TAG: corrections})
        log_evaluation(tracking, run_id, evaluation, {"bias_by_position": plot})
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
    run_id = tracking.stages["calibration"]
    config = state.config
    if not accepted(state.report["calibration"]["losses"]):
        decision = "not registered: the calibration loss did not go down (or was not finite)"
        tracking.set_tags(run_id, {DECISION_TAG: decision})
        state.report["tracking"]["decision"] = decision
        return None
    corrections = Path(state.report["corrections"])
    logged = log_pyfunc_model(tracking.uri, run_id, state.merged_dir, corrections, example_task=config.tasks[0],
                              router=Path(state.report["router"]["path"]))
    registration = register_version(
        tracking.client, registered_model_name(config), logged, run_id, config.tracking.alias
    )
    state.report["tracking"].update({"logged_model_uri": logged, **registration.to_dict()})
    return registration
