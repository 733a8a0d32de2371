"""Placement: which resources a job's actors ask for, and a bounded wait on a real (local) Ray cluster that
fails with a clear message when Ray cannot place them, STRICT_SPREAD included."""

from __future__ import annotations

import time

import pytest
import ray

from darts_dist.config import ClusterSection
from darts_dist.errors import DartsError
from darts_dist.ray_cluster.placement import (
    custom_resources,
    expert_actor_options,
    job_bundles,
    placement_tags,
    wait_for_resources,
)


def test_bundles_follow_the_config() -> None:
    gpu = ClusterSection(use_gpu=True, num_workers=2, cpus_per_worker=8,
                         expert_resources={"CPU": 4, "expert_node": 1}, worker_resources={"train_node": 1})
    assert job_bundles(gpu, 3) == [{"CPU": 4, "GPU": 1.0, "expert_node": 1}] * 3 + \
        [{"CPU": 8, "GPU": 1.0, "train_node": 1}] * 2
    assert custom_resources(job_bundles(gpu, 3)) == {"expert_node": 3, "train_node": 2}
    cpu = ClusterSection()
    assert job_bundles(cpu, 2) == [{"CPU": 1.0, "GPU": 0.0}] * 3
    assert expert_actor_options(cpu) == {"num_cpus": 1.0, "num_gpus": 0.0, "resources": {}}
    spread = ClusterSection(placement_strategy="SPREAD", expert_resources={"GPU": 0.5})
    assert expert_actor_options(spread) == {"num_cpus": 1.0, "num_gpus": 0.5, "resources": {},
                                            "scheduling_strategy": "SPREAD"}


def test_placement_tags_name_each_node_by_address_id_and_labels() -> None:
    placement = {"experts": {"code": ["aaaaaaaaaaaa"]}, "workers": ["bbbbbbbbbbbb"],
                 "nodes": {"aaaaaaaaaaaa": {"address": "10.0.0.2", "resources": {"CPU": 4, "expert_node": 3}},
                           "bbbbbbbbbbbb": {"address": "10.0.0.1", "resources": {"CPU": 2}}}}
    assert placement_tags(placement) == {
        "darts.placement.expert.code": "10.0.0.2 aaaaaaaa (CPU=4, expert_node=3)",
        "darts.placement.worker.0": "10.0.0.1 bbbbbbbb (CPU=2)",
    }


@pytest.mark.slow  # the session's Ray cluster
def test_waiting_for_missing_resources_is_bounded_and_says_what_is_missing(ray_cluster) -> None:
    wait_for_resources(ClusterSection(expert_resources={"expert_node": 0.25}), num_experts=3)  # fits: returns
    wait_for_resources(ClusterSection(expert_resources={"CPU": 0}), num_experts=3)  # experts that ask for nothing
    assert ray.util.placement_group_table() == {} or all(
        group["state"] == "REMOVED" for group in ray.util.placement_group_table().values())  # nothing kept reserved
    started = time.monotonic()
    with pytest.raises(DartsError) as error:
        wait_for_resources(ClusterSection(expert_resources={"gpu_node": 1}, resource_wait_s=1.0), num_experts=3)
    assert 1.0 <= time.monotonic() - started < 10
    assert "no room for the job's expert actors after waiting 1 s" in error.value.what
    assert "3 × (CPU=1, gpu_node=1)" in error.value.what and "CPU=8, GPU=4, expert_node=1" in error.value.what
    assert "ray start --resources" in error.value.fix


@pytest.mark.slow  # the session's Ray cluster
def test_strict_spread_needs_a_node_per_worker(ray_cluster) -> None:
    """Two workers that would fit one node's CPUs, but STRICT_SPREAD asks for two nodes: Ray says no."""
    wait_for_resources(ClusterSection(num_workers=2, placement_strategy="PACK"), num_experts=1)
    with pytest.raises(DartsError, match="training workers") as error:
        wait_for_resources(ClusterSection(num_workers=2, placement_strategy="STRICT_SPREAD", resource_wait_s=1.0),
                           num_experts=1)
    assert "(STRICT_SPREAD)" in error.value.what and "expert actors" not in error.value.what
