"""Expert actors -> Ray Data rows -> the training workers' shards, with back-pressure all the way.

A row is one calibration sample, cut to its real length: `task`, `row` (its index in the task's
calibration set, so that "every row exactly once" can be checked), `node`, `gpus`, `memory` and `compute` (the
Ray node of the expert actor that made it, its GPU ids, its peak memory so far, its device and dtype), `input_ids`,
`attention_mask`, `response_mask`, `entropy` (H_t, fp32: one scalar per token) and
`target.<layer>` (h^k at each layer the loss reads: `CalibrationSection.loss_layers`), and with a logit term
`top_log_p` and `top_ids` (`TOP_FIELDS`). Hidden states travel in
`calibration.wire_dtype` (`CalibrationSection.wire_dtype_for`: the compute dtype, bf16 for fp32 CPU experts of wide models;
bf16, which numpy lacks, as its raw 16 bits), cast on the expert's device and copied off a GPU through pinned memory.

Imports stay light at the top: Ray Data and Ray Train unpickle `ExpertStream` and `ExactlyOnceSplit`
in their controller and coordinator processes, which never run a model, and torch plus
transformers would cost each of those processes seconds. The expert actor imports them itself.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import ray
import ray.data
import ray.train
from ray.actor import ActorHandle

from darts_dist.config import CalibrationSection, ClusterSection, CpuSchedule
from darts_dist.fanin import fan_in
from darts_dist.memory import PeakMemory
from darts_dist.ray_cluster.cpu_share import ForwardTurn, cpu_share, node_cores, take_share
from darts_dist.ray_cluster.placement import expert_actor_options, gpu_ids
from darts_dist.torch_thread import TorchThread

if TYPE_CHECKING:
    import torch

    from darts_dist.core import LayerKey, TokenizedSet

TOKEN_FIELDS = ("input_ids", "attention_mask", "response_mask")
# Token rows travel compact, 6 bytes a token instead of TokenizedSet's 17: the source holds every row in the
# object store for the whole stream, so they are what grows there with the data. `token_column` and
# `stored_tokens` widen them again.
WIRE_DTYPES = {"input_ids": np.int32, "attention_mask": np.bool_, "response_mask": np.bool_}
STORED_DTYPES = {"input_ids": np.int64, "attention_mask": np.int64, "response_mask": np.bool_}  # TokenizedSet's
Batch = dict[str, np.ndarray]  # a batch of rows as Ray Data hands it over: one array per column
# The logit term's columns ([L, k] a row): the expert's likeliest next tokens' log-probabilities (fp32) and ids (int32).
TOP_FIELDS = ("top_log_p", "top_ids")


def target_column(layer: LayerKey) -> str:
    """The column holding h^k at one surgery layer."""
    return f"target.{layer}"


def source_rows(data: TokenizedSet) -> list[dict[str, object]]:
    """One item per sample of a task's calibration set, cut to its real length, for `ray.data.from_items`."""
    lengths = data.attention_mask.sum(dim=1).tolist()
    return [
        {
            "task": data.task,
            "row": row,
            **{name: getattr(data, name)[row, :length].numpy().astype(WIRE_DTYPES[name]) for name in TOKEN_FIELDS},
        }
        for row, length in enumerate(lengths)
    ]


def token_column(column: Sequence[np.ndarray]) -> torch.Tensor:
    """A batch's token rows as the models read them: right-padded, int64 [B, max length]."""
    from darts_dist.core import pad_rows

    return pad_rows(column).long()


def stored_tokens(batch: Batch, i: int) -> dict[str, np.ndarray]:
    """Row i's token fields as the workers keep them (in TokenizedSet's dtypes)."""
    return {name: np.asarray(batch[name][i], dtype=STORED_DTYPES[name]) for name in TOKEN_FIELDS}


def to_wire(values: torch.Tensor, dtype: str) -> np.ndarray:
    """Hidden states as they travel: cast to `dtype` where they are (rounded to nearest), then on the host.

    Off a GPU through pinned memory with a non-blocking copy (pageable memory would be staged through a pinned
    buffer of the driver's anyway, at half the bandwidth). bf16 travels as its raw 16 bits (uint16).
    """
    import torch

    values = values.detach().to(getattr(torch, dtype))
    if values.is_cuda:
        host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
        host.copy_(values, non_blocking=True)
        torch.cuda.current_stream(values.device).synchronize()
        values = host
    values = values.contiguous()
    return values.view(torch.uint16).numpy() if dtype == "bfloat16" else values.numpy()


