"""The one YAML file of a darts-dist run, validated with pydantic before any work starts."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from darts_dist.errors import DartsError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Flag:
    """Marks a config field as a command-line flag too (`options` builds the flags from the marked fields): its
    name, what it sets, its metavar; a flag without a value sets `const`; `parse` turns the raw text into the
    field's value before the config is validated again."""

    name: str
    help: str
    metavar: str | None = None
    const: Any = None
    parse: Callable[[str], Any] | None = None


def _no_limit_for_all(raw: str) -> str | None:
    return None if raw == "all" else raw


PositiveInt = Annotated[int, Field(gt=0)]
# A surgery layer: a decoder layer's index or "final" (the final norm's output); in a config also a set of
# layers, made concrete once the model is known (calibrate.layers): "all" decoder layers, "every:N" (layers
# N−1, 2N−1, … below the layer count), "changed" (the decoder layers some expert's weights differ from the base's in).
Layer = int | Annotated[str, Field(pattern=r"^(final|all|changed|every:[1-9][0-9]*)$")]
# What a run folder (OUTPUT_DIR/NAME) holds, by name; the router's file is core.ROUTER_FILE.
RUN_CONFIG_FILE = "config.yaml"  # the validated config that made the run
MERGED_FOLDER = "merged"  # the merged model, unless merge.output puts it elsewhere
REGMEAN_RECORD = "regmean_config.yml"  # in a RegMean merge's folder: what was merged, how, from which data
LEARNED_FOLDER = "learned-merge"  # calibration.method merge_coefficients[+darts]: the learned merge
CORRECTIONS_FILE = "corrections.safetensors"
# Prompt tokens whose keys and values a generation engine's prefix cache keeps (~46 kB each for SmolLM2-135M
# in fp32): serving's default and evaluation's.
PREFIX_CACHE_TOKENS = 4096
# Served model ids are NAME:<task>, NAME:merged (no correction) and NAME (task "auto": routed).
RESERVED_TASKS = ("auto", "merged", "routed")


class _Section(BaseModel):
    # Frozen so a validated config cannot drift while a run uses it; extra="forbid" so a
    # misspelt key is an error instead of a silently ignored setting.
    model_config = ConfigDict(frozen=True, extra="forbid")


class DataSpec(_Section):
    """A task's calibration and held-out sets (JSONL, Parquet or text files)."""

    calibration: str
    heldout: str | None = None
    format: Literal["auto", "text", "chat", "prompt_response"] = "auto"
    text_field: str | None = None
    # Prompts a server captured for this task (a JSONL that `darts-dist recalibrate --from-traffic` writes):
    # they take calibration.traffic_share of the calibration samples.
    traffic: str | None = None
    # How the task's answers are checked (task_scores.SCORERS); auto: the demo task's own scorer for
    # `demo:<task>` held-out data, none otherwise.
    scorer: Literal["auto", "math_exact", "instruct_exact", "code_tests", "humaneval", "none"] = "auto"


class ExpertSpec(_Section):
    """One fine-tuned expert: a model folder or a PEFT LoRA adapter of the base."""

    task: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]+$")]
    path: str
    data: DataSpec | None = None
    merge_parameters: dict[str, Any] = Field(default_factory=dict)

    @field_validator("task")
    @classmethod
    def _not_reserved(cls, task: str) -> str:
        if task in RESERVED_TASKS:
            raise ValueError(f"the task name {task!r} is reserved for serving (model ids NAME:merged and the routed "
                             f"task 'auto'); rename the task")
        return task


class SourcesSection(_Section):
    """What is merged: the base and its experts (one per task)."""

    base: str
    experts: list[ExpertSpec] = Field(min_length=1)

    @field_validator("experts")
    @classmethod
    def _unique_tasks(cls, experts: list[ExpertSpec]) -> list[ExpertSpec]:
        tasks = [e.task for e in experts]
        duplicates = sorted({t for t in tasks if tasks.count(t) > 1})
        if duplicates:
            raise ValueError(f"each expert needs its own task name; repeated: {duplicates}")
        return experts


class MergeOthers(_Section):
    """RegMean merges the decoder layers' linear weights; the other tensors (embeddings, norms, LM head, biases)
    go through this mergekit method. The default, every expert's plain mean, is RegMean's own choice."""

    method: str = "linear"
    parameters: dict[str, Any] = Field(default_factory=lambda: {"weight": 1.0})


REGMEAN_PARAMETERS = {"alpha"}  # merge.parameters of merge.method regmean (and regmean_plus)
# darts-dist's own merges, from the experts' inputs on their calibration rows (merge.regmean): RegMean, and RegMean++
# (each layer's inputs from the layers merged below it).
GRAM_MERGES = ("regmean", "regmean_plus")


