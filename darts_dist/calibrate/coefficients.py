"""calibration.method merge_coefficients: per-layer task-arithmetic coefficients fitted on the experts' targets.

The experts' hidden states (and their entropy, which weighs the tokens as DARTS's loss does) are the
targets DARTS trains on, at the aligned layers and below each. The merged model θ(c) = θ_base +
Σ_k c[g, k]·τ_k runs on each task's samples, every aligned layer on the expert's own input to it, with
its output pulled toward the expert's (layer-wise distillation as in ProDistill; Expert Merging,
arXiv 2509.25712, aligns hidden states and logits the same way), optionally its logits too. Nothing
below the lowest aligned layer runs at a step: its input is the expert's, streamed.

The result is a mergekit YAML with one weight per expert and layer (parameter filters) and the model
mergekit makes from it, so the learned merge is reproducible with mergekit alone.
"""

from __future__ import annotations

import gc
import json
import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from torch.func import functional_call
from transformers import PreTrainedModel

from darts_dist.calibrate.features import TaskFeatures, collect_features
from darts_dist.calibrate.loop import StepCallback, step_minibatches
from darts_dist.config import CalibrationSection, RunConfig
from darts_dist.core import (
    LayerKey,
    LayerwiseMerge,
    TaskVectors,
    capture_hidden,
    coefficient_table,
    decoder_layers,
    entropy_weights,
    fed_inputs,
    layer_group,
    layer_prefix,
    run_from,
    weighted_l1_loss,
)
from darts_dist.errors import DartsError
from darts_dist.fsutil import atomic_file
from darts_dist.logs import progress_bar
from darts_dist.merge.mergekit import build_mergekit_config, run_merge
from darts_dist.sources.data import calibration_sets
from darts_dist.sources.models import load_causal_lm, load_tokenizer, model_dtype, read_model_info, resolve_device
from darts_dist.sources.references import ResolvedSources

logger = logging.getLogger(__name__)
COEFFICIENTS_FILE = "coefficients.json"  # in the learned merge's folder: the table and the fit's losses
CHECKPOINT_COEFFICIENTS = "coefficients.safetensors"  # a Ray job's checkpoint of c [L + 1, K] (rank 0)


def model_tensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of a model folder's safetensors files, by name, one at a time."""
    for file in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as weights:
            for name in weights.keys():
                yield name, weights.get_tensor(name)


def read_task_vectors(base_dir: Path, experts: Mapping[str, Path]) -> TaskVectors:
    """τ_k of every tensor an expert changed, read one expert at a time (the base and the changed tensors stay). An
    expert's vocabulary rows beyond the base's are left out, as the merge leaves them (VOCABULARY_POLICY)."""
    base = dict(model_tensors(base_dir))
    changed: dict[str, dict[str, torch.Tensor]] = {}
    for task, folder in experts.items():
        changed[task] = {}
        for name, value in model_tensors(folder):
            if name in base and value.shape[1:] == base[name].shape[1:] and len(value) > len(base[name]):
                value = value[: len(base[name])]
            if name in base and value.shape == base[name].shape:
                delta = value.float() - base[name].float()
                if delta.any():
                    changed[task][name] = delta
    names = [name for name in base if any(name in deltas for deltas in changed.values())]
    deltas = {name: torch.stack([changed[t].get(name, torch.zeros(base[name].shape)) for t in experts])
              for name in names}
    return TaskVectors(tuple(experts), {name: base[name].float() for name in names}, deltas,
                       read_model_info(base_dir).num_layers)


def changed_layers(base_dir: Path, experts: Mapping[str, Path]) -> list[int]:
    """The decoder layers some expert's weights differ from the base's in, compared tensor by tensor (nothing
    kept but the indices: cheap in memory for any model size)."""
    num_layers = read_model_info(base_dir).num_layers
    base_files = sorted(Path(base_dir).glob("*.safetensors"))
    where = {}
    for file in base_files:
        with safe_open(str(file), framework="pt") as weights:
            where.update({name: file for name in weights.keys()})
    changed: set[int] = set()
    for folder in experts.values():
        for name, value in model_tensors(folder):
            group = layer_group(name, num_layers)
            if group in changed or group == num_layers or name not in where:
                continue
            with safe_open(str(where[name]), framework="pt") as weights:
                if not torch.equal(weights.get_tensor(name), value):
                    changed.add(group)
    return sorted(changed)


