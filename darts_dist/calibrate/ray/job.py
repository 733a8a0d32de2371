"""Distributed calibration as one Ray job: expert actors stream hidden states into DeepSpeed Ray Train workers.

`calibrate_distributed` is the calibrate stage on a Ray cluster: one started for the job on this
machine, or an existing one (`--address`, `cluster.address` or RAY_ADDRESS). `run_calibration_job`
is the job itself, on plain values.

Fault injection, for tests and drills on a real cluster; never on unless set:
  DARTS_DIST_FAIL_WORKER_AT_STEP=N   rank 0 raises in step N of a run that did not start from a checkpoint
  DARTS_DIST_FAIL_EXPERT_AFTER=N     every expert actor dies after N batches, once
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import ray
import ray.train
import torch
from ray.data import ExecutionOptions, ExecutionResources
from ray.train.torch import TorchConfig, TorchTrainer
from safetensors.torch import load_file

from darts_dist.calibrate.coefficients import (
    CHECKPOINT_COEFFICIENTS,
    CoefficientFit,
    fit_layers,
    initial_coefficients,
)
from darts_dist.calibrate.features import TaskFeatures
from darts_dist.calibrate.loop import CalibrationResult, StepCallback
from darts_dist.calibrate.outcome import CalibrationOutcome, router_tasks, token_weights
from darts_dist.calibrate.ray.checkpoint_state import PROGRESS_FILE, verify_manifest
from darts_dist.calibrate.ray.stream import ExactlyOnceSplit, expert_stream
from darts_dist.calibrate.ray.train_entry import train_loop_per_worker
from darts_dist.calibrate.ray.window import StreamWindow, window_tokens
from darts_dist.calibrate.ray.worker import (
    CHECKPOINT_CORRECTIONS,
    FAIL_WORKER_AT_STEP,
)
from darts_dist.config import CORRECTIONS_FILE, CalibrationSection, ClusterSection, RunConfig, updated
from darts_dist.core import DartsCorrections, TokenizedSet, load_corrections, mask_positions, parse_layer
from darts_dist.errors import DartsError
from darts_dist.ray_cluster.cpu_share import per_node
from darts_dist.ray_cluster.placement import (
    alive_nodes,
    custom_resources,
    job_bundles,
    node_table,
    placement_tags,
    wait_for_resources,
    worker_bundle,
)
from darts_dist.ray_cluster.remote import ray_session, run_as_expert
from darts_dist.sources.corrections import save_corrections_for
from darts_dist.sources.data import calibration_sets
from darts_dist.sources.models import content_hash, load_tokenizer, read_model_info
from darts_dist.sources.references import ResolvedSources

logger = logging.getLogger(__name__)
FAIL_EXPERT_AFTER = "DARTS_DIST_FAIL_EXPERT_AFTER"


@dataclass(frozen=True)
class JobPlan:
    """Everything one calibration job needs, as plain values."""

    data: dict[str, TokenizedSet]  # each task's calibration set, in task order
    experts: dict[str, Path]
    merged_dir: Path
    settings: CalibrationSection
    cluster: ClusterSection
    run_id: str
    storage_path: str
    address: str | None = None
    on_step: StepCallback | None = None  # per-step metrics to MLflow, sent by rank 0
    # What the workers train: DARTS corrections on merged_dir, or merge coefficients over the experts' task
    # vectors, starting from `init`, with merged_dir the base.
    fit: Literal["corrections", "coefficients"] = "corrections"
    init: tuple[float, ...] = ()
    router_tasks: tuple[str, ...] = ()  # tasks whose rows' prompt features the workers pool (in_process.router_tasks)


@dataclass
class JobResult:
    """What the job trained, on which rows, and how it went."""

    corrections: DartsCorrections | None  # None for a coefficients fit
    losses: list[float]
    rows: dict[int, dict[str, list[int]]]  # worker rank -> task -> the row ids it trained on
    entropy: dict[str, dict[int, np.ndarray]]  # task -> row -> the expert's H_t on the row's tokens
    prompt_features: dict[str, dict[int, np.ndarray]]  # task -> row -> the router's features of its prompt
    # rows, bytes (of hidden states received), spilled_bytes, peak_memory_bytes; on rank 0, first_rows_seconds (until
    # every expert's first rows came) and steady_tokens (the tokens that came after)
    stream: dict[str, float]
    timings: dict[str, float]  # seconds: startup, stream, train, total
    # The step this job's last attempt started training from: None for a fresh start, the last step
    # when the run had finished already (nothing trained, the corrections are the run's).
    resumed_from: int | None
    checkpoint_path: str
    object_store_peak_bytes: int  # the most the object store held above its use when the job began
    # The most memory each worker's work ("workers", by rank) and each task's expert actor ("experts") held above
    # what its process held before loading its model, on the workers' "device" (darts_dist.memory: torch's peak
    # allocation on a GPU): the plan's roles, measured.
    memory: dict[str, object]
    # Node ids: "workers" by rank, "experts" by task (calibrate.ray.worker.placement); "nodes": id ->
    # address and resources.
    placement: dict[str, object]
    coefficients: torch.Tensor | None = None  # c [L + 1, K] of a coefficients fit
    coefficient_meta: dict[str, object] | None = None  # its experts, changed tensors and owned layers


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    return None if not value else int(value)


def local_cluster_resources(plan: JobPlan) -> dict[str, object]:
    """`ray.init` arguments of a local cluster for the job: logical CPUs for one slot per actor plus
    one for Ray Data, and the custom resources the config names (so a config written for a
    multi-node cluster runs unchanged on one machine).

    CPUs are sized above the cores on purpose: on 2 cores, `num_cpus=2` left Ray Data's tasks no CPU
    next to the training worker and the stream deadlocked (DESIGN.md §4); oversubscribing logically runs.
    No idle Python workers are started ahead (Ray starts one per logical CPU by default): the job's actors
    start their own, and on a small machine the spares' imports took cores from the stream (~5% of the job).
    """
    bundles = job_bundles(plan.cluster, len(plan.data))
    need = sum(bundle["CPU"] for bundle in bundles) + 1
    return {"num_cpus": max(os.cpu_count() or 1, int(need + 0.999)), "resources": custom_resources(bundles),
            "_system_config": {"enable_worker_prestart": False, "prestart_worker_first_driver": False}}


class ObjectStoreSampler:
    """Samples the cluster's object store use from a background thread while a block runs.

    `peak` is the most it held above what it held when the block began (`baseline`), in bytes.
    """

    def __init__(self, interval: float = 0.2) -> None:
        self.interval = interval
        self.baseline = 0
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def used(self) -> int:
        # Ray's public APIs report the object store's capacity, not its use; this raylet call is what
        # `ray memory --stats-only` prints.
        from ray._private import internal_api

        state = internal_api.get_state_from_address(ray.get_runtime_context().gcs_address)
        return int(internal_api.get_memory_info_reply(state).store_stats.object_store_bytes_used)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, self.used() - self.baseline)

    def __enter__(self) -> ObjectStoreSampler:
        self.baseline = self.used()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def check_plan(plan: JobPlan) -> None:
    """Fail before any work when a worker could get no rows of a task.

    Each expert's rows reach the workers in batches of `batch_size`, each to the worker with the
    fewest rows so far: every worker gets some rows of a task with more than (workers - 1) batches.
    """
    workers, batch = plan.cluster.num_workers, plan.settings.batch_size
    for task, data in plan.data.items():
        if len(data) <= (workers - 1) * batch:
            raise DartsError(
                f"task {task!r} has {len(data)} calibration samples: too few for {workers} workers "
                f"fed in batches of {batch} (each needs some of every task)",
                "lower cluster.num_workers or calibration.batch_size, or raise calibration.num_samples",
            )


def _user_error(error: ray.train.TrainingFailedError) -> DartsError | None:
    """A worker's DartsError, so the command line reports it as the input problem it is."""
    for failure in getattr(error, "worker_failures", {}).values():
        for cause in (failure, getattr(failure, "cause", None), failure.__cause__):
            if isinstance(cause, DartsError):
                return cause
    return None


