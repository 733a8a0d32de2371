"""The demo's self-check: this run's scores against the documented ones of the shipped experts."""

from __future__ import annotations

import json
import re
from pathlib import Path

from darts_dist.sources.demo.reference import MODELS, REFERENCE_FILE, reference, reproduction, reproduction_line

REPO = Path(__file__).resolve().parents[1]


def evaluation(scores: dict[str, tuple[float, float, float]], n: int = 200) -> dict:
    return {"tasks": {task: {"score_n": n, **{f"score_{model}": score for model, score in zip(MODELS, values)}}
                      for task, values in scores.items()}}


def write_reference(path: Path) -> Path:
    path.write_text(json.dumps({"commit": "abc1234", "tasks": {
        "code": {"n": 200, "expert": {"score": 0.9, "ci": [0.85, 0.94]}, "merged": {"score": 0.8, "ci": [0.74, 0.85]},
                 "corrected": {"score": 0.88, "ci": [0.83, 0.92]}},
        "math": {"n": 200, "expert": {"score": 0.4, "ci": [0.33, 0.47]}, "merged": {"score": 0.2, "ci": [0.15, 0.26]},
                 "corrected": {"score": 0.35, "ci": [0.29, 0.42]}}}}))
    return path


def test_a_run_inside_every_interval_reproduces(tmp_path: Path) -> None:
    check = reproduction(evaluation({"code": (0.9, 0.85, 0.85), "math": (0.33, 0.26, 0.3)}),
                         write_reference(tmp_path / "reference.json"))
    assert check == {"commit": "abc1234", "checked": 6, "outside": []}
    assert "all 6 scores inside" in reproduction_line(check) and "abc1234" in reproduction_line(check)


def test_the_scores_outside_their_interval_are_named(tmp_path: Path) -> None:
    check = reproduction(evaluation({"code": (0.9, 0.85, 0.95), "math": (0.32, 0.2, 0.35)}),
                         write_reference(tmp_path / "reference.json"))
    assert check["checked"] == 6
    assert check["outside"] == ["code corrected 95.0% (documented 88.0%, 83.0%-92.0%)",
                                "math expert 32.0% (documented 40.0%, 33.0%-47.0%)"]
    assert reproduction_line(check).startswith("reproduction: 2 of 6 scores outside")


def test_a_run_on_other_problems_is_not_compared(tmp_path: Path) -> None:
    check = reproduction(evaluation({"code": (0.0, 0.0, 0.0), "math": (0.0, 0.0, 0.0)}, n=20),
                         write_reference(tmp_path / "reference.json"))
    assert check["checked"] == 0 and check["outside"] == []
    assert "not checked" in reproduction_line(check)


def test_the_shipped_reference_is_the_docs_table() -> None:
    """Every documented score of reference.json is the one the results page's demo table prints."""
    reference = json.loads(REFERENCE_FILE.read_text())
    results = (REPO / "docs" / "results.md").read_text()
    for task, documented in reference["tasks"].items():
        row = re.search(rf"^\| {task} \| {documented['n']} \|.*$", results, re.MULTILINE)
        assert row, task
        for model in MODELS:
            low, high = documented[model]["ci"]
            cell = f"{100 * documented[model]['score']:.1f}% ({100 * low:.1f}–{100 * high:.1f})"
            assert cell in row.group(0), (task, model, cell, row.group(0))


def test_a_run_reproduces_the_reference_made_from_it(tmp_path: Path) -> None:
    """The reference written from a run's evaluation holds that run's scores and intervals: the run reproduces it."""
    run = evaluation({"code": (0.9, 0.8, 0.88), "math": (0.4, 0.2, 0.35)})
    for fields in run["tasks"].values():
        for model in MODELS:
            fields[f"score_{model}_ci"] = [fields[f"score_{model}"] - 0.05, fields[f"score_{model}"] + 0.05]
    documented = reference(run, "abc1234")
    assert documented["tasks"]["math"]["merged"] == {"score": 0.2, "ci": [0.2 - 0.05, 0.2 + 0.05]}
    (tmp_path / "reference.json").write_text(json.dumps(documented))
    assert reproduction(run, tmp_path / "reference.json") == {"commit": "abc1234", "checked": 6, "outside": []}