def initial_coefficients(config: RunConfig) -> list[float]:
    """Where the fit starts: coefficients.init, else the run's task-arithmetic weights (plain ones: one number per
    expert, no normalize or lambda), else 1/K."""
    tasks, init = config.tasks, config.calibration.coefficients.init
    if init is not None:
        return [init] * len(tasks)
    merge = config.merge
    plain = not merge.parameters.get("normalize", False) and merge.parameters.get("lambda", 1.0) == 1.0
    if merge.method == "task_arithmetic" and merge.mergekit_yaml is None and plain:
        shared = merge.parameters.get("weight", 1.0)
        weights = [e.merge_parameters.get("weight", shared) for e in config.sources.experts]
        if all(isinstance(w, (int, float)) and not isinstance(w, bool) for w in weights):
            return [float(w) for w in weights]
    return [1.0 / len(tasks)] * len(tasks)


def _param_name(model: PreTrainedModel, parameter: torch.nn.Parameter) -> str:
    return next(name for name, p in model.named_parameters() if p is parameter)


def input_layer(key: LayerKey, num_layers: int) -> int | None:
    """The layer whose output is `key`'s input: i − 1 for decoder layer i, the top layer for "final"; None for 0."""
    if key == "final":
        return num_layers - 1
    return None if key == 0 else key - 1


def fit_layers(layers: Sequence[LayerKey], num_layers: int) -> list[LayerKey]:
    """The layers whose expert hidden states the fit reads: the aligned ones and the inputs of each."""
    inputs = [input_layer(k, num_layers) for k in layers]
    wanted = {*layers, *(i for i in inputs if i is not None)}
    return [*sorted(k for k in wanted if isinstance(k, int)), *(["final"] if "final" in wanted else [])]


def owned_layers(vectors: TaskVectors, layers: Sequence[LayerKey]) -> dict[str, list[LayerKey]]:
    """Per expert, the aligned layers it changed ("final": when it changed a tensor outside the layers).

    An expert is the authority on the layers it changed: its task's loss is taken there only. Where it left
    the base alone its hidden states only repeat the base's, and pulling other experts' changes there toward
    nothing would undo what they learned (experts fine-tuned on every layer own every layer)."""
    owned = {}
    for k, expert in enumerate(vectors.experts):
        groups = {vectors.group(name) for name, delta in vectors.deltas.items() if delta[k].any()}
        owned[expert] = [key for key in layers
                         if (vectors.num_layers if key == "final" else key) in groups]
    return owned


def coefficient_loss(
    model: PreTrainedModel, tensors: Mapping[str, torch.Tensor], rows: Mapping[str, object], expert_index: int,
    layers: Sequence[LayerKey], owned: Sequence[LayerKey], beta: float, weight_on: str, logit_weight: float,
) -> torch.Tensor:
    """One task's minibatch, layer by layer: each aligned layer of θ(c) (`tensors`, the merge's forward) runs
    on the expert's own input to it (teacher forcing, as in layer-wise distillation) and its output is pulled
    toward the expert's there, by the entropy-weighted L1 of DARTS's loss, at the layers the expert owns; plus
    logit_weight × the mean KL(expert ‖ merged) of the next-token distributions from the final states."""
    device = next(model.parameters()).device
    num_layers = len(decoder_layers(model))
    mask = rows["attention_mask"].to(device)
    weights = entropy_weights(rows["entropy"].to(device), mask, beta,
                              rows["response_mask"].to(device) if weight_on == "response" else None)
    targets = {k: v.to(device) for k, v in rows["targets"].items()}
    start = min((k for k in layers if isinstance(k, int)), default=num_layers)
    inputs = {k: targets[input_layer(k, num_layers)] for k in layers
              if input_layer(k, num_layers) is not None and k != start}
    decoder = model.get_decoder()
    prefix = next(name for name, module in model.named_modules() if module is decoder) + "."
    own = dict(decoder.named_parameters())
    # Layers below `start` do not run (their output is the expert's input to it): their tensors stay out. Each
    # θ(c) tensor takes the dtype of the weight it replaces (fp32 coefficients on a bf16 base; the cast keeps grad).
    inside = {name.removeprefix(prefix): t.to(own[name.removeprefix(prefix)].dtype) for name, t in tensors.items()
              if name.startswith(prefix) and "@" not in name and layer_group(name, num_layers) >= start}
    read = [*owned, *(["final"] if logit_weight and "final" not in owned else [])]
    with capture_hidden(model, read) as hidden, fed_inputs(model, inputs), \
            run_from(model, start, targets[start - 1] if start > 0 else None):
        functional_call(decoder, inside, args=(), kwargs={"input_ids": rows["input_ids"].to(device),
                                                          "attention_mask": mask})
    loss = torch.zeros((), device=device)
    for k in owned:
        loss = loss + weighted_l1_loss(hidden[k].float(), targets[k], mask, weights)
    if logit_weight:
        head = model.get_output_embeddings().weight
        lm = lm_head_name(model)
        merged_head = tensors.get(lm, head).float()
        expert_head = tensors.get(f"{lm}@{expert_index}", head).float()
        counted = mask.bool()
        merged_logp = F.log_softmax(F.linear(hidden["final"][counted].float(), merged_head), -1)
        expert_logp = F.log_softmax(F.linear(targets["final"][counted].float(), expert_head), -1)
        loss = loss + logit_weight * F.kl_div(merged_logp, expert_logp, log_target=True, reduction="batchmean")
    return loss


