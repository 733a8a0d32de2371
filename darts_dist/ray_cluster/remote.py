"""Model work that must not run on the driver: a function run in a Ray task with an expert actor's resources
(a GPU with `cluster.use_gpu`), on the run's cluster, once Ray can reserve them (bounded by
`cluster.resource_wait_s`)."""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable, Iterator, Mapping
from typing import TypeVar

import ray
from ray.exceptions import RayTaskError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from darts_dist.config import ClusterSection
from darts_dist.errors import DartsError
from darts_dist.logs import init_ray
from darts_dist.ray_cluster.placement import custom_resources, expert_actor_options, expert_bundle

T = TypeVar("T")


@contextlib.contextmanager
def ray_session(address: str | None, local: Mapping[str, object]) -> Iterator[None]:
    """This process's Ray cluster: the one it already joined, the one at `address`, or a local one
    for the job, started with the `ray.init` arguments `local`."""
    if ray.is_initialized():
        yield
        return
    if address:
        init_ray(address=address)
    else:
        init_ray(include_dashboard=False, **local)
    try:
        yield
    finally:
        ray.shutdown()


def expert_cluster(cluster: ClusterSection, actors: int) -> dict[str, object]:
    """`ray.init` arguments of a local cluster for `actors` actors with an expert's resources: their logical CPUs
    (at least the machine's cores) and the custom resources they ask for; no idle workers started ahead."""
    bundle = expert_bundle(cluster)
    return {"num_cpus": max(os.cpu_count() or 1, math.ceil(bundle["CPU"] * actors)),
            "resources": custom_resources([bundle] * actors),
            "_system_config": {"enable_worker_prestart": False, "prestart_worker_first_driver": False}}


def get_or_raise(refs: object) -> object:
    """ray.get, with a DartsError raised in a task or actor re-raised as itself (the command line's error and fix)."""
    try:
        return ray.get(refs)
    except RayTaskError as error:
        if isinstance(error.cause, DartsError):
            raise error.cause from None
        raise


@contextlib.contextmanager
def expert_group(cluster: ClusterSection, count: int, what: str) -> Iterator[list[dict[str, object]]]:
    """A placement group of `count` expert bundles on the run's cluster (`cluster.address`, or RAY_ADDRESS, or the
    cluster this process joined, else a local one); yields each bundle's Ray options (resources and scheduling).
    Fails naming `what` when Ray cannot reserve them within `cluster.resource_wait_s`."""
    bundle = {name: amount for name, amount in expert_bundle(cluster).items() if amount}
    address = cluster.address or os.environ.get("RAY_ADDRESS")
    with ray_session(address, expert_cluster(cluster, count)):
        group = placement_group([bundle] * count)
        try:
            if not ray.wait([group.ready()], timeout=cluster.resource_wait_s)[0]:
                raise DartsError(f"the Ray cluster had no room for {what} ({count} × {bundle}) after "
                                 f"{cluster.resource_wait_s:g} s", "add nodes with those resources")
            yield [expert_actor_options(cluster) | {"scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=group, placement_group_bundle_index=index)} for index in range(count)]
        finally:
            remove_placement_group(group)


def run_as_expert(cluster: ClusterSection, what: str, work: Callable[..., T], *args: object) -> T:
    """`work(*args)` in a Ray task with one expert actor's resources (`expert_group`)."""
    with expert_group(cluster, 1, what) as (options,):
        return get_or_raise(ray.remote(work).options(max_retries=0, **options).remote(*args))
