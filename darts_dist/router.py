"""The task router: which task's correction a prompt needs, read off the merged model's own hidden states.

DARTS needs a task per request; the router removes that need (DESIGN.md §1, Inference). It is a
multinomial logistic regression on the mean-pooled hidden state of the prompt at the surgery layer,
features standardised, fit on the calibration prompts. Its softmax probability of the top task is
the confidence: at or above the threshold the request gets that task's correction, below it none.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import Tensor
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from darts_dist.config import RunConfig
from darts_dist.core.io import read_tagged_header, read_tagged_tensors, write_tagged
from darts_dist.data import calibration_split, detect_format, load_rows, prompts_of
from darts_dist.errors import DartsError
from darts_dist.features import LayerKey, merged_hidden, model_dtype, resolve_device
from darts_dist.models import load_causal_lm, load_tokenizer
from darts_dist.sources import ResolvedSources

# The task a request names to be routed; config.RESERVED_TASKS keeps it from being a real task's name.
ROUTED = "auto"
ROUTER_FILE = "router.safetensors"
FORMAT = "darts-dist-router"
FORMAT_VERSION = 1
_HEADER_KEYS = ("tasks", "layer", "hidden_size", "threshold", "metadata")


class Routing(NamedTuple):
    """The router's decision for a batch: task index per sequence (−1: below the threshold), its confidence,
    and every task's probability."""

    task: Tensor  # [B] long
    confidence: Tensor  # [B]
    probabilities: Tensor  # [B, K]


class TaskRouter:
    """softmax(W·(h − mean)/scale + b) over the tasks, for pooled prompt features h ∈ R^d."""

    def __init__(
        self,
        tasks: Sequence[str],
        layer: LayerKey,
        mean: Tensor,
        scale: Tensor,
        weight: Tensor,
        bias: Tensor,
        threshold: float = 0.5,
    ) -> None:
        if not 0.0 <= threshold <= 1.0:
            raise DartsError(f"the router threshold must be in [0, 1], got {threshold}")
        self.tasks = tuple(tasks)
        self.layer = layer
        self.mean, self.scale, self.weight, self.bias = mean.float(), scale.float(), weight.float(), bias.float()
        self.threshold = threshold

    @property
    def hidden_size(self) -> int:
        return self.mean.shape[0]

    def probabilities(self, hidden: Tensor) -> Tensor:
        """[B, d] pooled features -> [B, K] task probabilities."""
        x = (hidden.float().cpu() - self.mean) / self.scale
        return torch.softmax(x @ self.weight.T + self.bias, dim=-1)

    def route(self, hidden: Tensor, threshold: float | None = None) -> Routing:
        """The top task of each sequence, or −1 where its probability is below the threshold."""
        probabilities = self.probabilities(hidden)
        confidence, task = probabilities.max(dim=-1)
        cut = self.threshold if threshold is None else threshold
        return Routing(task.masked_fill(confidence < cut, -1), confidence, probabilities)

    def _tensors(self) -> dict[str, Tensor]:
        return {"mean": self.mean, "scale": self.scale, "weight": self.weight, "bias": self.bias}

    def save(self, path: Path, metadata: dict[str, Any] | None = None) -> Path:
        """The router as safetensors with a JSON header (tasks, layer, threshold), written atomically."""
        header = {"format": FORMAT, "version": FORMAT_VERSION, "tasks": list(self.tasks), "layer": self.layer,
                  "hidden_size": self.hidden_size, "threshold": self.threshold, "metadata": metadata or {}}
        return write_tagged(path, self._tensors(), header, "router")

    @classmethod
    def load(cls, path: Path) -> TaskRouter:
        """Read a router file, refusing one whose tensors do not fit its header."""
        path = Path(path)
        header = read_tagged_header(path, FORMAT, FORMAT_VERSION, _HEADER_KEYS, "router")
        K, d = len(header["tasks"]), header["hidden_size"]
        expected = {"mean": [d], "scale": [d], "weight": [K, d], "bias": [K]}
        tensors = read_tagged_tensors(path, expected, "router")
        return cls(header["tasks"], header["layer"], threshold=header["threshold"], **tensors)


def fit_router(
    features: Tensor,
    labels: Tensor,
    tasks: Sequence[str],
    layer: LayerKey,
    threshold: float = 0.5,
    steps: int = 300,
    l2: float = 1e-2,
) -> TaskRouter:
    """Multinomial logistic regression, features [N, d] -> labels [N] (task indices), by full-batch L-BFGS.

    Deterministic: the weights start at zero and every step sees the whole set. The L2 penalty keeps
    the weights finite on separable data, so the confidence stays a probability and not a step function.
    """
    labels = torch.as_tensor(labels, dtype=torch.long)
    if features.ndim != 2 or features.shape[0] != labels.shape[0]:
        raise DartsError(f"router features must be [N, d] with one label each, got {list(features.shape)} "
                         f"and {list(labels.shape)} labels")
    missing = sorted(set(range(len(tasks))) - set(labels.tolist()))
    if missing:
        raise DartsError(f"no routing examples for tasks {[tasks[i] for i in missing]}",
                         "give every task calibration prompts")
    x = features.float().cpu()
    mean = x.mean(dim=0)
    # A feature that never varies is left unscaled instead of blowing up.
    scale = x.std(dim=0, unbiased=False).clamp_min(1e-6)
    x = (x - mean) / scale
    weight = torch.zeros(len(tasks), x.shape[1], requires_grad=True)
    bias = torch.zeros(len(tasks), requires_grad=True)
    optimizer = torch.optim.LBFGS([weight, bias], max_iter=steps, history_size=20, line_search_fn="strong_wolfe",
                                  tolerance_grad=1e-9, tolerance_change=1e-12)

    def closure() -> Tensor:
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(x @ weight.T + bias, labels) + 0.5 * l2 * weight.pow(2).sum()
        loss.backward()
        return loss

    with torch.enable_grad():
        optimizer.step(closure)
    return TaskRouter(tasks, layer, mean, scale, weight.detach(), bias.detach(), threshold)