def lm_head_name(model: PreTrainedModel) -> str:
    """The name of the LM head's weight among the model's parameters (the embeddings' when they are tied)."""
    return _param_name(model, model.get_output_embeddings().weight)


class CoefficientModule(nn.Module):
    """The layer-wise merge and the frozen base as one module whose forward is one step's loss, Σ over tasks of
    `coefficient_loss`: what the in-process fit and the Ray workers' DeepSpeed engine both train. The base is
    kept outside the module's parameters (θ(c) replaces its changed tensors in each forward): DeepSpeed sees,
    and ZeRO-3 partitions, only the merge's task vectors and coefficients."""

    def __init__(self, base: PreTrainedModel, vectors: TaskVectors, init: Sequence[float],
                 settings: CalibrationSection) -> None:
        super().__init__()
        coefficients = settings.coefficients
        self.layers = list(coefficients.layers)
        self.owned = owned_layers(vectors, self.layers)
        if not any(self.owned.values()):
            raise DartsError(f"no expert changed any of the aligned layers {self.layers}: the coefficients would "
                             "not move", "align where the experts differ from the base: "
                             "calibration.coefficients.layers: [changed, final]")
        if coefficients.logit_weight and "final" not in self.layers:
            raise DartsError("calibration.coefficients.logit_weight needs the experts' final hidden states",
                             "add final to calibration.coefficients.layers, or set logit_weight to 0")
        self.merge = LayerwiseMerge(vectors, init, [lm_head_name(base)] if coefficients.logit_weight else [])
        self.settings = settings
        object.__setattr__(self, "base", base)  # not a submodule: DeepSpeed must not wrap or partition it

    def trained(self) -> list[nn.Parameter]:
        return [self.merge.coefficients]

    def save_trained(self, folder: Path) -> None:
        save_file({"coefficients": self.merge.coefficients.detach().cpu().contiguous()},
                  str(folder / CHECKPOINT_COEFFICIENTS))

    def forward(self, minibatches: Sequence[tuple[str, Mapping[str, object]]]) -> torch.Tensor:
        tensors = self.merge()
        settings = self.settings
        loss = torch.zeros((), device=self.merge.coefficients.device)
        for task, rows in minibatches:
            loss = loss + coefficient_loss(self.base, tensors, rows, self.merge.experts.index(task), self.layers,
                                           self.owned[task], settings.beta_for(task), settings.weight_on_for(task),
                                           settings.coefficients.logit_weight)
        return loss


@dataclass
class CoefficientFit:
    coefficients: torch.Tensor  # c [L + 1, K]
    experts: tuple[str, ...]
    changed: tuple[str, ...]  # the tensors some expert changed: where the coefficients act
    losses: list[float]
    seconds: float
    layers: list[LayerKey]  # the aligned layers
    owned: dict[str, list[LayerKey]]
    task_vector_bytes: int

    def table(self) -> dict[str, dict[str, float]]:
        return coefficient_table(self.coefficients, self.experts)


