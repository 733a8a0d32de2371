"""Calibration features: expert targets h^k with entropy H and merged states h^m, per task.

The in-process loop and the Ray expert actors and workers compute them with these functions; the merged
states and the router's pooled prompt features, which serving computes too, are core's (`core.hooks`,
`core.router`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch
from transformers import PreTrainedModel

from darts_dist.core import (
    LayerKey,
    TokenizedSet,
    capture_hidden,
    mask_positions,
    merged_hidden,
    next_token_entropy,
    top_k_log_probs,
)
from darts_dist.logs import progress_bar


@torch.no_grad()
def expert_targets(
    model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor, layers: Sequence[LayerKey],
    top_k: int = 0,
) -> tuple[dict[LayerKey, torch.Tensor], torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """Expert k's hidden states at each surgery layer, in its compute dtype (they are upcast where they are used,
    `TaskFeatures.rows`, not before they travel), its next-token entropy H_t (fp32), and with `top_k` its top_k
    likeliest next tokens' log-probabilities (fp32) and ids (int32), the logit term's targets (else None)."""
    with capture_hidden(model, layers) as hidden:
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
    return dict(hidden), next_token_entropy(logits), top_k_log_probs(logits, top_k) if top_k else None


HOST = torch.device("cpu")


def onto(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` on `device`; from the host to a GPU through pinned memory with a non-blocking copy (pageable memory
    is staged through a pinned buffer anyway, at about half the bandwidth), ordered before whatever the device's
    stream does with it next."""
    if device.type == "cuda" and tensor.device.type == "cpu":
        # Gathered into a dense pinned buffer in one copy (a strided tensor's own pin_memory() would pin its whole
        # span, and the device copy would then stage it through pageable memory after all).
        pinned = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        pinned.copy_(tensor)
        return pinned.to(device, non_blocking=True)
    return tensor.to(device)


@dataclass
class TaskFeatures:
    """Everything training needs about one task's calibration set, computed once.

    `targets` are the expert's hidden states h^k at each surgery layer; `merged` holds the
    merged model's h^m at the final representation when training can run on features alone
    (surgery only at the final norm), so the merged model is not run again each step.
    """

    task: str
    task_index: int
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_mask: torch.Tensor
    positions: torch.Tensor
    entropy: torch.Tensor
    targets: dict[LayerKey, torch.Tensor]
    merged: dict[LayerKey, torch.Tensor] = field(default_factory=dict)
    # Training through the model from its lowest corrected decoder layer: the trained model's hidden states
    # entering that layer ([N, S, d]), so the layers below run once, not at every step.
    start_hidden: torch.Tensor | None = None
    # The logit term's targets: the expert's likeliest next tokens' log-probabilities (fp32) and ids (int32),
    # [N, S, k] each (or `Ragged` rows, as the hidden states may be); None without one.
    top_log_p: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def rows(self, index: torch.Tensor, device: torch.device = HOST, logit_picks: torch.Tensor | None = None
             ) -> dict[str, object]:
        """A minibatch of rows on `device`, trimmed to its longest real sequence, its hidden states in fp32; with
        `logit_picks` ([rows, P] positions among each row's real tokens), the tokens the logit term is taken at.

        Hidden states may be kept in half precision or as `Ragged` rows (the Ray workers'); either way
        `v[index]` is the rows at `index`, padded, in the dtype they are kept in: they go to the device so (through
        pinned memory to a GPU, `onto`) and are upcast to fp32 there.
        """
        mask = self.attention_mask[index]
        length = int(mask.sum(dim=1).max())
        cut = slice(0, length)

        def hidden(values) -> torch.Tensor:
            return onto(values[index][:, cut], device).float()

        return {
            "input_ids": onto(self.input_ids[index][:, cut], device),
            "attention_mask": onto(mask[:, cut], device),
            "response_mask": onto(self.response_mask[index][:, cut], device),
            "positions": onto(self.positions[index][:, cut], device),
            "entropy": onto(self.entropy[index][:, cut], device),
            "targets": {k: hidden(v) for k, v in self.targets.items()},
            "merged": {k: hidden(v) for k, v in self.merged.items()},
            "start_hidden": None if self.start_hidden is None else hidden(self.start_hidden),
            "top_log_p": None if self.top_log_p is None else onto(self.top_log_p[index][:, cut], device).float(),
            "top_ids": None if self.top_ids is None else onto(self.top_ids[index][:, cut], device),
            "logit_picks": None if logit_picks is None else onto(logit_picks, device),
        }


