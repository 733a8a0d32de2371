"""The plan's check that `calibrate`, `evaluate`, `serve` and `serve-deploy` run before any merge, MLflow run or
Ray job starts: the roles of the phases a command runs against the nodes they will run on. What cannot fit is
refused (error/fix, exit 2); what fits only once an autoscaler adds nodes (`cluster.autoscaler`) is said, and
the job's own placement waits `cluster.resource_wait_s` for it."""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import psutil
import torch

from darts_dist.config import ClusterSection, RunConfig, ServeSection, updated
from darts_dist.core.io import read_header
from darts_dist.errors import DartsError
from darts_dist.plan import Plan, build_plan
from darts_dist.plan.cluster import GIB, gpu_memory, placement_problems, read_nodes, size_problems
from darts_dist.plan.roles import Role, correction_parameters, export_role, serving_role
from darts_dist.plan.shapes import ModelShape, model_shape
from darts_dist.sources.models import check_compute_dtype, resolve_device

if TYPE_CHECKING:
    from darts_dist.serve.model import ModelSource

logger = logging.getLogger(__name__)
LOCAL = "a local Ray cluster on this machine"

FIX = ("add nodes or GPUs, ask for fewer (cluster.num_workers, expert_resources, serve.num_replicas), lower dtypes "
       "and batch sizes, or set cluster.zero_stage: 3 to partition the frozen model over the workers; "
       "`darts-dist plan CONFIG` prints every role's memory")


def local_node(roles: Sequence[Role]) -> dict[str, float]:
    """The node of the local cluster a job starts on this machine: Ray gives it the CPUs and custom resources the
    job asks for (calibrate.ray.job.local_cluster_resources), and finds the machine's GPUs and memory itself."""
    named = {key for role in roles for key in role.bundle if key not in ("GPU", "memory")}
    return {**{key: math.inf for key in named}, "GPU": float(torch.cuda.device_count()),
            "memory": float(psutil.virtual_memory().total)}


def launch_nodes(address: str | None, roles: Sequence[Role]) -> tuple[list[dict[str, float]], str]:
    """The nodes the command's Ray work will run on, and which cluster they are: the one this process has
    joined, the one at `address` (cluster.address, --address, RAY_ADDRESS), or a local one."""
    import ray

    if ray.is_initialized():
        from darts_dist.ray_cluster.placement import alive_nodes

        return [dict(node["Resources"]) for node in alive_nodes()], "the Ray cluster this process joined"
    if address:
        return read_nodes(address), f"the Ray cluster at {address}"
    return [local_node(roles)], LOCAL


def check_launch(roles: Sequence[Role], cluster: ClusterSection, address: str | None = None,
                 driver: Role | None = None) -> None:
    """Refuse (DartsError) what the nodes cannot hold; with `cluster.autoscaler` on a running cluster, actors that
    find no node yet are left to the autoscaler (logged) and only what no node can ever hold (a GPU too small) is
    refused.
    `driver`: the driver's role, checked against this machine's memory."""
    found = []
    if driver is not None and driver.resident_bytes > psutil.virtual_memory().total:
        found.append(f"driver: holds {driver.resident_bytes / GIB:.1f} GiB, this machine has "
                     f"{psutil.virtual_memory().total / GIB:.1f} GiB")
    if roles:
        address = address or cluster.address or os.environ.get("RAY_ADDRESS")
        nodes, which = launch_nodes(address, roles)
        gpu_bytes, _ = gpu_memory(nodes, None)
        if gpu_bytes is None and not address and torch.cuda.is_available():
            gpu_bytes = min(torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count()))
        placement, sizes = placement_problems(roles, nodes), size_problems(roles, nodes, gpu_bytes)
        local = which == LOCAL  # a cluster the command starts itself: no autoscaler adds nodes to it
        if placement and cluster.autoscaler and not local:
            logger.warning("the nodes of %s cannot hold every actor now; waiting up to %g s "
                           "(cluster.resource_wait_s) for the autoscaler to add nodes:\n    %s",
                           which, cluster.resource_wait_s, "\n    ".join(placement))
            placement = []
        found += [f"{problem} (on {which})" for problem in [*placement, *sizes]]
    if found:
        raise DartsError("the cluster cannot hold this run:\n    " + "\n    ".join(found), FIX)


