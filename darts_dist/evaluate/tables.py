"""Evaluation results for people and for comparison: means over tasks, and formatted table rows."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from darts_dist.core.modeling_darts import MERGED
from darts_dist.evaluate.statistics import gap_closed, nll_gap

SCORE_KEYS = ("score_base", "score_expert", "score_merged", "score_corrected", "score_routed")
OVERALL_KEYS = (
    "bias_before", "bias_after", "bias_reduction", "weighted_bias_reduction", "late_bias_reduction",
    "nll_expert", "nll_merged", "nll_corrected", "nll_gap_closed", *SCORE_KEYS,
)


def overall(tasks: Mapping[str, Mapping[str, object]]) -> dict[str, float | None]:
    """Unweighted mean over tasks, so every task counts the same whatever its length (scores: over scored tasks;
    their intervals and tests come from the problems, `task_scores.overall_score_fields`). The NLL gap closed is
    the ratio of the mean NLLs, as the score's is of the mean scores: a mean of per-task ratios would let a task
    whose merge is already within a hair of its expert (a gap of 0.0005) swing it by hundreds of points."""
    summary: dict[str, float | None] = {}
    for key in OVERALL_KEYS:
        values = [t[key] for t in tasks.values() if t.get(key) is not None]
        summary[key] = sum(values) / len(values) if values else None
    expert, merged, corrected = (summary[f"nll_{model}"] for model in ("expert", "merged", "corrected"))
    sds = [t.get("nll_gap_sd") for t in tasks.values()]
    if expert is not None and merged is not None and None not in sds:
        # The mean over tasks of independent differences: its sd is √(Σ sd²) / tasks.
        summary["nll_gap_sd"] = math.sqrt(sum(sd * sd for sd in sds)) / len(sds)
        summary["nll_gap_closed"], summary["nll_no_gap"] = nll_gap(expert, merged, corrected, summary["nll_gap_sd"])
    elif summary["nll_gap_closed"] is not None and None not in (expert, merged, corrected):  # an older report
        summary["nll_gap_closed"] = gap_closed(-expert, -merged, -corrected)  # lower is better
    return summary


def format_value(key: str, value: object) -> str:
    """A result for people: shares as percentages (intervals as "low–high"), p-values with three significant
    digits, counts and names as they are, missing ones as "-"."""
    if isinstance(value, (list, tuple)):
        return "–".join(f"{100 * float(v):.1f}" for v in value)
    if key.endswith("pvalue") and value is not None:
        return f"{float(value):.3g}"
    if value is None or isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool)):
        return "-" if value is None else str(value)
    if not math.isfinite(float(value)):
        return "-"
    if key.endswith(("reduction", "closed")) or key in SCORE_KEYS or key.startswith("retention_agreement"):
        return f"{100 * float(value):.1f}%"
    return f"{float(value):.4f}"


def evaluation_rows(
    tasks: Mapping[str, Mapping[str, object]], columns: Sequence[str], summary: Mapping[str, object] | None = None,
) -> list[list[str]]:
    """Table rows (one per task, then the overall row: `summary`, by default the mean over the tasks) with
    numbers formatted for people."""
    summary = overall(tasks) if summary is None else summary
    return [[name] + [_cell(c, result) for c in columns] for name, result in [*tasks.items(), ("overall", summary)]]


def _cell(key: str, result: Mapping[str, object]) -> str:
    if key == "nll_gap_closed" and result.get("nll_no_gap"):
        return "no gap"  # the merge's NLL within the noise of the expert's (statistics.nll_gap)
    return format_value(key, result.get(key))


EVALUATION_COLUMNS = {
    "bias_before": "bias merged",
    "bias_after": "bias corrected",
    "bias_reduction": "bias reduction",
    "weighted_bias_reduction": "entropy-weighted",
    "late_bias_reduction": "late (t>=64)",
    "nll_expert": "NLL expert",
    "nll_merged": "NLL merged",
    "nll_corrected": "NLL corrected",
    "nll_gap_closed": "NLL gap closed",
}


# The task-score table: a model's score is shown with its interval in one cell ("score (low–high)").
SCORE_COLUMNS = {
    "score_n": "n",
    "score_base": "base",
    "score_expert": "expert",
    "score_merged": "merged",
    "score_corrected": "corrected",
    "score_routed": "routed",
    "score_gap_closed": "gap closed",
    "score_wins": "wins",
    "score_losses": "losses",
    "score_pvalue": "p",
    "canonical_nll_expert": "solution NLL expert",
    "canonical_nll_merged": "solution NLL merged",
    "canonical_nll_corrected": "solution NLL corrected",
}


def _score_cell(key: str, result: Mapping[str, object]) -> str:
    value = format_value(key, result.get(key))
    interval = result.get(f"{key}_ci")
    return value if interval is None or value == "-" else f"{value} ({format_value(key, interval)})"


RETENTION_TITLE = ("retention: {n} general instructions outside the tasks, the base model's own greedy replies; NLL "
                   "per reply token and token agreement (the model's greedy choice, teacher-forced), 95% intervals "
                   "over the instructions; word for word: replies it would give whole. corrected: what a request "
                   "without a task gets (the router's pick, else the uncorrected model)")


def retention_table(retained: Mapping[str, object]) -> tuple[str, list[str], list[list[str]]]:
    """(title, headers, rows) of an evaluation's retention: the base, each expert, the merge, the corrected."""
    models = {"base": retained.get("base"), **{f"expert {task}": summary for task, summary in retained["experts"].items()},
              "merged": retained.get("merged"), "corrected": retained.get("corrected")}
    rows = []
    for name, summary in models.items():
        if summary is None:
            continue
        low, high = summary["nll_ci"]
        rows.append([name, f"{summary['nll']:.4f} ({low:.4f}–{high:.4f})",
                     _score_cell("retention_agreement", {"retention_agreement": summary["agreement"],
                                                         "retention_agreement_ci": summary["agreement_ci"]}),
                     f"{100 * summary['exact']:.1f}%"])
    n = next(summary["n"] for summary in models.values() if summary is not None)
    return RETENTION_TITLE.format(n=n), ["model", "NLL of the base's replies", "agreement", "word for word"], rows