def _task_rows(path: Path) -> Iterator[tuple[str, int, np.ndarray]]:
    """A worker's per-row file (keys "task/row"), row by row."""
    with np.load(path) as saved:
        for key in saved.files:
            task, row = key.rsplit("/", 1)
            yield task, int(row), saved[key]


def _read_checkpoint(
    checkpoint: ray.train.Checkpoint,
) -> tuple[DartsCorrections | torch.Tensor, dict, dict, dict, dict]:
    """The trained parameters (corrections, or the coefficients of a coefficients fit), progress, rows, entropy
    and the router's prompt features (task -> row -> vector)."""
    with checkpoint.as_directory() as folder:
        folder = Path(folder)
        if (folder / CHECKPOINT_COEFFICIENTS).is_file():
            trained = load_file(str(folder / CHECKPOINT_COEFFICIENTS))["coefficients"]
        else:
            trained, _ = load_corrections(folder / CHECKPOINT_CORRECTIONS)
        progress = json.loads((folder / PROGRESS_FILE).read_text())
        rows: dict[int, dict[str, list[int]]] = {}
        entropy: dict[str, dict[int, np.ndarray]] = {}
        for path in sorted(folder.glob("rows-*.npz")):
            rank = int(path.stem.split("-")[1])
            rows[rank] = {}
            for task, row, values in _task_rows(path):
                rows[rank].setdefault(task, []).append(row)
                entropy.setdefault(task, {})[row] = values
        prompts: dict[str, dict[int, np.ndarray]] = {}
        for path in folder.glob("prompts-*.npz"):
            for task, row, values in _task_rows(path):
                prompts.setdefault(task, {})[row] = values
    return trained, progress, rows, entropy, prompts


