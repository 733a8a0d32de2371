"""Whether a cluster holds a run's roles: its nodes' resources (a live Ray cluster, or a file), each phase's
actors packed onto them, and each GPU role's bytes against one GPU's memory."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import yaml

from darts_dist.errors import DartsError
from darts_dist.plan.roles import Role
from darts_dist.ray_cluster.placement import Bundle, alive_nodes

GIB = 1 << 30
# Memory of one GPU by Ray's accelerator type (the largest variant where a type comes in several).
GPU_MEMORY_GIB = {"H200": 141, "H100": 80, "A100": 80, "L40S": 48, "L40": 48, "A6000": 48, "A10G": 24, "A10": 24,
                  "L4": 24, "V100": 32, "T4": 16}
PHASES = ("merge", "calibration", "evaluation", "registration", "serving")


def read_nodes(address: str | None = None, resources: Path | None = None) -> list[dict[str, float]]:
    """Each node's resources: a live cluster's (`address`), or a file holding one dict shaped like
    `ray.cluster_resources()` (taken as one node) or a list of them (one per node)."""
    if resources is not None:
        try:
            loaded = yaml.safe_load(Path(resources).read_text())
        except (OSError, yaml.YAMLError) as error:
            raise DartsError(f"cannot read the resources file {resources}: {error}",
                             "pass a JSON or YAML file shaped like ray.cluster_resources() (or a list of them)") from None
        nodes = loaded if isinstance(loaded, list) else [loaded]
        if not nodes or not all(isinstance(n, dict) and all(isinstance(v, (int, float)) for v in n.values())
                                for n in nodes):
            raise DartsError(f"{resources} is not shaped like ray.cluster_resources(): {json.dumps(loaded)[:200]}",
                             'write e.g. {"CPU": 48, "GPU": 4, "accelerator_type:L40S": 1} (or a list, one per node)')
        return [{k: float(v) for k, v in node.items()} for node in nodes]
    import ray

    ray.init(address=address, include_dashboard=False, logging_level="ERROR")
    try:
        return [dict(node["Resources"]) for node in alive_nodes()]
    finally:
        ray.shutdown()


def gpu_memory(nodes: Sequence[dict[str, float]], given_gib: float | None) -> tuple[int | None, str]:
    """One GPU's memory in bytes, and where the number comes from: given, or the nodes' accelerator type."""
    if given_gib is not None:
        return int(given_gib * GIB), f"{given_gib:g} GiB (--gpu-memory)"
    types = {key.split(":", 1)[1] for node in nodes for key in node if key.startswith("accelerator_type:")}
    known = [GPU_MEMORY_GIB[t] for t in types if t in GPU_MEMORY_GIB]
    if known:
        return min(known) * GIB, f"{min(known)} GiB ({', '.join(sorted(types))})"
    return None, "unknown (pass --gpu-memory GIB)"


def unplaced(bundles: Sequence[tuple[str, Bundle]], nodes: Sequence[dict[str, float]]) -> list[tuple[str, Bundle]]:
    """The bundles that find no room when packed first fit, the most demanding first (GPUs, then CPUs)."""
    free = [dict(node) for node in nodes]
    left = []
    for name, bundle in sorted(bundles, key=lambda item: (-item[1].get("GPU", 0), -item[1].get("CPU", 0))):
        need = {k: v for k, v in bundle.items() if v > 0}
        node = next((n for n in free if all(n.get(k, 0.0) >= v - 1e-9 for k, v in need.items())), None)
        if node is None:
            left.append((name, bundle))
            continue
        for k, v in need.items():
            node[k] -= v
    return left


def placement_problems(roles: Sequence[Role], nodes: Sequence[dict[str, float]]) -> list[str]:
    """Per phase, the actors that find no node (more nodes, or an autoscaler, would hold them)."""
    found = []
    for phase in PHASES:
        bundles = [(role.name, role.bundle) for role in roles if role.phase == phase for _ in range(role.count)]
        for name, bundle in unplaced(bundles, nodes):
            found.append(f"{phase}: {name} asks for {_resources(bundle)} and no node has it free beside the "
                         f"phase's other actors ({len(bundles)} in all)")
    return found


def size_problems(roles: Sequence[Role], nodes: Sequence[dict[str, float]], gpu_bytes: int | None) -> list[str]:
    """The roles larger than the device they get: a GPU role than one GPU, a CPU role than the largest node's
    memory (Ray's `memory` resource, where the nodes say it). No number of such nodes would hold them."""
    found = []
    node_memory = max((node.get("memory", 0.0) for node in nodes), default=0.0)
    for role in roles:
        share = role.bundle.get("GPU", 0)
        host = sum(role.host.values())
        if host and node_memory and host > node_memory:
            found.append(f"{role.phase}: {role.name} keeps {host / GIB:.1f} GiB in host memory beside its GPU's, the "
                         f"largest node has {node_memory / GIB:.1f} GiB")
        if share > 0 and gpu_bytes is not None:
            # A fractional GPU shares its device: 1/share such actors on one GPU.
            need = role.bytes / share
            if need > gpu_bytes:
                found.append(f"{role.phase}: {role.name} needs {need / GIB:.1f} GiB on a GPU "
                             f"({_resources(role.bundle)}), the cluster's GPUs have {gpu_bytes / GIB:.0f} GiB")
        elif share == 0 and node_memory and role.resident_bytes > node_memory:
            found.append(f"{role.phase}: {role.name} needs {role.resident_bytes / GIB:.1f} GiB of memory on a CPU node, the "
                         f"largest node has {node_memory / GIB:.1f} GiB")
    return found


def problems(roles: Sequence[Role], nodes: Sequence[dict[str, float]], gpu_bytes: int | None) -> list[str]:
    """What the cluster cannot hold: actors that find no node, and roles larger than their device."""
    return placement_problems(roles, nodes) + size_problems(roles, nodes, gpu_bytes)


def _resources(bundle: Bundle) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in bundle.items() if v) + "}"