class MergeSection(_Section):
    """How the experts are merged: a method of mergekit's registry, RegMean (regmean: darts-dist's own, from
    each expert's inputs on its calibration rows; regmean_plus: RegMean++, those inputs from the merge's own layers
    below), or a mergekit YAML as it is."""

    method: str = "task_arithmetic"
    # The method's parameters; regmean's (and regmean_plus'): alpha, the share of its Grams' off-diagonal entries
    # kept (default 0.9).
    parameters: dict[str, Any] = Field(default_factory=dict)
    others: MergeOthers | None = None  # regmean(_plus) only: the mergekit method for the other tensors
    mergekit_yaml: Path | None = None
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    # Where the driver computes the merge (mergekit's tensors, RegMean's float64 solve): cpu; cuda, the driver's
    # GPU (refused where it has none); auto, its GPU where it has one.
    device: Literal["cpu", "cuda", "auto"] = "cpu"
    output: Path | None = None

    @model_validator(mode="after")
    def _regmean_settings(self) -> MergeSection:
        if not self.from_grams:
            if self.others is not None:
                raise ValueError(f"merge.others sets how RegMean merges the tensors it does not, but merge.method is "
                                 f"{self.method!r}: remove merge.others, or set merge.method: regmean")
            return self
        if self.mergekit_yaml is not None:
            raise ValueError(f"merge.method {self.method} computes its merge from the calibration data, and "
                             "merge.mergekit_yaml names a fixed mergekit merge: remove one of them")
        unknown = sorted(set(self.parameters) - REGMEAN_PARAMETERS)
        if unknown:
            raise ValueError(f"merge.parameters {unknown} are not {self.method}'s (it takes "
                             f"{sorted(REGMEAN_PARAMETERS)}); the other tensors' method takes its own under "
                             "merge.others.parameters")
        alpha = self.parameters.get("alpha", 0.9)
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0.0 <= alpha <= 1.0:
            raise ValueError(f"merge.parameters.alpha is {alpha!r}: give a number from 0 (the Grams' diagonal alone) "
                             "to 1 (the whole Grams)")
        return self

    @property
    def from_grams(self) -> bool:
        """Whether it is one of darts-dist's own merges (GRAM_MERGES), from the experts' inputs' Grams."""
        return self.method in GRAM_MERGES

    @property
    def alpha(self) -> float:
        """RegMean's share of the Grams' off-diagonal entries."""
        return float(self.parameters.get("alpha", 0.9))

    @property
    def others_merge(self) -> MergeOthers:
        return self.others or MergeOthers()


class TaskCalibration(_Section):
    """Per-task overrides of the entropy weighting."""

    beta: float | None = Field(default=None, ge=0.0, le=1.0)
    weight_on: Literal["all", "response"] | None = None


class CoefficientSection(_Section):
    """Learned merge coefficients (calibration.method merge_coefficients): their Adam fit."""

    # Where the merged model's hidden states are aligned with each expert's (each layer on the expert's input
    # to it), at the layers that expert changed; layer sets as for calibration.layers.
    layers: list[Layer] = Field(default_factory=lambda: ["changed", "final"], min_length=1)
    steps: PositiveInt = 200
    learning_rate: float = Field(default=0.01, gt=0.0)
    # The start of every expert's coefficients; None: the run's merge, where it is task_arithmetic (each expert's
    # weight), else 1/K.
    init: float | None = None
    # Weight of the logits' term, KL(expert ‖ merged) per token, next to the hidden states' L1 (needs "final"
    # among the layers: the expert's logits are its LM head on its streamed final state); 0: hidden states only.
    logit_weight: float = Field(default=0.0, ge=0.0)


WIDE_HIDDEN_SIZE = 2048  # from here on, hidden states travel in bf16 on CPUs (wire_dtype: auto)
# The dtype a model role computes in: a torch dtype's name, or auto (bfloat16 on GPUs, float32 on CPUs).
ComputeDtype = Literal["auto", "float32", "bfloat16", "float16"]


def compute_dtype_name(name: str, on_gpu: bool) -> str:
    """The dtype a role set to `name` computes in on a GPU (`on_gpu`) or a CPU: `auto` is bfloat16 on GPUs and
    float32 on CPUs (where bf16 is slow on most processors); any other name holds on every device."""
    if name == "auto":
        return "bfloat16" if on_gpu else "float32"
    return name


@dataclass(frozen=True)
class CalibrationMethod:
    """What a calibration.method does: fit merge coefficients first (the corrections, if any, then apply to the
    learned merge), and train DARTS corrections."""

    fits_coefficients: bool
    trains_corrections: bool


# calibration.method's registry, the one place its names mean something (config.calibration_method reads it).
CALIBRATION_METHODS = {
    "darts": CalibrationMethod(fits_coefficients=False, trains_corrections=True),
    "merge_coefficients": CalibrationMethod(fits_coefficients=True, trains_corrections=False),
    "merge_coefficients+darts": CalibrationMethod(fits_coefficients=True, trains_corrections=True),
}


