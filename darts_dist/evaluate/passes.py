"""The forward passes of evaluation and their tallies: representation bias by position and NLL, merged vs.
corrected vs. expert, on one batch at a time.

The expert's side of a batch (`reference`) is computed once and compared with any number of merged
models and corrections (`merged_outputs`, `corrected_outputs`); `TaskTally` sums a task's results.
What a pass keeps (`reference`, `merged_outputs`) leaves the model's device with its batch, hidden states in the
model's own dtype (a bf16 model's are kept at half an fp32 copy's bytes, and exactly): a held-out set's passes sit
in host memory, and a batch returns to the device only while a correction is judged on it; the corrected outputs
(`corrected_outputs`) are judged there and let go.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields

import numpy as np
import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from darts_dist.core import (
    BucketMeans,
    DartsCorrections,
    LayerKey,
    attach_corrections,
    capture_hidden,
    entropy_weights,
    features_only,
    mask_positions,
    next_token_entropy,
    token_bias,
    token_nll,
)
from darts_dist.evaluate.statistics import nll_gap, paired_mean_difference_sd

LATE_POSITION = 64


@dataclass
class _NllSum:
    """Each row's summed NLL and token count (float64, host): the mean over tokens, and rows to resample."""

    sums: list[torch.Tensor] = field(default_factory=list)
    counts: list[torch.Tensor] = field(default_factory=list)

    def add(self, nll: torch.Tensor, mask: torch.Tensor) -> None:
        self.sums.append((nll.double() * mask).sum(-1).cpu())
        self.counts.append(mask.double().sum(-1).cpu())

    def rows(self) -> tuple[np.ndarray, np.ndarray]:
        if not self.sums:
            return np.zeros(0), np.zeros(0)
        return torch.cat(self.sums).numpy(), torch.cat(self.counts).numpy()

    @property
    def count(self) -> int:
        return int(sum(float(c.sum()) for c in self.counts))

    @property
    def mean(self) -> float:
        return sum(float(s.sum()) for s in self.sums) / max(self.count, 1)


def _gap_sd(merged: _NllSum, expert: _NllSum) -> float:
    """The bootstrap sd of the merged-minus-expert NLL, over the task's rows (the same tokens on both sides)."""
    (merged_sums, counts), (expert_sums, _) = merged.rows(), expert.rows()
    return paired_mean_difference_sd(merged_sums - expert_sums, counts)


def _reduction(before: float, after: float) -> float | None:
    """1 − after/before; None when there was no bias to remove (or no tokens, e.g. no late positions)."""
    if not math.isfinite(before) or not math.isfinite(after) or before == 0:
        return None
    return 1.0 - after / before


@dataclass
class Reference:
    """The expert's side of one held-out batch, computed once and compared with any number of merged models.

    `weights` are the expert's entropy weights with β = 1; `nll_mask` marks the predictions NLL counts.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    positions: torch.Tensor
    hidden: torch.Tensor
    weights: torch.Tensor
    nll: torch.Tensor
    nll_mask: torch.Tensor

    def to(self, device: torch.device) -> Reference:
        return Reference(**{f.name: getattr(self, f.name).to(device) for f in fields(self)})


@dataclass
class Outputs:
    """A merged model's side of one batch, plain or corrected: h at the bias layer (in the model's dtype) and the
    per-token NLL (fp32)."""

    hidden: torch.Tensor
    nll: torch.Tensor

    def to(self, device: torch.device) -> Outputs:
        return Outputs(hidden=self.hidden.to(device), nll=self.nll.to(device))


HOST = torch.device("cpu")  # where a pass's results are kept between batches


def _device(model: PreTrainedModel) -> torch.device:
    return next(model.parameters()).device


@torch.no_grad()
def reference(expert: PreTrainedModel, batch: Mapping[str, torch.Tensor], layer: LayerKey) -> Reference:
    """Run the expert once over a batch (input_ids, attention_mask, response_mask)."""
    device = _device(expert)
    ids = batch["input_ids"].to(device)
    mask = batch["attention_mask"].to(device)
    targets = batch["response_mask"].to(device)  # all real tokens for plain text
    with capture_hidden(expert, [layer]) as hidden:
        logits = expert(input_ids=ids, attention_mask=mask).logits
    nll, nll_mask = token_nll(logits, ids, mask, targets)
    return Reference(
        input_ids=ids,
        attention_mask=mask,
        positions=mask_positions(mask),
        hidden=hidden[layer],
        weights=entropy_weights(next_token_entropy(logits), mask, 1.0),
        nll=nll,
        nll_mask=nll_mask,
    ).to(HOST)


def _outputs(logits: torch.Tensor, hidden: torch.Tensor, input_ids: torch.Tensor, mask: torch.Tensor) -> Outputs:
    nll, _ = token_nll(logits, input_ids, mask)
    return Outputs(hidden=hidden, nll=nll)


@torch.no_grad()
def merged_outputs(merged: PreTrainedModel, batch: Mapping[str, torch.Tensor], layer: LayerKey) -> Outputs:
    """The uncorrected merged model on a batch (input_ids, attention_mask): a reference's or one of the same rows."""
    device = _device(merged)
    ids, mask = batch["input_ids"].to(device), batch["attention_mask"].to(device)
    with capture_hidden(merged, [layer]) as hidden:
        logits = merged(input_ids=ids, attention_mask=mask).logits
    return _outputs(logits, hidden[layer], ids, mask).to(HOST)


