"""The Ray Train calibration worker: the frozen merged model and its corrections (or the frozen base, the
experts' task vectors and the merge coefficients), trained with DeepSpeed.

`train_worker` reads like single-process training: load the merged model, hook in the
corrections, drain this worker's shard of every expert's stream into a feature store (each row's
merged forward runs here once), then run the in-process reference's step schedule through a
DeepSpeed engine, checkpointing what it trains (corrections, or coefficients) and the optimizer state
every `checkpoint_every` steps.
"""

from __future__ import annotations

import itertools
import json
import logging
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import deepspeed
import numpy as np
import ray.train
import ray.train.torch
import torch
import torch.distributed as dist
from ray.actor import ActorHandle
from torch import nn

from darts_dist.calibrate.coefficients import CoefficientModule, read_task_vectors
from darts_dist.calibrate.features import TaskFeatures
from darts_dist.calibrate.loop import StepCallback, build_corrections, calibration_loss, step_minibatches
from darts_dist.calibrate.ray.checkpoint_state import PROGRESS_FILE, TrainState, write_manifest
from darts_dist.calibrate.ray.feature_store import FeatureStore
from darts_dist.calibrate.ray.stream import TOP_FIELDS, Batch, stored_tokens, target_column, to_wire, token_column
from darts_dist.config import CalibrationSection
from darts_dist.core import (
    DartsCorrections,
    LayerKey,
    attach_corrections,
    features_only,
    first_decoder_layer,
    mask_positions,
    merged_hidden,
    row_prompt_features,
    save_corrections,
)
from darts_dist.errors import DartsError
from darts_dist.logs import progress_interval, show_progress_logs
from darts_dist.memory import PeakMemory
from darts_dist.ray_cluster.cpu_share import ForwardTurn, cpu_share, node_cores, take_share, training_threads
from darts_dist.ray_cluster.placement import gpu_ids
from darts_dist.sources.models import load_causal_lm, model_compute, model_dtype

logger = logging.getLogger(__name__)
ENGINE_TAG = "engine"  # DeepSpeed's folder inside each checkpoint
CHECKPOINT_CORRECTIONS = "corrections.safetensors"  # the whole corrections, gathered (rank 0)
FAIL_WORKER_AT_STEP = "DARTS_DIST_FAIL_WORKER_AT_STEP"  # read by the driver, which passes it on


def rows_file(rank: int) -> str:
    """Per worker: the entropy H_t of every row it trained on, keyed "task/row" (so its row ids too)."""
    return f"rows-{rank}.npz"


def prompts_file(rank: int) -> str:
    """Per worker: the router's features of its rows' prompts (core.row_prompt_features), keyed
    "task/row"."""
    return f"prompts-{rank}.npz"


def merged_column(layer: object) -> str:
    return f"merged.{layer}"


START_COLUMN = "merged.start"  # through the model: the merged hidden states entering the lowest corrected layer


class CalibrationModule(nn.Module):
    """The frozen merged model and the trainable corrections as one module: DeepSpeed sees both, and
    ZeRO-3 partitions both. Its forward is one step's loss, Σ over tasks of `calibration_loss`."""

    def __init__(self, merged: nn.Module, corrections: DartsCorrections, settings: CalibrationSection) -> None:
        super().__init__()
        self.merged = merged
        self.corrections = corrections
        self.settings = settings
        self.handle = None

    def attach(self) -> None:
        """Hook the corrections into the merged model, for multi-layer surgery.

        Called after deepspeed.initialize: hooks run in the order they were registered, and ZeRO-3's
        own hook on a module marks its output for re-gathering the module's weights in backward;
        the corrections must see (and record) that marked output, or backward through the final
        norm finds its weight still partitioned.
        """
        if not features_only(self.corrections.layer_keys):
            self.handle = attach_corrections(self.merged, self.corrections)
            self.handle.record = True

    def trained(self) -> list[nn.Parameter]:
        return list(self.corrections.parameters())

    def save_trained(self, folder: Path) -> None:
        save_corrections(folder / CHECKPOINT_CORRECTIONS, self.corrections)

    def forward(self, minibatches: Sequence[tuple[str, dict[str, object]]]) -> torch.Tensor:
        device = next(self.corrections.parameters()).device
        tasks = self.corrections.spec.tasks
        loss = torch.zeros((), device=device)
        for task, rows in minibatches:
            loss = loss + calibration_loss(
                self.corrections,
                rows,
                tasks.index(task),
                self.settings.beta_for(task),
                self.settings.weight_on_for(task),
                merged_model=None if self.handle is None else self.merged,
                handle=self.handle,
                logit_weight=self.settings.logit_weight,
                head=self.merged.get_output_embeddings(),
            )
        return loss