class CalibrationSection(_Section):
    """The DARTS correction and its training (DESIGN.md §1), or learned merge coefficients, or both."""

    # darts: corrections on the run's merge; merge_coefficients: per-layer task-arithmetic coefficients fitted on
    # the same expert stream, written as a merged model and its mergekit YAML (no corrections);
    # merge_coefficients+darts: DARTS on that learned merge.
    method: Literal["darts", "merge_coefficients", "merge_coefficients+darts"] = "darts"
    layers: list[Layer] = Field(default_factory=lambda: ["final"], min_length=1)
    # Where the loss is taken: at every corrected layer against the expert's hidden state there (SurgeryV2),
    # or at the last corrected layer only (the layers below trained through the model to serve it).
    loss_at: Literal["every", "last"] = "every"
    coefficients: CoefficientSection = Field(default_factory=CoefficientSection)
    rank: PositiveInt = 16
    max_positions: PositiveInt = 512
    position_bias: Literal["per_task", "shared", "none"] = "per_task"
    position_rank: PositiveInt | None = None
    beta: float = Field(default=1.0, ge=0.0, le=1.0)
    weight_on: Literal["all", "response"] = "all"
    # Weight of a term on the answer beside the hidden states' L1: per token KL(expert ‖ corrected) of the next-token
    # distributions, over the expert's logit_top_k likeliest tokens and the rest of its mass (what its actor sends:
    # 8 bytes a listed token, not a vocabulary's logits), weighted by w_t as the L1; the corrected distribution is the
    # merged model's LM head on the corrected final state, so it needs "final" among the layers. 0: the paper's loss.
    logit_weight: float = Field(default=0.0, ge=0.0)
    logit_top_k: PositiveInt = 64
    # The KL at this many of each row's real tokens a step, drawn anew every step (uniformly, with replacement) by the
    # step schedule's generator, where it is taken at every token (None): the LM head is most of a step's cost
    # (a vocabulary's logits a token), and a sample's KL is an estimate of the whole row's.
    logit_positions: PositiveInt | None = None
    tasks: dict[str, TaskCalibration] = Field(default_factory=dict)
    num_samples: PositiveInt = 128
    max_length: PositiveInt = 128
    batch_size: PositiveInt = 8
    steps: Annotated[PositiveInt, Flag("--steps", "calibration steps", "N")] = 400
    learning_rate: float = Field(default=1e-3, gt=0.0)
    weight_decay: float = Field(default=0.0, ge=0.0)
    validation_fraction: float = Field(default=0.0, ge=0.0, lt=1.0)
    # The share of num_samples taken from a task's captured traffic (data.traffic; `recalibrate` writes it with
    # that many prompts spread evenly over the captured window); the rest are the calibration file's first rows.
    # Fewer captured prompts than the share: all of them.
    traffic_share: Annotated[float, Flag("--traffic-share", "share of the calibration samples taken from the captured "
                                         "prompts", "X")] = Field(default=0.5, ge=0.0, le=1.0)
    # The most of a task's traffic samples one client (one API key of the server's key file) may give: a client
    # sending most of the traffic decides at most this share of the task's recalibration data, and where the other
    # clients sent too little to fill theirs, fewer traffic samples are taken (the calibration file gives the rest).
    # Prompts of a server without keys, whose clients cannot be told apart, are not capped.
    traffic_client_share: Annotated[float, Flag(
        "--traffic-client-share", "the most of a task's traffic samples one API key's prompts may be", "X",
    )] = Field(default=0.5, gt=0.0, le=1.0)
    seed: int = 0
    # The dtype every model role computes in (expert actors, training workers, Gram actors, the router, the
    # evaluation, the registered model's check), on GPUs and CPUs alike; auto: bfloat16 on GPUs (what a 7B user
    # picks: half the memory, the tensor cores' rate), float32 on CPUs. The corrections and their optimizer
    # state are fp32 whatever this says.
    dtype: Annotated[ComputeDtype, Flag("--dtype", "the dtype every model role computes in (auto: bfloat16 on "
                                        "GPUs, float32 on CPUs)", "{auto,float32,bfloat16,float16}")] = "auto"
    device: str = "auto"
    # The dtype expert hidden states travel and are kept in on the workers (upcast to fp32 per minibatch). auto:
    # the dtype the experts compute in, except that experts computing fp32 on CPUs send bfloat16 for wide models
    # (hidden size >= 2048: half the bytes of the stream, the object store and the spill disk, for bf16 rounding
    # of the targets).
    wire_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"

    def wire_dtype_for(self, hidden_size: int, on_gpu: bool) -> str:
        """The dtype hidden states travel in, from experts of `hidden_size` on GPUs (`on_gpu`) or CPUs."""
        if self.wire_dtype != "auto":
            return self.wire_dtype
        computed = compute_dtype_name(self.dtype, on_gpu)
        if on_gpu or computed != "float32":
            return computed
        return "bfloat16" if hidden_size >= WIDE_HIDDEN_SIZE else "float32"

    @field_validator("layers")
    @classmethod
    def _distinct_layers(cls, layers: list[Layer]) -> list[Layer]:
        if len(set(map(str, layers))) != len(layers):
            raise ValueError(f"surgery layers must be distinct, got {layers}")
        if any(isinstance(layer, int) and layer < 0 for layer in layers):
            raise ValueError(f"decoder layer indices count from 0, got {layers}")
        return layers

    @model_validator(mode="after")
    def _logits_need_the_final_state(self) -> CalibrationSection:
        if self.logit_weight and "final" not in self.layers:
            raise ValueError(f"logit_weight {self.logit_weight} needs the corrected final state, which layers "
                             f"{self.layers} lack: add final to calibration.layers, or set logit_weight to 0")
        return self

    def logit_targets(self) -> int:
        """How many of each expert's likeliest next tokens travel with its rows: logit_top_k with a logit term, else
        none."""
        return self.logit_top_k if self.logit_weight else 0

    def logit_samples(self) -> int | None:
        """How many of each row's tokens a step draws for the logit term (None: every token, or no term, so that a
        setting the loss does not use leaves the step schedule alone)."""
        return self.logit_positions if self.logit_weight else None

    def logit_target_bytes(self) -> int:
        """What a token's logit targets take on the wire and in the feature store: an fp32 log-probability and an
        int32 id per listed token."""
        return 8 * self.logit_targets()

    def loss_layers(self) -> list[Layer]:
        """The layers whose expert hidden states the loss reads: every surgery layer (loss_at every), or the last
        one only, "final" if corrected there, else the highest decoder layer (loss_at last)."""
        if self.loss_at == "every":
            return list(self.layers)
        return ["final"] if "final" in self.layers else [max(k for k in self.layers if isinstance(k, int))]

    def headline_layer(self) -> Layer:
        """Where bias is reported and the router reads the merged model: the final representation when corrected
        there, else the last surgery layer."""
        return "final" if "final" in self.layers else max(self.layers)

    def beta_for(self, task: str) -> float:
        override = self.tasks.get(task)
        return self.beta if override is None or override.beta is None else override.beta

    def weight_on_for(self, task: str) -> str:
        override = self.tasks.get(task)
        return self.weight_on if override is None or override.weight_on is None else override.weight_on


