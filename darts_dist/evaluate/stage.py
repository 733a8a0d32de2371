"""The evaluate stage: held-out bias, NLL and task scores of the merged, corrected and expert models, on Ray
(`evaluate.on_ray`) or in this process, one expert loaded at a time."""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from darts_dist.config import RunConfig
from darts_dist.errors import DartsError
from darts_dist.evaluate.evaluator import (
    NO_BASE,
    BaseSide,
    Evaluator,
    ExpertSide,
    MergedSide,
    judged_artifacts,
)
from darts_dist.evaluate.on_ray import evaluate_on_ray, uses_ray
from darts_dist.sources.models import load_causal_lm, load_tokenizer, model_compute, model_dtype, resolve_device
from darts_dist.sources.output_cache import OutputCache
from darts_dist.sources.references import ResolvedSources


def base_side(evaluator: Evaluator, base_dir: Path, dtype: torch.dtype, device: torch.device) -> BaseSide:
    """The base model's task-score answers and retention set (`Evaluator.base_side`, as asked for), the base
    loaded alone and let go after."""
    if not evaluator.needs_base:
        return NO_BASE
    base = load_causal_lm(base_dir, dtype=dtype, device=device)
    side = evaluator.base_side(base, base_dir, evaluator.identity(base_dir, dtype, device))
    del base
    gc.collect()
    return side


def evaluate_stage(
    config: RunConfig, sources: ResolvedSources, merged_dir: Path, corrections_path: Path | None,
    router_path: Path | None = None, cache: OutputCache | None = None, memory: dict[str, int] | None = None,
    *, driver_holds_models: Callable[[], bool], compute: dict[str, str] | None = None,
) -> dict[str, object]:
    """Held-out bias, NLL and task scores per task, merged vs. corrected vs. expert (and routed, with a router).

    The corrections apply to config.model_dir: the merged model, or the learned merge, which is then judged
    (with its corrections, if any) against the merged model it started from. The base's, experts' and merged
    model's passes go through the output cache (`cache`, or the cache folder's; none with evaluation.cache off).
    On Ray, `memory` gets each evaluation actor's peak memory, by model; `compute` gets where and in what dtype the
    models ran (sources.models.compute_label), by role; `driver_holds_models` says whether
    `auto`, finding no room on the cluster, may evaluate in this process instead (the run's plan answers it).
    """
    settings = config.calibration
    missing = [t for t in config.tasks if sources.data[t].heldout is None]
    if missing:
        raise DartsError(f"tasks {missing} have no held-out data to evaluate on",
                         "set sources.experts[...].data.heldout for each task")
    if uses_ray(config):
        result = evaluate_on_ray(config, sources.data, sources.base, sources.experts, merged_dir, corrections_path,
                                 router_path, cache,
                                 driver_holds_models=driver_holds_models, memory=memory, compute=compute)
        if result is not None:  # None: `auto` found no room for an actor per model
            return result
    device = resolve_device(settings.device)
    dtype = model_dtype(settings.dtype, device)
    corrections, router, model_dir = judged_artifacts(config, merged_dir, corrections_path, router_path)
    corrections = None if corrections is None else corrections.to(device)
    evaluator = Evaluator(config, sources.data, load_tokenizer(sources.base), cache=cache)
    base = base_side(evaluator, sources.base, dtype, device)
    merged = load_causal_lm(merged_dir, dtype=dtype, device=device)
    if compute is not None:
        compute["evaluation (in-process)"] = model_compute(merged)
    merged_identity = evaluator.identity(merged_dir, dtype, device)

    def sides() -> Iterator[tuple[ExpertSide, MergedSide]]:
        # One task at a time, its expert let go before the next: peak memory is the merged model, one expert
        # and one task's passes.
        for index, task in enumerate(config.tasks):
            expert = load_causal_lm(sources.experts[task], dtype=dtype, device=device)
            side = evaluator.expert_side(index, expert, base_passes=base.passes.get(task),
                                         identity=evaluator.identity(sources.experts[task], dtype, device))
            del expert
            gc.collect()
            yield side, evaluator.merged_side(merged, index, identity=merged_identity)

    candidate = None if model_dir == merged_dir else load_causal_lm(model_dir, dtype=dtype, device=device)
    return evaluator.evaluate(merged, corrections, sides(), router=router, candidate=candidate)