def _ragged(batch: np.ndarray, lengths: Sequence[int]) -> np.ndarray:
    """Per-sample arrays cut to each sample's length (an object array, so Ray Data keeps them ragged)."""
    out = np.empty(len(lengths), dtype=object)
    for i, length in enumerate(lengths):
        out[i] = batch[i, :length]
    return out


class ExpertStream:
    """The Ray Data actor of one expert: loads the expert once and turns its task's samples into rows."""

    def __init__(
        self,
        model_path: str,
        layers: Sequence[LayerKey],
        dtype: str,
        device: str,
        fail_after_batches: int | None = None,
        cpu: tuple[CpuSchedule, int] | None = None,
        window: ActorHandle | None = None,
        wire_dtype: str = "auto",
        top_k: int = 0,
    ) -> None:
        from darts_dist.logs import show_progress_logs

        show_progress_logs()  # this actor's own process: its lines reach the driver's console through Ray
        self.torch = TorchThread("expert")  # Ray calls __call__ from another thread than this constructor's
        self.torch.run(self._load, model_path, dtype, device, cpu, wire_dtype)
        self.layers = list(layers)
        self.top_k = top_k  # the logit term's targets: this many likeliest next tokens a position (0: none)
        self.fail_after_batches = fail_after_batches
        self.window = window  # the job's StreamWindow: a batch waits until its tokens fit in its task's window
        self.batches = 0
        # Each row says where it was made. Outside Ray (the actor's class used directly) there is no
        # node, and asking the runtime context for one would start a Ray session as a side effect.
        self.node = ray.get_runtime_context().get_node_id() if ray.is_initialized() else "local"
        self.gpus = gpu_ids() if ray.is_initialized() else ""

    def _load(self, model_path: str, dtype: str, device: str, cpu: tuple[CpuSchedule, int] | None,
              wire_dtype: str) -> None:
        from darts_dist.sources.models import load_causal_lm, model_compute, model_dtype, resolve_device

        # "auto" resolves inside the actor: one that Ray gave a GPU uses it, one without stays on the CPU.
        self.device = resolve_device(device)
        self.turn = ForwardTurn(enabled=False)
        if cpu is not None and self.device.type == "cpu":  # the job's schedule, model-running actors per node
            share = cpu_share(*cpu, node_cores())
            self.turn = take_share(share)
            if not share.turns:
                # All at once, experts yield to the training workers: those have as much forward work as
                # all the experts together (the merged model runs once on every row) and drain the
                # stream, so starving them only fills the object store.
                os.nice(19 - os.nice(0))
        self.dtype = model_dtype(dtype, self.device)
        self.memory = PeakMemory(self.device)  # what this actor's work holds, for the plan's comparison
        self.model = load_causal_lm(Path(model_path), dtype=self.dtype, device=self.device)
        self.compute = model_compute(self.model)
        self.wire_dtype = CalibrationSection(dtype=dtype, wire_dtype=wire_dtype).wire_dtype_for(
            self.model.config.hidden_size, on_gpu=self.device.type == "cuda")

    def __call__(self, batch: Batch) -> Batch:
        self._maybe_fail()
        lengths = [len(ids) for ids in batch["input_ids"]]
        if self.window is not None:
            ray.get(self.window.enter.remote(str(batch["task"][0]), [int(row) for row in batch["row"]], lengths))
        rows = {name: batch[name] for name in ("task", "row", *TOKEN_FIELDS)}
        rows["node"] = np.full(len(lengths), self.node, dtype=object)
        rows["gpus"] = np.full(len(lengths), self.gpus, dtype=object)
        rows.update(self.torch.run(self._targets, batch, lengths))
        self.batches += 1
        return rows

    def _targets(self, batch: Batch, lengths: list[int]) -> Batch:
        """The expert's columns of a batch: its entropy and hidden states, its memory and compute so far."""
        from darts_dist.calibrate.features import expert_targets

        ids = token_column(batch["input_ids"]).to(self.device)
        mask = token_column(batch["attention_mask"]).to(self.device)
        with self.turn:
            hidden, entropy, top = expert_targets(self.model, ids, mask, self.layers, self.top_k)
        rows = {"memory": np.full(len(lengths), self.memory.peak(), dtype=np.int64),
                "compute": np.full(len(lengths), self.compute, dtype=object),
                "entropy": _ragged(entropy.cpu().numpy(), lengths)}
        if top is not None:
            rows.update({name: _ragged(values.cpu().numpy(), lengths) for name, values in zip(TOP_FIELDS, top)})
        for layer in self.layers:
            rows[target_column(layer)] = _ragged(to_wire(hidden[layer], self.wire_dtype), lengths)
        return rows

    def _maybe_fail(self) -> None:
        # Fault injection for the restart test (DARTS_DIST_FAIL_EXPERT_AFTER): die hard, once, in the
        # actor's first life, as a lost node would; Ray restarts the actor and retries the batch.
        if self.fail_after_batches is None or self.batches < self.fail_after_batches:
            return
        if not ray.get_runtime_context().was_current_actor_reconstructed:
            os._exit(1)


