"""The calibration loss: expert entropy H_t, token weights w_t, and the weighted L1 between ĥ and h^k."""

from __future__ import annotations

import math

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


def top_k_log_probs(logits: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The k most likely next tokens at every position: their log-probabilities (fp32 [B, S, k]) and ids (int32).

    What an expert sends for the logit-level loss instead of its logits (a vocabulary's worth a token): with the mass
    they leave over, a distribution over k + 1 outcomes. One sequence at a time, as `next_token_entropy`.
    """
    values, ids = [], []
    for row in logits:
        top = torch.log_softmax(row.float(), dim=-1).topk(min(k, row.shape[-1]), dim=-1)
        values.append(top.values)
        ids.append(top.indices.int())
    if not values:
        empty = logits.new_zeros((*logits.shape[:2], min(k, logits.shape[-1])))
        return empty.float(), empty.int()
    return torch.stack(values), torch.stack(ids)


# The least mass the rest bucket holds: a sum of fp32 probabilities is only good to about 1e-7 anyway, and the floor
# keeps log q_rest and its gradient finite where the listed tokens hold (nearly) all of q.
REST_FLOOR = 1e-6


def _log_rest(log_p: Tensor) -> Tensor:
    """log(1 − Σ_i p_i) over the last axis, the log of the mass outside the listed tokens, at least log REST_FLOOR."""
    total = torch.logsumexp(log_p, dim=-1).clamp_max(math.log1p(-REST_FLOOR))
    return torch.log(-torch.expm1(total))  # log(1 − e^x), accurate near both ends


def top_k_kl(logits: Tensor, top_log_p: Tensor, top_ids: Tensor, mask: Tensor, weights: Tensor | None = None) -> Tensor:
    """KL(p ‖ q) per token between the expert's p, known on its top k tokens and their rest, and the model's q of
    `logits`, both taken over those k tokens and one bucket for the rest; its masked mean, weighted by w_t as the
    L1 is (fp32 scalar):

        KL_t = Σ_i p_i (log p_i − log q_i) + p_rest (log p_rest − log q_rest).

    With k the vocabulary size, the full KL(p ‖ q) (up to REST_FLOOR). Gradients reach `logits` only.
    """
    mask = mask.bool()
    log_q_all = torch.log_softmax(logits.float(), dim=-1)
    log_q = log_q_all.gather(-1, top_ids.long())
    log_p = top_log_p.float()
    p = log_p.exp()
    log_p_rest, log_q_rest = _log_rest(log_p), _log_rest(log_q)
    kl = (p * (log_p - log_q)).sum(-1) + log_p_rest.exp() * (log_p_rest - log_q_rest)
    m = mask.float() if weights is None else torch.where(mask, weights.float(), 0.0)
    total = torch.where(mask, kl * m, 0.0).sum()
    return total / m.sum().clamp_min(torch.finfo(torch.float32).tiny)