def fit_coefficients(
    features: Sequence[TaskFeatures], model: PreTrainedModel, vectors: TaskVectors, init: Sequence[float],
    settings: CalibrationSection, progress: bool = True, on_step: StepCallback | None = None,
) -> CoefficientFit:
    """Adam on the coefficients in this process, one random minibatch of every task per step (DARTS's schedule
    and seed: the Ray workers' fit takes the same steps).

    `model` is the base (frozen); each task's features hold its expert's hidden states at
    `fit_layers(settings.coefficients.layers)`.
    """
    module = CoefficientModule(model, vectors, init, settings).to(next(model.parameters()).device)
    optimizer = torch.optim.Adam([module.merge.coefficients], lr=settings.coefficients.learning_rate)
    generator = torch.Generator().manual_seed(settings.seed)
    losses: list[float] = []
    started = time.perf_counter()
    bar = progress_bar(range(settings.coefficients.steps), desc="merge coefficients", unit="step", disable=not progress)
    for step in bar:
        optimizer.zero_grad(set_to_none=True)
        device = module.merge.coefficients.device
        total = module([(task.task, task.rows(index, device))
                        for task, index, _ in step_minibatches(features, settings.batch_size, generator)])
        total.backward()
        optimizer.step()
        losses.append(float(total.detach()) / len(features))
        bar.set_postfix(loss=f"{losses[-1]:.4f}")
        if on_step is not None:
            on_step(step + 1, {"coefficient_loss": losses[-1]})
    return CoefficientFit(module.merge.coefficients.detach().cpu(), vectors.experts, tuple(vectors.deltas), losses,
                          time.perf_counter() - started, module.layers, module.owned, vectors.nbytes())


def layerwise_mergekit_config(base: Path, experts: Mapping[str, Path], fit: CoefficientFit, dtype: str) -> dict:
    """mergekit's task_arithmetic with one weight per expert and decoder layer: a filter per changed layer
    (its tensors' name prefix, e.g. "model.layers.3."), then the OTHER group's weight for every other tensor."""
    table = fit.coefficients.tolist()
    num_layers = len(table) - 1
    prefixes = {layer_group(name, num_layers): layer_prefix(name) for name in fit.changed if layer_prefix(name)}

    def weights(k: int) -> list[dict[str, object]]:
        conditions = [{"filter": prefixes[g], "value": table[g][k]} for g in sorted(prefixes)]
        return [*conditions, {"value": table[num_layers][k]}]

    return build_mergekit_config(base, experts, "task_arithmetic", parameters={"normalize": False},
                                 expert_parameters={t: {"weight": weights(k)} for k, t in enumerate(fit.experts)},
                                 dtype=dtype)


def learned_merge(
    config: RunConfig, base: Path, experts: Mapping[str, Path], fit: CoefficientFit, out_dir: Path,
) -> Path:
    """The learned merge as a model folder (mergekit's own output of the layer-wise YAML, which it keeps as
    mergekit_config.yml) with the coefficients and the fit's losses in coefficients.json."""
    merged = run_merge(layerwise_mergekit_config(base, experts, fit, config.merge.dtype), out_dir, overwrite=True,
                       device=config.merge.device)
    with atomic_file(merged / COEFFICIENTS_FILE) as tmp:
        tmp.write_text(json.dumps({"experts": list(fit.experts), "coefficients": fit.table(),
                                   "layers": [str(k) for k in fit.layers],
                                   "owned": {e: [str(k) for k in ks] for e, ks in fit.owned.items()},
                                   "losses": fit.losses, "seconds": fit.seconds}, indent=1))
    return merged


def fit_in_process(
    config: RunConfig, sources: ResolvedSources, progress: bool = True, on_step: StepCallback | None = None,
) -> CoefficientFit:
    """The coefficients' fit in this process (cluster.executor in-process; on Ray: `fit_coefficients_distributed`).

    Memory: the base model, plus its changed tensors and their K task vectors in fp32, plus one expert at a
    time while its hidden states at the fit's layers are collected (those are kept).
    """
    settings = config.calibration
    device = resolve_device(settings.device)
    dtype = model_dtype(settings.dtype, device)
    vectors = read_task_vectors(sources.base, sources.experts).to(device)
    logger.info("merge coefficients: %d experts changed %d tensors (%d decoder layers); task vectors %.1f MiB",
                len(vectors.experts), len(vectors.deltas), len(vectors.changed_layers()), vectors.nbytes() / 2**20)
    layers = fit_layers(settings.coefficients.layers, vectors.num_layers)
    features = []
    for index, (task, data) in enumerate(calibration_sets(config, sources.data, load_tokenizer(sources.base)).items()):
        expert = load_causal_lm(sources.experts[task], dtype=dtype, device=device)
        features.append(collect_features(task, index, data, expert, None, layers, settings.batch_size, progress))
        del expert
        gc.collect()
    base = load_causal_lm(sources.base, dtype=dtype, device=device)
    return fit_coefficients(features, base, vectors, initial_coefficients(config), settings, progress, on_step)
