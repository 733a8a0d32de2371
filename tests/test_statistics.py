"""Score statistics against closed forms: Wilson's interval, McNemar's exact test, the gap closed, and the
fields a task's scores carry in the report."""

from __future__ import annotations

import math

import pytest

from darts_dist.evaluate.statistics import gap_closed, mean_score_interval, paired_comparison, wilson_interval
from darts_dist.evaluate.tables import evaluation_tables, format_value
from darts_dist.evaluate.task_scores import SCORERS, overall_score_fields, score_fields
from darts_dist.tracking.runs import evaluation_metrics


def wilson_by_hand(k: int, n: int, z: float = 1.959963984540054) -> tuple[float, float]:
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return centre - half, centre + half


@pytest.mark.parametrize(("k", "n"), [(54, 200), (0, 200), (200, 200), (1, 3), (10, 20)])
def test_wilson_interval_equals_the_closed_form(k: int, n: int) -> None:
    low, high = wilson_interval([True] * k + [False] * (n - k))
    assert (low, high) == pytest.approx(wilson_by_hand(k, n), abs=1e-12)
    assert 0.0 <= low <= k / n <= high <= 1.0


def test_mcnemar_exact_equals_a_binomial_sum_by_hand() -> None:
    # 12 problems only the corrected model passes, 3 only the merged one, 30 both, 5 neither.
    corrected = [True] * 12 + [False] * 3 + [True] * 30 + [False] * 5
    merged = [False] * 12 + [True] * 3 + [True] * 30 + [False] * 5
    result = paired_comparison(corrected, merged)
    tail = sum(math.comb(15, i) for i in range(4)) / 2**15  # P(X <= 3), X ~ Binomial(15, 1/2)
    assert (result.wins, result.losses) == (12, 3)
    assert result.pvalue == pytest.approx(2 * tail, rel=1e-12)
    assert paired_comparison(merged, corrected).pvalue == pytest.approx(result.pvalue)  # two-sided
    assert paired_comparison([True, False], [True, False]).pvalue == 1.0  # nothing tells them apart
    with pytest.raises(ValueError, match="same problems"):
        paired_comparison([True], [True, False])


def test_gap_closed() -> None:
    assert gap_closed(expert=0.6, merged=0.2, corrected=0.5) == pytest.approx(0.75)
    assert gap_closed(expert=0.6, merged=0.2, corrected=0.1) == pytest.approx(-0.25)  # the correction hurt
    assert gap_closed(expert=0.3, merged=0.3, corrected=0.4) is None  # no gap to close


def test_score_fields_in_the_report_tables_and_mlflow() -> None:
    n = 40
    passes = {
        "base": [i < 4 for i in range(n)],
        "expert": [i < 30 for i in range(n)],
        "merged": [i < 10 for i in range(n)],
        "corrected": [i < 24 or i == 39 for i in range(n)],  # 15 wins (problems 10-23 and 39), no loss
        "routed": None,  # no router: left out
    }
    fields = score_fields(SCORERS["math_exact"], passes)
    assert fields["score_n"] == n and "score_routed" not in fields
    assert fields["score_base"] == 0.1 and fields["score_expert"] == 0.75 and fields["score_corrected"] == 0.625
    assert fields["score_merged_ci"] == pytest.approx(list(wilson_by_hand(10, n)))
    assert fields["score_gap_closed"] == pytest.approx((0.625 - 0.25) / (0.75 - 0.25))
    assert (fields["score_wins"], fields["score_losses"]) == (15, 0)
    assert fields["score_pvalue"] == pytest.approx(2 / 2**15)
    metrics = evaluation_metrics({"overall": {}, "tasks": {"math": fields}})
    assert metrics["eval.math.score_merged_ci.low"] == pytest.approx(wilson_by_hand(10, n)[0])
    assert metrics["eval.math.score_pvalue"] == pytest.approx(2 / 2**15)
    assert format_value("score_merged_ci", [0.1234, 0.4]) == "12.3–40.0"
    assert format_value("score_pvalue", 6.1035e-05) == "6.1e-05"


def test_overall_scores_pool_the_problems_of_every_task() -> None:
    a = {"expert": [True] * 30 + [False] * 10, "merged": [True] * 10 + [False] * 30,
         "corrected": [True] * 25 + [False] * 15, "routed": None}
    b = {"expert": [True] * 20 + [False] * 20, "merged": [True] * 19 + [False] * 21,
         "corrected": [False] + [True] * 18 + [False] * 21, "routed": None}  # a one-problem gap, one loss
    fields = overall_score_fields({"a": a, "b": b})
    assert fields["score_n"] == 80 and "score_base" not in fields and "score_routed" not in fields
    assert fields["score_expert"] == pytest.approx((0.75 + 0.5) / 2)
    # The ratio of the mean scores, not the mean of the ratios (b's would be -1.0 on a one-problem gap).
    assert fields["score_gap_closed"] == pytest.approx(((25 + 18) / 40 / 2 - (10 + 19) / 40 / 2)
                                                       / ((30 + 20) / 40 / 2 - (10 + 19) / 40 / 2))
    assert (fields["score_wins"], fields["score_losses"]) == (15, 1)  # pooled over both tasks
    assert fields["score_pvalue"] == pytest.approx(paired_comparison([True] * 15 + [False], [False] * 15 + [True]).pvalue)
    # The merged model's interval against the normal approximation of a mean of two independent rates (each task's
    # rate varies by p(1-p)/n), within one step of the bootstrap's grid (the mean of two rates over 40 moves by 1/80).
    mean, spread = (10 / 40 + 19 / 40) / 2, math.sqrt(0.25 * 0.75 / 40 + 0.475 * 0.525 / 40) / 2
    assert fields["score_merged"] == pytest.approx(mean)
    assert fields["score_merged_ci"] == pytest.approx([mean - 1.959964 * spread, mean + 1.959964 * spread], abs=1 / 80)


def test_the_bootstrap_interval_of_one_task_is_close_to_wilson_and_seeded() -> None:
    passes = [True] * 54 + [False] * 146
    bootstrap = mean_score_interval({"t": passes})
    assert bootstrap == pytest.approx(wilson_by_hand(54, 200), abs=0.015)
    assert mean_score_interval({"t": passes}) == bootstrap  # the same every run
    # Two tasks count the same whatever their sizes: the interval is around the mean of the two rates.
    low, high = mean_score_interval({"t": passes, "u": [True] * 10})
    assert low < (0.27 + 1.0) / 2 < high and high - low < bootstrap[1] - bootstrap[0]


def test_the_score_table_shows_each_score_with_its_interval() -> None:
    passes = {"base": [False] * 8, "expert": [True] * 6 + [False] * 2, "merged": [True] * 2 + [False] * 6,
              "corrected": [True] * 5 + [False] * 3, "routed": None}
    task = score_fields(SCORERS["math_exact"], passes)
    evaluation = {"tasks": {"math": task}, "overall": overall_score_fields({"math": passes})}
    (_, _, _), (title, headers, rows) = evaluation_tables("t", evaluation)
    assert headers == ["task (scorer)", "n", "base", "expert", "merged", "corrected", "gap closed", "wins", "losses",
                       "p"]  # no router: no routed column
    low, high = wilson_interval(passes["corrected"])
    assert rows[0][:2] == ["math (math_exact)", "8"]
    assert rows[0][5] == f"62.5% ({100 * low:.1f}–{100 * high:.1f})"
    assert rows[0][6:] == ["75.0%", "3", "0", format_value("score_pvalue", task["score_pvalue"])]
    assert rows[1][0] == "overall" and rows[1][5].startswith("62.5% (")