def expert_stream(
    data: TokenizedSet,
    model_path: Path,
    settings: CalibrationSection,
    cluster: ClusterSection,
    fail_after_batches: int | None = None,
    actors_per_node: int = 1,
    window: ActorHandle | None = None,
) -> ray.data.Dataset:
    """The rows of one task: its samples, run through one actor that holds its expert.

    The actor runs batches of `settings.batch_size` samples, as the in-process reference does; on a CPU
    node it shares the cores by `cluster.cpu_schedule` with the node's other model-running actors (about
    `actors_per_node`; ray_cluster.cpu_share); with a `window` (calibrate.ray.window), each batch waits for
    room in its task's window of tokens in flight. Ray
    Data restarts a lost actor and retries the batches it lost (its defaults: max_restarts=-1,
    max_task_retries=-1; a batch that raises is not retried, it fails the run).
    """
    rows = source_rows(data)
    # One block per batch: a map task emits its output block when it ends, so a task of one batch sends its rows
    # on at once (many batches in one block would reach the workers together, and a window never).
    blocks = max(1, math.ceil(len(rows) / settings.batch_size))
    dataset = ray.data.from_items(rows, override_num_blocks=blocks).map_batches(
        ExpertStream,
        fn_constructor_kwargs={
            "model_path": str(model_path),
            "layers": settings.loss_layers(),
            "dtype": settings.dtype,
            "device": settings.device,
            "fail_after_batches": fail_after_batches,
            "cpu": (cluster.cpu_schedule, actors_per_node),
            "window": window,
            "wire_dtype": settings.wire_dtype,
            "top_k": settings.logit_targets(),
        },
        batch_size=settings.batch_size,
        compute=ray.data.ActorPoolStrategy(size=1),
        **expert_actor_options(cluster),
    )
    dataset.set_name(f"expert-{data.task}")
    # darts-dist prints its own progress; Ray Data's bars would interleave with it.
    dataset.context.enable_progress_bars = False
    return dataset


def arrivals(shards: Mapping[str, ray.data.DataIterator], batch_size: int) -> Iterator[tuple[str, Batch]]:
    """A worker's side of the stream: (task, batch) in the order the experts deliver them, every
    expert's shard pulled at once from the moment this is called (so the experts start while the
    caller does other work).

    A thread per shard: a shard's pipeline starts only when first pulled, so pulling them in turn
    would start the experts one after the other, and the slowest would hold up the rest.
    """
    return fan_in({task: shard.iter_batches(batch_size=batch_size, batch_format="numpy")
                   for task, shard in shards.items()})


class ExactlyOnceSplit(ray.train.DataConfig):
    """Split each expert's stream over the training workers so that every row reaches exactly one.

    Ray Train's default split (equal=True) drops the remainder rows to give every worker the same
    count. Without it, Ray Data hands each block to the worker that has the fewest rows so far, so
    workers still get about the same share of every task.
    """

    def configure(
        self,
        datasets: dict[str, ray.data.Dataset],
        world_size: int,
        worker_handles: list | None,
        worker_node_ids: list | None,
        **kwargs: object,
    ) -> list[dict[str, ray.data.DataIterator]]:
        shards: list[dict[str, ray.data.DataIterator]] = [{} for _ in range(world_size)]
        for name, dataset in datasets.items():
            dataset = dataset.copy(dataset)
            dataset.context.execution_options = self._resolve_execution_options(name)
            hints = worker_node_ids if self._enable_shard_locality else None
            for rank, shard in enumerate(dataset.streaming_split(world_size, equal=False, locality_hints=hints)):
                shards[rank][name] = shard
        return shards
