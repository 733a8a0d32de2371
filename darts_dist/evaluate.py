"""Held-out evaluation: representation bias by position and NLL, merged vs. corrected vs. expert."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from darts_dist.core import (
    BucketMeans,
    DartsCorrections,
    attach_corrections,
    capture_hidden,
    entropy_weights,
    next_token_entropy,
    token_bias,
    token_nll,
)
from darts_dist.calibrate import LayerKey, batch_positions
from darts_dist.data import TokenizedSet

LATE_POSITION = 64


@dataclass
class _NllSum:
    total: float = 0.0
    count: int = 0

    def add(self, nll: torch.Tensor, mask: torch.Tensor) -> None:
        self.total += float((nll * mask).sum())
        self.count += int(mask.sum())

    @property
    def mean(self) -> float:
        return self.total / max(self.count, 1)


def _reduction(before: float, after: float) -> float | None:
    """1 − after/before; None when there was no bias to remove (or no tokens, e.g. no late positions)."""
    if not math.isfinite(before) or not math.isfinite(after) or before == 0:
        return None
    return 1.0 - after / before


def _gap_closed(merged: float, corrected: float, expert: float) -> float | None:
    """(NLL_merged − NLL_corrected) / (NLL_merged − NLL_expert); undefined when the expert is no better."""
    gap = merged - expert
    return None if gap <= 0 else (merged - corrected) / gap


@torch.no_grad()
def evaluate_task(
    task: str,
    task_index: int,
    data: TokenizedSet,
    expert: PreTrainedModel,
    merged: PreTrainedModel,
    corrections: DartsCorrections | None,
    layer: LayerKey,
    batch_size: int,
    progress: bool = True,
) -> dict[str, object]:
    """Bias |h^m_t − h^k_t| at `layer` before and after correction, by position bucket, and NLLs.

    Bias counts every real token; NLL counts the predicted response tokens where the data
    marks a prompt/response boundary (chat), every token otherwise. The weighted form
    weights each token by the expert's entropy weight with β = 1, so it shows whether the
    correction removes bias where the expert is uncertain.
    """
    device = next(merged.parameters()).device
    bias = {name: BucketMeans() for name in ("before", "after")}
    weighted = {name: BucketMeans() for name in ("before", "after")}
    nll = {name: _NllSum() for name in ("expert", "merged", "corrected")}
    handle = attach_corrections(merged, corrections) if corrections is not None else None
    num_tasks = 0 if corrections is None else len(corrections.spec.tasks)
    try:
        for batch in tqdm(list(data.batches(batch_size)), desc=f"evaluate {task}", unit="batch", disable=not progress):
            ids = batch["input_ids"].to(device)
            mask = batch["attention_mask"].to(device)
            targets = batch["response_mask"].to(device)  # all real tokens for plain text
            positions = batch_positions(mask)
            with capture_hidden(expert, [layer]) as hidden:
                expert_logits = expert(input_ids=ids, attention_mask=mask).logits
            target = hidden[layer].float()
            weights = entropy_weights(next_token_entropy(expert_logits), mask, 1.0)
            runs = {"merged": None}
            if handle is not None:
                runs["corrected"] = torch.zeros(ids.shape[0], num_tasks, device=device)
                runs["corrected"][:, task_index] = 1.0
            for name, task_weights in runs.items():
                if handle is not None:
                    handle.set_task_weights(task_weights)
                with capture_hidden(merged, [layer]) as hidden:
                    logits = merged(input_ids=ids, attention_mask=mask).logits
                values = token_bias(hidden[layer], target)
                side = "before" if name == "merged" else "after"
                bias[side].add(values, positions, mask)
                weighted[side].add(values, positions, mask, weights)
                nll[name].add(*token_nll(logits, ids, mask, targets))
            nll["expert"].add(*token_nll(expert_logits, ids, mask, targets))
    finally:
        if handle is not None:
            handle.remove()
    result: dict[str, object] = {
        "task": task,
        "layer": str(layer),
        "tokens": nll["merged"].count,
        "bias_before": bias["before"].overall(),
        "bias_before_by_position": bias["before"].means(),
        "nll_expert": nll["expert"].mean,
        "nll_merged": nll["merged"].mean,
    }
    if handle is not None:
        result.update({
            "bias_after": bias["after"].overall(),
            "bias_after_by_position": bias["after"].means(),
            "bias_reduction": _reduction(bias["before"].overall(), bias["after"].overall()),
            "weighted_bias_reduction": _reduction(weighted["before"].overall(), weighted["after"].overall()),
            "late_bias_reduction": _reduction(bias["before"].late(LATE_POSITION), bias["after"].late(LATE_POSITION)),
            "nll_corrected": nll["corrected"].mean,
            "nll_gap_closed": _gap_closed(nll["merged"].mean, nll["corrected"].mean, nll["expert"].mean),
        })
    return result


OVERALL_KEYS = (
    "bias_before", "bias_after", "bias_reduction", "weighted_bias_reduction", "late_bias_reduction",
    "nll_expert", "nll_merged", "nll_corrected", "nll_gap_closed",
)


def overall(tasks: Mapping[str, Mapping[str, object]]) -> dict[str, float | None]:
    """Unweighted mean over tasks, so every task counts the same whatever its length."""
    summary: dict[str, float | None] = {}
    for key in OVERALL_KEYS:
        values = [t[key] for t in tasks.values() if t.get(key) is not None]
        summary[key] = sum(values) / len(values) if values else None
    return summary


def evaluation_rows(tasks: Mapping[str, Mapping[str, object]], columns: Sequence[str]) -> list[list[str]]:
    """Table rows (one per task, then the overall mean) with numbers formatted for people."""
    def fmt(key: str, value: object) -> str:
        if value is None or not math.isfinite(float(value)):
            return "-"
        if key.endswith(("reduction", "closed")):
            return f"{100 * float(value):.1f}%"
        return f"{float(value):.4f}"

    rows = [[name] + [fmt(c, result.get(c)) for c in columns] for name, result in tasks.items()]
    mean = overall(tasks)
    rows.append(["overall"] + [fmt(c, mean.get(c)) for c in columns])
    return rows
