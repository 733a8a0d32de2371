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
from torch.func import functional_call
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from darts_dist.calibrate.features import TaskFeatures, collect_features
from darts_dist.calibrate.in_process import calibration_sets
from darts_dist.calibrate.loop import StepCallback, step_minibatches
from darts_dist.config import CalibrationSection, RunConfig
from darts_dist.core import (
    LayerKey,
    LayerwiseMerge,
    TaskVectors,
    capture_hidden,
    entropy_weights,
    fed_inputs,
    layer_prefix,
    run_from,
    weighted_l1_loss,
)
from darts_dist.errors import DartsError
from darts_dist.fsutil import atomic_file
from darts_dist.merge import build_mergekit_config, run_merge
from darts_dist.sources.models import load_causal_lm, load_tokenizer, model_dtype, read_model_info, resolve_device
from darts_dist.sources.references import ResolvedSources

logger = logging.getLogger(__name__)
COEFFICIENTS_FILE = "coefficients.json"  # in the learned merge's folder: the table and the fit's losses


def _tensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    for file in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as weights:
            for name in weights.keys():
                yield name, weights.get_tensor(name)


def read_task_vectors(base_dir: Path, experts: Mapping[str, Path]) -> TaskVectors:
    """τ_k of every tensor an expert changed, read one expert at a time (the base and the changed tensors stay)."""
    base = dict(_tensors(base_dir))
    changed: dict[str, dict[str, torch.Tensor]] = {}
    for task, folder in experts.items():
        changed[task] = {}
        for name, value in _tensors(folder):
            if name in base and value.shape == base[name].shape:
                delta = value.float() - base[name].float()
                if delta.any():
                    changed[task][name] = delta
    names = [name for name in base if any(name in deltas for deltas in changed.values())]
    deltas = {name: torch.stack([changed[t].get(name, torch.zeros(base[name].shape)) for t in experts])
              for name in names}
    return TaskVectors(tuple(experts), {name: base[name].float() for name in names}, deltas,
                       read_model_info(base_dir).num_layers)


def initial_coefficients(config: RunConfig) -> list[float]:
    """Where the fit starts: coefficients.init, else the run's task-arithmetic weights, else 1/K."""
    tasks, init = config.tasks, config.calibration.coefficients.init
    if init is not None:
        return [init] * len(tasks)
    if config.merge.method == "task_arithmetic" and config.merge.mergekit_yaml is None:
        shared = config.merge.parameters.get("weight", 1.0)
        return [float(e.merge_parameters.get("weight", shared)) for e in config.sources.experts]
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
    model: PreTrainedModel, tensors: Mapping[str, torch.Tensor], vectors: TaskVectors, rows: Mapping[str, object],
    expert: str, layers: Sequence[LayerKey], owned: Sequence[LayerKey], beta: float, weight_on: str,
    logit_weight: float,
) -> torch.Tensor:
    """One task's minibatch, layer by layer: each aligned layer of θ(c) runs on the expert's own input to it
    (teacher forcing, as in layer-wise distillation) and its output is pulled toward the expert's there, by the
    entropy-weighted L1 of DARTS's loss, at the layers the expert owns; plus logit_weight × the mean
    KL(expert ‖ merged) of the next-token distributions from the final states."""
    device = next(model.parameters()).device
    num_layers = vectors.num_layers
    mask = rows["attention_mask"].to(device)
    weights = entropy_weights(rows["entropy"].to(device), mask, beta,
                              rows["response_mask"].to(device) if weight_on == "response" else None)
    targets = {k: v.to(device) for k, v in rows["targets"].items()}
    start = min((k for k in layers if isinstance(k, int)), default=num_layers)
    inputs = {k: targets[input_layer(k, num_layers)] for k in layers
              if input_layer(k, num_layers) is not None and k != start}
    decoder = model.get_decoder()
    prefix = next(name for name, module in model.named_modules() if module is decoder) + "."
    inside = {name.removeprefix(prefix): t for name, t in tensors.items() if name.startswith(prefix)}
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
        lm = _param_name(model, head)
        merged_head = tensors.get(lm, head).float()
        expert_head = head.float()
        if lm in vectors.deltas:
            expert_head = vectors.base[lm] + vectors.deltas[lm][vectors.experts.index(expert)]
        counted = mask.bool()
        merged_logp = F.log_softmax(F.linear(hidden["final"][counted].float(), merged_head), -1)
        expert_logp = F.log_softmax(F.linear(targets["final"][counted], expert_head.to(device)), -1)
        loss = loss + logit_weight * F.kl_div(merged_logp, expert_logp, log_target=True, reduction="batchmean")
    return loss


@dataclass
class CoefficientFit:
    merge: LayerwiseMerge
    losses: list[float]
    seconds: float
    layers: list[LayerKey]  # the aligned layers
    owned: dict[str, list[LayerKey]]


