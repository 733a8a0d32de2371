"""Evaluation as a Ray job: the base, each expert and the merged model in an actor of its own, their passes at
once; the merged model's actor then judges the corrections (the corrected and routed passes) against them.

Every actor runs the one evaluator (the passes in-process evaluation runs, model by model, through the same
output cache), so the numbers are the in-process ones; only where the work runs changes. Each actor takes an
expert actor's resources (`cluster.expert_resources`; a GPU each with `cluster.use_gpu`), so on a GPU cluster
the stage takes the slowest model's passes instead of their sum. On CPU nodes the actors split the cores
(ray_cluster.cpu_share's concurrent share), which gains nothing over one process using them all: hence
`evaluation.executor: auto` evaluates on Ray only on GPU clusters.
"""

from __future__ import annotations

import gc
import logging
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TypeVar

import ray
import torch
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from darts_dist.config import RunConfig
from darts_dist.errors import DartsError
from darts_dist.evaluate.evaluator import (
    NO_BASE,
    BaseSide,
    Evaluator,
    ExpertSide,
    MergedSide,
    judged_artifacts,
    scores_base,
)
from darts_dist.memory import PeakMemory
from darts_dist.ray_cluster.cpu_share import cpu_share, node_cores, per_node
from darts_dist.ray_cluster.placement import alive_nodes, expert_actor_options, expert_bundle
from darts_dist.ray_cluster.remote import expert_cluster, get_or_raise, ray_session
from darts_dist.sources.data import TaskFiles
from darts_dist.sources.models import load_causal_lm, load_tokenizer, model_compute, model_dtype, resolve_device
from darts_dist.sources.output_cache import OutputCache

logger = logging.getLogger(__name__)
T = TypeVar("T")


def uses_ray(config: RunConfig) -> bool:
    """`evaluation.executor`, with `auto` resolved: on Ray where calibration runs on Ray with a GPU per actor."""
    executor = config.evaluation.executor
    if executor == "auto":
        return config.models_on_gpus
    return executor == "ray"