def deepspeed_config(settings: CalibrationSection, zero_stage: int) -> dict[str, object]:
    """Plain fp32 ZeRO stepping exactly as the reference loop does: torch's own Adam, L2 weight decay, no clipping."""
    return {
        "train_micro_batch_size_per_gpu": settings.batch_size,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,  # DeepSpeed clips to norm 1.0 unless told; the reference does not clip
        "zero_optimization": {"stage": zero_stage},
        "optimizer": {
            "type": "Adam",
            "params": {
                "lr": settings.learning_rate,
                "weight_decay": settings.weight_decay,
                "torch_adam": True,
                "adam_w_mode": False,
            },
        },
        "steps_per_print": 1 << 30,
    }


class Progress:
    """Rank 0's progress lines, at most one every `interval` seconds (the driver's console's rate) unless forced."""

    def __init__(self, enabled: bool, interval: float | None = None) -> None:
        self.enabled = enabled
        self.interval = progress_interval() if interval is None else interval
        self.last = 0.0

    def __call__(self, message: str, force: bool = False) -> None:
        now = time.monotonic()
        if self.enabled and (force or now - self.last >= self.interval):
            self.last = now
            logger.info("calibrate: %s", message)


@dataclass
class RouterFeatures:
    """The router's prompt features of this worker's rows of `tasks` (those with a prompt/response boundary),
    pooled at `layer` from the merged forwards the stream runs anyway; keyed "task/row" for the checkpoint."""

    layer: object
    tasks: Sequence[str]
    pooled: dict[str, np.ndarray] = field(default_factory=dict)

    def add(self, task: str, rows: Sequence[int], pooled: torch.Tensor, has_prompt: torch.Tensor) -> None:
        for row, vector in zip((r for r, kept in zip(rows, has_prompt.tolist()) if kept), pooled.numpy()):
            self.pooled[f"{task}/{int(row)}"] = vector


def first_noted(items: Iterator[tuple[str, dict[str, np.ndarray]]], tasks: int, profile: dict[str, float],
                since: float) -> Iterator:
    """(task, batch) `items` of `tasks` tasks, with profile["first_rows_seconds"] the seconds from `since` until every
    task's first batch had come (the stream's fixed start: each expert loading its model and running its first
    batch) and profile["steady_tokens"] the tokens that came after (at the stream's steady rate: what further rows
    cost)."""
    seen: set[str] = set()
    profile.update(first_rows_seconds=0.0, steady_tokens=0)
    for task, batch in items:
        if len(seen) == tasks:
            profile["steady_tokens"] += sum(len(ids) for ids in batch["input_ids"])
        elif task not in seen:
            seen.add(task)
            profile["first_rows_seconds"] = time.time() - since
        yield task, batch


def in_lockstep(items: Iterator, device: torch.device) -> Iterator:
    """Every item, then None until all ranks are done: ZeRO-3 gathers weights with collectives, so
    every rank must run as many forwards as the rank with the most batches."""
    more = torch.zeros(1, device=device)
    for item in itertools.chain(items, itertools.repeat(None)):
        more.fill_(item is not None)
        dist.all_reduce(more, op=dist.ReduceOp.MAX)
        if not more.item():
            return
        yield item