CpuSchedule = Literal["concurrent", "turns"]


class ClusterSection(_Section):
    """Where the work runs: local Ray by default, or an existing cluster."""

    # "ray": expert actors stream into Ray Train workers (a local cluster started for the job unless
    # `address`, --address or RAY_ADDRESS names one); "in-process": the one-process reference loop.
    executor: Annotated[Literal["ray", "in-process"], Flag("--in-process", "calibrate with the one-process reference "
                                                           "loop instead of Ray", const="in-process")] = "ray"
    address: Annotated[str | None, Flag("--address", "an existing Ray cluster to calibrate on (default: RAY_ADDRESS, "
                                        "else a local cluster started for the job)", "ADDR")] = None
    num_workers: PositiveInt = 1
    zero_stage: Literal[0, 1, 2, 3] = 0
    use_gpu: bool = False
    cpus_per_worker: float = Field(default=1.0, gt=0.0)
    # Ray resources per expert actor and per training worker: CPU, GPU, or custom ones that name the
    # nodes they must run on (e.g. {expert_node: 1}, given to a node by `ray start --resources`).
    expert_resources: dict[str, float] = Field(default_factory=dict)
    worker_resources: dict[str, float] = Field(default_factory=dict)
    # How the training workers' placement group packs them (Ray's strategies); SPREAD and
    # STRICT_SPREAD also spread the expert actors over the nodes.
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    # How long a job waits for Ray to reserve the resources above, free (a busy cluster's other work may
    # release them) or added (an autoscaler may be adding nodes), before it fails with a message naming
    # what is missing, rather than hanging.
    resource_wait_s: float = Field(default=120.0, gt=0)
    # The cluster adds nodes on demand (the Ray cluster launcher's or KubeRay's autoscaler): actors the nodes
    # cannot hold when a command starts are left to it (waiting resource_wait_s) instead of refused at once.
    autoscaler: bool = False
    # The Ray Train run: the same run id resumes from its last checkpoint. Default: NAME plus a hash of
    # everything that decides the result, so an unchanged command resumes and a changed one starts afresh.
    run_id: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]+$")] | None = None
    # Checkpoints go to RUN_DIR/ray-train by default; multi-node clusters need shared storage (NFS, s3://).
    storage_path: str | None = None
    checkpoint_every: PositiveInt = 100  # steps
    max_failures: int = Field(default=2, ge=0)  # restarts of a lost worker group (Ray Data restarts lost experts)
    # Streamed features a worker keeps in memory; beyond this they spill to its local disk, memory-mapped.
    feature_memory_mb: PositiveInt = 2048
    # Object store the stream of each expert may fill before Ray Data's back-pressure pauses its actor.
    stream_buffer_mb: PositiveInt = 256
    # How the experts and workers share a CPU node (no effect on GPUs): "concurrent", all at once with a
    # share of the cores each; "turns", one model forward at a time with all the node's cores
    # (ray_cluster/cpu_share.py; docs/cluster.md: why concurrent is the default).
    cpu_schedule: CpuSchedule = "concurrent"

    @property
    def on_ray(self) -> bool:
        """Whether the run's model work runs on Ray (executor ray), not in this one process."""
        return self.executor == "ray"


