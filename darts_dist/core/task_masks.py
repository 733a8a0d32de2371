"""Per-task models from task vectors alone, no data and no training: TALL masks and EMR-merging. Each is served with
the task id, as a per-task correction is, so they are the baselines a correction must beat at its own contract.

τ_t is expert t's task vector (θ_t − θ_base), over the tensors some expert changed (`TaskVectors`).

TALL masks (Wang et al., 2024, "Localizing Task Information for Improved Model Merging and Compression"): with a
merge's task vector τ_M = θ_merged − θ_base, task t keeps the merge's entries where its own vector dominates what the
merge added beside it, m_t = 1{|τ_t| ≥ λ·|τ_M − τ_t|}, and its model is θ_base + m_t ⊙ τ_M: one bit per changed
parameter per task.

EMR-merging (Huang et al., 2024, "EMR-Merging: Tuning-Free High-Performance Model Merging"): one unified vector
τ_U, per parameter the sign of Σ_t τ_t and the largest |τ_t| among the tasks of that sign; task t's mask
m_t = 1{τ_t · τ_U > 0} and rescaler s_t = Σ|τ_t| / Σ|m_t ⊙ τ_U| (over every changed parameter), and its model is
θ_base + s_t · m_t ⊙ τ_U: one bit per changed parameter and one number per task.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from darts_dist.core.coefficients import TaskVectors

TALL_LAMBDA = 0.4  # the middle of the paper's range (0.2-0.6; it picks λ per task on validation data)


def tall_deltas(vectors: TaskVectors, merged: Mapping[str, Tensor], task: int,
                lam: float = TALL_LAMBDA) -> dict[str, Tensor]:
    """Task `task`'s model as θ_base + these deltas: m_t ⊙ τ_M, with `merged` the merge's weights by name."""
    deltas = {}
    for name, stacked in vectors.deltas.items():
        merge = merged[name].float() - vectors.base[name]
        own = stacked[task]
        deltas[name] = torch.where(own.abs() >= lam * (merge - own).abs(), merge, torch.zeros_like(merge))
    return deltas


def emr_unified(vectors: TaskVectors) -> dict[str, Tensor]:
    """τ_U: per parameter, the elected sign (of Σ_t τ_t) times the largest |τ_t| among the tasks of that sign."""
    unified = {}
    for name, stacked in vectors.deltas.items():
        sign = torch.sign(stacked.sum(0))
        agreeing = torch.where(stacked * sign > 0, stacked.abs(), torch.zeros_like(stacked))
        unified[name] = sign * agreeing.amax(0)
    return unified


def emr_deltas(vectors: TaskVectors, unified: Mapping[str, Tensor], task: int) -> dict[str, Tensor]:
    """Task `task`'s model as θ_base + these deltas: s_t · m_t ⊙ τ_U."""
    masked = {name: torch.where(stacked[task] * unified[name] > 0, unified[name], torch.zeros_like(unified[name]))
              for name, stacked in vectors.deltas.items()}
    own = sum(float(stacked[task].abs().sum()) for stacked in vectors.deltas.values())
    kept = sum(float(delta.abs().sum()) for delta in masked.values())
    scale = own / kept if kept else 0.0
    return {name: scale * delta for name, delta in masked.items()}


def changed_parameters(vectors: TaskVectors) -> int:
    return sum(value.numel() for value in vectors.base.values())


def mask_bytes(vectors: TaskVectors, numbers: int = 0) -> int:
    """Bytes a task adds to what is served: one bit per changed parameter (packed), and `numbers` fp32 values."""
    return -(-changed_parameters(vectors) // 8) + 4 * numbers