def drain(
    batches: Iterator[tuple[str, dict[str, np.ndarray]]],
    merged_model: nn.Module | None,
    device: torch.device,
    store: FeatureStore,
    settings: CalibrationSection,
    lockstep: bool,
    log: Progress,
    expert_nodes: dict[str, set[tuple[str, str]]],
    expert_memory: dict[str, int],
    expert_compute: dict[str, set[str]],
    turn: ForwardTurn | None = None,
    router: RouterFeatures | None = None,
    window: ActorHandle | None = None,
) -> int:
    """Keep this worker's rows of every task in `store`; returns the bytes of hidden states received.
    `expert_nodes` gets, per task, the (node, GPU ids) its expert actors ran on, `expert_memory` the most memory
    one of them held (darts_dist.memory), `expert_compute` their devices and dtypes (sources.models.compute_label).

    In feature mode the merged model runs here once per row, so training steps need no model at all; through
    the model, it runs once per row and each row keeps the hidden states entering the lowest corrected layer
    (START_COLUMN), so steps run the layers from there on (not under ZeRO-3, whose weight gathering follows the module order).
    Without a merged model (the merge coefficients' fit) rows are kept as they come. The merged forwards take
    `turn` (a CPU node's turns with the expert actors), and pool the router's prompt features into `router`.
    A batch leaves the stream's `window` once kept: until then it is in the object store (its arrays are views
    into it), whether Ray Data still holds it or it waits here, prefetched or queued by the fan-in.
    """
    turn = turn or ForwardTurn(enabled=False)
    with_merged = merged_model is not None and features_only(settings.layers)
    start = 0 if lockstep or merged_model is None else first_decoder_layer(settings.layers)
    if lockstep and with_merged:
        batches = in_lockstep(batches, device)
    kept_layers = list(settings.layers) if with_merged else [start - 1] if start else []
    captured = list(dict.fromkeys(kept_layers + ([router.layer] if router is not None else [])))
    received = rows = 0
    started = time.perf_counter()
    for item in batches:
        if item is None:  # this rank is done, others are not: a one-token forward keeps gathers in step
            merged_hidden(merged_model, torch.ones(1, 1, dtype=torch.long, device=device),
                          torch.ones(1, 1, dtype=torch.long, device=device), captured)
            continue
        task, batch = item
        merged = _merged_forward(merged_model, task, batch, device, captured, turn, router) if kept_layers else {}
        # The merged states are kept in the dtype the targets travelled in: the store holds every hidden state at
        # the wire's width, and training upcasts a minibatch at a time.
        wire = _wire_name(batch[target_column(settings.loss_layers()[0])][0].dtype)
        kept = {merged_column(layer) if with_merged else START_COLUMN: to_wire(merged[layer], wire)
                for layer in kept_layers}
        received += _keep_rows(store, task, batch, kept, settings)
        if window is not None:
            window.leave.remote(task, [int(row) for row in batch["row"]])
        rows += len(batch["row"])
        expert_nodes.setdefault(task, set()).update(zip(batch["node"], batch["gpus"]))
        expert_memory[task] = max(expert_memory.get(task, 0), int(np.max(batch["memory"])))
        expert_compute.setdefault(task, set()).update(batch["compute"])
        log(f"streamed {rows} rows ({rows / (time.perf_counter() - started):.1f} rows/s)")
    log(f"streamed {rows} rows in {time.perf_counter() - started:.1f} s", force=True)
    return received


def _merged_forward(
    model: nn.Module, task: str, batch: dict[str, np.ndarray], device: torch.device, layers: list[LayerKey],
    turn: ForwardTurn, router: RouterFeatures | None,
) -> dict[LayerKey, torch.Tensor]:
    """The merged model's states of a streamed batch at `layers` (in the node's turn), the router's prompt
    features of its rows pooled on the way."""
    ids, mask = (token_column(batch[name]).to(device) for name in ("input_ids", "attention_mask"))
    with turn:
        merged = merged_hidden(model, ids, mask, layers)
    if router is not None and task in router.tasks:
        router.add(task, batch["row"], *row_prompt_features(merged[router.layer], mask,
                                                           token_column(batch["response_mask"])))
    return merged


