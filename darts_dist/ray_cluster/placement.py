"""Where a calibration job's actors run: their Ray resources, a bounded wait (Ray's placement groups) for
nodes that have them, and a record of which node ran what.

Imports stay light (no torch): the stream's Ray Data actors import this module too.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import ray
from ray.util.placement_group import placement_group, remove_placement_group

from darts_dist.config import ClusterSection
from darts_dist.errors import DartsError

Bundle = dict[str, float]  # one actor's Ray resources, as placement groups write them: {"CPU": 1, "GPU": 1, ...}

# Resources Ray gives every node itself; the rest of a node's resources are the user's labels.
BUILTIN_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory")


def expert_bundle(cluster: ClusterSection) -> Bundle:
    """One expert actor: `cluster.expert_resources`, with 1 CPU, and 1 GPU on a GPU cluster, unless they say otherwise."""
    return {"CPU": 1.0, "GPU": 1.0 if cluster.use_gpu else 0.0, **cluster.expert_resources}


def worker_bundle(cluster: ClusterSection) -> Bundle:
    """One training worker: `cpus_per_worker` CPUs, 1 GPU on a GPU cluster, and `worker_resources`."""
    return {"CPU": cluster.cpus_per_worker, "GPU": 1.0 if cluster.use_gpu else 0.0, **cluster.worker_resources}


def expert_actor_options(cluster: ClusterSection) -> dict[str, object]:
    """Ray Data's `map_batches` arguments that place an expert actor: its resources and, when the
    config spreads the job, a SPREAD scheduling strategy so the experts land on different nodes."""
    bundle = dict(expert_bundle(cluster))
    options: dict[str, object] = {"num_cpus": bundle.pop("CPU"), "num_gpus": bundle.pop("GPU"), "resources": bundle}
    if cluster.placement_strategy in ("SPREAD", "STRICT_SPREAD"):
        options["scheduling_strategy"] = "SPREAD"
    return options


def job_bundles(cluster: ClusterSection, num_experts: int) -> list[Bundle]:
    return [expert_bundle(cluster)] * num_experts + [worker_bundle(cluster)] * cluster.num_workers


def custom_resources(bundles: Sequence[Bundle]) -> dict[str, float]:
    """The user-named resources the bundles need in all: what a local cluster must give its one node."""
    total: dict[str, float] = {}
    for bundle in bundles:
        for name, amount in bundle.items():
            if name not in BUILTIN_RESOURCES:
                total[name] = total.get(name, 0.0) + amount
    return total


def gpu_ids() -> str:
    """The GPU ids Ray gave this worker or actor, comma-separated ("" for none)."""
    return ",".join(str(i) for i in ray.get_gpu_ids())


def alive_nodes() -> list[dict]:
    return [node for node in ray.nodes() if node["Alive"]]


def _reservable(bundles: Sequence[Bundle]) -> list[Bundle]:
    """The bundles as a placement group takes them: no zero amounts, and no bundle of nothing (an actor that
    asks for no resources fits anywhere)."""
    return [kept for bundle in bundles if (kept := {name: amount for name, amount in bundle.items() if amount})]


def wait_for_resources(cluster: ClusterSection, num_experts: int) -> None:
    """Return once Ray can reserve every expert actor's and training worker's resources at the same time;
    after `cluster.resource_wait_s` seconds without, fail naming what is missing (the job itself would wait
    forever). Resources count when they are free, or once an autoscaler has added them: on a cluster busy
    with other work, the job waits that long for them, then fails.

    Ray's own scheduler decides, with the job's own constraints: one placement group for the training
    workers with `cluster.placement_strategy` (STRICT_SPREAD: a node each), one for the expert actors
    (spread over the nodes when the config spreads), reserved together and released at once.
    """
    spread = cluster.placement_strategy in ("SPREAD", "STRICT_SPREAD")
    wanted = {
        "expert actors": (_reservable([expert_bundle(cluster)] * num_experts), "SPREAD" if spread else "PACK"),
        "training workers": (_reservable([worker_bundle(cluster)] * cluster.num_workers),
                             cluster.placement_strategy),
    }
    groups = {name: placement_group(bundles, strategy=strategy)
              for name, (bundles, strategy) in wanted.items() if bundles}
    if not groups:
        return
    try:
        signals = {name: group.ready() for name, group in groups.items()}
        ready, _ = ray.wait(list(signals.values()), num_returns=len(signals), timeout=cluster.resource_wait_s)
        placed = {name for name, signal in signals.items() if signal in ready}
    finally:
        for group in groups.values():
            remove_placement_group(group)
    missing = [name for name in groups if name not in placed]
    if not missing:
        return
    asked = {"expert actors": f"{num_experts} × ({_labels(expert_bundle(cluster))})",
             "training workers": f"{cluster.num_workers} × ({_labels(worker_bundle(cluster))}) "
                                 f"({cluster.placement_strategy})"}
    have = "; ".join(_labels(node["Resources"]) for node in alive_nodes()) or "no nodes"
    raise DartsError(
        f"the Ray cluster has no room for the job's {' and '.join(missing)} after waiting "
        f"{cluster.resource_wait_s:g} s: wanted {'; '.join(asked[name] for name in missing)}; its nodes have: {have}",
        "add nodes with those resources (`ray start --resources '{\"NAME\": N}'`, or the cluster YAML's "
        "node types), or change cluster.expert_resources / worker_resources / num_workers / use_gpu / "
        "placement_strategy; cluster.resource_wait_s sets how long to wait for an autoscaler",
    )


def _brief(resources: Mapping[str, float]) -> dict[str, float]:
    return {k: v for k, v in sorted(resources.items())
            if v and not k.startswith("node:") and k not in ("memory", "object_store_memory")}


def _labels(resources: Mapping[str, float]) -> str:
    return ", ".join(f"{k}={v:g}" for k, v in _brief(resources).items())


def node_table() -> dict[str, dict[str, object]]:
    """Each alive node's id -> its address and resources (the user's labels among them)."""
    return {node["NodeID"]: {"address": node["NodeManagerAddress"], "resources": _brief(node["Resources"])}
            for node in alive_nodes()}


def placement_tags(placement: Mapping[str, object]) -> dict[str, str]:
    """MLflow tags of which node ran what, darts.placement.expert.TASK and darts.placement.worker.RANK,
    each naming the node by address, id and resources (on one machine only the id tells nodes apart).
    `placement`: node ids under "experts" (by task) and "workers" (by rank), and the "nodes" table."""
    nodes = placement["nodes"]

    def name(node: str) -> str:
        info = nodes.get(node)
        return node if info is None else f"{info['address']} {node[:8]} ({_labels(info['resources'])})"

    tags = {f"darts.placement.expert.{task}": ", ".join(map(name, ids)) for task, ids in placement["experts"].items()}
    tags |= {f"darts.placement.worker.{rank}": name(node) for rank, node in enumerate(placement["workers"])}
    return tags