@ray.remote
class ModelPasses:
    """One model (the base, an expert or the merge) loaded once in its actor (`load`), running the evaluator's
    passes. Their results leave the device batch by batch (evaluate.passes), so the sides travel and the merged
    actor keeps them in host memory; a batch is on the device only while it is judged (as in-process)."""

    def __init__(self, config: RunConfig, data: Mapping[str, TaskFiles], tokenizer_dir: Path,
                 cache_folder: Path | None) -> None:
        self.evaluator = Evaluator(config, data, load_tokenizer(tokenizer_dir), progress=False,
                                   cache=None if cache_folder is None else OutputCache(cache_folder))
        self.device = resolve_device(config.calibration.device)
        self.merged: list[MergedSide] = []

    def load(self, model_dir: Path, actors_per_node: int) -> None:
        """Load the model (in a method, not the constructor, so a DartsError reaches the driver as itself), in
        place of the one loaded before, if any (the merge's actor holds the base first for the retention set)."""
        config = self.evaluator.config
        if not config.cluster.use_gpu:
            torch.set_num_threads(cpu_share("concurrent", actors_per_node, node_cores()).threads)
        dtype = model_dtype(config.calibration.dtype, self.device)
        if getattr(self, "model", None) is not None:
            self.model = None
            gc.collect()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        self.memory = PeakMemory(self.device)
        self.model = load_causal_lm(model_dir, dtype=dtype, device=self.device)
        self.identity = self.evaluator.identity(model_dir, dtype, self.device)
        self.model_dir = model_dir

    def base_retention(self) -> BaseSide:
        return self._timed("base retention", lambda: self.evaluator.base_retention(self.model, self.model_dir,
                                                                                   self.identity))

    def base_answers(self) -> dict[str, list[bool] | None]:
        return self._timed("base answers", lambda: self.evaluator.base_answers(self.model, self.identity))

    def expert_side(self, index: int, base: BaseSide) -> ExpertSide:
        """Task `index`'s expert side (it travels to the merged model's actor), on `base`'s retention set."""
        self.evaluator.use_base(base)
        return self._timed(f"expert {self.evaluator.config.tasks[index]}",
                           lambda: self.evaluator.expert_side(index, self.model, identity=self.identity))

    def merged_sides(self, base: BaseSide) -> None:
        """Every task's merged side, kept here (in host memory) for `judge`, on `base`'s retention set."""
        self.evaluator.use_base(base)
        tasks = self.evaluator.config.tasks
        self.merged = self._timed("merged model", lambda: [
            self.evaluator.merged_side(self.model, index, identity=self.identity) for index in range(len(tasks))])

    def judge(self, base: BaseSide, base_passes: Mapping[str, list[bool] | None], corrections_path: Path | None,
              router_path: Path | None, *sides: ExpertSide) -> dict[str, object]:
        """The evaluation of the corrections (on config.model_dir) against the experts' sides (passed as
        separate arguments, so Ray hands over their values, not references) and this merge's."""
        config = self.evaluator.config
        corrections, router, model_dir = judged_artifacts(config, self.model_dir, corrections_path, router_path)
        corrections = None if corrections is None else corrections.to(self.device)
        candidate = None if model_dir == self.model_dir else load_causal_lm(
            model_dir, dtype=next(self.model.parameters()).dtype, device=self.device)
        self.evaluator.use_base(base)
        pairs = ((side.with_base(base_passes.get(side.task)), merged)
                 for side, merged in zip(sides, self.merged, strict=True))
        return self._timed("corrected model", lambda: self.evaluator.evaluate(
            self.model, corrections, pairs, router=router, candidate=candidate))

    def peak_memory(self) -> int:
        """The most memory this actor's work has held since it began loading its model (darts_dist.memory)."""
        return self.memory.peak()

    def compute(self) -> str:
        """Where and in what dtype this actor's model computes (sources.models.compute_label)."""
        return model_compute(self.model)

    def cache_counts(self) -> dict[str, int]:
        return {"hits": 0, "misses": 0} if self.evaluator.cache is None else self.evaluator.cache.counts()

    def _timed(self, what: str, work: Callable[[], T]) -> T:
        started = time.perf_counter()
        result = work()
        logger.info("evaluate on Ray: %s done in %.1f s", what, time.perf_counter() - started)
        return result


def _fits(bundles: list[dict[str, float]]) -> bool:
    """Whether the cluster has, in all (busy or not), the resources of every bundle."""
    total = ray.cluster_resources()
    return all(total.get(name, 0.0) >= sum(b.get(name, 0.0) for b in bundles) for name in {*bundles[0]})


def evaluate_on_ray(
    config: RunConfig, data: Mapping[str, TaskFiles], base_dir: Path, experts: Mapping[str, Path], merged_dir: Path,
    corrections_path: Path | None, router_path: Path | None, cache: OutputCache | None = None,
    driver_holds_models: Callable[[], bool] = lambda: True, memory: dict[str, int] | None = None,
    compute: dict[str, str] | None = None,
) -> dict[str, object] | None:
    """`evaluate.stage.evaluate_stage`'s result, its models' passes in actors of their own on the cluster
    (`cluster.address` or RAY_ADDRESS, else a local one); `cache` counts what the actors read back from their
    output caches and what they computed; `memory` gets each actor's peak memory by model, `compute` its device and
    dtype by role.

    With `evaluation.executor: auto`, None (evaluate in-process) when the cluster does not have an actor's
    resources for every model (the base, each expert, the merge: a GPU each on a GPU cluster) in all and
    `driver_holds_models()` (the plan: this machine holds the models in-process); otherwise (and asked for explicitly) the job waits
    `cluster.resource_wait_s` for them, then fails naming what it asked for.
    """
    cluster = config.cluster
    roles = {**({"base": base_dir} if scores_base(config, data) else {}),
             **{f"expert {t}": experts[t] for t in config.tasks}, "merged": merged_dir}
    bundles = [{name: amount for name, amount in expert_bundle(cluster).items() if amount}] * len(roles)
    address = cluster.address or os.environ.get("RAY_ADDRESS")
    with ray_session(address, expert_cluster(config.cluster, len(roles))):
        if config.evaluation.executor == "auto" and not _fits(bundles):
            if driver_holds_models():
                logger.info("evaluate: the cluster has no room for %d model actors (%s each), and this machine "
                            "holds the models: evaluating in-process", len(roles), bundles[0])
                return None
            logger.info("evaluate: the cluster has no room for %d model actors (%s each) now, and this machine "
                        "cannot hold the models: waiting for them", len(roles), bundles[0])
        spread = cluster.placement_strategy in ("SPREAD", "STRICT_SPREAD")
        group = placement_group(bundles, strategy="SPREAD" if spread else "PACK")
        try:
            if not ray.wait([group.ready()], timeout=cluster.resource_wait_s)[0]:
                raise DartsError(
                    f"the Ray cluster had no room for {len(roles)} evaluation actors ({', '.join(roles)}) of "
                    f"{bundles[0]} each after {cluster.resource_wait_s:g} s",
                    "add nodes with those resources, or set evaluation.executor: in-process")
            return _run_actors(config, data, base_dir, roles, group, corrections_path, router_path, cache, memory,
                               compute)
        finally:
            remove_placement_group(group)


