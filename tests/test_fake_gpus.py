"""A GPU cluster's layout rehearsed on this CPU machine: the test session's Ray cluster has 4 GPUs it does not have
(conftest's `ray_cluster`), so Ray hands out GPU ids exactly as on a 4-GPU node while every model runs on the CPU.
One calibration of one-GPU roles (2 experts and 2 training ranks) takes the 4 distinct GPUs, the ranks never share
one, a run asking for 5 is refused in seconds, the driver loads no model weights, and serving replicas take a GPU
each. The same calibration is the whole job in the GPU's dtype: RegMean's Gram actors, ZeRO-3 over two ranks, the
router, the evaluation actors and the registered model all compute in bf16 (ZeRO-0 in bf16 is test_gpu_check's).
It is also the Ray path's ZeRO-3 check against the in-process loop (each Ray run costs most of a minute here, so
one run answers both): deep corrections through the partitioned merged model, uneven shards, every expert actor
lost once and restarted by Ray Data."""

from __future__ import annotations

import json
import time
import urllib.request
from argparse import Namespace
from pathlib import Path

import pytest
from conftest import FAKE_GPUS
from serving import free_port
from test_ablation import router_accuracy_by_hand
from test_distributed import assert_every_row_once
from transformers import PreTrainedModel

from darts_dist.calibrate.in_process import calibrate_stage
from darts_dist.calibrate.ray import job as job_module
from darts_dist.cli import main
from darts_dist.config import RunConfig, ServeSection, load_config, parse_config
from darts_dist.core import DartsCorrections
from darts_dist.evaluate.stage import evaluate_stage
from darts_dist.options import apply_config_flags
from darts_dist.serve.model import resolve_model
from darts_dist.sources.corrections import save_corrections_for
from darts_dist.sources.models import model_compute
from darts_dist.sources.references import resolve_sources

pytestmark = pytest.mark.slow  # Ray jobs on the session's cluster

TASKS = ("code", "math", "instruct")


def gpu_config(tiny_family, out: Path, tasks=TASKS, workers: int = 1, zero_stage: int = 0,
               merge: str = "task_arithmetic", calibration: dict | None = None) -> Path:
    """The tiny family on the 7B examples' layout: a GPU per expert and per worker, evaluation on Ray without the
    base (4 one-GPU actors), bf16 everywhere."""
    config = {
        "name": f"gpus-{len(tasks)}x{workers}",
        "output_dir": str(out),
        "sources": {"base": str(tiny_family.base), "experts": [
            {"task": t, "path": str(tiny_family.experts[t]), "data": {"calibration": f"demo:{t}", "heldout": f"demo:{t}"}}
            for t in tasks]},
        "merge": {"method": merge, **({"parameters": {"weight": 0.5}} if merge == "task_arithmetic" else {})},
        "calibration": {"rank": 4, "max_positions": 64, "num_samples": 8, "max_length": 64, "batch_size": 4,
                        "steps": 12, "learning_rate": 0.01, "device": "auto", "dtype": "bfloat16", **(calibration or {})},
        "cluster": {"use_gpu": True, "num_workers": workers, "zero_stage": zero_stage, "resource_wait_s": 60},
        "evaluation": {"score_limit": 1, "max_new_tokens": 4, "score_base": False},
        "tracking": {"uri": f"sqlite:///{out}/mlflow.db"},
    }
    parse_config(config)
    path = out / "config.yaml"
    path.write_text(json.dumps(config))
    return path