def _keep_rows(store: FeatureStore, task: str, batch: dict[str, np.ndarray], kept: dict[str, torch.Tensor],
               settings: CalibrationSection) -> int:
    """Put each row of a streamed batch in the store, with the merged states `kept` (by column, [B, L, d]) cut to
    its length; returns the bytes of the expert's hidden states the batch brought."""
    received = 0
    for i, row in enumerate(batch["row"]):
        length = len(batch["input_ids"][i])
        arrays = {**stored_tokens(batch, i), "entropy": batch["entropy"][i],
                  **{name: batch[name][i] for name in TOP_FIELDS if name in batch}}
        for layer in settings.loss_layers():
            received += batch[target_column(layer)][i].nbytes
            arrays[target_column(layer)] = batch[target_column(layer)][i]
        for column, states in kept.items():
            arrays[column] = states[i, :length]
        store.add(task, int(row), arrays)
    return received


def _wire_name(dtype: np.dtype) -> str:
    """The wire dtype's name of an array of hidden states as they travel (bf16 as uint16 bits)."""
    return "bfloat16" if dtype == np.uint16 else np.dtype(dtype).name


def task_features(store: FeatureStore, task: str, index: int, settings: CalibrationSection) -> TaskFeatures:
    """One task's stored rows as the reference loop's TaskFeatures: the per-token fields padded in memory, the
    hidden states as the store's `Ragged` rows (memory-mapped where they spilled), padded and upcast per minibatch."""
    arrays = store.arrays(task)
    dense = {name: torch.from_numpy(arrays.pop(name).padded())
             for name in ("input_ids", "attention_mask", "response_mask", "entropy")}
    mask = dense["attention_mask"]
    return TaskFeatures(
        task=task,
        task_index=index,
        input_ids=dense["input_ids"],
        attention_mask=mask,
        response_mask=dense["response_mask"],
        positions=mask_positions(mask),
        entropy=dense["entropy"],
        targets={layer: arrays[target_column(layer)] for layer in settings.loss_layers()},
        merged={layer: arrays[merged_column(layer)] for layer in settings.layers if merged_column(layer) in arrays},
        start_hidden=arrays.get(START_COLUMN),
        # Kept as stored, as the hidden states are: k values a token is far more than the per-token fields above.
        **{name: arrays[name] for name in TOP_FIELDS if name in arrays},
    )


def training_module(config: Mapping[str, object], tasks: Sequence[str], device: torch.device) -> nn.Module:
    """What the worker trains: the merged model (frozen) with fresh corrections, or, for the merge coefficients'
    fit (config["fit"] == "coefficients"), the base (frozen) with the experts' task vectors and coefficients."""
    settings: CalibrationSection = config["settings"]
    dtype = model_dtype(settings.dtype, device)
    if config.get("fit") == "coefficients":
        base = load_causal_lm(Path(config["base_dir"]), dtype=dtype, device=device)
        vectors = read_task_vectors(Path(config["base_dir"]), {t: Path(p) for t, p in config["experts"].items()})
        module = CoefficientModule(base, vectors, config["init"], settings)  # on the CPU so far
        if config["zero_stage"] == 3:
            # Partitioned tensor by tensor as each moves to the device: a rank's GPU holds its share of the task
            # vectors, never all of them at once (3 experts' in fp32 are 81 GB at 7B). DeepSpeed then leaves the
            # placement as it is.
            deepspeed.zero.Init(module=module, config_dict_or_path=deepspeed_config(settings, 3))
            return module
        return module.to(device)
    merged = load_causal_lm(Path(config["merged_dir"]), dtype=dtype, device=device)
    torch.manual_seed(settings.seed)  # the reference loop's initial corrections
    corrections = build_corrections(tasks, merged.config.hidden_size, settings).to(device)
    return CalibrationModule(merged, corrections, settings)


def frozen_model(module: nn.Module) -> nn.Module:
    """The frozen model a training module computes with: the merged model (corrections), or the base (merge
    coefficients)."""
    return module.merged if isinstance(module, CalibrationModule) else module.base


