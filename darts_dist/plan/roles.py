"""What each Ray role of a run holds, in bytes, from the config and the models' shapes: RegMean's Gram actors, the
expert actors and training workers of calibration, the evaluation actors, the serving replicas, and the driver.

Estimates, on purpose simple: weights (parameters × the role's dtype), the forward's largest transient tensors
(logits B·S·V and, for NLL, their fp32 shifted copy and its log-softmax; the hidden states the loss reads; one
decoder layer's activations), the KV cache a generation may grow to, the worker's feature store (up to
`cluster.feature_memory_mb`, the rest spills to disk), Adam's state for the trained parameters (16 bytes each: fp32
value, gradient and two moments), and the driver's merge (mergekit maps every input's weight files and holds its
output shard). A role whose work runs in stages one after another (the driver's merge, then its router; an
evaluation actor's scoring passes, then its generation) holds its largest stage at its peak, not their sum.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from darts_dist.calibrate.layers import concrete_layers
from darts_dist.config import DataSpec, RunConfig, ServeSection, compute_dtype_name
from darts_dist.core import CorrectionSpec, expected_parameter_count
from darts_dist.errors import DartsError
from darts_dist.evaluate.on_ray import uses_ray
from darts_dist.evaluate.retention import RETENTION_ROW_TOKENS
from darts_dist.plan.shapes import ITEMSIZE, ModelShape
from darts_dist.ray_cluster.placement import Bundle, expert_bundle, worker_bundle
from darts_dist.sources.references import heldout_rows

TOKEN_ROW_BYTES = 17  # input ids and attention mask (int64) and the response mask (bool) of a token
ADAM_BYTES = 16  # per trained parameter: fp32 value, gradient, two moments
LONGEST_ANSWER = 192  # the longest answer a darts-dist scorer asks for (HumanEval's), when the config names none
MERGE_SHARD_BYTES = 5 * 10**9  # mergekit's default out_shard_size: the merge's output is held a shard at a time
MAPPED_INPUTS = "mapped inputs"  # weight files mapped and read once: page cache the system drops under pressure


@dataclass(frozen=True)
class Role:
    name: str
    phase: str  # merge, calibration, evaluation, registration, serving or driver: roles of one phase run at once
    count: int
    bundle: Bundle  # Ray resources of one instance
    memory: dict[str, int] = field(default_factory=dict)  # one instance's bytes held throughout, by what holds them
    # Work one instance does one stage after another, each stage's bytes by what holds them: only the largest
    # stage is held beside `memory` (the driver's merge, then its router; an evaluation's scoring, then answers).
    stages: dict[str, dict[str, int]] = field(default_factory=dict)
    # A GPU role's bytes in its node's host memory, beside the GPU's (an evaluation's passes, which leave the
    # device batch by batch); a CPU role holds such bytes in `memory`.
    host: dict[str, int] = field(default_factory=dict)

    @property
    def device(self) -> str:
        return "GPU" if self.bundle.get("GPU", 0) > 0 else "CPU"

    @property
    def peak_stage(self) -> str | None:
        return max(self.stages, key=lambda stage: sum(self.stages[stage].values()), default=None)

    @property
    def parts(self) -> dict[str, int]:
        """What one instance holds at its peak: `memory` and its largest stage's parts."""
        parts = dict(self.memory)
        for part, value in self.stages.get(self.peak_stage or "", {}).items():
            parts[part] = parts.get(part, 0) + value
        return parts

    @property
    def bytes(self) -> int:
        return sum(self.parts.values())

    @property
    def resident_bytes(self) -> int:
        """The most memory one instance needs resident: its bytes less input files mapped and read once."""
        held = sum(self.memory.values())
        return held + max((sum(v for part, v in stage.items() if part != MAPPED_INPUTS)
                           for stage in self.stages.values()), default=0)


def _held(role_on_gpu: bool, parts: dict[str, int]) -> dict[str, dict[str, int]]:
    """`parts` a role keeps in host memory: as its `host` on a GPU role, in its `memory` on a CPU one."""
    return {"host": parts} if role_on_gpu else {"memory": parts}