def count_driver_loads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every model this (the driver's) process loads with from_pretrained from now on; Ray's workers are other
    processes."""
    loads: list[str] = []
    original = PreTrainedModel.from_pretrained.__func__

    def counted(cls, path, *args, **kwargs):
        loads.append(str(path))
        return original(cls, path, *args, **kwargs)

    monkeypatch.setattr(PreTrainedModel, "from_pretrained", classmethod(counted))
    return loads


def distinct_gpus(placement: dict) -> list[str]:
    """Every GPU the job's actors held, as node:id; one entry per actor holding it."""
    held = [f"{node}:{gpus}" for node, gpus in zip(placement["workers"], placement["worker_gpus"])]
    held += [where for places in placement["expert_gpus"].values() for where in places]
    return held


def bias_reduction(config: RunConfig, merged: Path, corrections: DartsCorrections) -> float:
    """Held-out bias reduction of in-memory corrections of `merged`, as `darts-dist evaluate` measures it, here in
    this process."""
    here = parse_config(config.model_dump(mode="json") | {"evaluation": {
        **config.evaluation.model_dump(mode="json"), "executor": "in-process"}})
    path = save_corrections_for(here.run_dir / "reference.safetensors", corrections, merged)
    return evaluate_stage(here, resolve_sources(here), merged, path,
                          driver_holds_models=lambda: True)["overall"]["bias_reduction"]


GPU_TASKS = ("code", "math")
# 21 rows a task: two ranks get uneven shards (their merged forwards kept in lockstep by ZeRO-3).
SAMPLES = 21
# Two ranks train on two halves of the rows with gradients averaged: another sampling of the same problem, so the
# held-out bias reduction is close to the in-process reference's, not equal: within this share of it.
BIAS_REDUCTION_TOLERANCE = 0.05


@pytest.fixture(scope="module")
def calibrated(ray_cluster, tiny_family, tmp_path_factory):
    """The module's one calibration (each costs about a minute here): two experts and two training ranks at ZeRO-3,
    the 4 GPUs' worth of one-GPU roles (the 7B examples': a GPU per expert and per worker), on RegMean's merge, in
    bf16, correcting two layers with the logit term (the partitioned LM head gathered for it), every expert actor
    lost after its first batch; its config, report, the job's result, and the models the driver loaded meanwhile."""
    out = tmp_path_factory.mktemp("gpus")
    config = gpu_config(tiny_family, out, tasks=GPU_TASKS, workers=2, zero_stage=3, merge="regmean",
                        calibration={"layers": [1, "final"], "num_samples": SAMPLES, "learning_rate": 1e-3, "steps": 30,
                                     "logit_weight": 0.5, "logit_top_k": 8})
    report = out / "report.json"
    jobs: list[job_module.JobResult] = []
    real_job = job_module.run_calibration_job

    def kept_job(plan):
        jobs.append(real_job(plan))
        return jobs[-1]

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(job_module.FAIL_EXPERT_AFTER, "1")
        patch.setattr(job_module, "run_calibration_job", kept_job)
        loads = count_driver_loads(patch)
        assert main(["calibrate", str(config), "--report", str(report)]) == 0
    [job] = jobs
    return config, report, job, loads


def test_one_gpu_roles_take_distinct_gpus_two_ranks_never_share_one_and_the_driver_loads_no_model(
    calibrated
) -> None:
    _, report, _, driver_loads = calibrated
    result = json.loads(report.read_text())
    placement = result["calibration"]["job"]["placement"]
    held = distinct_gpus(placement)
    assert len(held) == FAKE_GPUS and len(set(held)) == FAKE_GPUS, held
    workers = [f"{node}:{gpus}" for node, gpus in zip(placement["workers"], placement["worker_gpus"])]
    assert len(workers) == 2 and len(set(workers)) == 2 and all(w.split(":")[1] for w in workers), workers
    # The router's held-out check ran in a Ray task, the evaluation in actors: no forward on the driver.
    assert driver_loads == []
    # The router fit in that Ray task is the one its held-out accuracy says (recomputed here, after the check above).
    accuracy, per_task = router_accuracy_by_hand(result, str(report.parent / "gpus-2x2" / "merged"))
    assert result["router"]["accuracy"] == pytest.approx(accuracy) and result["router"]["per_task"] == pytest.approx(per_task)
    assert "math" in result["variants"]["darts"]["tasks"]
    # Each role measured its own peak memory (benchmarks/plan_accuracy.py sets them beside the plan).
    memory = result["calibration"]["job"]["memory"]
    assert memory["device"] == "cpu" and len(memory["workers"]) == 2 and sorted(memory["experts"]) == sorted(GPU_TASKS)
    assert all(peak > 0 for peak in [*memory["workers"], *memory["experts"].values()])
    # The base too, for the retention set (its task scores are off): first, in the merge's actor and GPU.
    assert sorted(result["evaluation_memory"]) == sorted(["base", "merged", *(f"expert {t}" for t in GPU_TASKS)])
    retained = result["variants"]["darts"]["retention"]
    assert set(retained) == {"base", "experts", "merged", "corrected"} and set(retained["experts"]) == set(GPU_TASKS)
    assert 0.0 <= retained["corrected"]["agreement"] <= 1.0 and retained["corrected"]["nll"] > 0
    # The config's bfloat16 held in every role that computed, on CPUs as it would on GPUs, and the job learned.
    assert set(result["compute"].values()) == {"cpu bfloat16"}, result["compute"]
    assert {"Gram actor (math)", "calibration worker", "router", "evaluation actor (merged)", "evaluation actor (base)",
            "registration check"} <= set(result["compute"])
    assert result["config"]["calibration"]["dtype"] == "bfloat16" and result["config"]["cluster"]["zero_stage"] == 3
    assert result["config"]["calibration"]["logit_weight"] == 0.5
    assert result["calibration"]["final_loss"] < result["calibration"]["first_loss"]
    # Held out, the bf16 corrections remove most of the merge's bias (0.70 measured; the NLL moves by less than
    # bf16's rounding at this size, so the bias is the measure here).
    assert result["variants"]["darts"]["overall"]["bias_reduction"] > 0.4


def test_two_zero3_ranks_train_deep_corrections_and_outlive_their_experts_as_the_in_process_loop(
    calibrated, tiny_family
) -> None:
    """Every row reached one rank while each expert actor died once (the stream healed itself: no worker restart),
    and two ranks trained what the in-process loop trains on the same merge: the redone batches are the same rows,
    but which rank got which depends on the timing, hence a tolerance on the held-out bias reduction."""
    path, report, job, _ = calibrated
    result = json.loads(report.read_text())
    assert_every_row_once(job, {task: SAMPLES for task in GPU_TASKS}, workers=2)
    assert job.resumed_from is None
    assert job.corrections.layer_keys == (1, "final")
    assert sum(job.losses[-5:]) / 5 < 0.8 * job.losses[0], job.losses
    merged = report.parent / "gpus-2x2" / "merged"
    config = apply_config_flags(load_config(path), Namespace(output_dir=str(report.parent / "reference")))
    reference = calibrate_stage(config, resolve_sources(config), merged).result.corrections
    ours = result["variants"]["darts"]["overall"]["bias_reduction"]
    theirs = bias_reduction(config, merged, reference)
    assert theirs > 0.4 and abs(ours - theirs) < BIAS_REDUCTION_TOLERANCE * theirs, (ours, theirs)


def test_the_ray_runs_rank_0_logs_each_step_and_its_run_says_where_it_ran(calibrated) -> None:
    """What a tracked Ray run adds to test_tracking's in-process one: the training workers' rank 0 logs the steps
    to the calibration's MLflow run, and the run's tags name the job, its checkpoint and each role's node."""
    from mlflow import MlflowClient

    _, report, job, _ = calibrated
    result = json.loads(report.read_text())
    client = MlflowClient(result["tracking"]["uri"])
    calibration = client.get_run(result["tracking"]["stage_runs"]["calibration"])
    tags, metrics = calibration.data.tags, calibration.data.metrics
    assert (tags["darts.executor"], tags["darts.ray_address"]) == ("ray", "local")
    assert (tags["darts.num_workers"], tags["darts.zero_stage"], tags["darts.use_gpu"]) == ("2", "3", "True")
    ran = result["calibration"]["job"]
    assert tags["darts.ray_run_id"] == ran["run_id"] and tags["darts.checkpoint"] == ran["checkpoint_path"] == job.checkpoint_path
    assert {f"darts.placement.worker.{rank}" for rank in (0, 1)} | {f"darts.placement.expert.{t}" for t in GPU_TASKS} <= set(tags)
    assert metrics["job.stream.rows"] == SAMPLES * len(GPU_TASKS) and metrics["job.seconds.total"] > 0
    losses = client.get_metric_history(calibration.info.run_id, "loss")
    assert [m.step for m in losses] == list(range(1, len(job.losses) + 1))
    assert [m.value for m in losses] == pytest.approx(result["calibration"]["losses"])
    assert all(m.value > 0 for m in client.get_metric_history(calibration.info.run_id, "rows_per_second"))


def test_evaluate_and_register_load_no_model_on_the_driver(calibrated, monkeypatch) -> None:
    """`evaluate` evaluates in actors of its own; `register` (here a run whose model was never logged: its tags
    taken off) checks the logged model in a GPU role's Ray task, as the pipeline's registration does."""
    from darts_dist.tracking.registry import MODEL_URI_TAG, VERSION_TAG
    from mlflow import MlflowClient

    config, report, _, _ = calibrated
    result = json.loads(report.read_text())
    driver_loads = count_driver_loads(monkeypatch)
    evaluation = report.parent / "evaluation.json"
    assert main(["evaluate", str(config), "--report", str(evaluation)]) == 0
    assert json.loads(evaluation.read_text())["variants"]["darts"]["tasks"].keys() == set(GPU_TASKS)
    client = MlflowClient(result["tracking"]["uri"])
    calibration = result["tracking"]["stage_runs"]["calibration"]
    for tag in (MODEL_URI_TAG, VERSION_TAG):
        client.delete_tag(calibration, tag)
    registered = report.parent / "registered.json"
    assert main(["register", str(report), "--report", str(registered)]) == 0
    assert json.loads(registered.read_text())["tracking"]["version"] == "2"
    assert driver_loads == []
    # The registered model computes as the run did: its pyfunc loads and answers in bf16.
    import mlflow
    import pandas as pd

    from darts_dist.tracking.store import environment

    # The run's store through the environment, put back after (MLflow's own _use_tracking_uri unsets the variable
    # when it restores a process-wide URI that was never set: every later command would track to ./mlflow.db).
    with environment(MLFLOW_TRACKING_URI=result["tracking"]["uri"]):
        champion = mlflow.pyfunc.load_model("models:/darts-dist-gpus-2x2@champion")
    assert model_compute(champion.unwrap_python_model().lm.model) == "cpu bfloat16"
    answer = champion.predict(pd.DataFrame({"prompt": ["def f(x):"], "task": ["code"]}), params={"max_new_tokens": 3})
    assert answer["completion_tokens"].tolist()[0] >= 1


def test_a_run_asking_for_five_gpus_is_refused_in_seconds(ray_cluster, tiny_family, tmp_path, capsys) -> None:
    config = gpu_config(tiny_family, tmp_path, workers=2)  # 3 experts + 2 workers
    started = time.perf_counter()
    assert main(["calibrate", str(config)]) == 2
    assert time.perf_counter() - started < 30
    err = capsys.readouterr().err
    assert "calibration worker asks for" in err and "(5 in all)" in err and "fix:" in err
    assert not (tmp_path / "gpus-3x2").exists() and not (tmp_path / "mlflow.db").exists()  # nothing started


def test_a_serving_replica_holds_a_gpu_and_says_it_found_no_cuda(ray_cluster, tiny_family, tmp_path) -> None:
    from ray import serve

    from darts_dist.serve.runner import start

    source, _ = resolve_model(str(tiny_family.base))
    settings = ServeSection(use_gpu=True, port=free_port(), num_replicas=1)
    try:
        url = start(source, settings)
        with urllib.request.urlopen(url.removesuffix("/v1") + "/healthz", timeout=60) as response:
            health = json.loads(response.read())
        assert health["device"] == "cpu" and any("no CUDA device" in w for w in health["warnings"])
        assert len(health["gpus"]) == 1  # Ray gave the replica one of the node's GPUs
        assert health["peak_memory_bytes"] > 0
    finally:
        serve.shutdown()