class EvaluationSection(_Section):
    """Task scores on held-out data (greedy generation is slow on a CPU, hence the limit)."""

    # problems per task; None = all, 0 = no task scores
    score_limit: Annotated[int | None, Flag("--score-limit", "task-score problems per task, or all (0: no task "
                                            "scores)", "N|all", parse=_no_limit_for_all)] = Field(default=20, ge=0)
    max_new_tokens: PositiveInt | None = None  # a cap on every answer; None: each scorer's own length
    # Answers generated at once (continuous batching: a finished answer's place goes to the next problem).
    generation_batch_size: PositiveInt = 32
    sandbox_timeout: float = Field(default=5.0, gt=0.0)  # seconds per check program (code scorers)
    # Where code answers' checks run: "bwrap", only in bubblewrap's sandbox (no network, no environment, one folder
    # of its own; where it cannot start, code tasks are refused before any model loads); "limits", also under
    # resource limits alone where it cannot (CPU, memory, file size, processes: no security boundary).
    sandbox: Annotated[Literal["bwrap", "limits"], Flag(
        "--sandbox", "where code answers run: bwrap, only in bubblewrap's sandbox (refused where it cannot start); "
        "limits, also under resource limits alone (no security boundary)", "{bwrap,limits}")] = "bwrap"
    # Also score the base model (before fine-tuning) on each task: what the experts learnt, the yardstick
    # of the merge's loss. One more model's answers per task.
    score_base: bool = True
    # Retention: score every model (base, experts, merge, the correction a request without a task gets) on general
    # instructions outside the tasks, by its NLL of the base model's own greedy replies and its token agreement
    # with them (evaluate.retention). Loads the base once more where score_base is off.
    retention: bool = True
    # Keep what the base, the experts and the merge compute (held-out passes, greedy answers, the router's
    # features) in the cache folder, keyed by their weights' content hash and everything else the result
    # depends on, so a repeat run reads them back (sources.output_cache). Corrected outputs are never kept.
    cache: bool = True
    # Where the models' passes run: "ray", each model (base, experts, merge) in a Ray actor of its own with an
    # expert actor's resources (a GPU each with cluster.use_gpu), all at once; "in-process", one model after
    # another in this process; "auto": Ray when calibration runs on Ray with GPUs (on CPU nodes the actors
    # would only split the same cores: evaluate.on_ray).
    executor: Literal["auto", "ray", "in-process"] = "auto"


class TrackingSection(_Section):
    """MLflow: embedded sqlite file by default, or a tracking server."""

    uri: str = "sqlite:///mlflow.db"
    experiment: str = "darts-dist"
    registered_model: str | None = None
    alias: str = "champion"


class CaptureSection(_Section):
    """Opt-in traffic capture: the prompts a server answers, with their task, kept for recalibration.

    Stored per prompt: the prompt's text (a chat's rendered with the chat template), the task whose correction
    applied (named or routed), whether it was a chat, the model version and the time. Never the response, a
    key or a header. Each replica buffers prompts and writes them as a new segment file (temporary name, then
    renamed) every flush_s seconds or segment_bytes; beyond max_bytes the oldest segments are deleted.
    """

    enabled: bool = False
    # Where the segments go; relative to the folder the server starts in (serve.model.serve_settings). On a
    # cluster, storage every replica's node shares (NFS), or each node keeps its own replicas' prompts.
    dir: Path = Path("traffic")
    max_bytes: PositiveInt = 256 * 1024 * 1024
    segment_bytes: PositiveInt = 4 * 1024 * 1024
    flush_s: float = Field(default=10.0, gt=0.0)

    @model_validator(mode="after")
    def _segment_fits(self) -> CaptureSection:
        if self.segment_bytes > self.max_bytes:
            raise ValueError(f"capture.segment_bytes ({self.segment_bytes}) exceeds capture.max_bytes "
                             f"({self.max_bytes}); one segment must fit in the store")
        return self


