"""Calibration as a Ray job (expert actors, Ray Data, Ray Train + DeepSpeed) against the in-process reference.

All tests share the test session's Ray cluster (conftest's `ray_cluster`). Each Ray run costs 30-45 s here, mostly
process start-up on 2 cores, so every test makes the most of its runs.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import pytest
import torch

from darts_dist.calibrate.coefficients import fit_in_process
from darts_dist.calibrate.in_process import calibrate_stage
from darts_dist.calibrate.ray import job as job_module
from darts_dist.calibrate.ray.job import (
    FAIL_WORKER_AT_STEP,
    JobResult,
    calibrate_distributed,
    fit_coefficients_distributed,
    job_plan,
    run_calibration_job,
)
from darts_dist.calibrate.ray.stream import arrivals
from darts_dist.calibrate.router import task_prompts
from darts_dist.config import parse_config
from darts_dist.core import load_corrections, prompt_features
from darts_dist.errors import DartsError
from darts_dist.sources.models import load_causal_lm, load_tokenizer, pad_id
from darts_dist.sources.references import demo_data, resolve_sources

TASKS = ("code", "math")
ALL_TASKS = ("code", "math", "instruct")
# Ray's path is bit-identical to the in-process loop here (same rows, same Adam); the tolerance only
# allows for BLAS summing in another order on other machines.
SAME_CORRECTIONS_ATOL = 1e-6


def make_config(tiny_family, out: Path, data: dict[str, str] | None = None, calibration=None, cluster=None):
    data = data or {task: f"demo:{task}" for task in TASKS}
    return parse_config({
        "name": "t",
        "output_dir": str(out),
        "sources": {
            "base": str(tiny_family.base),
            "experts": [
                {"task": task, "path": str(tiny_family.experts[task]),
                 "data": {"calibration": data[task], "heldout": f"demo:{task}"}}
                for task in data
            ],
        },
        "calibration": {"rank": 4, "max_positions": 16, "num_samples": 12, "max_length": 24, "batch_size": 4,
                        "steps": 30, "learning_rate": 0.01, **(calibration or {})},
        "cluster": {"checkpoint_every": 10, "max_failures": 1, **(cluster or {})},
        "evaluation": {"score_limit": 0},  # bias is what these tests compare; task scores cost generation
    })


def run_job(config, tiny_family) -> JobResult:
    return run_calibration_job(job_plan(config, resolve_sources(config), tiny_family.base))


def assert_every_row_once(job: JobResult, sizes: dict[str, int], workers: int) -> None:
    """Each calibration row reached exactly one worker: per-task histogram and ids, over all workers."""
    assert sorted(job.rows) == list(range(workers))
    for task, size in sizes.items():
        received = [row for ranks in job.rows.values() for row in ranks.get(task, [])]
        assert len(received) == size, (task, len(received), size)
        assert sorted(received) == list(range(size))
        assert all(ranks.get(task) for ranks in job.rows.values()), "every worker trains on every task"
    assert job.stream["rows"] == sum(sizes.values())


def checkpoints(config) -> list[Path]:
    return sorted((config.run_dir / "ray-train").glob("*/checkpoint_*"))


# Deep DARTS with the loss at the last corrected layer only: rows keep the merged states entering layer 2 and
# steps run from there; with the logit term, the experts stream their likeliest next tokens beside (weighted to
# count: the tiny models' distributions are near uniform, their KL ~1e-6), taken at 3 sampled tokens of a row a step.
# The disturbed run trains these, so that one Ray run checks the resume (the replayed schedule draws the samples
# again), deep DARTS and the logit term.
DEEP = {"layers": [2, 3, "final"], "loss_at": "last", "learning_rate": 0.001, "logit_weight": 1e4, "logit_top_k": 8,
        "logit_positions": 3}


@pytest.fixture(scope="module")
def disturbed(ray_cluster, tiny_family, tmp_path_factory):
    """One worker, ZeRO 0, deep corrections, lost in step 15 (after the checkpoint at step 10): the Ray path,
    and the in-process loop on the same config."""
    config = make_config(tiny_family, tmp_path_factory.mktemp("ray"), calibration=DEEP)
    sources = resolve_sources(config)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(FAIL_WORKER_AT_STEP, "15")
        ray_outcome = calibrate_distributed(config, sources, tiny_family.base)
    reference = calibrate_stage(make_config(tiny_family, tmp_path_factory.mktemp("ref"), calibration=DEEP), sources,
                                tiny_family.base)
    return config, ray_outcome, reference


@pytest.mark.slow
def test_a_lost_worker_resumes_from_its_last_checkpoint(disturbed) -> None:
    config, ray_outcome, _ = disturbed
    resumed_from = ray_outcome.job["resumed_from"]
    assert resumed_from == 10
    assert 15 - resumed_from <= config.cluster.checkpoint_every  # no more steps redone than the interval
    assert len(ray_outcome.result.losses) == 30


@pytest.mark.slow
def test_one_worker_zero0_equals_the_in_process_loop_a_lost_worker_included(disturbed, tiny_family, tmp_path) -> None:
    """The resumed run trains exactly what the reference does: checkpoints restore the corrections, the
    optimizer and the step schedule; deep corrections train from their lowest layer as in-process, with the logit
    term from the streamed top tokens as in-process from the experts' own logits."""
    config, ray_outcome, reference = disturbed
    assert ray_outcome.result.corrections.layer_keys == (2, 3, "final")
    assert ray_outcome.job["stream"]["bytes"] > 0
    for (name, ours), theirs in zip(ray_outcome.result.corrections.named_parameters(),
                                   reference.result.corrections.parameters()):
        torch.testing.assert_close(ours, theirs, atol=SAME_CORRECTIONS_ATOL, rtol=0, msg=name)
    assert ray_outcome.result.losses == pytest.approx(reference.result.losses, abs=SAME_CORRECTIONS_ATOL)
    saved, _ = load_corrections(ray_outcome.corrections_path)
    torch.testing.assert_close(saved["final"].position, reference.result.corrections["final"].position,
                               atol=SAME_CORRECTIONS_ATOL, rtol=0)
    for task in TASKS:  # the entropy weights the experts streamed are the ones the reference computed
        torch.testing.assert_close(ray_outcome.entropy_weights[task], reference.entropy_weights[task])
    # The logit term is in what both trained: without it the same schedule gives other losses.
    without = calibrate_stage(make_config(tiny_family, tmp_path / "l1", calibration=DEEP | {"logit_weight": 0.0}),
                              resolve_sources(config), tiny_family.base)
    assert reference.result.losses[0] > without.result.losses[0] + 1e-3


