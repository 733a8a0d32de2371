"""Held-out evaluation (the evaluator every caller shares): every number equals a direct computation on a small set."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from darts_dist.config import parse_config
from darts_dist.core import CorrectionSpec, DartsCorrections, capture_hidden
from darts_dist.evaluate.evaluator import Evaluator
from darts_dist.evaluate.statistics import nll_gap, paired_mean_difference_sd
from darts_dist.evaluate.tables import evaluation_rows, overall
from darts_dist.sources.data import TaskFiles, tokenized
from darts_dist.sources.demo.tiny import build_tiny_tokenizer
from darts_dist.sources.models import load_causal_lm
from darts_dist.sources.references import demo_data
from darts_dist.tracking.runs import evaluation_metrics


@pytest.fixture(scope="module")
def setup(tiny_family, tmp_path_factory):
    merged = load_causal_lm(tiny_family.base)
    expert = load_causal_lm(tiny_family.experts["math"])
    heldout = tmp_path_factory.mktemp("heldout") / "math.jsonl"  # six held-out rows
    heldout.write_text("".join(demo_data()["math"]["heldout"].read_text().splitlines(keepends=True)[:6]))
    config = parse_config({
        "sources": {"base": str(tiny_family.base), "experts": [
            {"task": t, "path": str(tiny_family.experts[t]), "data": {"calibration": str(heldout),
                                                                      "heldout": str(heldout)}}
            for t in ("code", "math")]},
        "calibration": {"max_length": 140, "batch_size": 4},
    })
    files = TaskFiles(calibration=heldout, heldout=heldout)
    evaluator = Evaluator(config, {"code": files, "math": files}, build_tiny_tokenizer(), progress=False)
    data = tokenized(files, "math", "heldout", config.calibration, build_tiny_tokenizer())
    torch.manual_seed(1)
    corrections = DartsCorrections(CorrectionSpec(("code", "math"), 64, rank=4, max_positions=8), ["final"])
    with torch.no_grad():
        for p in corrections.parameters():
            p.add_(0.1 * torch.randn_like(p))
    side = evaluator.expert_side(1, expert)
    pairs = [(side, evaluator.merged_side(merged, side.index))]
    return merged, evaluator, pairs, data, corrections


def _nll(logits, ids, mask, response):
    """Mean NLL of the predicted response tokens (chat data: the prompt is context only)."""
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), reduction="none").view(ids.shape[0], -1)
    counted = (mask[:, 1:] * mask[:, :-1]).bool() & response[:, 1:]
    return float(loss[counted].mean())


def test_numbers_equal_a_direct_computation(setup, tiny_family) -> None:
    merged, evaluator, pairs, data, corrections = setup
    expert = load_causal_lm(tiny_family.experts["math"])
    result = evaluator.evaluate(merged, corrections, pairs)["tasks"]["math"]

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
    late = real & (positions >= 64)  # 140 tokens reach the late buckets
    assert late.any()
    assert result["late_bias_reduction"] == pytest.approx(1 - float(after[late].mean() / before[late].mean()), rel=1e-4)


def test_without_corrections_the_corrected_model_is_the_merged_one(setup) -> None:
    merged, evaluator, pairs, _, _ = setup
    result = evaluator.evaluate(merged, None, pairs)["tasks"]["math"]
    assert result["bias_before"] > 0 and result["bias_after"] == result["bias_before"]
    assert result["nll_corrected"] == result["nll_merged"] and result["nll_gap_closed"] in (0.0, None)


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


def test_the_overall_nll_gap_closed_is_the_ratio_of_the_mean_nlls() -> None:
    """The RegMean demo's shape: math's merge within 0.0005 of its expert, a little worse corrected (−534% of its
    gap); the mean of the ratios would say −156% overall, the mean NLLs say 39% of the gap closed."""
    tasks = {
        "code": {"nll_expert": 0.0077, "nll_merged": 0.0181, "nll_corrected": 0.0157, "nll_gap_closed": 0.226},
        "math": {"nll_expert": 0.1747, "nll_merged": 0.1752, "nll_corrected": 0.1776, "nll_gap_closed": -5.343},
        "instruct": {"nll_expert": 0.8067, "nll_merged": 0.9064, "nll_corrected": 0.8632, "nll_gap_closed": 0.433},
    }
    expert, merged, corrected = (sum(t[f"nll_{m}"] for t in tasks.values()) / 3 for m in ("expert", "merged", "corrected"))
    assert overall(tasks)["nll_gap_closed"] == pytest.approx((merged - corrected) / (merged - expert))
    assert overall(tasks)["nll_gap_closed"] == pytest.approx(0.39, abs=0.01)


def test_a_merge_within_the_nlls_noise_of_its_expert_has_no_gap_to_close() -> None:
    """The RegMean demo's math: merged 0.1752 against the expert's 0.1747, a difference inside 2 bootstrap sds, is
    "no gap" (not "−534% closed") in the task's row, and the overall gap (the mean NLLs, its sd √Σsd²/tasks) keeps
    counting; one sd more and the same numbers are a gap again."""
    tasks = {
        "code": {"nll_expert": 0.0077, "nll_merged": 0.0181, "nll_corrected": 0.0157, "nll_gap_sd": 0.0010},
        "math": {"nll_expert": 0.1747, "nll_merged": 0.1752, "nll_corrected": 0.1776, "nll_gap_sd": 0.0040},
    }
    for task in tasks.values():
        task["nll_gap_closed"], task["nll_no_gap"] = nll_gap(task["nll_expert"], task["nll_merged"],
                                                             task["nll_corrected"], task["nll_gap_sd"])
    assert tasks["math"]["nll_no_gap"] and tasks["math"]["nll_gap_closed"] is None
    assert not tasks["code"]["nll_no_gap"] and tasks["code"]["nll_gap_closed"] == pytest.approx(0.0024 / 0.0104)
    summary = overall(tasks)
    assert summary["nll_gap_sd"] == pytest.approx(math.sqrt(0.001**2 + 0.004**2) / 2)
    assert not summary["nll_no_gap"] and summary["nll_gap_closed"] == pytest.approx(0.0, abs=1e-9)  # 0.09665 both
    rows = evaluation_rows(tasks, ["nll_merged", "nll_gap_closed"], summary)
    assert [row[2] for row in rows] == ["23.1%", "no gap", f"{100 * summary['nll_gap_closed']:.1f}%"]
    assert nll_gap(0.1747, 0.1752, 0.1776, 0.0002) == (pytest.approx(-4.8), False)  # beyond 2 sd: a gap
    assert evaluation_metrics({"overall": summary, "tasks": tasks})["eval.math.nll_no_gap"] == 1.0


def test_the_gap_sd_is_the_bootstrap_of_the_rows_mean_difference() -> None:
    """Rows of equal length: the per-token mean difference is the mean of the rows' means, whose sd is known."""
    rng = np.random.default_rng(1)
    counts = np.full(400, 10.0)
    differences = rng.normal(0.05, 0.3, 400) * counts
    expected = (differences / counts).std() / math.sqrt(400)
    assert paired_mean_difference_sd(differences, counts) == pytest.approx(expected, rel=0.08)
    assert paired_mean_difference_sd(differences[:1], counts[:1]) == 0.0