def worker_device() -> torch.device:
    """The GPU Ray Train gave this rank, or the CPU where its GPU resource has no CUDA device behind it (a CPU
    machine whose Ray node was started with GPUs it has not: the job warned on the driver)."""
    return ray.train.torch.get_device() if torch.cuda.is_available() else torch.device("cpu")


def build_engine(config: Mapping[str, object], tasks: Sequence[str], checkpoint: ray.train.Checkpoint | None):
    """The training module in a DeepSpeed engine; the checkpoint's state if given."""
    settings: CalibrationSection = config["settings"]
    device = worker_device()
    if device.type == "cpu":
        # On CPU DeepSpeed JIT-compiles a shared-memory allreduce when its communication backend starts: 35-40 s of
        # C++ on 2 cores in every fresh environment (and a compiler on every node), for nothing here, since gloo's
        # allreduce is ample for correction-sized gradients. Before training_module: ZeRO-3's zero.Init of the
        # coefficients' fit starts that backend.
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    module = training_module(config, tasks, device)
    engine, *_ = deepspeed.initialize(model=module, model_parameters=module.trained(),
                                      config=deepspeed_config(settings, config["zero_stage"]))
    if isinstance(engine.module, CalibrationModule):
        engine.module.attach()
    if checkpoint is not None:
        with checkpoint.as_directory() as folder:
            # Frozen weights are not in checkpoints (they are the merged model's): load non-strictly.
            engine.load_checkpoint(folder, tag=ENGINE_TAG, load_module_strict=False)
    return engine


def row_entropies(features: Sequence[TaskFeatures], row_ids: Mapping[str, Sequence[int]]) -> dict[str, np.ndarray]:
    """Each row's H_t over its real tokens, keyed "task/row": the driver's record of what trained where."""
    out = {}
    for task in features:
        lengths = task.attention_mask.sum(dim=1).tolist()
        for i, (row, length) in enumerate(zip(row_ids[task.task], lengths)):
            out[f"{task.task}/{row}"] = task.entropy[i, :length].numpy().copy()
    return out


def reduce_over_ranks(values: Sequence[float], device: torch.device, op: str = "mean") -> list[float]:
    """A few numbers reduced over all ranks: their mean, sum or max."""
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)  # gloo has no AVG
    if op == "mean":
        tensor /= dist.get_world_size()
    return tensor.tolist()


def save_checkpoint(
    engine: deepspeed.DeepSpeedEngine, state: TrainState, records: Mapping[str, Mapping[str, np.ndarray]],
    progress: dict,
) -> None:
    """Every rank: DeepSpeed's state (its own optimizer partition) and its rows' records (file name -> arrays);
    rank 0 also the whole trained parameters (corrections or merge coefficients) and the progress. Ray Train
    merges the ranks' folders into one checkpoint."""
    rank = dist.get_rank()
    with tempfile.TemporaryDirectory(prefix="darts-checkpoint-") as folder:
        engine.save_checkpoint(folder, tag=ENGINE_TAG, exclude_frozen_parameters=True)
        with deepspeed.zero.GatheredParameters(engine.module.trained()):
            if rank == 0:
                engine.module.save_trained(Path(folder))
        if rank == 0:
            progress = {**progress, "step": state.step, "losses": state.losses, "resumed_from": state.resumed_from}
            (Path(folder) / PROGRESS_FILE).write_text(json.dumps(progress))
        for name, arrays in records.items():
            np.savez(Path(folder) / name, **arrays)
        write_manifest(Path(folder), rank)  # last: every file this rank wrote
        metrics = {"step": state.step, "loss": state.losses[-1]}
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(folder))