@pytest.mark.slow
def test_the_workers_pool_the_routers_features_of_every_prompt_as_in_process(disturbed, tiny_family) -> None:
    """Every calibration row's prompt features, pooled by the worker that ran the merged model on it (the lost
    worker's rows again after the resume), in row order: the merged model's own pooled prompts (the tiny base
    here), which the in-process path computes for the router after a deep calibration (it keeps no merged states,
    and test_router checks its pooling of kept states against the same function)."""
    config, ray_outcome, reference = disturbed
    assert sorted(ray_outcome.prompt_features) == sorted(TASKS) and reference.prompt_features == {}
    tokenizer = load_tokenizer(tiny_family.base)
    model = load_causal_lm(tiny_family.base)
    for task in TASKS:
        assert ray_outcome.prompt_features[task].shape[0] == config.calibration.num_samples
        prompts = task_prompts(resolve_sources(config).data[task], "calibration", config, tokenizer)
        torch.testing.assert_close(ray_outcome.prompt_features[task],
                                   prompt_features(model, prompts, "final", pad_id(tokenizer)), atol=1e-5, rtol=1e-4)


@pytest.mark.slow
def test_rerunning_a_finished_run_resumes_it_instead_of_starting_over(disturbed, tiny_family, caplog,
                                                                     monkeypatch) -> None:
    """The finished run is read from its last checkpoint: no Ray session, no worker started to find that out."""
    config, first, _ = disturbed
    before = checkpoints(config)

    def no_ray(*args, **kwargs):
        raise AssertionError("a Ray session was opened for a finished run")

    monkeypatch.setattr(job_module, "ray_session", no_ray)
    logger = logging.getLogger("darts_dist")
    logger.addHandler(caplog.handler)  # directly: darts-dist's lines do not propagate to the root logger
    try:
        with caplog.at_level(logging.INFO, logger="darts_dist"):
            again = calibrate_distributed(config, resolve_sources(config), tiny_family.base)
    finally:
        logger.removeHandler(caplog.handler)
    assert checkpoints(config) == before  # no step was trained again
    assert "this run had finished" in caplog.text
    for ours, theirs in zip(again.result.corrections.parameters(), first.result.corrections.parameters()):
        assert torch.equal(ours, theirs)
    assert again.result.losses == first.result.losses


@pytest.mark.slow
def test_two_zero2_workers_stream_a_large_set_within_bounds(ray_cluster, tiny_family, tmp_path) -> None:
    """45 MB of hidden states from three experts, through 1 MB stream buffers and 2 MB feature budgets."""
    copies = 3
    data = {}
    for task in ALL_TASKS:
        rows = demo_data()[task]["calibration"].read_text().splitlines()
        data[task] = str(tmp_path / f"{task}.jsonl")
        Path(data[task]).write_text("\n".join(rows * copies) + "\n")
    size = 160 * copies
    calibration = {"num_samples": size, "max_length": 128, "batch_size": 8, "steps": 40}
    config = make_config(tiny_family, tmp_path / "ray", data, calibration,
                         cluster={"num_workers": 2, "zero_stage": 2, "stream_buffer_mb": 1, "feature_memory_mb": 2})
    job = run_job(config, tiny_family)

    assert_every_row_once(job, {task: size for task in ALL_TASKS}, workers=2)
    assert job.stream["bytes"] > 40e6
    # Past its 2 MB budget each worker spilled to disk, and trained from the memory-mapped files.
    assert job.stream["spilled_bytes"] > 0 and job.stream["peak_memory_bytes"] <= 3 << 20
    # The object store held a window of the stream, never the stream: per expert its 1 MB buffer and
    # the few 0.3 MB batches in flight between actor and worker (8-10 MB measured here).
    assert job.object_store_peak_bytes < 16 << 20
    assert job.object_store_peak_bytes < job.stream["bytes"] / 3
    assert sum(job.losses[-5:]) / 5 < job.losses[0]
    # What two workers train against the in-process loop: test_fake_gpus's ZeRO-3 run (a set this large costs the
    # reference and its evaluation about 25 s more here).