class ServeSection(_Section):
    """The Ray Serve app that exposes the corrected model."""

    # Beyond loopback only when `--host` says so on the command line: a host from here (registered with the model,
    # or a --config YAML) binds 127.0.0.1 instead, with a warning.
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=1, le=65535)
    # A file on the serving machine holding the API keys, one per client and line, `KEY` or `NAME KEY` (after
    # --api-key-file, --api-key and DARTS_DIST_API_KEY); the path is registered with the model, never a key.
    api_key_file: Path | None = None
    num_replicas: PositiveInt = 1
    # Ray Serve's autoscaling_config (min_replicas, max_replicas, target_ongoing_requests, ...); when set it
    # replaces num_replicas.
    autoscaling_config: dict[str, Any] | None = None
    max_ongoing_requests: PositiveInt = 32
    # Requests beyond max_ongoing_requests wait in Serve's queue, up to this many per deployment; past it Serve
    # answers 429 with Retry-After (-1: no bound).
    max_queued_requests: int = Field(default=64, ge=-1)
    max_tokens_limit: PositiveInt = 512
    # One request's list of prompts (/v1/completions); a longer list gets 400 before any of it is tokenised.
    max_prompts_per_request: PositiveInt = 16
    # Sequences waiting to join a replica's running batch. A request is queued only while the room left after it
    # is at least its own size (so large requests are refused first), else 429 with Retry-After.
    max_waiting_sequences: PositiveInt = 128
    # Continuous batching: at every decoding step finished sequences leave and waiting ones join, up to
    # max_batch_size sequences, while their KV cache slots stay within max_batch_tokens: a slot per sequence, its
    # prompt + max_tokens rounded up to a power of two (at least 16), allocated once (about 46 kB a token for
    # SmolLM2-135M in fp32: 16384 hold 0.75 GB).
    max_batch_size: PositiveInt = 32
    max_batch_tokens: PositiveInt = 16384
    # Prompt prefixes (a system prompt, a chat template's opening) whose keys and values are kept, per API key and
    # correction, so that a prompt starting the same way is prefilled from where they end; 0: none.
    prefix_cache_tokens: int = Field(default=PREFIX_CACHE_TOKENS, ge=0)
    # A prompt longer than this (past its cached prefix) is prefilled this many tokens a step beside the running
    # batch's decoding, so that it never stalls the streams for its whole prefill; a step then costs its decode and
    # one chunk. auto: 512 on a GPU (a decoding step leaves it mostly idle), 64 on a CPU (where a chunk of 64 costs
    # about what a decoding step of 32 sequences does).
    prefill_chunk_tokens: PositiveInt | Literal["auto"] = "auto"
    use_gpu: bool = False  # one GPU per replica
    num_cpus: float = Field(default=1.0, gt=0.0)  # per replica; also its torch threads
    # The replicas' compute dtype; auto: the run's calibration.dtype (so the served model computes as it was
    # evaluated), which is itself auto by default: bfloat16 on GPUs, float32 on CPUs.
    dtype: ComputeDtype = "auto"
    # The routed model id picks a task when the router's confidence reaches this, else no correction;
    # "soft" mixes the corrections with the router's probabilities instead of taking the top task.
    router_threshold: float = Field(default=0.5, ge=0.0, le=1.0)
    routing: Literal["hard", "soft"] = "hard"
    # A prompt outside its top task's envelope (unlike that task's calibration prompts: a general instruction to a
    # code/math/chat merge) gets no correction either, however confident the router; false: the router's pick.
    router_abstain_outside: bool = True
    # Slow or oversized requests must not tie up a replica: a body above max_request_bytes gets 413 (refused
    # on its Content-Length before any of it is read), a body not fully arrived after body_timeout_s gets 408,
    # and Serve's proxy answers 408 to a request still unanswered after request_timeout_s, or cuts a stream
    # still running then, a stalled reader's too (null: no limit).
    max_request_bytes: PositiveInt = 1024 * 1024
    body_timeout_s: float = Field(default=30.0, gt=0.0)
    request_timeout_s: float | None = Field(default=600.0, gt=0.0)
    # Serving models:/NAME@ALIAS: poll the registry every alias_poll_s and, when the alias moves, roll the
    # replicas over to the version it names. Without following, a server stays on the version it started on.
    follow_alias: bool = False
    alias_poll_s: float = Field(default=30.0, gt=0.0)
    # Replicas a rolling update may start beyond the target, in percent of it: with 100 every new replica is
    # ready before an old one stops (no request waits, but it needs room for them); with 0 old replicas stop
    # first and requests queue while their replacements load.
    max_surge_percent: int = Field(default=100, ge=0, le=100)
    # How long an old replica (a rolling update, a shutdown) may take to finish its requests before it stops.
    drain_timeout_s: float = Field(default=60.0, gt=0.0)
    capture: CaptureSection = CaptureSection()

    @model_validator(mode="after")
    def _bounds_fit(self) -> ServeSection:
        if self.max_queued_requests == 0:
            raise ValueError("serve.max_queued_requests is 0, which Ray Serve refuses: give -1 (no bound) or a count")
        if self.max_waiting_sequences < 2 * self.max_prompts_per_request:
            raise ValueError(f"serve.max_waiting_sequences ({self.max_waiting_sequences}) is below twice "
                             f"serve.max_prompts_per_request ({self.max_prompts_per_request}): a request of the "
                             "largest accepted size would be refused (429) even by an idle server")
        return self

    @model_validator(mode="before")
    @classmethod
    def _retired_keys(cls, values: Any) -> Any:
        # Registered versions of darts-dist 0.2 carry the dynamic batcher's wait; continuous batching has none.
        if isinstance(values, dict) and "batch_wait_timeout_s" in values:
            values = {key: value for key, value in values.items() if key != "batch_wait_timeout_s"}
            logger.warning("serve.batch_wait_timeout_s is ignored: continuous batching starts each sequence at the "
                           "next decoding step; remove the key")
        return values

    def prefill_chunk_for(self, on_gpu: bool) -> int:
        """`prefill_chunk_tokens` with auto resolved for a replica's device."""
        if self.prefill_chunk_tokens == "auto":
            return 512 if on_gpu else 64
        return self.prefill_chunk_tokens


