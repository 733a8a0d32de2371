"""The ablation: variants differ only in what they claim, tuning stays on validation data, `ablate` reports it all."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from darts_dist.ablation import VARIANTS, plan_ablation
from darts_dist.calibrate.coefficients import read_task_vectors
from darts_dist.calibrate.loop import build_corrections
from darts_dist.calibrate.router import task_prompts
from darts_dist.cli import main
from darts_dist.config import parse_config
from darts_dist.core import TaskRouter, prompt_features
from darts_dist.errors import DartsError
from darts_dist.evaluate import evaluator
from darts_dist.sources.data import calibration_split, load_rows
from darts_dist.sources.models import load_causal_lm, load_tokenizer, pad_id
from darts_dist.sources.references import demo_data, resolve_sources
from mlflow import MlflowClient

TASKS = ("code", "math")
# What each variant may change relative to DARTS (the config's settings), and nothing else.
CLAIMS = {"beta", "tasks", "position_bias", "position_rank"}


def _config(calibration: dict | None = None, **top: object):
    return parse_config({
        "sources": {"base": "b", "experts": [{"task": t, "path": t, "data": {"calibration": "c"}} for t in TASKS]},
        "calibration": {"beta": 0.7, "tasks": {"math": {"beta": 0.3, "weight_on": "response"}},
                        "position_bias": "per_task", "position_rank": 4, **(calibration or {})},
        **top,
    })


def test_variants_differ_only_in_what_they_claim() -> None:
    plan = plan_ablation(_config())
    darts = plan.variants["darts"]
    assert list(plan.variants) == ["merged", "surgery", "entropy", "position", "darts"]
    assert plan.variants["merged"] is None  # no correction at all
    assert darts == plan.config.calibration
    expected = {  # (β of code, β of math, position bias)
        "surgery": (0.0, 0.0, "none"),
        "entropy": (0.7, 0.3, "none"),
        "position": (0.0, 0.0, "per_task"),
        "darts": (0.7, 0.3, "per_task"),
    }
    for name, (beta_code, beta_math, position) in expected.items():
        settings = plan.variants[name]
        assert (settings.beta_for("code"), settings.beta_for("math"), settings.position_bias) == (
            beta_code, beta_math, position), name
        changed = {k for k, v in settings.model_dump().items() if v != darts.model_dump()[k]}
        assert changed <= CLAIMS, (name, changed)
        spec = build_corrections(TASKS, 32, settings).spec
        assert spec.position_tables == (0 if position == "none" else 2)
        assert (spec.rank, spec.max_positions) == (darts.rank, darts.max_positions)  # same budget
    # A config without a position bias still gets one in the `position` variant.
    no_bias = plan_ablation(_config({"position_bias": "none", "position_rank": None}))
    assert no_bias.variants["position"].position_bias == "per_task"


def test_plan_refuses_bad_requests() -> None:
    with pytest.raises(DartsError, match="unknown or repeated"):
        plan_ablation(_config(), ["task_arithmetic", "no_such_merge"])
    with pytest.raises(DartsError, match="unknown or repeated"):
        plan_ablation(_config(), ["ties", "ties"])
    with pytest.raises(DartsError, match="mergekit_yaml"):
        plan_ablation(_config(merge={"mergekit_yaml": "m.yml"}))
    with pytest.raises(DartsError, match="tuning metric"):
        plan_ablation(_config(), select="loss")
    with pytest.raises(DartsError, match="deep DARTS's layers"):
        plan_ablation(_config(), deep_layers=["every:0", "final"])
    with pytest.raises(DartsError, match="seeds"):
        plan_ablation(_config(), seeds=0)
    assert plan_ablation(_config(), deep_layers=["26", "final"]).deep_layers == ("26", "final")
    assert plan_ablation(_config()).merge_methods == ("task_arithmetic", "ties")
    assert plan_ablation(_config(merge={"method": "ties"})).merge_methods == ("ties", "task_arithmetic")
    # Tuning holds validation data back: the config's fraction, else 0.2.
    assert plan_ablation(_config(), trials=3).config.calibration.validation_fraction == 0.2
    assert plan_ablation(_config(), trials=0).config.calibration.validation_fraction == 0.0


def test_the_search_space_holds_the_configs_own_settings_and_trials_become_variants() -> None:
    from darts_dist.tuning import own_point, search_space, trial_settings

    settings = plan_ablation(_config(calibration={"rank": 24, "max_positions": 20, "max_length": 64})).variants["darts"]
    darts_space, surgery_space = search_space(settings, TASKS, darts=True), search_space(settings, TASKS, darts=False)
    assert set(surgery_space) == {"rank", "steps", "learning_rate"}  # no β, no T: Surgery has neither
    assert set(darts_space) == {"rank", "steps", "learning_rate", "max_positions", "beta.code", "beta.math"}
    point = own_point(settings, TASKS, darts=True)
    assert point == {"rank": 24, "steps": settings.steps, "learning_rate": settings.learning_rate,
                     "max_positions": 20, "beta.code": 0.7, "beta.math": 0.3}
    assert 24 in darts_space["rank"].categories and 20 in darts_space["max_positions"].categories
    assert min(darts_space["steps"].categories) == settings.steps  # a trial never trains less
    first = trial_settings(settings, point, TASKS, VARIANTS["darts"])  # the first trial: the config's own
    for key in ("rank", "steps", "learning_rate", "max_positions", "position_bias"):
        assert getattr(first, key) == getattr(settings, key)
    assert [first.beta_for(t) for t in TASKS] == [0.7, 0.3] and first.weight_on_for("math") == "response"
    drawn = {"rank": 64, "steps": 2 * settings.steps, "learning_rate": 0.01, "max_positions": 16, "beta.code": 0.1,
             "beta.math": 0.9}
    darts = trial_settings(settings, drawn, TASKS, VARIANTS["darts"])
    assert (darts.rank, darts.max_positions, darts.beta_for("code"), darts.beta_for("math")) == (64, 16, 0.1, 0.9)
    assert darts.weight_on_for("math") == "response"  # a task's other overrides stay
    surgery = trial_settings(settings, {"rank": 64, "steps": settings.steps, "learning_rate": 0.01}, TASKS,
                             VARIANTS["surgery"])
    assert (surgery.rank, surgery.beta_for("code"), surgery.position_bias) == (64, 0.0, "none")


def test_validation_rows_are_held_back_from_calibration() -> None:
    rows = load_rows(demo_data()["math"]["calibration"])
    train, validation = (calibration_split(rows, 0.25, split) for split in ("calibration", "validation"))
    assert len(validation) == round(0.25 * len(rows)) and len(train) + len(validation) == len(rows)
    assert not {json.dumps(r) for r in train["messages"]} & {json.dumps(r) for r in validation["messages"]}
    assert list(calibration_split(rows, 0.0, "calibration")["messages"]) == list(train["messages"]) + list(validation["messages"])
    with pytest.raises(DartsError, match="validation_fraction is 0"):
        calibration_split(rows, 0.0, "validation")


def router_accuracy_by_hand(report: dict, merged_dir: str | None = None) -> tuple[float, dict[str, float]]:
    """The accuracy of a report's router, overall and per task: its top task on the held-out prompts' features of
    the merged model (an ablation's headline merge, or `merged_dir`), against their task."""
    config = parse_config(report["config"])
    data = resolve_sources(config).data
    merged_dir = merged_dir or report["merge_methods"][report["headline_merge_method"]]["merged"]
    router, model, tokenizer = TaskRouter.load(Path(report["router"]["path"])), load_causal_lm(merged_dir), \
        load_tokenizer(merged_dir)
    right = {}
    for index, task in enumerate(config.tasks):
        features = prompt_features(model, task_prompts(data[task], "heldout", config, tokenizer), router.layer,
                                   pad_id(tokenizer), config.calibration.batch_size)
        right[task] = (router.probabilities(features).argmax(dim=-1) == index).tolist()
    every = [r for task in right.values() for r in task]
    return sum(every) / len(every), {task: sum(r) / len(r) for task, r in right.items()}


@pytest.mark.slow
def test_ablate_writes_the_report(tiny_family, tmp_path: Path, monkeypatch) -> None:
    config = {
        "name": "abl",
        "output_dir": str(tmp_path / "runs"),
        "sources": {
            "base": str(tiny_family.base),
            # HumanEval for code: the extra reference score, with the NLL of its canonical solutions
            "experts": [{"task": t, "path": str(tiny_family.experts[t]),
                         "data": {"calibration": f"demo:{t}", "heldout": f"demo:{t}",
                                  **({"scorer": "humaneval"} if t == "code" else {})}} for t in TASKS],
        },
        "merge": {"method": "task_arithmetic", "parameters": {"weight": 0.5}},
        "calibration": {"rank": 4, "max_positions": 16, "num_samples": 12, "max_length": 24, "steps": 8,
                        "batch_size": 4, "learning_rate": 0.01},
        "evaluation": {"score_limit": 1, "max_new_tokens": 4},
    }
    path = tmp_path / "abl.yaml"
    path.write_text(yaml.safe_dump(config))
    report_path = tmp_path / "ablation.json"
    routed_asked: list[tuple[str, list[bool]]] = []  # each routed scoring: its task and the real router's passes
    real_routed_passes = evaluator.routed_passes

    def recorded_routed_passes(lm, task, problems, *args, **kwargs):
        passes = real_routed_passes(lm, task, problems, *args, **kwargs)
        routed_asked.append((task, passes))
        return passes

    monkeypatch.setattr(evaluator, "routed_passes", recorded_routed_passes)
    import mlflow

    assert main(["ablate", str(path), "--merge-methods", "task_arithmetic,ties", "--tune", "2", "--seeds", "2",
                 "--report", str(report_path)]) == 0
    # Ray Tune's MLflow callback pinned the process-wide URI to the tuning's store; it is put back, so MLflow
    # follows MLFLOW_TRACKING_URI again (else every later fluent call of the process, the registry's log_model,
    # would go to the tuning's store).
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/elsewhere.db")
    assert mlflow.get_tracking_uri() == f"sqlite:///{tmp_path}/elsewhere.db"
    report = json.loads(report_path.read_text())
    assert list(report["merge_methods"]) == ["task_arithmetic", "ties"]
    assert report["variants"] == report["merge_methods"]["task_arithmetic"]["variants"]
    keys = {"bias_reduction", "weighted_bias_reduction", "late_bias_reduction", "nll_gap_closed"}
    basic = ["merged", "surgery", "entropy", "position", "darts"]
    # Deep DARTS on every merge, the learned coefficients (alone and with DARTS) on the headline merge only.
    assert list(report["variants"]) == [*basic, "deep", "coefficients", "coefficients+darts", "tall", "emr"]
    assert list(report["merge_methods"]["ties"]["variants"]) == [*basic, "deep", "tall"]
    # TALL and EMR: each task's model from the task vectors, judged as the merge is, at a bit per changed parameter
    # (and EMR's rescaler); each merge's TALL masks its own vector.
    experts = {task: tiny_family.experts[task] for task in TASKS}
    changed = sum(t.numel() for t in read_task_vectors(tiny_family.base, experts).base.values())
    assert report["variants"]["tall"]["bytes_per_task"] == -(-changed // 8)
    assert report["variants"]["emr"]["bytes_per_task"] == -(-changed // 8) + 4
    ties_tall = report["merge_methods"]["ties"]["variants"]["tall"]
    for task in TASKS:  # each task's own model: its bias against the expert is neither merge's (this data has no NLL)
        tall = report["variants"]["tall"]["tasks"][task]["bias_before"]
        assert tall not in (ties_tall["tasks"][task]["bias_before"], report["variants"]["merged"]["tasks"][task]["bias_before"])
        assert 0 < report["variants"]["emr"]["tasks"][task]["bias_before"] != tall
    assert report["variants"]["darts"]["bytes_per_task"] > 0 and report["variants"]["merged"]["bytes_per_task"] == 0
    assert report["variants"]["deep"]["settings"]["layers"] == [2, 3, "final"]  # the tiny experts' layers
    learned = Path(report["variants"]["coefficients"]["seed_runs"][1]["coefficients"]["learned_merge"])
    assert (learned / "mergekit_config.yml").is_file()
    assert report["seeds"] == 2
    # No claim can be made: the tiny experts are worse than their merge on held-out NLL and score 0 as it does, so
    # neither compared gap (NLL, score) is defined in any run, and a claim needs one on both sides.
    assert {run["overall"].get(metric) for variant in report["variants"].values() for run in variant["seed_runs"]
            for metric in ("nll_gap_closed", "score_gap_closed")} == {None}
    assert report["claims"] == [] and report["claims_across_merges"] == []
    # Problem by problem: every two variants of the headline merge, and the variants across the two merges.
    merged_passes = report["variants"]["merged"]["seed_runs"][0]["passes"]
    assert set(merged_passes) == set(TASKS) and len(merged_passes["math"]["corrected"]) == 1
    test = report["paired"]["merged vs darts"]
    for seed, run in enumerate(report["variants"]["darts"]["seed_runs"]):
        ours, theirs = ("".join(p[t]["corrected"] for t in TASKS) for p in (merged_passes, run["passes"]))
        assert test["seeds"][seed]["wins"] == sum(a > b for a, b in zip(ours, theirs))
        assert test["seeds"][seed]["losses"] == sum(a < b for a, b in zip(ours, theirs))
    across = report["paired_across_merges"]
    assert "task_arithmetic/darts vs ties/darts" in across and "task_arithmetic/merged vs task_arithmetic/darts" not in across
    for method in report["merge_methods"].values():
        for name, variant in method["variants"].items():
            assert keys <= set(variant["overall"]) and {"bias_reduction", "weighted_bias_reduction"} <= set(variant["overall_sd"])
            assert len(variant["seed_runs"]) == (1 if name in ("merged", "tall", "emr") else 2)
            if name in ("deep", "coefficients", "coefficients+darts"):
                continue
            assert set(variant["tasks"]) == set(TASKS)
            for task in variant["tasks"].values():
                assert keys | {"score_base", "score_expert", "score_merged", "score_corrected", "score_n",
                               "score_corrected_ci", "score_pvalue"} <= set(task)
            corrections = variant["seed_runs"][0]["corrections"]
            if name in ("merged", "tall", "emr"):  # no correction: each judged as its own merged model
                assert corrections is None and variant["overall"]["bias_reduction"] == 0.0
            else:
                assert Path(corrections).is_file() and variant["overall"]["bias_reduction"] > 0
        assert variant["tasks"]["code"]["score_name"] == "humaneval" and "canonical_nll_corrected" in variant["tasks"]["code"]
    # Retention of what a request without a task gets: DARTS's routed pick on the headline merge, the merged model
    # itself for a variant without a router; beside each variant's other numbers, with its spread over seeds.
    headline = report["variants"]
    merged_retention = headline["merged"]["overall"]["retention_nll_corrected"]
    assert headline["surgery"]["overall"]["retention_nll_corrected"] == merged_retention
    routed = headline["darts"]["seed_runs"][0]["retention"]["corrected"]
    assert sum(routed["routes"].values()) == routed["n"]  # each instruction a task's correction, or none
    # Only instructions inside a task's envelope are corrected: none, and the merge's retention is kept exactly.
    assert (headline["darts"]["overall"]["retention_nll_corrected"] == merged_retention) == (
        routed["routes"]["merged"] == routed["n"])
    assert "retention_nll_corrected" in headline["darts"]["overall_sd"]
    assert headline["darts"]["seed_runs"][0]["retention"]["base"]["agreement"] == 1.0
    # Tuning: paired trials of Surgery and DARTS on the validation split of the headline merge, whose
    # winners the other merge reuses.
    tuning = report["merge_methods"]["task_arithmetic"]["tuning"]
    assert [(t["trial"], t["variant"]) for t in tuning] == [(0, "surgery"), (1, "surgery"), (0, "darts"), (1, "darts")]
    own = {"rank": 4, "steps": 8, "learning_rate": 0.01, "max_positions": 16}
    assert {key: tuning[2]["settings"][key] for key in own} == own  # each Tuner's first trial: the config's own
    assert tuning[0]["settings"]["position_bias"] == "none" and tuning[0]["settings"]["beta"] == 0.0  # Surgery
    assert all(isinstance(t["nll_gap_closed"], float) for t in tuning)
    assert "tuning" not in report["merge_methods"]["ties"]
    for name in ("surgery", "darts"):
        assert report["merge_methods"]["ties"]["variants"][name]["settings"] == report["variants"][name]["settings"]
    assert report["tuning"]["validation_fraction"] == 0.2
    # The headline merge's router: its held-out accuracy, and DARTS's scores with the task left to it.
    router = report["router"]
    accuracy, per_task = router_accuracy_by_hand(report)
    assert router["accuracy"] == pytest.approx(accuracy) and router["per_task"] == pytest.approx(per_task)
    # The routed answers are asked for DARTS on the headline merge only, each seed and task, with the run's own
    # router (routed_passes against routing every problem: test_task_scores); the report's scores are theirs.
    assert [task for task, _ in routed_asked] == [*TASKS, *TASKS]
    for task in TASKS:
        scores = {name: v["tasks"][task] for name, v in report["variants"].items()}
        seeds = [sum(passes) / len(passes) for asked, passes in routed_asked if asked == task]
        assert [run["tasks"][task]["score_routed"] for run in report["variants"]["darts"]["seed_runs"]] == seeds
        assert scores["darts"]["score_routed"] == pytest.approx(sum(seeds) / len(seeds))
        assert all(s.get("score_routed") is None for name, s in scores.items() if name != "darts")
        assert "score_routed" not in report["merge_methods"]["ties"]["variants"]["darts"]["tasks"][task]
    assert Path(report["plots"]["ablation_bias_by_position"]).read_bytes().startswith(b"\x89PNG")
    # The frontier: a point per merge and variant, its bytes, seconds, score and retention as the variant has them.
    assert Path(report["plots"]["frontier"]).read_bytes().startswith(b"\x89PNG")
    points = {(p["merge"], p["variant"]): p for p in report["frontier"]}
    assert set(points) == {(m, v) for m, r in report["merge_methods"].items() for v in r["variants"]}
    darts = points[("task_arithmetic", "darts")]
    assert darts["bytes_per_task"] == report["variants"]["darts"]["bytes_per_task"]
    assert darts["calibration_seconds"] == pytest.approx(sum(
        run["calibration"]["train_seconds"] for run in report["variants"]["darts"]["seed_runs"]) / 2)
    assert darts["score"] == report["variants"]["darts"]["overall"]["score_corrected"]
    assert points[("task_arithmetic", "tall")]["retention_nll"] is None and points[("ties", "merged")]["calibration_seconds"] == 0
    runs = report["tracking"]["stage_runs"]
    assert "ablation/ties/darts" in runs
    # Every Tune trial is an MLflow run nested under the command's (Ray Tune's MLflow callback).
    client = MlflowClient(report["tracking"]["uri"])
    trial_runs = client.search_runs([report["tracking"]["experiment_id"]],
                                    f"tags.mlflow.parentRunId = '{report['tracking']['run_id']}' and "
                                    "tags.`darts.stage` LIKE 'tune/%'")
    assert sorted(run.data.tags["darts.stage"] for run in trial_runs) == ["tune/darts"] * 2 + ["tune/surgery"] * 2
    assert all("nll_gap_closed" in run.data.metrics for run in trial_runs)
    metrics = MlflowClient(report["tracking"]["uri"]).get_run(runs["ablation/ties/darts"]).data.metrics
    parent = MlflowClient(report["tracking"]["uri"]).get_run(report["tracking"]["run_id"]).data.metrics
    assert parent["router.accuracy"] == pytest.approx(router["accuracy"])
    assert metrics["eval.overall.bias_reduction"] == pytest.approx(
        report["merge_methods"]["ties"]["variants"]["darts"]["overall"]["bias_reduction"])


@pytest.mark.slow
def test_demo_ablate_reports_every_variant_and_the_router(tmp_path: Path, monkeypatch, capsys) -> None:
    """`demo --ablate`: the ablation on the packaged config, its report the demo's."""
    monkeypatch.chdir(tmp_path)  # the tiny config tracks to ./mlflow.db
    assert main(["demo", "--tiny", "--tune", "2"]) == 2  # an ablation option without --ablate is refused
    assert "add --ablate" in capsys.readouterr().err
    report_path = tmp_path / "demo.json"
    every = ["merged", "surgery", "entropy", "position", "darts", "deep", "coefficients", "tall", "emr", "darts+logits"]
    assert main(["demo", "--tiny", "--ablate", "--steps", "10", "--merge-methods", "task_arithmetic",
                 "--score-limit", "0", "--output-dir", str(tmp_path / "runs"), "--report", str(report_path),
                 "--variants", ",".join(every)]) == 0
    report = json.loads(report_path.read_text())
    assert list(report["variants"]) == ["merged", "surgery", "entropy", "position", "darts", "darts+logits", "deep",
                                        "coefficients", "coefficients+darts", "tall", "emr"]
    # DARTS with the logit term trained on the experts' streamed top tokens, and is served by the run's router.
    logits = report["variants"]["darts+logits"]
    assert logits["settings"]["logit_weight"] == 1.0 and logits["overall"]["bias_reduction"] > 0
    assert logits["overall"]["bias_reduction"] != report["variants"]["darts"]["overall"]["bias_reduction"]
    routes = logits["seed_runs"][0]["retention"]["corrected"]["routes"]
    assert sum(routes.values()) == logits["seed_runs"][0]["retention"]["corrected"]["n"]
    assert set(report["variants"]["darts"]["tasks"]) == {"code", "math", "instruct"}
    assert report["variants"]["surgery"]["settings"]["steps"] == 10
    accuracy, per_task = router_accuracy_by_hand(report)
    assert report["router"]["accuracy"] == pytest.approx(accuracy)
    assert report["router"]["per_task"] == pytest.approx(per_task)


def _variant(*seeds: tuple[float, dict[str, str]]) -> dict:
    """A variant's summary from (score gap closed, {task: passes}) per seed."""
    return {"seed_runs": [{"overall": {"score_gap_closed": gap},
                           "passes": {t: {"corrected": p} for t, p in passes.items()}} for gap, passes in seeds]}


def test_a_score_claim_needs_the_seed_spread_and_mcnemar_in_every_seed() -> None:
    from darts_dist.ablation import claims, mcnemar, paired_tests

    merged = _variant((0.0, {"math": "0" * 30, "code": "0" * 30}))
    strong = _variant((0.9, {"math": "1" * 12 + "0" * 18, "code": "1" * 4 + "0" * 26}),
                      (0.8, {"math": "1" * 10 + "0" * 20, "code": "1" * 5 + "0" * 25}))
    # Beyond two sd over seeds, but 3 wins against none in each seed: McNemar's p is 0.25.
    few = _variant((0.3, {"math": "111" + "0" * 27, "code": "0" * 30}),
                   (0.31, {"math": "0" * 27 + "111", "code": "0" * 30}))
    variants = {"merged": merged, "strong": strong, "few": few}
    test = mcnemar(strong, merged)
    assert [(c["wins"], c["losses"]) for c in test["seeds"]] == [(16, 0), (15, 0)]
    assert test["tasks"]["math"][1] == {"wins": 10, "losses": 0, "pvalue": pytest.approx(2 * 0.5**10)}
    assert test["pvalue_max"] == pytest.approx(2 * 0.5**15) and test["wins_every_seed"]
    assert mcnemar(few, merged)["pvalue_max"] == pytest.approx(0.25)
    found = claims(variants, {"score_gap_closed": 1})
    assert [c.split(" on ")[0] for c in found] == ["strong beats merged", "strong beats few"]
    assert "McNemar p ≤" in found[0]
    assert set(paired_tests(variants)) == {"merged vs strong", "merged vs few", "strong vs few"}
    assert claims(variants, {"score_gap_closed": 1}, keep=lambda a, b: b == "few") == [found[1]]


def test_variants_can_be_chosen() -> None:
    plan = plan_ablation(_config(), variants=["merged", "darts"])
    assert list(plan.variants) == ["merged", "darts"]
    assert not plan.deep and not plan.coefficients and plan.masked == ()
    # TALL and EMR need no DARTS (they train nothing).
    assert plan_ablation(_config(), variants=["merged", "emr", "tall"]).masked == ("tall", "emr")
    plan = plan_ablation(_config(), variants=["darts", "deep"])
    assert list(plan.variants) == ["darts"] and plan.deep and not plan.coefficients
    assert not plan_ablation(_config(), extended=False).deep
    # The ranked variants: DARTS's settings at another rank, run only when named.
    plan = plan_ablation(_config({"rank": 32}), variants=["darts", "rank16", "rank64"])
    darts = plan.variants["darts"]
    for name, rank in (("rank16", 16), ("rank64", 64)):
        assert plan.variants[name] == darts.model_copy(update={"rank": rank}) and darts.rank != rank
    assert not {"rank16", "rank64"} & set(plan_ablation(_config()).variants)
    # DARTS with the logit term: weight 1 where the config sets none, the config's where it does; when named.
    plan = plan_ablation(_config(), variants=["darts", "darts+logits"])
    assert plan.variants["darts+logits"] == plan.variants["darts"].model_copy(update={"logit_weight": 1.0})
    # A config with the term (the demo's): its paper variants train the paper's loss, the term is the variant's.
    plan = plan_ablation(_config({"logit_weight": 0.3, "logit_positions": 4}),
                         variants=["surgery", "darts", "rank16", "darts+logits"])
    assert plan.variants["darts+logits"].logit_weight == 0.3 and plan.variants["darts+logits"].logit_positions == 4
    assert all(plan.variants[name].logit_weight == 0.0 for name in ("surgery", "darts", "rank16"))
    assert "darts+logits" not in plan_ablation(_config()).variants
    with pytest.raises(DartsError, match="unknown or repeated"):
        plan_ablation(_config(), variants=["merged", "dart"])
    with pytest.raises(DartsError, match="add darts"):
        plan_ablation(_config(), variants=["merged", "coefficients"])


def test_each_merge_method_gets_settings_it_takes() -> None:
    from darts_dist.ablation import _merge_config

    config = _config(merge={"method": "task_arithmetic", "parameters": {"weight": 0.5}})
    regmean = _merge_config(config, "regmean").merge
    assert (regmean.method, regmean.parameters, regmean.others, regmean.alpha) == ("regmean", {}, None, 0.9)
    assert _merge_config(config, "task_arithmetic").merge.parameters == {"weight": 0.5}
    back = _merge_config(_config(merge={"method": "regmean", "others": {"method": "linear", "parameters": {
        "weight": 2.0}}}), "ties").merge
    assert (back.method, back.parameters, back.others) == ("ties", {"weight": 2.0}, None)


def test_across_merges_a_lower_nll_wins_and_gaps_are_not_compared() -> None:
    from darts_dist.ablation import ACROSS_MERGES, claims

    def variant(*nlls: float) -> dict:
        return {"seed_runs": [{"overall": {"nll_corrected": nll, "nll_gap_closed": 0.0}} for nll in nlls]}

    variants = {"ta/darts": variant(0.38, 0.381, 0.383), "regmean/darts": variant(0.352, 0.352, 0.351)}
    found = claims(variants, ACROSS_MERGES)
    assert [c.split(":")[0] for c in found] == ["regmean/darts beats ta/darts on nll_corrected"]
    assert "0.0297" in found[0] or "0.03" in found[0]
