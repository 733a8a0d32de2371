"""Fitting the task router (core.router) on the calibration prompts: scikit-learn's logistic regression on
the merged model's mean-pooled prompt states, standardised."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from sklearn.linear_model import LogisticRegression
from sklearn.preprocessing import StandardScaler
from torch import Tensor
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from darts_dist.config import RunConfig
from darts_dist.core import ROUTER_FILE, LayerKey, TaskRouter, fit_envelope, prompt_features
from darts_dist.errors import DartsError
from darts_dist.sources.data import TaskFiles, detect_format, prompts_of, split_rows
from darts_dist.sources.models import (
    compute_label,
    encode_prompt,
    load_causal_lm,
    load_tokenizer,
    model_compute,
    model_dtype,
    model_identity,
    pad_id,
    resolve_device,
)
from darts_dist.sources.output_cache import OutputCache, digest


def fit_router(
    features: Tensor, labels: Tensor, tasks: Sequence[str], layer: LayerKey, threshold: float = 0.5, l2: float = 1e-2,
    abstain_outside: bool = True,
) -> TaskRouter:
    """Multinomial logistic regression, features [N, d] -> labels [N] (task indices), on standardised features,
    and each task's envelope in the same standardised space (core.fit_envelope).

    The objective is the mean cross-entropy plus l2/2·‖W‖² over the K weight rows (scikit-learn's C = 1/(l2·N)):
    the penalty keeps the weights finite on separable data, so the confidence stays a probability and not a
    step function. Two tasks have one logit difference w = W₁ − W₀, and at the optimum W₁ = −W₀ = w/2, so the
    same penalty is l2/4·‖w‖²: C = 2/(l2·N). Deterministic (L-BFGS over the whole set).
    """
    labels = torch.as_tensor(labels, dtype=torch.long)
    if features.ndim != 2 or features.shape[0] != labels.shape[0]:
        raise DartsError(f"router features must be [N, d] with one label each, got {list(features.shape)} "
                         f"and {list(labels.shape)} labels")
    missing = sorted(set(range(len(tasks))) - set(labels.tolist()))
    if missing:
        raise DartsError(f"no routing examples for tasks {[tasks[i] for i in missing]}",
                         "give every task calibration prompts")
    x = features.double().cpu().numpy()
    scaler = StandardScaler().fit(x)  # a feature that never varies keeps scale 1 instead of blowing up
    model = LogisticRegression(C=(2.0 if len(tasks) == 2 else 1.0) / (l2 * len(x)), max_iter=1000, tol=1e-8)
    standardised = scaler.transform(x)
    model.fit(standardised, labels.numpy())
    weight, bias = torch.from_numpy(model.coef_), torch.from_numpy(model.intercept_)
    if len(tasks) == 2:  # scikit-learn keeps one row for two classes: logit(task 1) − logit(task 0)
        weight, bias = torch.cat([torch.zeros_like(weight), weight]), torch.cat([torch.zeros_like(bias), bias])
    envelope = fit_envelope(torch.from_numpy(standardised), labels, len(tasks))
    return TaskRouter(tasks, layer, torch.from_numpy(scaler.mean_), torch.from_numpy(scaler.scale_), weight, bias,
                      threshold, envelope, abstain_outside)


def task_prompts(
    files: TaskFiles, split: str, config: RunConfig, tokenizer: PreTrainedTokenizerBase
) -> list[list[int]]:
    """A task's prompts as a served request would tokenise them: calibration rows (the ones calibration
    trains on) or held-out rows, each cut to `calibration.max_length` tokens."""
    rows = split_rows(files, split, config.calibration)
    fmt = detect_format(rows, files.text_field) if files.format == "auto" else files.format
    # A prompt rendered with the chat template holds its special tokens already (as CorrectedLM.chat does).
    rendered = fmt != "text" and tokenizer.chat_template is not None
    encoded = [encode_prompt(tokenizer, p, rendered)[:config.calibration.max_length]
               for p in prompts_of(rows, tokenizer, fmt, files.text_field)]
    return [ids for ids in encoded if ids]


def _labelled_features(
    tasks: Sequence[str], prompts: Mapping[str, list[list[int]]], known: Mapping[str, Tensor],
    model: Callable[[], PreTrainedModel], tokenizer: PreTrainedTokenizerBase, layer: LayerKey, batch_size: int,
    cache: OutputCache | None, identity: str,
) -> tuple[Tensor, Tensor]:
    """Pooled features of every task's prompts, with the task's index as the label: a task's `known` features
    where calibration pooled them already, else computed through the output cache when there is one (the
    merged model's features of the same prompts do not change between runs), so `model` is only called
    (loaded) for features not kept yet."""
    features, labels = [], []
    for index, task in enumerate(tasks):
        if task in known:
            pooled = known[task]
        elif prompts.get(task):
            def compute(task: str = task) -> dict[str, Tensor]:
                return {"features": prompt_features(model(), prompts[task], layer, pad_id(tokenizer), batch_size)}

            key = digest("prompt_features", identity, str(layer), batch_size, pad_id(tokenizer), prompts[task])
            pooled = compute()["features"] if cache is None else cache.tensors(key, compute)["features"]
        else:
            continue
        features.append(pooled)
        labels.append(torch.full((len(pooled),), index, dtype=torch.long))
    return torch.cat(features), torch.cat(labels)


def router_features(
    config: RunConfig, data: Mapping[str, TaskFiles], merged_dir: Path, layer: LayerKey, known: Mapping[str, Tensor],
    model: PreTrainedModel | None = None,
) -> tuple[dict[str, tuple[Tensor, Tensor]], dict[str, int], str]:
    """Labelled features (pooled prompt states, task indices) by split: the calibration prompts (`known` tasks' as
    given) and, where there is held-out data, the held-out ones; the output cache's counts; and where the merged
    model computes (`compute_label`). The merged model (`model`, else loaded on first need, once for both splits)
    runs only for features the cache does not hold."""
    settings, tasks = config.calibration, config.tasks
    tokenizer = load_tokenizer(merged_dir)
    device = resolve_device(settings.device)
    dtype = model_dtype(settings.dtype, device)
    cache = OutputCache() if config.evaluation.cache else None
    identity = model_identity(merged_dir, dtype, device) if cache is not None else ""
    loaded = [] if model is None else [model]

    def merged() -> PreTrainedModel:
        if not loaded:
            loaded.append(load_causal_lm(merged_dir, dtype=dtype, device=device))
        return loaded[0]

    splits = {"calibration": known, **({"heldout": {}} if any(f.heldout is not None for f in data.values()) else {})}
    labelled = {}
    for split, given in splits.items():
        prompts = {task: task_prompts(data[task], split, config, tokenizer) for task in tasks
                   if task not in given and (split != "heldout" or data[task].heldout is not None)}
        features, labels = _labelled_features(tasks, prompts, given, merged, tokenizer, layer, settings.batch_size,
                                              cache, identity)
        labelled[split] = (features.cpu(), labels)
    counts = cache.counts() if cache is not None else {"hits": 0, "misses": 0}
    return labelled, counts, model_compute(model) if model is not None else compute_label(device, dtype)


def fit_run_router(
    config: RunConfig, data: Mapping[str, TaskFiles], merged_dir: Path, layer: LayerKey,
    model: PreTrainedModel | None = None, calibration_features: Mapping[str, Tensor] | None = None,
) -> dict[str, Any]:
    """Fit the router on the run's calibration prompts, save RUN_DIR/router.safetensors, and report it.

    `calibration_features`: tasks' prompt features at `layer` that calibration pooled from its own merged
    forwards (`CalibrationOutcome.prompt_features`); the merged model runs only for the other tasks' prompts.
    With the models on GPU actors (`config.models_on_gpus`) it runs in a Ray task with an expert actor's
    resources, never on the driver (a cluster's head: no GPU, and a 7B model in fp32 is 27 GB).

    With held-out data (of any task) the report has `accuracy` (top task = true task, whatever the
    confidence), `per_task`, and the shares of held-out prompts below the threshold, outside their top task's
    envelope, and (either, as the router is set) given no correction.
    """
    tasks, path = config.tasks, config.run_dir / ROUTER_FILE
    calibration_features = {task: pooled for task, pooled in (calibration_features or {}).items() if len(pooled)}
    args = (config, data, merged_dir, layer, calibration_features)
    if config.models_on_gpus and model is None:
        from darts_dist.ray_cluster.remote import run_as_expert

        labelled, counts, compute = run_as_expert(config.cluster, "the router's merged model", router_features, *args)
    else:
        labelled, counts, compute = router_features(*args, model)
    features, labels = labelled["calibration"]
    router = fit_router(features, labels, tasks, layer, threshold=config.serve.router_threshold,
                        abstain_outside=config.serve.router_abstain_outside)
    train_accuracy = router.accuracy(features, labels)
    router.save(path, metadata={"train_accuracy": train_accuracy, "train_prompts": len(labels)})
    report: dict[str, Any] = {"path": str(path), "layer": layer, "threshold": router.threshold,
                              "train_accuracy": train_accuracy, "compute": compute}
    if "heldout" in labelled:
        features, labels = labelled["heldout"]
        report["accuracy"] = router.accuracy(features, labels)
        report["per_task"] = {task: router.accuracy(features[labels == i], labels[labels == i])
                              for i, task in enumerate(tasks) if (labels == i).any()}
        routing = router.route(features)
        report["below_threshold"] = float((routing.confidence < router.threshold).float().mean())
        report["outside_envelope"] = float(routing.outside.float().mean())
        report["no_correction"] = float((routing.task < 0).float().mean())
    if calibration_features:
        report["features_from_calibration"] = sorted(calibration_features)
    if config.evaluation.cache:
        report["output_cache"] = counts
    return report