def fit_coefficients(
    features: Sequence[TaskFeatures], model: PreTrainedModel, vectors: TaskVectors, init: Sequence[float],
    settings: CalibrationSection, progress: bool = True, on_step: StepCallback | None = None,
) -> CoefficientFit:
    """Adam on the coefficients, one random minibatch of every task per step (DARTS's schedule and seed).

    `model` is the base (frozen; θ(c) replaces its changed tensors in each forward); each task's features hold
    its expert's hidden states at `fit_layers(settings.coefficients.layers)`.
    """
    coefficients = settings.coefficients
    layers = list(coefficients.layers)
    owned = owned_layers(vectors, layers)
    if not any(owned.values()):
        raise DartsError(f"no expert changed any of the aligned layers {layers}: the coefficients would not move",
                         "align where the experts differ from the base: calibration.coefficients.layers: "
                         "[changed, final]")
    if coefficients.logit_weight and "final" not in layers:
        raise DartsError("calibration.coefficients.logit_weight needs the experts' final hidden states",
                         "add final to calibration.coefficients.layers, or set logit_weight to 0")
    merge = LayerwiseMerge(vectors, init).to(next(model.parameters()).device)
    optimizer = torch.optim.Adam(merge.parameters(), lr=coefficients.learning_rate)
    generator = torch.Generator().manual_seed(settings.seed)
    losses: list[float] = []
    started = time.perf_counter()
    bar = tqdm(range(coefficients.steps), desc="merge coefficients", unit="step", disable=not progress)
    for step in bar:
        optimizer.zero_grad(set_to_none=True)
        tensors = merge.tensors()
        total = torch.zeros(())
        for task, index in step_minibatches(features, settings.batch_size, generator):
            total = total + coefficient_loss(model, tensors, vectors, task.rows(index), task.task, layers,
                                             owned[task.task], settings.beta_for(task.task),
                                             settings.weight_on_for(task.task), coefficients.logit_weight)
        total.backward()
        optimizer.step()
        losses.append(float(total.detach()) / len(features))
        bar.set_postfix(loss=f"{losses[-1]:.4f}")
        if on_step is not None:
            on_step(step + 1, {"coefficient_loss": losses[-1]})
    return CoefficientFit(merge, losses, time.perf_counter() - started, layers, owned)


def layerwise_mergekit_config(base: Path, experts: Mapping[str, Path], merge: LayerwiseMerge, dtype: str) -> dict:
    """mergekit's task_arithmetic with one weight per expert and decoder layer: a filter per changed layer
    (its tensors' name prefix, e.g. "model.layers.3."), then the OTHER group's weight for every other tensor."""
    vectors, table = merge.vectors, merge.coefficients.detach().cpu().tolist()
    prefixes = {vectors.group(name): layer_prefix(name) for name in vectors.deltas if layer_prefix(name)}

    def weights(k: int) -> list[dict[str, object]]:
        conditions = [{"filter": prefixes[g], "value": table[g][k]} for g in sorted(prefixes)]
        return [*conditions, {"value": table[vectors.num_layers][k]}]

    return build_mergekit_config(base, experts, "task_arithmetic", parameters={"normalize": False},
                                 expert_parameters={t: {"weight": weights(k)} for k, t in enumerate(vectors.experts)},
                                 dtype=dtype)


def learned_merge(
    config: RunConfig, base: Path, experts: Mapping[str, Path], fit: CoefficientFit, out_dir: Path,
) -> Path:
    """The learned merge as a model folder (mergekit's own output of the layer-wise YAML, which it keeps as
    mergekit_config.yml) with the coefficients and the fit's losses in coefficients.json."""
    mergekit_config = layerwise_mergekit_config(base, experts, fit.merge, config.merge.dtype)
    merged = run_merge(mergekit_config, out_dir, overwrite=True)
    with atomic_file(merged / COEFFICIENTS_FILE) as tmp:
        tmp.write_text(json.dumps({"experts": list(fit.merge.vectors.experts), "coefficients": fit.merge.table(),
                                   "layers": [str(k) for k in fit.layers],
                                   "owned": {e: [str(k) for k in ks] for e, ks in fit.owned.items()},
                                   "losses": fit.losses,
                                   "seconds": fit.seconds}, indent=1))
    return merged


def coefficient_stage(
    config: RunConfig, sources: ResolvedSources, progress: bool = True, on_step: StepCallback | None = None,
) -> tuple[Path, CoefficientFit]:
    """Fit the coefficients in this process and write the learned merge to config.model_dir.

    Memory: the base model, plus its changed tensors and K task vectors of them in fp32, plus one expert at a
    time while its targets are collected (each expert's hidden states at the fit's layers are kept).
    """
    settings = config.calibration
    device = resolve_device(settings.device)
    dtype = model_dtype(settings.dtype, device)
    vectors = read_task_vectors(sources.base, sources.experts).to(device)
    logger.info("merge coefficients: %d experts changed %d tensors (%d decoder layers); task vectors %.1f MiB",
                len(vectors.experts), len(vectors.deltas), len(vectors.changed_layers()), vectors.nbytes() / 2**20)
    layers = fit_layers(settings.coefficients.layers, vectors.num_layers)
    tokenizer = load_tokenizer(sources.base)
    features = []
    for index, (task, data) in enumerate(calibration_sets(config, sources, tokenizer).items()):
        expert = load_causal_lm(sources.experts[task], dtype=dtype, device=device)
        features.append(collect_features(task, index, data, expert, None, layers, settings.batch_size, progress))
        del expert
        gc.collect()
    base = load_causal_lm(sources.base, dtype=dtype, device=device)
    fit = fit_coefficients(features, base, vectors, initial_coefficients(config), settings, progress, on_step)
    logger.info("merge coefficients: loss %.4f -> %.4f in %.1f s", fit.losses[0], fit.losses[-1], fit.seconds)
    return learned_merge(config, sources.base, sources.experts, fit, config.model_dir), fit