def placement(expert_nodes: Mapping[str, set[tuple[str, str]]], expert_compute: Mapping[str, set[str]],
              worker_compute: str) -> dict[str, object]:
    """Which node and GPUs ran what, and how, gathered from every rank: each rank's node, GPU ids and device and
    dtype, and each task's expert nodes, GPU ids ("" without a GPU; Ray's ids, unique on a node) and devices and
    dtypes."""
    gathered = gather((ray.get_runtime_context().get_node_id(), gpu_ids(), worker_compute), expert_nodes,
                      expert_compute)
    experts: dict[str, set[tuple[str, str]]] = {}
    computes: dict[str, set[str]] = {}
    for _, nodes, compute in gathered:
        for task, where in nodes.items():
            experts.setdefault(task, set()).update(where)
        for task, how in compute.items():
            computes.setdefault(task, set()).update(how)
    return {"workers": [node for (node, _, _), *_ in gathered], "worker_gpus": [gpus for (_, gpus, _), *_ in gathered],
            "worker_compute": [how for (_, _, how), *_ in gathered],
            "experts": {task: sorted({node for node, _ in where}) for task, where in experts.items()},
            "expert_gpus": {task: sorted({f"{node}:{gpus}" for node, gpus in where if gpus})
                            for task, where in experts.items()},
            "expert_compute": {task: sorted(how) for task, how in computes.items()}}


def gather(*values: object) -> list:
    """`values` of every rank, by rank."""
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, values)
    return gathered


def role_memory(worker: PeakMemory, expert_memory: Mapping[str, int]) -> dict[str, object]:
    """The most memory each rank's work and each task's expert actor held, gathered from every rank, and the
    workers' device ("cuda": torch's peak allocation on the GPU; "cpu": resident memory)."""
    gathered = gather(worker.peak(), dict(expert_memory))
    experts: dict[str, int] = {}
    for _, seen in gathered:
        for task, peak in seen.items():
            experts[task] = max(experts.get(task, 0), peak)
    return {"device": worker.device.type, "workers": [peak for peak, _ in gathered], "experts": experts}


def train_worker(config: dict, checkpoint: ray.train.Checkpoint | None, state: TrainState,
                 stream: Iterator[tuple[str, Batch]] | None, started: float) -> None:
    """One calibration worker (`train_entry.train_loop_per_worker` started its experts' `stream`, None when the
    run is finished): Ray Train runs it on every rank, and again from the last checkpoint after a failure."""
    settings: CalibrationSection = config["settings"]
    tasks: list[str] = config["tasks"]
    rank = ray.train.get_context().get_world_rank()
    log = Progress(enabled=rank == 0)
    show_progress_logs()  # this worker's own process: its lines reach the driver's console through Ray
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    if stream is None:
        log(f"this run finished at step {state.step}: nothing left to do", force=True)
        return
    memory = PeakMemory(worker_device())  # this rank's work, from before it loads the merged model
    engine = build_engine(config, tasks, checkpoint)
    if state.resumed_from is not None:
        log(f"resuming from the checkpoint at step {state.step}", force=True)
    device = worker_device()
    turn = None
    if device.type == "cpu":
        # ZeRO-3's forwards gather weights from the other ranks: a rank waiting for its turn while a rank on
        # the same node holds it would never get it, so ZeRO-3 workers run concurrently, with their share.
        schedule, actors = config["cpu"]
        turn = take_share(cpu_share("concurrent" if config["zero_stage"] == 3 else schedule, actors, node_cores()))
    timings = {"worker_start": started, "setup": time.time() - started}
    with tempfile.TemporaryDirectory(prefix="darts-features-") as spill_dir:
        store = FeatureStore(tasks, settings.max_length, config["feature_memory_mb"] << 20, Path(spill_dir))
        expert_nodes: dict[str, set[tuple[str, str]]] = {}
        expert_memory: dict[str, int] = {}
        expert_compute: dict[str, set[str]] = {}
        merged_model = engine.module.merged if isinstance(engine.module, CalibrationModule) else None
        router = RouterFeatures(**config["router"]) if config.get("router") else None
        profile: dict[str, float] = {}
        received = drain(first_noted(stream, len(tasks), profile, time.time()), merged_model, device, store, settings,
                         lockstep=config["zero_stage"] == 3, log=log,
                         expert_nodes=expert_nodes, expert_memory=expert_memory, expert_compute=expert_compute, turn=turn,
                         router=router, window=config.get("window"))
        row_ids = {task: store.row_ids(task) for task in tasks}
        missing = [task for task, ids in row_ids.items() if not ids]
        if missing:
            raise DartsError(f"calibration worker {rank} received no rows of tasks {missing}",
                             "use fewer workers (cluster.num_workers) or more calibration samples per task")
        features = [task_features(store, task, index, settings) for index, task in enumerate(tasks)]
        rows, spilled, received = reduce_over_ranks(
            [sum(map(len, row_ids.values())), store.spilled_bytes, received], device, "sum")
        stream_stats = {"rows": rows, "bytes": received, "spilled_bytes": spilled,
                        "peak_memory_bytes": reduce_over_ranks([store.peak_memory_bytes], device, "max")[0],
                        **profile}  # rank 0's start and steady tokens
        timings["stream"] = time.time() - started - timings["setup"]
        progress = {"timings": timings, "stream": stream_stats,
                    "placement": placement(expert_nodes, expert_compute, model_compute(frozen_model(engine.module)))}
        if isinstance(engine.module, CoefficientModule):  # what the driver needs to write the learned merge
            merge = engine.module.merge
            progress["coefficients"] = {"experts": list(merge.experts), "task_vector_bytes": merge.task_vector_bytes,
                                        "changed": list(merge.names),
                                        "owned": {e: [str(k) for k in ks] for e, ks in engine.module.owned.items()}}
        if device.type == "cpu":
            torch.set_num_threads(training_threads(ray.train.get_context().get_local_world_size(), node_cores()))
        records = {rows_file(rank): row_entropies(features, row_ids)}
        if router is not None:
            records[prompts_file(rank)] = router.pooled
        train_steps(engine, features, state, config, records, progress, log,
                    measure=lambda: role_memory(memory, expert_memory))


