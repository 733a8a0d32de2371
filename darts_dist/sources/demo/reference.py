"""The demo's documented scores on the shipped experts, and whether a run reproduces them.

`reference.json` (next to this module) holds, per task, the expert's, the merge's and the corrected
model's score with its 95% interval from the run the docs' table comes from. A run on another machine should
differ by float rounding only, so each of its scores falls inside the documented interval; one that does not
points at a changed environment (library versions, a different base conversion), not at the method.
After a docs run, `python -m darts_dist.sources.demo.reference runs/demo/report.json COMMIT` writes it anew.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from pathlib import Path

REFERENCE_FILE = Path(__file__).with_name("reference.json")
MODELS = ("expert", "merged", "corrected")


def reference(evaluation: Mapping[str, object], commit: str) -> dict[str, object]:
    """The numbers to document from a demo run's evaluation: each task's expert, merged and corrected score and
    its interval, on how many problems."""
    return {"commit": commit, "tasks": {
        task: {"n": fields["score_n"],
               **{model: {"score": fields[f"score_{model}"], "ci": fields[f"score_{model}_ci"]} for model in MODELS}}
        for task, fields in evaluation["tasks"].items()}}


def reproduction(evaluation: Mapping[str, object], reference_file: Path = REFERENCE_FILE) -> dict[str, object]:
    """Each task's scores of this run against the documented ones: inside the documented 95% interval or not.
    Compared only on the same number of problems (a run with another --score-limit asks other questions)."""
    reference = json.loads(Path(reference_file).read_text())
    checked, outside = 0, []
    for task, documented in reference["tasks"].items():
        fields = evaluation["tasks"].get(task, {})
        if fields.get("score_n") != documented["n"]:
            continue
        for model in MODELS:
            low, high = documented[model]["ci"]
            checked += 1
            if not low <= fields[f"score_{model}"] <= high:
                outside.append(f"{task} {model} {fields[f'score_{model}']:.1%} (documented "
                               f"{documented[model]['score']:.1%}, {low:.1%}-{high:.1%})")
    return {"commit": reference["commit"], "checked": checked, "outside": outside}


def reproduction_line(check: Mapping[str, object]) -> str:
    """One line for the console: does this machine reproduce the documented table?"""
    if not check["checked"]:
        return ("reproduction: not checked (the documented scores are on every held-out problem; "
                "this run scored fewer)")
    if not check["outside"]:
        return (f"reproduction: all {check['checked']} scores inside the documented 95% intervals "
                f"(commit {check['commit']}): this machine reproduces the docs' table")
    return (f"reproduction: {len(check['outside'])} of {check['checked']} scores outside the documented 95% intervals "
            f"(commit {check['commit']}): " + "; ".join(check["outside"]))


if __name__ == "__main__":
    report_file, commit = sys.argv[1:3]
    evaluation = json.loads(Path(report_file).read_text())["variants"]["darts"]
    REFERENCE_FILE.write_text(json.dumps(reference(evaluation, commit), indent=2) + "\n")