def test_too_few_rows_for_the_workers_is_refused_before_any_work(tiny_family, tmp_path) -> None:
    config = make_config(tiny_family, tmp_path, calibration={"num_samples": 4}, cluster={"num_workers": 2})
    with pytest.raises(DartsError, match="too few for 2 workers"):
        run_job(config, tiny_family)
    assert not (config.run_dir / "ray-train").exists()


@pytest.mark.slow
def test_a_job_asking_for_missing_resources_waits_then_says_what_is_missing(ray_cluster, tiny_family,
                                                                             tmp_path) -> None:
    """A cluster with an autoscaler: the job leaves missing nodes to it, waits resource_wait_s, then says what is
    missing, before any step (a fixed cluster's refusal by the plan's check, before any work: test_plan)."""
    config = make_config(tiny_family, tmp_path, cluster={"expert_resources": {"gpu_node": 1}, "resource_wait_s": 2,
                                                         "autoscaler": True})
    started = time.monotonic()
    with pytest.raises(DartsError, match="no room for the job's expert actors after waiting 2 s") as refused:
        run_job(config, tiny_family)
    assert time.monotonic() - started >= 2
    assert "gpu_node" in refused.value.what and refused.value.fix and "resource_wait_s" in refused.value.fix
    assert not (config.run_dir / "ray-train").exists()


def test_the_job_plan_resumes_the_same_command_and_not_a_changed_one(tiny_family, tmp_path) -> None:
    config = make_config(tiny_family, tmp_path)
    sources = resolve_sources(config)
    plan = job_plan(config, sources, tiny_family.base)
    assert plan.run_id == job_plan(config, sources, tiny_family.base).run_id
    changed = make_config(tiny_family, tmp_path, calibration={"learning_rate": 0.02})
    assert job_plan(changed, sources, tiny_family.base).run_id != plan.run_id
    named = make_config(tiny_family, tmp_path, cluster={"run_id": "mine"})
    assert job_plan(named, sources, tiny_family.base).run_id == "mine"
    assert plan.storage_path == str(config.run_dir / "ray-train")


class FakeShard:
    """A worker's shard of one expert's stream: its batches, after `wait_for` is set if given."""

    def __init__(self, batches: list[dict], wait_for=None, fail: bool = False) -> None:
        self.batches, self.wait_for, self.fail = batches, wait_for, fail
        self.started = threading.Event()

    def iter_batches(self, batch_size: int, batch_format: str):
        self.started.set()
        if self.wait_for is not None and not self.wait_for.wait(timeout=10):
            raise TimeoutError("the other stream was never pulled")
        yield from self.batches
        if self.fail:
            raise RuntimeError("stream lost")


def test_every_experts_stream_is_pulled_at_once() -> None:
    """A stream that only delivers once another has started still arrives (pulling in turn would hang)."""
    second = FakeShard([{"row": [2]}, {"row": [3]}])
    first = FakeShard([{"row": [0]}, {"row": [1]}], wait_for=second.started)
    got = list(arrivals({"a": first, "b": second}, batch_size=1))
    assert sorted((task, batch["row"][0]) for task, batch in got) == [("a", 0), ("a", 1), ("b", 2), ("b", 3)]
    with pytest.raises(RuntimeError, match="stream lost"):
        list(arrivals({"a": FakeShard([{"row": [0]}], fail=True), "b": FakeShard([])}, batch_size=1))


@pytest.mark.slow
def test_the_coefficients_fit_on_a_zero3_worker_equals_the_in_process_fit(ray_cluster, tiny_family, tmp_path) -> None:
    """Merge coefficients on the expert stream: a DeepSpeed ZeRO-3 worker (task vectors partitioned) steps them
    exactly as the in-process fit does, on the same rows."""
    config = make_config(tiny_family, tmp_path, cluster={"zero_stage": 3}, calibration={
        "method": "merge_coefficients", "coefficients": {"layers": [2, 3, "final"], "steps": 12,
                                                         "learning_rate": 0.05}})
    sources = resolve_sources(config)
    on_ray = fit_coefficients_distributed(config, sources)
    own = fit_in_process(config, sources, progress=False)
    assert on_ray.owned == own.owned == {"code": [2, 3, "final"], "math": [2, 3, "final"]}
    assert on_ray.changed == own.changed and on_ray.task_vector_bytes == own.task_vector_bytes
    assert on_ray.losses == pytest.approx(own.losses, rel=1e-4)
    assert torch.allclose(on_ray.coefficients, own.coefficients, atol=1e-5)
    assert (own.coefficients[2] - 1.0).abs().max() > 0.05  # the fit moved them from the start (1.0 each)