def stream_window_tokens(plan: JobPlan) -> int:
    """Tokens a task's expert may have in flight: `cluster.stream_buffer_mb` of its rows' hidden states (as they
    travel: `calibration.wire_dtype`), entropies and logit targets."""
    settings = plan.settings
    hidden = read_model_info(plan.merged_dir).hidden_size
    wire_bytes = 4 if settings.wire_dtype_for(hidden, plan.cluster.use_gpu) == "float32" else 2
    token_bytes = hidden * wire_bytes * len(settings.loss_layers()) + 4 + settings.logit_target_bytes()
    lengths = [data.attention_mask.sum(dim=1).tolist() for data in plan.data.values()]
    return window_tokens(plan.cluster.stream_buffer_mb, token_bytes, lengths, settings.batch_size,
                         plan.cluster.num_workers)


def _cuda_devices() -> int:
    return torch.cuda.device_count()


def gpus_are_cuda(cluster: ClusterSection) -> bool:
    """Whether a GPU Ray gives an expert is a CUDA device. Ray takes a node's GPU count as given (`ray start
    --num-gpus 4` on a CPU machine): such a node rehearses a GPU cluster's layout on CPUs, said here once."""
    if run_as_expert(cluster, "a CUDA check", _cuda_devices) > 0:
        return True
    logger.warning("calibrate: the cluster's GPU resources have no CUDA device behind them (GPUs given to Ray "
                   "that the machine lacks): every model runs on the CPU, the workers train over gloo")
    return False


def run_calibration_job(plan: JobPlan) -> JobResult:
    """Stream every expert's targets into the training workers and train the corrections there."""
    check_plan(plan)
    done = finished_checkpoint(plan)
    if done is not None:  # nothing left to train: no Ray session, no workers started to find that out
        return job_result(plan, done, started=time.time(), finished=time.time(), object_store_peak_bytes=0, nodes={})
    cluster = plan.cluster
    started = time.time()
    with ray_session(plan.address, local_cluster_resources(plan)):
        wait_for_resources(cluster, len(plan.data))
        # On CPU nodes: the schedule, and the model-running actors a node holds if they spread evenly (PACK may
        # put more on one node: the share is then too large there, as it would be without the rule).
        nodes = sum(1 for node in alive_nodes() if node["Resources"].get("CPU"))
        cpu = (cluster.cpu_schedule, per_node(len(plan.data) + cluster.num_workers, nodes))
        trainer = _trainer(plan, cpu, StreamWindow.remote(stream_window_tokens(plan)))
        with ObjectStoreSampler() as store_use:
            try:
                result = trainer.fit()
            except ray.train.TrainingFailedError as error:
                raise (_user_error(error) or error) from None
        nodes = node_table()  # while connected: the nodes' addresses and resources, for the record
    return job_result(plan, result.checkpoint, started, time.time(), store_use.peak, nodes)