def train_steps(
    engine: deepspeed.DeepSpeedEngine,
    features: Sequence[TaskFeatures],
    state: TrainState,
    config: Mapping[str, object],
    records: Mapping[str, Mapping[str, np.ndarray]],
    progress: dict,
    log: Progress,
    measure: Callable[[], dict[str, object]],
) -> None:
    """The reference loop's schedule, through DeepSpeed, from `state.step`, checkpointing on the way; each
    checkpoint's progress has the roles' peak memory so far (`measure`, every rank takes part)."""
    settings: CalibrationSection = config["settings"]
    rank = dist.get_rank()
    generator = torch.Generator().manual_seed(settings.seed + rank)
    for _ in range(state.step):  # replay the schedule of the steps the checkpoint already holds
        step_minibatches(features, settings.batch_size, generator, settings.logit_samples())
    on_step: StepCallback | None = config["on_step"] if rank == 0 else None
    rows_per_step = settings.batch_size * len(features) * dist.get_world_size()
    device = worker_device()
    started = step_started = time.time()
    for step in range(state.step + 1, settings.steps + 1):
        if step == config["fail_at_step"] and state.resumed_from is None and rank == 0:
            raise RuntimeError(f"injected failure in step {step} ({FAIL_WORKER_AT_STEP})")
        # Each minibatch goes to the rank's device in the dtype the stream kept it in, upcast there.
        minibatches = [(task.task, task.rows(index, device, picks)) for task, index, picks
                       in step_minibatches(features, settings.batch_size, generator, settings.logit_samples())]
        loss = engine(minibatches)
        engine.backward(loss)
        engine.step()
        state.step = step
        state.losses.append(reduce_over_ranks([loss.item()], loss.device)[0] / len(features))
        log(f"step {step}/{settings.steps}, loss {state.losses[-1]:.4f}")
        if on_step is not None:
            now = time.time()
            on_step(step, {"loss": state.losses[-1], "rows_per_second": rows_per_step / (now - step_started)})
            step_started = now
        if step % config["checkpoint_every"] == 0 or step == settings.steps:
            if on_step is not None:  # the metrics of every checkpointed step are in the store
                on_step.flush()
            progress["timings"]["train"] = time.time() - started
            progress["memory"] = measure()
            save_checkpoint(engine, state, records, progress)
    log(f"step {state.step}/{settings.steps}, loss {state.losses[-1]:.4f}", force=True)