@torch.no_grad()
def prompt_features(
    model: PreTrainedModel, prompts: Sequence[Sequence[int]], layer: LayerKey, pad_id: int, batch_size: int = 8
) -> Tensor:
    """Each prompt's mean hidden state over its tokens at `layer`, [N, d] fp32 on the CPU.

    Right padding: every prompt keeps positions 0..n−1 and its causal attention never sees the pads,
    so a prompt's features do not depend on what it was batched with.
    """
    device = next(model.parameters()).device
    pooled = []
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start:start + batch_size]
        width = max(len(ids) for ids in chunk)
        input_ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for row, ids in enumerate(chunk):
            input_ids[row, :len(ids)] = torch.as_tensor(ids)
            mask[row, :len(ids)] = 1
        hidden = merged_hidden(model, input_ids.to(device), mask.to(device), [layer])[layer].cpu()
        weights = mask.unsqueeze(-1).float()
        pooled.append((hidden * weights).sum(dim=1) / weights.sum(dim=1))
    return torch.cat(pooled)


def task_prompts(
    config: RunConfig, sources: ResolvedSources, task: str, split: str, tokenizer: PreTrainedTokenizerBase
) -> list[list[int]]:
    """A task's prompts as a served request would tokenise them: calibration rows (the ones calibration
    trains on) or held-out rows, each cut to `calibration.max_length` tokens."""
    settings = config.calibration
    data = next(e for e in config.sources.experts if e.task == task).data
    files = sources.data[task]
    rows = load_rows(files.heldout if split == "heldout" else files.calibration, text_field=data.text_field)
    if split == "calibration":
        rows = calibration_split(rows, settings.validation_fraction, "calibration")
        rows = rows.select(range(min(settings.num_samples, len(rows))))
    fmt = detect_format(rows, data.text_field) if data.format == "auto" else data.format
    # A prompt rendered with the chat template holds its special tokens already (as CorrectedLM.chat does).
    rendered = fmt != "text" and tokenizer.chat_template is not None
    encoded = [tokenizer(p, add_special_tokens=not rendered, verbose=False)["input_ids"][:settings.max_length]
               for p in prompts_of(rows, tokenizer, fmt, data.text_field)]
    return [ids for ids in encoded if ids]


def _labelled_features(
    config: RunConfig, prompts: dict[str, list[list[int]]], model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase, layer: LayerKey,
) -> tuple[Tensor, Tensor]:
    """Pooled features of every task's prompts, with the task's index as the label."""
    pad_id = next(i for i in (tokenizer.pad_token_id, tokenizer.eos_token_id, 0) if i is not None)
    features, labels = [], []
    for index, task in enumerate(config.tasks):
        if prompts[task]:
            features.append(prompt_features(model, prompts[task], layer, pad_id, config.calibration.batch_size))
            labels.append(torch.full((len(prompts[task]),), index, dtype=torch.long))
    return torch.cat(features), torch.cat(labels)


def _accuracy(router: TaskRouter, features: Tensor, labels: Tensor) -> float:
    return float((router.probabilities(features).argmax(dim=-1) == labels).float().mean())


def fit_run_router(
    config: RunConfig, sources: ResolvedSources, merged_dir: Path, layer: LayerKey,
    model: PreTrainedModel | None = None,
) -> dict[str, Any]:
    """Fit the router on the run's calibration prompts, save RUN_DIR/router.safetensors, and report it.

    With held-out data (of any task) the report has `accuracy` (top task = true task, whatever the
    confidence), `per_task`, and `below_threshold` (the share of held-out prompts that would get no
    correction).
    """
    settings = config.calibration
    path = config.run_dir / ROUTER_FILE
    tokenizer = load_tokenizer(merged_dir)
    train = {task: task_prompts(config, sources, task, "calibration", tokenizer) for task in config.tasks}
    if model is None:  # a caller that holds the merged model already passes it
        device = resolve_device(settings.device)
        model = load_causal_lm(merged_dir, dtype=model_dtype(settings.dtype, device), device=device)
    features, labels = _labelled_features(config, train, model, tokenizer, layer)
    router = fit_router(features, labels, config.tasks, layer, threshold=config.serve.router_threshold)
    train_accuracy = _accuracy(router, features, labels)
    router.save(path, metadata={"train_accuracy": train_accuracy, "train_prompts": len(labels)})
    report: dict[str, Any] = {"path": str(path), "layer": layer, "threshold": router.threshold,
                              "train_accuracy": train_accuracy}
    heldout = {task: task_prompts(config, sources, task, "heldout", tokenizer)
               for task in config.tasks if sources.data[task].heldout is not None}
    if any(heldout.values()):
        features, labels = _labelled_features(config, {t: heldout.get(t, []) for t in config.tasks}, model,
                                              tokenizer, layer)
        report["accuracy"] = _accuracy(router, features, labels)
        report["per_task"] = {task: _accuracy(router, features[labels == i], labels[labels == i])
                              for i, task in enumerate(config.tasks) if heldout.get(task)}
        report["below_threshold"] = float((router.route(features).task < 0).float().mean())
    return report
