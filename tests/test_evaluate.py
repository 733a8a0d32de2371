"""Held-out evaluation: every number equals a direct computation on a small batch."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from darts_dist.core import CorrectionSpec, DartsCorrections, capture_hidden
from darts_dist.data import load_rows, tokenize_rows
from darts_dist.evaluate import evaluate_task, evaluation_rows, overall
from darts_dist.models import load_causal_lm
from darts_dist.sources import demo_data
from darts_dist.tiny import build_tiny_tokenizer


@pytest.fixture(scope="module")
def setup(tiny_family):
    merged = load_causal_lm(tiny_family.base)
    expert = load_causal_lm(tiny_family.experts["math"])
    data = tokenize_rows(load_rows(demo_data()["math"]["heldout"]), build_tiny_tokenizer(), "math", 140, 6)
    torch.manual_seed(1)
    corrections = DartsCorrections(CorrectionSpec(("code", "math"), 64, rank=4, max_positions=8), ["final"])
    with torch.no_grad():
        for p in corrections.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return merged, expert, data, corrections


def _nll(logits, ids, mask, response):
    """Mean NLL of the predicted response tokens (chat data: the prompt is context only)."""
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), reduction="none").view(ids.shape[0], -1)
    counted = (mask[:, 1:] * mask[:, :-1]).bool() & response[:, 1:]
    return float(loss[counted].mean())


def test_numbers_equal_a_direct_computation(setup) -> None:
    merged, expert, data, corrections = setup
    result = evaluate_task("math", 1, data, expert, merged, corrections, "final", batch_size=4, progress=False)

    ids, mask = data.input_ids, data.attention_mask
    real = mask.bool()
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        with capture_hidden(expert, ["final"]) as h:
            expert_logits = expert(input_ids=ids, attention_mask=mask).logits
        h_k = h["final"]
        with capture_hidden(merged, ["final"]) as h:
            merged_logits = merged(input_ids=ids, attention_mask=mask).logits
        h_m = h["final"]
        one_hot = torch.tensor([[0.0, 1.0]]).expand(ids.shape[0], 2)
        h_hat = corrections["final"](h_m, positions, one_hot)
        corrected_logits = merged.lm_head(h_hat)

    before = (h_m - h_k).abs().mean(-1)
    after = (h_hat - h_k).abs().mean(-1)
    assert result["bias_before"] == pytest.approx(float(before[real].mean()), rel=1e-4)
    assert result["bias_after"] == pytest.approx(float(after[real].mean()), rel=1e-4)
    assert result["bias_reduction"] == pytest.approx(1 - float(after[real].mean() / before[real].mean()), rel=1e-4)
    early = real & (positions <= 15)
    assert result["bias_before_by_position"]["0-15"] == pytest.approx(float(before[early].mean()), rel=1e-4)

    probs = expert_logits.float().softmax(-1)
    entropy = -(probs * probs.clamp_min(1e-30).log()).sum(-1)
    weights = entropy / entropy[real].mean()  # β = 1
    weighted = lambda bias: float((bias * weights)[real].sum() / weights[real].sum())  # noqa: E731
    assert result["weighted_bias_reduction"] == pytest.approx(1 - weighted(after) / weighted(before), rel=1e-3)

    response = data.response_mask
    assert data.has_boundary and (response & real).sum() < real.sum()  # math is chat data: prompt excluded
    nll_expert, nll_merged = _nll(expert_logits, ids, mask, response), _nll(merged_logits, ids, mask, response)
    nll_corrected = _nll(corrected_logits, ids, mask, response)
    assert result["nll_expert"] == pytest.approx(nll_expert, rel=1e-5)
    assert result["nll_merged"] == pytest.approx(nll_merged, rel=1e-5)
    assert result["nll_corrected"] == pytest.approx(nll_corrected, rel=1e-5)
    # The NLLs are checked by hand above; the gap is a ratio of their small differences, where
    # batching noise is amplified, so check the formula on the reported values themselves.
    merged_nll, corrected_nll, expert_nll = result["nll_merged"], result["nll_corrected"], result["nll_expert"]
    gap = merged_nll - expert_nll
    expected_gap = None if gap <= 0 else (merged_nll - corrected_nll) / gap
    assert result["nll_gap_closed"] == expected_gap
    assert result["late_bias_reduction"] is not None  # 140 tokens reach the late buckets


def test_without_corrections_only_the_merged_side_is_reported(setup) -> None:
    merged, expert, data, _ = setup
    result = evaluate_task("math", 1, data, expert, merged, None, "final", batch_size=4, progress=False)
    assert "bias_after" not in result and result["bias_before"] > 0


def test_overall_is_the_mean_over_tasks_and_rows_format() -> None:
    tasks = {
        "a": {"bias_reduction": 0.5, "nll_gap_closed": None, "nll_merged": 2.0},
        "b": {"bias_reduction": 0.7, "nll_gap_closed": 0.4, "nll_merged": 3.0},
    }
    summary = overall(tasks)
    assert summary["bias_reduction"] == pytest.approx(0.6)
    assert summary["nll_gap_closed"] == pytest.approx(0.4)  # undefined gaps do not count
    assert math.isclose(summary["nll_merged"], 2.5)
    rows = evaluation_rows(tasks, ["bias_reduction", "nll_gap_closed", "nll_merged"])
    assert rows == [["a", "50.0%", "-", "2.0000"], ["b", "70.0%", "40.0%", "3.0000"], ["overall", "60.0%", "40.0%", "2.5000"]]