def _train_loop_config(plan: JobPlan, cpu: tuple[str, int], window: ray.actor.ActorHandle) -> dict[str, object]:
    """What every training worker gets (`worker.train_worker`)."""
    settings, cluster = plan.settings, plan.cluster
    return {
        "settings": settings,
        "tasks": list(plan.data),
        "merged_dir": str(plan.merged_dir),
        "zero_stage": cluster.zero_stage,
        "checkpoint_every": cluster.checkpoint_every,
        "feature_memory_mb": cluster.feature_memory_mb,
        "fail_at_step": _env_int(FAIL_WORKER_AT_STEP),
        "on_step": plan.on_step,
        "fit": plan.fit,
        "base_dir": str(plan.merged_dir),
        "experts": {task: str(path) for task, path in plan.experts.items()},
        "init": list(plan.init),
        "cpu": cpu,
        "window": window,
        # The router's features of the tasks whose rows have a prompt, pooled by the merged forwards.
        "router": {"layer": settings.headline_layer(), "tasks": list(plan.router_tasks)}
        if plan.fit == "corrections" else None,
    }


def _trainer(plan: JobPlan, cpu: tuple[str, int], window: ray.actor.ActorHandle) -> TorchTrainer:
    """The Ray Train job: DeepSpeed workers fed by each expert's stream, within the object store's budget."""
    settings, cluster = plan.settings, plan.cluster
    cuda = not cluster.use_gpu or gpus_are_cuda(cluster)
    fail_expert_after = _env_int(FAIL_EXPERT_AFTER)
    return TorchTrainer(
        train_loop_per_worker,
        train_loop_config=_train_loop_config(plan, cpu, window),
        scaling_config=ray.train.ScalingConfig(
            num_workers=cluster.num_workers,
            use_gpu=cluster.use_gpu,
            resources_per_worker={k: v for k, v in worker_bundle(cluster).items() if v},
            placement_strategy=cluster.placement_strategy,
        ),
        datasets={
            task: expert_stream(data, plan.experts[task], settings, cluster, fail_expert_after, cpu[1], window)
            for task, data in plan.data.items()
        },
        # Back-pressure: each expert's stream may hold this much of the object store, no more (Ray Data's
        # budget; the window holds what it stops counting).
        dataset_config=ExactlyOnceSplit(execution_options=ExecutionOptions(
            resource_limits=ExecutionResources(object_store_memory=cluster.stream_buffer_mb << 20),
        )),
        run_config=ray.train.RunConfig(
            name=plan.run_id,
            storage_path=plan.storage_path,
            failure_config=ray.train.FailureConfig(max_failures=cluster.max_failures),
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=2),
            # DeepSpeed would look for CUDA first; on a CPU cluster it must use its CPU accelerator.
            worker_runtime_env={} if cluster.use_gpu and cuda else {"env_vars": {"DS_ACCELERATOR": "cpu"}},
        ),
        # NCCL needs CUDA devices: GPU resources without them (a rehearsal on CPUs) train over gloo.
        torch_config=None if cuda else TorchConfig(backend="gloo"),
    )


def finished_checkpoint(plan: JobPlan) -> ray.train.Checkpoint | None:
    """The run's last checkpoint if it trained every step, read from its folder (Ray Train's own `Result.from_path`);
    None for a new, unfinished or unreadable run, which Ray Train then starts or resumes."""
    try:
        checkpoint = ray.train.Result.from_path(f"{plan.storage_path.rstrip('/')}/{plan.run_id}").checkpoint
    except RuntimeError:  # no such run, or no checkpoint snapshot in it yet
        return None
    if checkpoint is None:
        return None
    with checkpoint.as_directory() as folder:
        verify_manifest(Path(folder))
        step = json.loads((Path(folder) / PROGRESS_FILE).read_text())["step"]
    return checkpoint if step >= plan.settings.steps else None


