"""Held-out metrics per token: representation bias |h^m_t − h^k_t|, next-token NLL, means by position bucket."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

POSITION_BUCKETS: tuple[tuple[int, int | None], ...] = ((0, 15), (16, 31), (32, 63), (64, 127), (128, 255), (256, None))
BUCKET_LABELS: tuple[str, ...] = tuple(f"{lo}+" if hi is None else f"{lo}-{hi}" for lo, hi in POSITION_BUCKETS)


def token_bias(h_a: Tensor, h_b: Tensor) -> Tensor:
    """bias_t = mean_dims |h_a,t − h_b,t|: [B, S, d] twice -> [B, S] fp32."""
    return (h_a.float() - h_b.float()).abs().mean(-1)


def token_nll(
    logits: Tensor, input_ids: Tensor, mask: Tensor, target_mask: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """NLL_t = −log p(x_{t+1} | x_≤t), [B, S−1] fp32 (0 where not counted), and its mask.

    A prediction counts when both the context token and the predicted token are real and,
    given `target_mask` [B, S], the predicted token is a target (e.g. a response token:
    the prompt is context, not what a chat model is judged on).
    """
    mask = mask.bool()
    next_mask = mask[:, 1:] & mask[:, :-1]
    if target_mask is not None:
        next_mask = next_mask & target_mask[:, 1:].bool()
    V = logits.shape[-1]
    nll = F.cross_entropy(
        logits[:, :-1].float().reshape(-1, V), input_ids[:, 1:].reshape(-1), reduction="none"
    ).view(next_mask.shape)
    return torch.where(next_mask, nll, 0.0), next_mask


class BucketMeans:
    """Accumulates a per-token value's (weighted) mean by position, across batches.

    Sums are kept per exact position (float64), so buckets, the overall mean and the mean
    after any start position all come from the same totals.
    """

    def __init__(self) -> None:
        self.sums = torch.zeros(0, dtype=torch.float64)
        self.weights = torch.zeros(0, dtype=torch.float64)

    def add(self, values: Tensor, positions: Tensor, mask: Tensor, weights: Tensor | None = None) -> None:
        """Adds Σ w·value and Σ w at each real token's position (all [B, S])."""
        mask = mask.bool().cpu()
        pos = positions.long().cpu()[mask]
        if pos.numel() == 0:
            return
        if (pos < 0).any():
            raise ValueError("positions of real tokens must be >= 0")
        w = torch.ones_like(pos, dtype=torch.float64) if weights is None else weights.double().cpu()[mask]
        v = values.double().cpu()[mask]
        size = max(int(pos.max()) + 1, self.sums.numel())
        self.sums = F.pad(self.sums, (0, size - self.sums.numel())) + torch.bincount(pos, v * w, size)
        self.weights = F.pad(self.weights, (0, size - self.weights.numel())) + torch.bincount(pos, w, size)

    def _mean(self, start: int, stop: int | None) -> float:
        total = self.weights[start:stop].sum().item()
        return self.sums[start:stop].sum().item() / total if total > 0 else math.nan

    def means(self) -> dict[str, float]:
        """Bucket label ("0-15", ..., "256+") -> mean; buckets with no tokens are left out."""
        out = {}
        for label, (lo, hi) in zip(BUCKET_LABELS, POSITION_BUCKETS):
            value = self._mean(lo, None if hi is None else hi + 1)
            if not math.isnan(value):
                out[label] = value
        return out

    def overall(self) -> float:
        """Mean over every token added (NaN if none)."""
        return self._mean(0, None)

    def late(self, start: int = 64) -> float:
        """Mean over positions >= start (NaN if none)."""
        return self._mean(start, None)