def _run_actors(
    config: RunConfig, data: Mapping[str, TaskFiles], tokenizer_dir: Path, roles: Mapping[str, Path],
    group: PlacementGroup, corrections_path: Path | None, router_path: Path | None, cache: OutputCache | None,
    memory: dict[str, int] | None, compute: dict[str, str] | None,
) -> dict[str, object]:
    """One actor per role in the placement group's bundles, their passes at once, the merged actor's judgement."""
    cpu_nodes = [node for node in alive_nodes() if node["Resources"].get("CPU")]
    per = per_node(len(roles), len(cpu_nodes))
    logger.info("evaluate on Ray: %d model actors (%s)", len(roles), ", ".join(roles))
    folder = None if cache is None else cache.folder
    options = expert_actor_options(config.cluster)  # an expert actor's resources, in the group's bundles

    actors = {role: ModelPasses.options(**options | {"scheduling_strategy": PlacementGroupSchedulingStrategy(
        placement_group=group, placement_group_bundle_index=index)}).remote(config, data, tokenizer_dir, folder)
        for index, role in enumerate(roles)}
    merged = actors["merged"]
    # Without task scores of its own the base has no actor: for the retention set it runs first in the merge's.
    retention_only = config.evaluation.retention and "base" not in roles
    try:
        get_or_raise([actors[role].load.remote(tokenizer_dir if retention_only and role == "merged" else path, per)
                      for role, path in roles.items()])
        base = NO_BASE
        if config.evaluation.retention:  # the rows every model is scored on: shipped, or the base's replies
            base = get_or_raise((merged if retention_only else actors["base"]).base_retention.remote())
        if retention_only:
            if memory is not None:
                memory["base"] = get_or_raise(merged.peak_memory.remote())
            if compute is not None:
                compute["evaluation actor (base)"] = get_or_raise(merged.compute.remote())
            get_or_raise(merged.load.remote(roles["merged"], per))
        # The base's answers go to the judgement alone: the experts and the merge need only the retention rows.
        base_passes = actors["base"].base_answers.remote() if "base" in actors else {}
        sides = [actors[f"expert {task}"].expert_side.remote(index, base) for index, task in enumerate(config.tasks)]
        get_or_raise(merged.merged_sides.remote(base))
        result = get_or_raise(merged.judge.remote(base, base_passes, corrections_path, router_path, *sides))
        if memory is not None:
            memory.update(zip(actors, get_or_raise([actor.peak_memory.remote() for actor in actors.values()])))
        if compute is not None:
            # Named as the plan names the roles: evaluation actor (merged), (base), (TASK).
            compute.update(zip((f"evaluation actor ({role.removeprefix('expert ')})" for role in actors),
                               get_or_raise([actor.compute.remote() for actor in actors.values()])))
        if cache is not None:
            for counts in get_or_raise([actor.cache_counts.remote() for actor in actors.values()]):
                cache.hits, cache.misses = cache.hits + counts["hits"], cache.misses + counts["misses"]
        return result
    finally:
        for actor in actors.values():
            ray.kill(actor)