def kept_outputs(config: RunConfig, merged: ModelShape, tasks: Sequence[str] | None = None) -> int:
    """What an evaluation keeps of one model's passes over `tasks`' held-out rows (default: every task's), in host
    memory: each token's hidden state in the compute dtype (evaluate.passes), at most `max_length` tokens a row;
    tasks whose held-out rows are unknown here count nothing."""
    rows = heldout_row_counts(config)
    c = config.calibration
    item = ITEMSIZE[compute_dtype_name(c.dtype, config.models_on_gpus)]
    return sum(rows.get(task) or 0 for task in (tasks or config.tasks)) * c.max_length * merged.hidden_size * item


def heldout_row_counts(config: RunConfig) -> dict[str, int | None]:
    """Each task's held-out rows; None without held-out data, or where its file is not readable here (a cluster's
    path). Each file is read once per process and version of it (`_heldout_rows`)."""
    return {e.task: None if e.data is None else _heldout_rows(e.data, _modified(e.data.heldout))
            for e in config.sources.experts}


def _modified(reference: str | None) -> int | None:
    """A held-out file's modification time (None: no such local file), so a changed file is counted again."""
    path = Path(reference) if reference else None
    return path.stat().st_mtime_ns if path is not None and path.is_file() else None


@functools.lru_cache(maxsize=256)
def _heldout_rows(data: DataSpec, modified: int | None) -> int | None:
    try:
        return heldout_rows(data)
    except DartsError:
        return None


def surgery_layer_count(config: RunConfig, num_layers: int) -> int:
    """Surgery layers; "changed" counts every decoder layer (which ones changed needs the weights)."""
    return len(concrete_layers(config.calibration.layers, num_layers, lambda: range(num_layers)))


def correction_parameters(config: RunConfig, shape: ModelShape) -> int:
    c = config.calibration
    spec = CorrectionSpec(tuple(config.tasks), shape.hidden_size, c.rank, c.max_positions, c.position_bias,
                          c.position_rank)
    return expected_parameter_count(spec, surgery_layer_count(config, shape.num_layers))


def _forward(shape: ModelShape, rows: int, length: int, itemsize: int) -> int:
    """One decoder layer's largest activations: attention in and out (4·d) and the MLP's two halves (2·I)."""
    return rows * length * (4 * shape.hidden_size + 2 * shape.intermediate_size) * itemsize