@torch.no_grad()
def corrected_outputs(
    merged: PreTrainedModel,
    ref: Reference,
    plain: Outputs,
    corrections: DartsCorrections,
    task_index: int,
    layer: LayerKey,
) -> Outputs:
    """The merged model under task `task_index`'s correction, on the reference's batch (kept on the host or not:
    it goes to the model's device for this pass), on that device.

    With surgery only at the final representation (and bias measured there), ĥ is the correction
    of the plain run's h^m and the logits are lm_head(ĥ), so no second forward pass is needed.
    Otherwise the merged model runs again with the corrections hooked in.
    """
    device = _device(merged)
    weights = torch.zeros(ref.input_ids.shape[0], len(corrections.spec.tasks), device=device)
    weights[:, task_index] = 1.0
    ids = ref.input_ids.to(device)
    if features_only(corrections.layer_keys) and layer == "final":
        head = merged.get_output_embeddings()
        # ĥ in the model's own dtype, as a forward with the corrections hooked in hands it to the head (they add in
        # fp32 and give back the input's dtype): the same logits, NLL and bias in any dtype.
        hidden = corrections["final"](plain.hidden.to(device), ref.positions.to(device), weights)
        # lm_head only where a prediction counts (not on padding or chat prompts): it is most of the cost.
        counted = ref.nll_mask.to(device)
        logits = head(hidden[:, :-1][counted].to(head.weight.dtype))
        nll = torch.zeros(counted.shape, device=device)
        nll[counted] = F.cross_entropy(logits.float(), ids[:, 1:][counted], reduction="none")
        return Outputs(hidden=hidden, nll=nll)
    with attach_corrections(merged, corrections) as handle, capture_hidden(merged, [layer]) as hidden:
        handle.set_task_weights(weights)
        logits = merged(input_ids=ids, attention_mask=ref.attention_mask.to(device)).logits
    return _outputs(logits, hidden[layer], ids, ref.attention_mask.to(device))


class TaskTally:
    """Running sums of one task's bias (plain, weighted, by position) and NLLs, across batches."""

    def __init__(self) -> None:
        self.bias = {side: BucketMeans() for side in ("before", "after")}
        self.weighted = {side: BucketMeans() for side in ("before", "after")}
        self.nll = {name: _NllSum() for name in ("expert", "merged", "corrected")}
        self.corrected = False

    def add(self, ref: Reference, plain: Outputs, corrected: Outputs | None = None) -> None:
        sides = {"before": plain} if corrected is None else {"before": plain, "after": corrected}
        for side, outputs in sides.items():
            values = token_bias(outputs.hidden, ref.hidden)
            self.bias[side].add(values, ref.positions, ref.attention_mask)
            self.weighted[side].add(values, ref.positions, ref.attention_mask, ref.weights)
        self.nll["expert"].add(ref.nll, ref.nll_mask)
        self.nll["merged"].add(plain.nll, ref.nll_mask)
        if corrected is not None:
            self.nll["corrected"].add(corrected.nll, ref.nll_mask)
            self.corrected = True

    def result(self, task: str, layer: LayerKey) -> dict[str, object]:
        bias, weighted, nll = self.bias, self.weighted, self.nll
        result: dict[str, object] = {
            "task": task,
            "layer": str(layer),
            "tokens": nll["merged"].count,
            "bias_before": bias["before"].overall(),
            "bias_before_by_position": bias["before"].means(),
            "nll_expert": nll["expert"].mean,
            "nll_merged": nll["merged"].mean,
            "nll_gap_sd": _gap_sd(nll["merged"], nll["expert"]),
        }
        closed, result["nll_no_gap"] = nll_gap(nll["expert"].mean, nll["merged"].mean,
                                               nll["corrected"].mean if self.corrected else None, result["nll_gap_sd"])
        if self.corrected:
            result.update({
                "bias_after": bias["after"].overall(),
                "bias_after_by_position": bias["after"].means(),
                "bias_reduction": _reduction(bias["before"].overall(), bias["after"].overall()),
                "weighted_bias_reduction": _reduction(weighted["before"].overall(), weighted["after"].overall()),
                "late_bias_reduction": _reduction(bias["before"].late(LATE_POSITION), bias["after"].late(LATE_POSITION)),
                "nll_corrected": nll["corrected"].mean,
                # Lower is better: (NLL_merged − NLL_corrected) / (NLL_merged − NLL_expert), where there is a gap.
                "nll_gap_closed": closed,
            })
        return result