@torch.no_grad()
def with_start_hidden(features: TaskFeatures, model: PreTrainedModel, start: int, batch_size: int) -> TaskFeatures:
    """`features` with `model`'s hidden states entering layer `start` (its layer start−1's output) on every row."""
    if start == 0:
        return features
    device = next(model.parameters()).device
    chunks = []
    for first in range(0, len(features), batch_size):
        index = torch.arange(first, min(first + batch_size, len(features)))
        hidden = merged_hidden(model, features.input_ids[index].to(device), features.attention_mask[index].to(device),
                               [start - 1])
        chunks.append(hidden[start - 1].cpu())
    return replace(features, start_hidden=torch.cat(chunks))


def _pad_cat(chunks: list[torch.Tensor], length: int) -> torch.Tensor:
    """Batches [b, L_j, ...] cut to their own longest row, stacked back into [N, length, ...]."""
    padded = [torch.nn.functional.pad(c, (0, 0) * (c.dim() - 2) + (0, length - c.shape[1])) for c in chunks]
    return torch.cat(padded)


def collect_features(
    task: str,
    task_index: int,
    data: TokenizedSet,
    expert: PreTrainedModel,
    merged: PreTrainedModel | None,
    layers: Sequence[LayerKey],
    batch_size: int,
    progress: bool = True,
    top_k: int = 0,
) -> TaskFeatures:
    """Run expert k (and, in feature mode, the merged model) once over task k's calibration set; with `top_k`, keep
    its likeliest next tokens for the logit term (`CalibrationSection.logit_targets`)."""
    device = next(expert.parameters()).device
    targets: dict[LayerKey, list[torch.Tensor]] = {k: [] for k in layers}
    entropies, top_log_p, top_ids = [], [], []
    batches = list(data.batches(batch_size))
    for batch in progress_bar(batches, desc=f"features {task}", unit="batch", disable=not progress):
        ids = batch["input_ids"].to(device)
        mask = batch["attention_mask"].to(device)
        hidden, entropy, top = expert_targets(expert, ids, mask, layers, top_k)
        entropies.append(entropy.cpu())
        if top is not None:
            top_log_p.append(top[0].cpu())
            top_ids.append(top[1].cpu())
        for k in layers:
            targets[k].append(hidden[k].cpu())
    length = data.input_ids.shape[1]
    attention_mask = data.attention_mask
    return TaskFeatures(
        task=task,
        task_index=task_index,
        input_ids=data.input_ids,
        attention_mask=attention_mask,
        response_mask=data.response_mask,
        positions=mask_positions(attention_mask),
        entropy=_pad_cat(entropies, length),
        targets={k: _pad_cat(v, length) for k, v in targets.items()},
        merged={} if merged is None else collect_merged(task, data, merged, layers, batch_size, progress),
        top_log_p=_pad_cat(top_log_p, length) if top_k else None,
        top_ids=_pad_cat(top_ids, length) if top_k else None,
    )


def collect_merged(
    task: str,
    data: TokenizedSet,
    merged: PreTrainedModel,
    layers: Sequence[LayerKey],
    batch_size: int,
    progress: bool = True,
) -> dict[LayerKey, torch.Tensor]:
    """The merged model's h^m over a calibration set, padded like it: TaskFeatures.merged in feature mode.

    Apart from the expert's pass, so several merges can share one expert pass (the ablation).
    """
    device = next(merged.parameters()).device
    states: dict[LayerKey, list[torch.Tensor]] = {k: [] for k in layers}
    for batch in progress_bar(list(data.batches(batch_size)), desc=f"merged features {task}", unit="batch",
                      disable=not progress):
        hidden = merged_hidden(merged, batch["input_ids"].to(device), batch["attention_mask"].to(device), layers)
        for k in layers:
            states[k].append(hidden[k].cpu())
    return {k: _pad_cat(v, data.input_ids.shape[1]) for k, v in states.items()}


