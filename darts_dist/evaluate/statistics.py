"""How sure a task score is: 95% intervals, the paired test of corrected against merged, the gap closed.

Scores are pass/fail per problem, so a score is a binomial proportion (Wilson's interval, which
stays inside [0, 1] and is honest at 0% and 100%), and two models answering the same problems are
compared pair by pair: only the problems where exactly one of them passes say anything, and under
"no difference" each of those is a fair coin (McNemar's exact test, a two-sided binomial test).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from scipy.stats import binomtest

CONFIDENCE = 0.95
BOOTSTRAP_SAMPLES = 4000


def wilson_interval(passes: Sequence[bool], confidence: float = CONFIDENCE) -> tuple[float, float]:
    """The Wilson score interval of the pass rate; (0, 1) when there is no problem at all."""
    if not passes:
        return 0.0, 1.0
    interval = binomtest(sum(map(bool, passes)), len(passes)).proportion_ci(confidence, method="wilson")
    return float(interval.low), float(interval.high)


@dataclass(frozen=True)
class PairedComparison:
    """A model against another on the same problems: where only it passes (wins), only the other (losses)."""

    wins: int
    losses: int
    pvalue: float  # McNemar's exact two-sided p-value; 1.0 when no problem tells them apart


def paired_comparison(model: Sequence[bool], other: Sequence[bool]) -> PairedComparison:
    """McNemar's exact test of `model` against `other`, both pass/fail on the same problems in the same order."""
    if len(model) != len(other):
        raise ValueError(f"paired results need the same problems: {len(model)} against {len(other)}")
    wins = sum(bool(a) and not bool(b) for a, b in zip(model, other))
    losses = sum(bool(b) and not bool(a) for a, b in zip(model, other))
    pvalue = 1.0 if wins + losses == 0 else float(binomtest(wins, wins + losses, 0.5).pvalue)
    return PairedComparison(wins, losses, pvalue)


def passes_text(passes: Sequence[bool]) -> str:
    """Pass/fail per problem as a string of 1s and 0s: how reports keep them for later paired tests."""
    return "".join("1" if passed else "0" for passed in passes)


def passes_of(text: str) -> list[bool]:
    return [character == "1" for character in text]


def gap_closed(expert: float, merged: float, corrected: float) -> float | None:
    """The share of the expert's lead over the merged model the correction wins back; None when there is none."""
    gap = expert - merged
    return None if gap <= 0 else (corrected - merged) / gap


# The merge's NLL within this many bootstrap sds of the expert's: no gap to close (a ratio over a difference
# inside the noise is noise: 0.1752 against 0.1747 read as "−534% closed").
NO_GAP_SDS = 2.0


def nll_gap(expert: float, merged: float, corrected: float | None, gap_sd: float) -> tuple[float | None, bool]:
    """(the NLL gap closed, whether there is no gap): lower NLL is better, and the expert's lead counts only where
    it is beyond NO_GAP_SDS sds of the merged-minus-expert difference (`paired_mean_difference_sd`)."""
    if merged - expert <= NO_GAP_SDS * gap_sd:
        return None, True
    return (None if corrected is None else gap_closed(-expert, -merged, -corrected)), False


def _resampled_ratios(values: np.ndarray, counts: np.ndarray, seed: int) -> np.ndarray:
    """BOOTSTRAP_SAMPLES draws of Σ values / Σ counts, rows resampled with replacement (seeded)."""
    rng, chunk = np.random.default_rng(seed), max(1, (1 << 22) // len(counts))  # ≤ 4 M indices at a time
    means = []
    for start in range(0, BOOTSTRAP_SAMPLES, chunk):
        rows = rng.integers(0, len(counts), size=(min(chunk, BOOTSTRAP_SAMPLES - start), len(counts)))
        means.append(values[rows].sum(axis=1) / np.maximum(counts[rows].sum(axis=1), 1))
    return np.concatenate(means)


def paired_mean_difference_sd(differences: np.ndarray, counts: np.ndarray, seed: int = 0) -> float:
    """The bootstrap sd of Σ differences / Σ counts, rows resampled: a per-token mean difference of two models
    scored on the same rows (each row's summed difference and its token count). 0 with fewer than two rows."""
    if len(counts) < 2:
        return 0.0
    return float(_resampled_ratios(differences, counts, seed).std())


def ratio_interval(values: Sequence[float], counts: Sequence[int], confidence: float = CONFIDENCE,
                   seed: int = 0) -> tuple[float, float]:
    """The percentile bootstrap interval of a per-token mean Σ values / Σ counts, rows resampled (a set's NLL or
    token agreement, each row's sum and its token count). Seeded: reproducible."""
    ratios = _resampled_ratios(np.asarray(values, dtype=float), np.asarray(counts, dtype=float), seed)
    tail = (1 - confidence) / 2
    return float(np.quantile(ratios, tail)), float(np.quantile(ratios, 1 - tail))


def mean_score_interval(
    passes_by_task: Mapping[str, Sequence[bool]], confidence: float = CONFIDENCE, seed: int = 0,
) -> tuple[float, float]:
    """The interval of the mean over tasks of their pass rates (every task counts the same, as in `overall`): a
    stratified percentile bootstrap, each task's problems resampled within the task. Seeded: reproducible."""
    rng = np.random.default_rng(seed)
    means = np.zeros(BOOTSTRAP_SAMPLES)
    for passes in passes_by_task.values():
        outcome = np.asarray(passes, dtype=float)
        means += outcome[rng.integers(0, len(outcome), size=(BOOTSTRAP_SAMPLES, len(outcome)))].mean(axis=1)
    means /= len(passes_by_task)
    tail = (1 - confidence) / 2
    return float(np.quantile(means, tail)), float(np.quantile(means, 1 - tail))