def job_result(plan: JobPlan, checkpoint: ray.train.Checkpoint, started: float, finished: float,
               object_store_peak_bytes: int, nodes: dict) -> JobResult:
    """The job's result from its last checkpoint; `nodes`: the cluster's node table, for the placement record."""
    trained, progress, rows, entropy, prompts = _read_checkpoint(checkpoint)
    coefficients = plan.fit == "coefficients"
    if coefficients != isinstance(trained, torch.Tensor):
        raise DartsError(f"the Ray run {plan.run_id} in {plan.storage_path} holds a checkpoint of another kind "
                         f"than this {plan.fit} fit", "set another cluster.run_id, or remove that run's folder")
    timings = progress["timings"]
    resumed_from = progress["resumed_from"]
    if timings["worker_start"] < started:  # a finished run, resumed: its last checkpoint is from before
        timings = {"worker_start": finished, "setup": 0.0, "stream": 0.0, "train": 0.0}
        resumed_from = len(progress["losses"])
    return JobResult(
        corrections=None if coefficients else trained,
        coefficients=trained if coefficients else None,
        coefficient_meta=progress.get("coefficients"),
        losses=progress["losses"],
        rows=rows,
        entropy=entropy,
        prompt_features=prompts,
        stream=progress["stream"],
        timings={
            "startup": timings["worker_start"] - started + timings["setup"],
            "stream": timings["stream"],
            "train": timings["train"],
            "total": finished - started,
        },
        resumed_from=resumed_from,
        checkpoint_path=checkpoint.path,
        object_store_peak_bytes=object_store_peak_bytes,
        memory=progress.get("memory", {}),
        placement={**progress["placement"], "nodes": nodes},
    )


def default_run_id(config: RunConfig, merged_dir: Path, data: Mapping[str, TokenizedSet],
                   fit: Mapping[str, object] | None = None) -> str:
    """NAME-<hash of what decides the result>: an unchanged command resumes its run, a changed one starts anew.
    `fit`: what else decides it (a coefficients fit's kind and start)."""
    digest = hashlib.sha256()
    decisive = {
        **({"fit": fit} if fit else {}),
        "calibration": config.calibration.model_dump(mode="json"),
        "experts": {e.task: e.path for e in config.sources.experts},
        "merged": content_hash(merged_dir),
        "workers": config.cluster.num_workers,
        "zero_stage": config.cluster.zero_stage,
    }
    digest.update(json.dumps(decisive, sort_keys=True).encode())
    for task, rows in data.items():
        digest.update(task.encode() + rows.input_ids.numpy().tobytes() + rows.response_mask.numpy().tobytes())
    return f"{config.name}-{digest.hexdigest()[:12]}"


def job_plan(
    config: RunConfig,
    sources: ResolvedSources,
    merged_dir: Path,
    address: str | None = None,
    on_step: StepCallback | None = None,
    init: tuple[float, ...] | None = None,
) -> JobPlan:
    """The job for a validated config: calibration sets tokenised as the in-process stage does. With `init`, a
    merge coefficients' fit from there (merged_dir is then the base); its run id is its own (`-coefficients`
    after a configured cluster.run_id), so it never resumes a corrections run, nor one from another start."""
    data = calibration_sets(config, sources.data, load_tokenizer(sources.base))
    cluster = config.cluster
    fit = None if init is None else {"fit": "coefficients", "init": list(init)}
    run_id = cluster.run_id and (cluster.run_id if fit is None else f"{cluster.run_id}-coefficients")
    return JobPlan(
        data=data,
        experts=dict(sources.experts),
        merged_dir=Path(merged_dir).absolute(),
        settings=config.calibration,
        cluster=cluster,
        run_id=run_id or default_run_id(config, merged_dir, data, fit),
        storage_path=cluster.storage_path or str((config.run_dir / "ray-train").absolute()),
        address=address or cluster.address or os.environ.get("RAY_ADDRESS"),
        on_step=on_step,
        fit="corrections" if init is None else "coefficients",
        init=tuple(init or ()),
        router_tasks=tuple(router_tasks(data, sources)),
    )


def entropy_features(task: str, index: int, data: TokenizedSet, entropy: Mapping[int, np.ndarray]) -> TaskFeatures:
    """A task's calibration set with the entropies the experts streamed (no hidden states)."""
    values = np.zeros(tuple(data.input_ids.shape), dtype=np.float32)
    for row, h in entropy.items():
        values[row, : len(h)] = h
    return TaskFeatures(task=task, task_index=index, input_ids=data.input_ids, attention_mask=data.attention_mask,
                        response_mask=data.response_mask, positions=mask_positions(data.attention_mask),
                        entropy=torch.from_numpy(values), targets={})