def calibration_roles(config: RunConfig, experts: dict[str, ModelShape], merged: ModelShape) -> list[Role]:
    """The expert actors and training workers of a calibration on Ray; in-process, the driver holds the models."""
    c, cluster = config.calibration, config.cluster
    if not cluster.on_ray:
        return []
    dtype = compute_dtype_name(c.dtype, cluster.use_gpu)
    item = ITEMSIZE[dtype]
    B, S, d = c.batch_size, c.max_length, merged.hidden_size
    loss_layers = 1 if c.loss_at == "last" else surgery_layer_count(config, merged.num_layers)
    roles = []
    for task, shape in experts.items():
        activations = {"activations": (B * S * shape.vocab_size * item + S * shape.vocab_size * 4
                                       + loss_layers * B * S * d * 4 + _forward(shape, B, S, item))}
        cast = _cast_on_load(shape.saved_dtype, dtype, cluster.use_gpu, shape)
        roles.append(Role(f"expert actor ({task})", "calibration", 1, expert_bundle(cluster),
                          {"weights": shape.weight_bytes(dtype)},
                          stages={"load": cast, "forward": activations} if cast else {"forward": activations}))
    workers = cluster.num_workers
    rows = len(config.tasks) * c.num_samples / workers
    wire = 4 if c.wire_dtype_for(d, cluster.use_gpu) == "float32" else 2
    # + entropy, targets, the merged state and the logit term's top tokens
    per_token = TOKEN_ROW_BYTES + 4 + (loss_layers + 1) * d * wire + c.logit_target_bytes()
    trained = correction_parameters(config, merged)
    share = workers if cluster.zero_stage == 3 else 1  # ZeRO-3 partitions the frozen model and the optimizer
    weights = merged.weight_bytes(dtype)
    held = {"weights": weights // share + trained * 4,
            "optimizer": trained * (ADAM_BYTES - 4) // (workers if cluster.zero_stage >= 1 else 1)}
    work = {"feature store": min(int(rows * S * per_token), cluster.feature_memory_mb << 20),
            "activations": _forward(merged, B, S, item) + (loss_layers + 2) * B * S * d * 4
            # the logit term: the head's fp32 logits of a minibatch (at its sampled tokens), their log-softmax and
            # its gradient
            + (3 * B * (c.logit_positions or S) * merged.vocab_size * 4 if c.logit_weight else 0)}
    cast = _cast_on_load(config.merge.dtype, dtype, cluster.use_gpu, merged)
    if share == 1 and not cast:
        roles.append(Role("calibration worker", "calibration", workers, worker_bundle(cluster), held | work))
    else:
        # A ZeRO-3 rank loads the whole merged model, then DeepSpeed partitions it: until then the whole model and
        # the rank's copy of its partition are held together (measured at width 4096: benchmarks/scaling.py).
        load = {**({"whole model before partitioning": weights} if share > 1 else {}), **cast}
        roles.append(Role("calibration worker", "calibration", workers, worker_bundle(cluster), held,
                          stages={"load": load, "stream and train": work}))
    return roles


def _cast_on_load(saved: str, dtype: str, on_gpu: bool, shape: ModelShape) -> dict[str, int]:
    """What a CPU role holds beside its weights while it loads a model saved in another dtype than it computes in:
    the weights as saved, read and cast (measured: a bf16 worker of an fp32 merge peaks at both, 2.3-2.4x the plan
    that counted the bf16 copy alone; benchmarks/scaling.py). Not counted on GPUs, where only the cast copy is on
    the device."""
    if on_gpu or saved == dtype:
        return {}
    return {"weights as saved, while cast": shape.weight_bytes(saved)}


def gram_bytes(shape: ModelShape) -> int:
    """An expert's RegMean Grams (fp32): per decoder layer one [in, in] matrix per distinct linear input, the
    attention's (q, k, v share it), o_proj's, the MLP's (gate and up share it) and down_proj's. o_proj's input
    is taken as hidden-wide (heads × head size: so in Llama, Mistral and Qwen)."""
    d, inter = shape.hidden_size, shape.intermediate_size
    return shape.num_layers * (3 * d * d + inter * inter) * 4


def _largest_linear(shape: ModelShape) -> tuple[int, int]:
    """(in, out) of the linear with the largest Gram: down_proj, intermediate-wide in, hidden-wide out."""
    return shape.intermediate_size, shape.hidden_size


def _solve_bytes(shape: ModelShape, experts: int) -> int:
    """RegMean's solve of its largest linear on the driver: every expert's fp32 share (G̃ and G̃Wᵀ) in transit,
    the float64 sums and Cholesky's factor."""
    n_in, n_out = _largest_linear(shape)
    return experts * (n_in * n_in + n_in * n_out) * 4 + (2 * n_in * n_in + n_in * n_out) * 8


def merge_roles(config: RunConfig, experts: dict[str, ModelShape]) -> list[Role]:
    """RegMean's Gram actors on Ray (merge.method regmean): each expert's weights, its Grams, its decoder's forward
    activations, and the float64 share of one linear it computes when the driver asks."""
    c, cluster = config.calibration, config.cluster
    if not config.merge.from_grams or cluster.executor != "ray":
        return []
    dtype = compute_dtype_name(c.dtype, cluster.use_gpu)
    item = ITEMSIZE[dtype]
    roles = []
    for task, shape in experts.items():
        n_in, n_out = _largest_linear(shape)
        memory = {"weights": shape.weight_bytes(dtype), "grams": gram_bytes(shape),
                  "activations": _forward(shape, c.batch_size, c.max_length, item),
                  "one linear's share": (2 * n_in * n_in + n_in * n_out) * 8}
        if config.merge.method == "regmean_plus":  # its task's states between layers, and their next layer's
            memory["carried states"] = 2 * c.num_samples * c.max_length * shape.hidden_size * item
        roles.append(Role(f"Gram actor ({task})", "merge", 1, expert_bundle(cluster), memory))
    return roles


def _nll_logits(shape: ModelShape, rows: int, length: int, itemsize: int) -> int:
    """A scoring pass's logits: B·S·V in the compute dtype, plus NLL's fp32 copy of the shifted logits and its
    log-softmax (core.metrics.token_nll)."""
    return rows * length * shape.vocab_size * (itemsize + 2 * 4)


def evaluation_roles(config: RunConfig, experts: dict[str, ModelShape], merged: ModelShape) -> list[Role]:
    """The evaluation actors (one model each) when evaluation runs on Ray; else the driver holds them (driver_role).

    Each holds its model, then in turn its scoring passes (held-out NLL and bias: experts and the merge) and its
    answers (task scores: a KV cache of `generation_batch_size` rows of a prompt up to `max_length` and the
    longest answer, and their prefill); with retention, every model's pass over the retention set. The base has an
    actor of its own for its task scores; for the retention set alone it runs first in the merge's place
    (evaluate.on_ray), which the merge's role covers (the same shape, fewer stages)."""
    if not uses_ray(config):
        return []
    e, c = config.evaluation, config.calibration
    dtype = compute_dtype_name(c.dtype, config.cluster.use_gpu)
    item = ITEMSIZE[dtype]
    answer = e.max_new_tokens or LONGEST_ANSWER
    models = {"merged": merged, **experts, **({"base": merged} if e.score_base else {})}
    # Kept passes: an expert's over its task's rows (until they travel), the merge's over every task's together with
    # every expert's it judges against.
    kept = {name: kept_outputs(config, merged, [name]) for name in experts}
    kept["merged"] = 2 * kept_outputs(config, merged)
    roles = []
    for name, shape in models.items():
        stages = {}
        if name != "base":  # the base only answers (its task scores, its retention replies)
            stages["scoring"] = {"logits": _nll_logits(shape, c.batch_size, c.max_length, item),
                                 "activations": _forward(shape, c.batch_size, c.max_length, item)}
        if e.retention:
            rows, length = e.generation_batch_size, RETENTION_ROW_TOKENS
            stages["retention"] = {"logits": _nll_logits(shape, rows, length, item),
                                   "activations": _forward(shape, rows, length, item)}
            if name == ("base" if e.score_base else "merged"):  # where the base makes its replies
                stages["retention replies"] = {"kv cache": rows * length * shape.kv_bytes_per_token(dtype),
                                               "activations": _forward(shape, rows, length, item)}
        if e.score_limit != 0:
            rows = e.generation_batch_size
            stages["answers"] = {"kv cache": rows * (c.max_length + answer) * shape.kv_bytes_per_token(dtype),
                                 "activations": _forward(shape, rows, c.max_length, item)}
        held = _held(config.cluster.use_gpu, {"kept outputs": kept[name]} if kept.get(name) else {})
        memory = {"weights": shape.weight_bytes(dtype), **held.get("memory", {})}
        roles.append(Role(f"evaluation actor ({name})", "evaluation", 1, expert_bundle(config.cluster), memory,
                          stages, host=held.get("host", {})))
    return roles


def export_role(merged: ModelShape) -> Role:
    """`darts-dist export` on this machine: one output shard (at most 5 GB) held while the next input tensor is read
    and cast, the largest being the embeddings or the LM head (export.weights.copy_weights)."""
    return Role("export", "export", 1, {"CPU": 1.0}, {
        "export shard": min(merged.weight_bytes("float32"), MERGE_SHARD_BYTES),
        "largest tensor": merged.vocab_size * merged.hidden_size * 4})


def registration_roles(config: RunConfig, merged: ModelShape) -> list[Role]:
    """MLflow's check of the logged model (it loads the model and generates a few tokens) in a GPU role's Ray task
    when the models are on GPUs (tracking.registry.log_checked_model); else the driver holds it (driver_role)."""
    if not config.models_on_gpus:
        return []
    dtype = compute_dtype_name(config.calibration.dtype, on_gpu=True)
    return [Role("registration check", "registration", 1, expert_bundle(config.cluster), {
        "weights": merged.weight_bytes(dtype) + correction_parameters(config, merged) * 4,
        "activations": _forward(merged, 1, config.calibration.max_length, ITEMSIZE[dtype])})]


def serving_role(settings: ServeSection, merged: ModelShape | None, correction_parameters: int) -> Role:
    """One serving replica (and how many at most): the merged model, its corrections, the KV cache of a full
    batch and the prefix cache, one decoding step's activations (no bytes where the shape is unknown)."""
    s = settings
    dtype = compute_dtype_name(s.dtype, s.use_gpu)
    replicas = s.autoscaling_config.get("max_replicas", s.num_replicas) if s.autoscaling_config else s.num_replicas
    bundle = {"CPU": s.num_cpus, "GPU": 1.0 if s.use_gpu else 0.0}
    if merged is None:
        return Role("serving replica", "serving", replicas, bundle)
    kv = merged.kv_bytes_per_token(dtype)
    return Role("serving replica", "serving", replicas, bundle, {
        "weights": merged.weight_bytes(dtype) + correction_parameters * 4,
        "kv cache": (s.max_batch_tokens + s.prefix_cache_tokens) * kv,
        "activations": s.max_batch_size * merged.vocab_size * 4 + _forward(merged, s.max_batch_size, 1, 4),
    })


def merge_stages(experts: dict[str, ModelShape], merged: ModelShape) -> dict[str, dict[str, int]]:
    """The driver's stages before calibration: each adapter expert merged into its base (base and merged copy in
    fp32, once: the folder is cached), and mergekit's merge on the CPU: every input's weight files mapped and read
    (in their saved dtype) and the output held a shard at a time."""
    stages = {}
    if any(shape.adapter for shape in experts.values()):
        stages["adapters"] = {"weights": 2 * merged.weight_bytes("float32")}
    inputs = [merged, *experts.values()]  # the base and every expert
    stages["merge"] = {MAPPED_INPUTS: sum(shape.weight_bytes(shape.saved_dtype) for shape in inputs),
                       "merge output": min(merged.weight_bytes(merged.saved_dtype), MERGE_SHARD_BYTES)}
    return stages


def regmean_stage(config: RunConfig, experts: dict[str, ModelShape], merged: ModelShape) -> dict[str, int]:
    """The driver's part of a RegMean merge: a shard of the merge rewritten while one linear is solved; in-process
    it also holds every expert's model and Grams (the collectors live in the driver then)."""
    stage = {"merge output": min(merged.weight_bytes("float32"), MERGE_SHARD_BYTES),
             "solve": _solve_bytes(merged, len(experts))}
    if not config.cluster.on_ray:
        dtype = compute_dtype_name(config.calibration.dtype, on_gpu=False)
        stage["experts and their grams"] = sum(s.weight_bytes(dtype) + gram_bytes(s) for s in experts.values())
        if config.merge.method == "regmean_plus":  # every task's states between layers, and their next layer's
            c = config.calibration
            stage["carried states"] = sum(2 * c.num_samples * c.max_length * s.hidden_size * ITEMSIZE[dtype]
                                          for s in experts.values())
    return stage


def driver_role(config: RunConfig, experts: dict[str, ModelShape], merged: ModelShape) -> Role:
    """The driver (the head node): the tokenised calibration sets throughout; in stages the merge (merge_stages)
    and, unless the models are on GPU actors, the models it runs itself, on its CPU in the compute dtype: the merged one for the router's held-out check and for MLflow's
    check of the logged model, the merged one and one other at a time (and one task's kept passes) for an
    evaluation or a calibration in-process."""
    c = config.calibration
    dtype = compute_dtype_name(c.dtype, on_gpu=False)
    item = ITEMSIZE[dtype]
    memory = {"calibration rows": len(config.tasks) * c.num_samples * c.max_length * TOKEN_ROW_BYTES}
    stages = merge_stages(experts, merged)
    if config.merge.from_grams:
        stages["regmean"] = regmean_stage(config, experts, merged)
    if not config.models_on_gpus:
        stages["router and registration check"] = {"weights": merged.weight_bytes(dtype),
                                                   "activations": _forward(merged, c.batch_size, c.max_length, item)}
    if not uses_ray(config) or config.cluster.executor != "ray":  # the merged model and one other at a time
        other = max(shape.weight_bytes(dtype) for shape in experts.values())
        largest = max(config.tasks, key=lambda task: kept_outputs(config, merged, [task]))
        stages["in-process"] = {"weights": merged.weight_bytes(dtype) + other,
                                "logits": _nll_logits(merged, c.batch_size, c.max_length, item),
                                "activations": _forward(merged, c.batch_size, c.max_length, item),
                                "kept outputs": 2 * kept_outputs(config, merged, [largest])}
    return Role("driver", "driver", 1, {"CPU": 1.0}, memory, stages)
