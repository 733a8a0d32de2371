"""The calibration loss: expert entropy H_t, token weights w_t, and the weighted L1 between ĥ and h^k."""

from __future__ import annotations

import torch
from torch import Tensor


def next_token_entropy(logits: Tensor) -> Tensor:
    """H_t = −Σ_v p(v|x≤t)·log p(v|x≤t): [B, S, V] logits -> [B, S] fp32.

    One sequence at a time, so the fp32 copy of the logits is [S, V], not [B, S, V].
    """
    rows = []
    for row in logits:
        log_p = torch.log_softmax(row.float(), dim=-1)
        # A vocabulary entry masked to −inf has p = 0: clamping log p keeps 0·log 0 at 0 instead of NaN.
        rows.append(-(log_p.exp() * log_p.clamp_min(torch.finfo(torch.float32).min)).sum(-1))
    if not rows:
        return logits.new_zeros(logits.shape[:2], dtype=torch.float32)
    return torch.stack(rows)


def entropy_weights(
    entropy: Tensor, mask: Tensor, beta: float | Tensor, weight_mask: Tensor | None = None
) -> Tensor:
    """w_t = (1 − β) + β·H_t / mean(H over the batch's real tokens), fp32 [B, S].

    β is a float or one value per sequence [B]. Padding (mask False) gets w = 0. Where weight_mask
    is False (e.g. prompt tokens when only the response is weighted) w = 1 and that token's H stays
    out of the mean. If that mean is 0 (no entropy anywhere) the weights are uniform.
    """
    mask = mask.bool()
    weighted = mask if weight_mask is None else mask & weight_mask.bool()
    # torch.where, not a product: entropy at padding may be garbage (inf, NaN).
    H = torch.where(weighted, entropy.float(), 0.0)
    mean_H = H.sum() / weighted.sum().clamp_min(1)
    ratio = torch.where(mean_H > 0, H / mean_H.clamp_min(torch.finfo(torch.float32).tiny), 1.0)
    beta = torch.as_tensor(beta, dtype=torch.float32, device=H.device)
    if beta.ndim == 1:
        beta = beta[:, None]
    w = (1 - beta) + beta * ratio
    w = torch.where(weighted, w, 1.0)
    return torch.where(mask, w, 0.0)


def weighted_l1_loss(corrected: Tensor, target: Tensor, mask: Tensor, weights: Tensor | None = None) -> Tensor:
    """L = Σ_{b,t} mask·w·‖ĥ_{b,t} − h^k_{b,t}‖_1 / (d · Σ_{b,t} mask·w), fp32 scalar.

    weights None means w = 1: L is then the masked mean of |ĥ − h^k| over tokens and dims.
    """
    mask = mask.bool()
    d = corrected.shape[-1]
    l1 = (corrected.float() - target.float()).abs().sum(-1)
    m = mask.float() if weights is None else torch.where(mask, weights.float(), 0.0)
    # torch.where, not a product: hidden states at padding may be garbage (inf, NaN).
    total = torch.where(mask, l1 * m, 0.0).sum()
    return total / (d * m.sum()).clamp_min(torch.finfo(torch.float32).tiny)