def summary(job: JobResult) -> str:
    """The job's progress in one line: rows streamed, steps, loss, rows/s, where the seconds went."""
    if job.resumed_from == len(job.losses):
        trained = "corrections" if job.corrections is not None else "coefficients"
        return (f"this run had finished: its {trained} after {len(job.losses)} steps are reused "
                "(set cluster.run_id to start a new run)")
    rows = int(job.stream["rows"])
    seconds = ", ".join(f"{name} {value:.1f}" for name, value in job.timings.items())
    return (f"{rows} rows streamed ({rows / job.timings['stream']:.1f} rows/s), {len(job.losses)} steps, "
            f"loss {job.losses[0]:.4f} -> {job.losses[-1]:.4f}; seconds: {seconds}")


def calibrate_distributed(
    config: RunConfig,
    sources: ResolvedSources,
    merged_dir: Path,
    address: str | None = None,
    on_step: StepCallback | None = None,
) -> CalibrationOutcome:
    """The calibrate stage as a Ray job; saves RUN_DIR/corrections.safetensors like the in-process stage."""
    plan = job_plan(config, sources, merged_dir, address, on_step)
    cluster = config.cluster
    logger.info("calibrate: Ray run %s (%d worker(s), ZeRO-%d), checkpoints in %s", plan.run_id,
                cluster.num_workers, cluster.zero_stage, plan.storage_path)
    job = run_calibration_job(plan)
    logger.info("calibrate: %s", summary(job))
    tags = placement_tags(job.placement)
    logger.info("calibrate: placement: %s", "; ".join(f"{key.removeprefix('darts.placement.')} on {node}"
                                                      for key, node in tags.items()))
    path = save_corrections_for(config.run_dir / CORRECTIONS_FILE, job.corrections, merged_dir)
    weights = {
        task: token_weights(entropy_features(task, index, plan.data[task], job.entropy[task]), config.calibration)
        for index, task in enumerate(plan.data)
    }
    result = CalibrationResult(corrections=job.corrections, losses=job.losses, seconds=job.timings["train"])
    details = {"run_id": plan.run_id, "checkpoint_path": job.checkpoint_path, "resumed_from": job.resumed_from,
               "placement": job.placement, "memory": job.memory,
               "stream": {**job.stream, "object_store_peak_bytes": job.object_store_peak_bytes},
               "seconds": job.timings}
    prompts = {task: torch.from_numpy(np.stack([by_row[row] for row in sorted(by_row)]))
               for task, by_row in job.prompt_features.items()}
    where = job.placement  # a run resumed from a checkpoint of an older darts-dist has no compute record
    compute = {f"expert actor ({task})": ", ".join(how) for task, how in where.get("expert_compute", {}).items()}
    if where.get("worker_compute"):
        compute["calibration worker"] = ", ".join(sorted(set(where["worker_compute"])))
    return CalibrationOutcome(corrections_path=path, result=result, entropy_weights=weights, job=details,
                              prompt_features=prompts, compute=compute)


def fit_coefficients_distributed(
    config: RunConfig, sources: ResolvedSources, address: str | None = None, on_step: StepCallback | None = None,
) -> CoefficientFit:
    """The merge coefficients' fit as a Ray job: the experts stream their hidden states at the fit's layers into
    DeepSpeed workers that hold the base and the task vectors (ZeRO-3 partitions the task vectors) and step the
    coefficients on the same schedule as the in-process fit."""
    settings = config.calibration
    coefficients = settings.coefficients
    layers = fit_layers(coefficients.layers, read_model_info(sources.base).num_layers)
    # The job's own settings: the stream carries every fit layer, the steps and learning rate are the fit's.
    job_settings = updated(settings, layers=layers, loss_at="every", steps=coefficients.steps,
                           learning_rate=coefficients.learning_rate, weight_decay=0.0)
    plan = job_plan(updated(config, calibration=job_settings), sources, sources.base, address, on_step,
                    init=tuple(initial_coefficients(config)))
    logger.info("merge coefficients: Ray run %s (%d worker(s), ZeRO-%d)", plan.run_id, config.cluster.num_workers,
                config.cluster.zero_stage)
    job = run_calibration_job(plan)
    logger.info("merge coefficients: %s", summary(job))
    meta = job.coefficient_meta
    return CoefficientFit(job.coefficients, tuple(meta["experts"]), tuple(meta["changed"]), job.losses,
                          job.timings["train"], list(coefficients.layers),
                          {e: [parse_layer(k) for k in ks] for e, ks in meta["owned"].items()},
                          meta.get("task_vector_bytes", 0))