class RunConfig(_Section):
    """A whole darts-dist run."""

    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]+$")] = "darts-dist"
    output_dir: Annotated[Path, Flag("--output-dir", "where run folders go", "DIR",
                                     parse=lambda raw: Path(raw).absolute())] = Path("runs")
    sources: SourcesSection
    merge: MergeSection = MergeSection()
    calibration: CalibrationSection = CalibrationSection()
    cluster: ClusterSection = ClusterSection()
    evaluation: EvaluationSection = EvaluationSection()
    tracking: TrackingSection = TrackingSection()
    serve: ServeSection = ServeSection()

    @model_validator(mode="after")
    def _cross_checks(self) -> RunConfig:
        tasks = {e.task for e in self.sources.experts}
        unknown = sorted(set(self.calibration.tasks) - tasks)
        if unknown:
            raise ValueError(f"calibration.tasks names {unknown}, which no expert has; experts' tasks: {sorted(tasks)}")
        if self.calibration.position_rank is not None and self.calibration.position_bias == "none":
            raise ValueError("calibration.position_rank is set but calibration.position_bias is 'none'")
        device, on_ray = self.calibration.device, self.cluster.on_ray
        worker_gpus = self.cluster.worker_resources.get("GPU", 1.0 if self.cluster.use_gpu else 0.0)
        if on_ray and self.cluster.num_workers > 1 and worker_gpus and worker_gpus != int(worker_gpus):
            raise ValueError(f"cluster.worker_resources GPU: {worker_gpus:g} puts each of the "
                             f"{self.cluster.num_workers} training ranks on a share of a GPU, so two could share one "
                             "device, which NCCL refuses: give each worker whole GPUs (1)")
        if self.cluster.use_gpu and device == "cpu":
            raise ValueError("cluster.use_gpu gives every actor a GPU, but calibration.device: cpu computes on the "
                             "CPU: set calibration.device auto (or cuda), or cluster.use_gpu false")
        if on_ray and not self.cluster.use_gpu and device.startswith("cuda") and "GPU" not in \
                self.cluster.expert_resources:
            raise ValueError(f"calibration.device: {device} on Ray needs GPUs for the actors: set cluster.use_gpu "
                             "true (Ray gives an actor no GPU it did not ask for)")
        return self

    @property
    def tasks(self) -> tuple[str, ...]:
        return tuple(e.task for e in self.sources.experts)

    @property
    def calibration_method(self) -> CalibrationMethod:
        return CALIBRATION_METHODS[self.calibration.method]

    @property
    def run_dir(self) -> Path:
        return self.output_dir / self.name

    @property
    def models_on_gpus(self) -> bool:
        """Whether the run's models are on GPU actors (Ray with cluster.use_gpu): no model forward then runs on
        the driver, whose node (a cluster's head) may have no GPU and too little memory for the models."""
        return self.cluster.on_ray and self.cluster.use_gpu

    @property
    def serving(self) -> ServeSection:
        """The serve section as the replicas take it (`served_by`)."""
        return served_by(self.serve, self)

    @property
    def merged_dir(self) -> Path:
        """Where the run's merged model goes: `merge.output`, else RUN_DIR/merged."""
        return self.merge.output or self.run_dir / MERGED_FOLDER

    @property
    def model_dir(self) -> Path:
        """The model the run's corrections apply to and that it serves: the learned merge (RUN_DIR/learned-merge)
        when calibration.method fits merge coefficients, else the merged model."""
        return self.run_dir / LEARNED_FOLDER if self.calibration_method.fits_coefficients else self.merged_dir


Section = TypeVar("Section", bound=_Section)


def served_by(settings: ServeSection, run: RunConfig) -> ServeSection:
    """Serve settings for a model `run` made: `serve.dtype: auto` is the run's compute dtype (calibration.dtype), so
    the served model computes as the run evaluated it."""
    return updated(settings, dtype=run.calibration.dtype) if settings.dtype == "auto" else settings


def updated(section: Section, **changes: Any) -> Section:
    """A copy of a config (or a section of one) with `changes`, validated like the YAML it came from.

    Not pydantic's model_copy, which skips validation: a bad value must fail here, with its key path
    (e.g. `calibration.steps`), not later inside the work.
    """
    return type(section).model_validate({**section.model_dump(), **changes})


def format_errors(error: ValidationError, names: Mapping[str, str] | None = None) -> str:
    """One line per problem: its key path (or, given `names`, what the user wrote for it) and the reason."""
    lines = []
    for item in error.errors():
        where = ".".join(str(part) for part in item["loc"]) or "(top level)"
        where = (names or {}).get(where, where)
        reason = "unknown key (check its spelling or remove it)" if item["type"] == "extra_forbidden" else item["msg"]
        lines.append(f"  {where}: {reason}")
    return "\n".join(lines)


