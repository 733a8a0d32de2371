"""The merge sweep: candidates parsed and checked, each merge scored on the validation split (never the
held-out set), the best one named, through the command line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from darts_dist.cli import main
from darts_dist import merge_sweep
from darts_dist.config import EvaluationSection, parse_config, updated
from darts_dist.errors import DartsError
from darts_dist.evaluate.task_scores import SCORERS, problem_passes
from darts_dist.generation import CorrectedLM
from darts_dist.merge_sweep import MergeCandidate, sweep_merges
from darts_dist.sources.data import split_rows
from darts_dist.sources.references import resolve_sources


def test_candidates_parse_and_bad_ones_say_how_to_write_them() -> None:
    candidate = MergeCandidate.parse("ties:weight=1,density=0.5")
    assert (candidate.method, dict(candidate.parameters)) == ("ties", {"weight": 1.0, "density": 0.5})
    assert candidate.name == "ties:density=0.5,weight=1"
    assert MergeCandidate.parse("task_arithmetic").name == "task_arithmetic"
    with pytest.raises(DartsError, match="unknown merge method 'avg'"):
        MergeCandidate.parse("avg:weight=1")
    with pytest.raises(DartsError, match="is not key=number") as caught:
        MergeCandidate.parse("task_arithmetic:weight=half")
    assert "task_arithmetic:weight=0.5" in caught.value.fix


def _config(tiny_family, tmp_path: Path, **calibration: object):
    return parse_config({
        "name": "sweep",
        "output_dir": str(tmp_path / "runs"),
        "sources": {"base": str(tiny_family.base), "experts": [
            {"task": t, "path": str(tiny_family.experts[t]),
             "data": {"calibration": f"demo:{t}", "heldout": f"demo:{t}"}} for t in ("math", "instruct")]},
        "calibration": {"max_length": 64, "num_samples": 16, **calibration},
        "evaluation": {"score_limit": 3, "max_new_tokens": 4, "generation_batch_size": 3},
    })


def test_sweep_scores_every_candidate_on_validation_rows_and_names_the_best(
    tiny_family, tmp_path: Path, monkeypatch,
) -> None:
    with pytest.raises(DartsError, match="validation_fraction is 0"):
        sweep_merges(_config(tiny_family, tmp_path), progress=False)
    with pytest.raises(DartsError, match="score_limit is 0"):
        sweep_merges(updated(_config(tiny_family, tmp_path, validation_fraction=0.5), evaluation=EvaluationSection(
            score_limit=0)), progress=False)
    config = _config(tiny_family, tmp_path, validation_fraction=0.5)
    asked: dict[tuple[str, str], list[str]] = {}  # (merged model folder, task) -> the questions it was asked
    # Planted: the second candidate passes every validation problem, so it must be named best (a tie of the real
    # scores, all 0 on the tiny family, would name the first).
    planted = "task_arithmetic:weight=1"

    def recording(lm, task, problems, scorer, settings, desc="", progress=False):
        asked[(str(lm.model.name_or_path), desc.rsplit(" ", 1)[-1])] = [p.messages[0]["content"] for p in problems]
        if desc.startswith(f"{planted} answers "):
            return [True] * len(problems)
        return problem_passes(lm, task, problems, scorer, settings, desc, progress)

    monkeypatch.setattr(merge_sweep, "problem_passes", recording)
    candidates = [MergeCandidate.parse("task_arithmetic:weight=0.5"), MergeCandidate.parse("task_arithmetic:weight=1")]
    report = sweep_merges(config, candidates, progress=False)
    assert list(report["candidates"]) == ["task_arithmetic:weight=0.5", "task_arithmetic:weight=1"]
    assert report["candidates"][planted]["score_mean"] == 1.0
    assert report["candidates"]["task_arithmetic:weight=0.5"]["score_mean"] < 1.0  # else the planting decides nothing
    assert report["best"] == planted
    assert report["best_merge"] == {"method": "task_arithmetic", "parameters": {"weight": 1.0}}

    # What each merge was asked: the validation rows (the calibration file's second half), never held-out ones;
    # and its scores are its own answers to them.
    sources = resolve_sources(config)
    for name, result in report["candidates"].items():
        with CorrectedLM.load(Path(result["merged"])) as lm:
            for task, fields in result["tasks"].items():
                rows = split_rows(sources.data[task], "validation", config.calibration)
                assert asked[(result["merged"], task)] == [r["messages"][0]["content"] for r in rows.select(range(3))]
                calibration = split_rows(sources.data[task], "calibration", config.calibration)
                heldout = split_rows(sources.data[task], "heldout", config.calibration)
                seen = {r["messages"][0]["content"] for r in [*calibration, *heldout]}
                assert not set(asked[(result["merged"], task)]) & seen
                problems = SCORERS[fields["score_name"]].problems_of(rows, "validation", "validation", 3)
                passes = [True] * 3 if name == planted else problem_passes(
                    lm, None, problems, SCORERS[fields["score_name"]], EvaluationSection(
                        score_limit=3, max_new_tokens=4, generation_batch_size=3))
                assert fields["score_merged"] == sum(passes) / 3 and fields["score_n"] == 3, (name, task)
        assert result["score_mean"] == pytest.approx(sum(t["score_merged"] for t in result["tasks"].values()) / 2)


def test_merge_sweep_command_writes_its_report(tiny_family, tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    config = _config(tiny_family, tmp_path, validation_fraction=0.5)
    path = tmp_path / "sweep.yaml"
    path.write_text(json.dumps(config.model_dump(mode="json")))
    assert main(["merge-sweep", str(path), "--candidates", "task_arithmetic:weight=0.7", "--report",
                 str(tmp_path / "sweep.json")]) == 0
    report = json.loads((tmp_path / "sweep.json").read_text())
    assert report["best"] == "task_arithmetic:weight=0.7" and report["split"] == "validation"
    out = capsys.readouterr().out
    assert "best on validation: task_arithmetic:weight=0.7" in out and "merge sweep" in out
    assert main(["merge-sweep", str(path), "--candidates", "task_arithmetic:w"]) == 2


def test_a_regmean_candidate_is_merged_from_the_calibration_rows(tiny_family, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(merge_sweep, "problem_passes", lambda lm, task, problems, *a, **k: [False] * len(problems))
    config = _config(tiny_family, tmp_path, validation_fraction=0.5)
    config = updated(config, merge=updated(config.merge, method="regmean", parameters={}, others={"method": "linear"}),
                     cluster=updated(config.cluster, executor="in-process"))  # RegMean's Grams on Ray: test_regmean
    candidates = [MergeCandidate.parse("regmean:alpha=0.5"), MergeCandidate.parse("task_arithmetic:weight=0.5")]
    report = sweep_merges(config, candidates, progress=False)
    merged = Path(report["candidates"]["regmean:alpha=0.5"]["merged"])
    assert (merged / "regmean_config.yml").is_file() and "alpha: 0.5" in (merged / "regmean_config.yml").read_text()
    assert not (Path(report["candidates"]["task_arithmetic:weight=0.5"]["merged"]) / "regmean_config.yml").exists()