def retention_line(evaluation: Mapping[str, object]) -> str | None:
    """One line of an evaluation's retention for the console: each model's NLL of the base's replies (the base's
    own is the floor) and its token agreement; None without a retention set."""
    retained = evaluation.get("retention")
    if not retained:
        return None
    experts = [s for s in retained["experts"].values() if s is not None]
    models = {"base": retained.get("base"), "merged": retained.get("merged"), "corrected": retained.get("corrected")}
    shown = [f"{name} {s['nll']:.3f} / {100 * s['agreement']:.0f}%" for name, s in models.items() if s is not None]
    served = models["corrected"]
    if served is not None and "routes" in served:
        shown[-1] += f" (no correction on {served['routes'][MERGED]} of {served['n']})"
    if experts:
        shown.insert(1, "experts {:.3f} / {:.0f}%".format(sum(s["nll"] for s in experts) / len(experts),
                                                         100 * sum(s["agreement"] for s in experts) / len(experts)))
    n = next(s for s in [*models.values(), *experts] if s is not None)["n"]
    return (f"retention ({n} general instructions; NLL of the base's own "
            f"replies / agreement with them): " + ", ".join(shown))


def evaluation_tables(title: str, evaluation: Mapping[str, object]) -> list[tuple[str, list[str], list[list[str]]]]:
    """(title, headers, rows) of an evaluation's results, and of its task scores where a task has them (columns
    no task has, e.g. routed scores without a router, left out)."""
    tables = [(title, ["task", *EVALUATION_COLUMNS.values()],
               evaluation_rows(evaluation["tasks"], list(EVALUATION_COLUMNS), evaluation["overall"]))]
    scored = {task: result for task, result in evaluation["tasks"].items() if "score_name" in result}
    if scored:
        columns = [key for key in SCORE_COLUMNS if any(result.get(key) is not None for result in scored.values())]
        rows = [[f"{task} ({result['score_name']})", *(_score_cell(key, result) for key in columns)]
                for task, result in scored.items()]
        rows.append(["overall", *(_score_cell(key, evaluation["overall"]) for key in columns)])
        tables.append(("task scores: greedy answers to held-out problems, score (95% interval: Wilson per task, a "
                       "stratified bootstrap of the mean overall); wins / losses / p: corrected against merged on the "
                       "same problems (McNemar's exact test)", ["task (scorer)", *(SCORE_COLUMNS[k] for k in columns)],
                       rows))
    if evaluation.get("retention"):
        tables.append(retention_table(evaluation["retention"]))
    return tables