def parse_config(data: Any, origin: str = "config") -> RunConfig:
    """Validate a mapping into a RunConfig; errors list every key path and its reason."""
    if not isinstance(data, dict):
        raise DartsError(f"{origin}: expected a YAML mapping at the top level, got {type(data).__name__}",
                         "see jobs/configs/demo.yaml for the layout")
    try:
        return RunConfig.model_validate(data)
    except ValidationError as error:
        raise DartsError(f"{origin} is not a valid darts-dist config:\n{format_errors(error)}",
                         "fix the keys above; jobs/configs/demo.yaml shows every section") from None


def parse_record(data: Any, origin: str) -> RunConfig:
    """A config a run wrote down (its folder's config.yaml, its MLflow config.json, a report's), every key as it was
    dumped. A record without `merge.device` predates the compute dtype, when `calibration.dtype` and `serve.dtype`
    named the dtype on GPUs and a CPU computed fp32 whatever they said: their bfloat16, the default then, meant what
    `auto` means now, and is read so (a registered model of then still serves from a CPU in fp32)."""
    if isinstance(data, dict) and isinstance(data.get("merge"), dict) and "device" not in data["merge"]:
        data = {**data, **{section: {**data[section], "dtype": "auto"} for section in ("calibration", "serve")
                           if isinstance(data.get(section), dict) and data[section].get("dtype") == "bfloat16"}}
    return parse_config(data, origin)


def load_record(path: Path) -> RunConfig:
    """A run folder's config.yaml (`parse_record`), its relative paths taken from the folder."""
    path = Path(path).absolute()
    return resolve_paths(parse_record(read_yaml(path), origin=str(path)), path.parent)


def read_yaml(path: Path) -> Any:
    """Read a YAML file with the safe loader, turning I/O and syntax problems into DartsError."""
    path = Path(path)
    if not path.is_file():
        raise DartsError(f"config file {path} does not exist", "pass the path of a YAML file")
    try:
        return yaml.safe_load(path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as error:
        raise DartsError(f"{path} is not readable YAML: {error}", "fix the syntax") from None


def is_mergekit_yaml(data: Any) -> bool:
    """A mergekit YAML has `merge_method` at its top level; a darts-dist one has `sources`."""
    return isinstance(data, dict) and "merge_method" in data and "sources" not in data


def packaged_config(name: str) -> Path:
    """A config shipped inside the package: `demo` (the embedded default) or `tiny` (its tiny twin); the
    checkout's jobs/configs/ links to the same files."""
    return Path(str(resources.files("darts_dist") / "configs" / f"{name}.yaml"))


def load_config(path: Path) -> RunConfig:
    """Read and validate a darts-dist YAML.

    Relative model and data paths resolve against the YAML's folder; `output_dir` against the
    current folder.
    """
    path = Path(path).absolute()
    data = read_yaml(path)
    if is_mergekit_yaml(data):
        raise DartsError(f"{path} is a mergekit YAML, not a darts-dist config",
                         "use it with `darts-dist merge`, or point `merge.mergekit_yaml` of a darts-dist config at it")
    return resolve_paths(parse_config(data, origin=str(path)), path.parent)


def _resolve(value: Path | str, root: Path) -> Path:
    value = Path(value).expanduser()
    return value if value.is_absolute() else (root / value).absolute()


REFERENCE_SCHEMES = ("bundled:", "demo:", "tiny:", "thin:")


def _resolve_source(value: str, root: Path) -> str:
    # References such as `bundled:smollm2-135m-instruct` or `demo:math` name things darts-dist
    # makes itself; everything else is a local path that must become absolute because mergekit
    # treats a relative path it cannot find as a hub id.
    return value if value.startswith(REFERENCE_SCHEMES) else str(_resolve(value, root))


def resolve_paths(config: RunConfig, root: Path) -> RunConfig:
    """Return a copy whose relative paths are absolute, taken relative to `root`."""
    experts = []
    for expert in config.sources.experts:
        data = expert.data
        if data is not None:
            data = updated(data, calibration=_resolve_source(data.calibration, root),
                           heldout=None if data.heldout is None else _resolve_source(data.heldout, root),
                           traffic=None if data.traffic is None else str(_resolve(data.traffic, root)))
        experts.append(updated(expert, path=_resolve_source(expert.path, root), data=data))
    sources = updated(config.sources, base=_resolve_source(config.sources.base, root), experts=experts)
    merge = updated(
        config.merge,
        mergekit_yaml=None if config.merge.mergekit_yaml is None else _resolve(config.merge.mergekit_yaml, root),
        output=None if config.merge.output is None else _resolve(config.merge.output, root),
    )
    # output_dir is where the user runs from, like any command's output; inputs are relative to the config.
    return updated(config, sources=sources, merge=merge, output_dir=config.output_dir.absolute())
