"""Placement: which resources a job's actors ask for, whether a cluster can hold them, and a bounded
wait that fails with a clear message on a real (local) Ray cluster that lacks them."""

from __future__ import annotations

import time

import pytest
import ray

from darts_dist.config import ClusterSection
from darts_dist.errors import DartsError
from darts_dist.placement import (
    custom_resources,
    expert_actor_options,
    job_bundles,
    placement_tags,
    unplaced,
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


def test_unplaced_bundles_are_the_ones_no_node_can_hold() -> None:
    experts = [{"CPU": 1, "GPU": 1, "expert_node": 1}] * 3
    workers = [{"CPU": 4, "GPU": 1}] * 2
    gpu_node = {"CPU": 16, "GPU": 4, "expert_node": 4}
    assert unplaced(experts + workers, [{"CPU": 8}, gpu_node, gpu_node]) == []
    # One GPU node: 5 GPUs wanted, 4 there.
    assert len(unplaced(experts + workers, [{"CPU": 8}, gpu_node])) == 1
    # The label is missing everywhere: every expert is left over, the workers still fit.
    assert unplaced(experts + workers, [{"CPU": 16, "GPU": 8}]) == experts
    # Totals over nodes are not enough: a bundle must fit on one node.
    assert unplaced([{"CPU": 6}], [{"CPU": 4}, {"CPU": 4}]) == [{"CPU": 6}]


def test_placement_tags_name_each_node_by_address_id_and_labels() -> None:
    placement = {"experts": {"code": ["aaaaaaaaaaaa"]}, "workers": ["bbbbbbbbbbbb"],
                 "nodes": {"aaaaaaaaaaaa": {"address": "10.0.0.2", "resources": {"CPU": 4, "expert_node": 3}},
                           "bbbbbbbbbbbb": {"address": "10.0.0.1", "resources": {"CPU": 2}}}}
    assert placement_tags(placement) == {
        "darts.placement.expert.code": "10.0.0.2 aaaaaaaa (CPU=4, expert_node=3)",
        "darts.placement.worker.0": "10.0.0.1 bbbbbbbb (CPU=2)",
    }


@pytest.fixture
def small_cluster():
    ray.init(num_cpus=4, resources={"expert_node": 1}, include_dashboard=False)
    yield
    ray.shutdown()


def test_waiting_for_missing_resources_is_bounded_and_says_what_is_missing(small_cluster) -> None:
    wait_for_resources(ClusterSection(expert_resources={"expert_node": 0.25}), num_experts=3)  # fits: returns
    started = time.monotonic()
    with pytest.raises(DartsError) as error:
        wait_for_resources(ClusterSection(expert_resources={"gpu_node": 1}, resource_wait_s=1.0), num_experts=3,
                           poll_s=0.2)
    assert 1.0 <= time.monotonic() - started < 10
    assert "no room for 3 of the job's 4 actors after waiting 1 s" in error.value.what
    assert "gpu_node" in error.value.what and "CPU=4, expert_node=1" in error.value.what
    assert "ray start --resources" in error.value.fix