def driver_holds_evaluation(config: RunConfig) -> bool:
    """Whether this machine holds an in-process evaluation's models (the plan's driver, evaluating in-process)
    in the memory it has free."""
    in_process = updated(config, evaluation=updated(config.evaluation, executor="in-process"))
    return build_plan(in_process).driver.resident_bytes <= psutil.virtual_memory().available


def check_dtype(config: RunConfig) -> None:
    """The run's compute dtype on the device its models run on, where this machine can try it: the CPU, or the
    driver's own device in-process (GPU actors' nodes are another machine's)."""
    if not config.models_on_gpus:
        device = resolve_device(config.calibration.device)
        check_compute_dtype(config.calibration.dtype, device if not config.cluster.on_ray else torch.device("cpu"))


def check_code_sandbox(config: RunConfig) -> None:
    """Task scores that run the models' code answers (a code scorer, score_limit not 0) need bubblewrap's sandbox
    here, or `evaluation.sandbox: limits`: refused before any model loads otherwise (evaluate.sandbox)."""
    from darts_dist.evaluate.sandbox import checked_sandbox
    from darts_dist.evaluate.task_scores import scorer_named
    from darts_dist.sources.references import scorer_name

    if config.evaluation.score_limit == 0:
        return
    code = [e.task for e in config.sources.experts
            if e.data is not None and (scorer := scorer_named(scorer_name(e.data))) is not None and scorer.runs_code]
    if code:
        try:
            checked_sandbox(config.evaluation.sandbox == "limits")
        except DartsError as error:
            raise DartsError(f"task(s) {code} score code answers, but {error.what}", error.fix) from None


def check_run(config: RunConfig, phases: Sequence[str]) -> Plan:
    """`calibrate` (phases merge, calibration and evaluation) and `evaluate` (evaluation): the compute dtype, where
    code answers are checked, the plan's roles of those phases on the run's cluster, and the driver on this
    machine."""
    check_dtype(config)
    if "evaluation" in phases:
        check_code_sandbox(config)
    plan = build_plan(config)
    roles = [role for role in plan.roles if role.phase in phases]
    check_launch(roles, config.cluster, driver=plan.driver)
    return plan


def check_registration(config: RunConfig) -> None:
    """`register`: the compute dtype where the check runs here (the device the logged model picks: a GPU where this
    machine has one), and MLflow's check of the logged model on the run's cluster (a GPU role where the models are on
    GPUs). Where the run's models are not readable here (another machine's paths), only the dtype is checked."""
    if not config.models_on_gpus:
        check_compute_dtype(config.calibration.dtype, resolve_device("auto"))
    try:
        plan = build_plan(config)
    except DartsError as error:
        logger.info("register: the run's models are not readable here (%s): not checking the cluster", error.what)
        return
    check_launch([role for role in plan.roles if role.phase == "registration"], config.cluster)


def check_export(merged_dir: Path) -> None:
    """`export`: what it holds (a weight shard and a tensor, `roles.export_role`) against this machine's memory."""
    check_launch([], ClusterSection(), driver=export_role(model_shape(str(merged_dir))))


def check_serving(source: ModelSource, config: RunConfig | None, settings: ServeSection,
                  address: str | None = None) -> Role:
    """`serve` and `serve-deploy`: the replicas on the cluster they deploy onto. The model's shape comes from the
    merged folder's config.json or (a registered version, which each replica fetches itself) from its run's
    config; where neither is readable here, only the replicas' resources are checked."""
    if not settings.use_gpu:
        check_compute_dtype(settings.dtype, torch.device("cpu"))
    role = serving_role(settings, *_served_shape(source, config))
    if not role.parts:
        logger.info("serve: the model's config.json is not readable here: checking the replicas' resources only")
    check_launch([role], config.cluster if config is not None else ClusterSection(), address)
    return role


def _served_shape(source: ModelSource, config: RunConfig | None) -> tuple[ModelShape | None, int]:
    """The served model's shape and its corrections' parameter count (None, 0 where unknown here)."""
    if source.files is not None:
        corrections = source.files.corrections
        parameters = 0 if corrections is None else sum(
            math.prod(shape) for shape in read_header(corrections)["shapes"].values())
        return model_shape(str(source.files.merged_dir)), parameters
    try:
        merged = model_shape(config.sources.base) if config is not None else None
    except DartsError:  # the run's base path is another machine's
        merged = None
    return merged, 0 if merged is None else correction_parameters(config, merged)
