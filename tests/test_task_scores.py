"""Task scores: the checks on known strings, the HumanEval sandbox, and the evaluator's scores against a direct
computation."""

from __future__ import annotations

import copy
import json
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from darts_dist.config import DataSpec, EvaluationSection, parse_config
from darts_dist.core import ROUTED, CorrectionSpec, DartsCorrections, TaskRouter, attach_corrections, prompt_features
from darts_dist.errors import DartsError
from darts_dist.evaluate import task_scores
from darts_dist.evaluate.evaluator import Evaluator
from darts_dist.evaluate.sandbox import Checks, run_sandboxed, sandbox_kind
from darts_dist.evaluate.statistics import paired_comparison, wilson_interval
from darts_dist.evaluate.task_scores import (
    SCORERS,
    Problem,
    Scorer,
    answered_problems,
    humaneval_problems,
    humaneval_check,
    problem_passes,
    routed_passes,
)
from darts_dist.generation import CorrectedLM
from darts_dist.sources.data import TaskFiles
from darts_dist.sources.demo.tiny import build_tiny_tokenizer
from darts_dist.sources.models import load_causal_lm, pad_id
from darts_dist.sources.references import demo_data, scorer_name


def test_math_and_instruct_checks_on_known_strings() -> None:
    math, instruct = SCORERS["math_exact"], SCORERS["instruct_exact"]
    problem = Problem(id="m", answer="1200")
    assert math.passed(problem, "3*400 = <<3*400=1200>>1,200 apples.\n#### 1,200", Checks(1.0))
    assert math.passed(problem, "So the answer is 1200.0", Checks(1.0))  # no ####: the last number
    assert not math.passed(problem, "#### 1201", Checks(1.0))
    assert not math.passed(problem, "I do not know", Checks(1.0))
    assert not math.passed(Problem(id="m", answer="none"), "none", Checks(1.0))  # an answer without a number never passes
    assert instruct.passed(Problem(id="i", answer="b a"), "  b a\n", Checks(1.0))
    assert not instruct.passed(Problem(id="i", answer="b a"), "b  a", Checks(1.0))


def test_humaneval_problems_come_from_the_installed_wheel() -> None:
    problems = humaneval_problems()
    assert len(problems) == 164 and problems[0].id == "HumanEval/0"
    assert [p.id for p in humaneval_problems(3)] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
    assert all(p.prompt and p.answer and p.test and p.entry_point for p in problems)


def test_sandbox_passes_a_solution_fails_a_wrong_one_and_stops_a_loop() -> None:
    problem = humaneval_problems(1)[0]
    assert humaneval_check(problem, problem.answer, Checks(10.0)).passed
    wrong = humaneval_check(problem, "    return False\n", Checks(10.0))
    assert not wrong.passed and wrong.status == "failed: AssertionError"
    started = time.perf_counter()
    looping = humaneval_check(problem, "    while True:\n        pass\n", Checks(1.0))
    assert looping.status == "timed out" and time.perf_counter() - started < 10
    # Isolated: a fresh folder as cwd holding only its own code, no environment variables (LC_CTYPE is Python's own
    # coercion).
    probe = "import os, sys\nassert sorted(os.listdir('.')) == ['answer.py', 'program.py'], os.listdir('.')\n" \
            "assert set(os.environ) <= {'LC_CTYPE'}, dict(os.environ)\nassert sys.flags.isolated\n"
    assert run_sandboxed(probe, Checks(10.0)).passed
    # A program passes when its tests run to their end, not by exiting with status 0 before them.
    early = run_sandboxed("import sys\nsys.exit(0)\ndef f():\n    return 1\n", Checks(10.0), tests="assert f() == 1\n")
    assert not early.passed and early.status == "failed: exited before its end (status 0)"


def test_code_tests_need_tests_in_every_row(tmp_path: Path) -> None:
    rows = tmp_path / "code.jsonl"
    row = {"messages": [{"role": "user", "content": "Write f()."}], "answer": "def f():\n    return 1\n"}
    rows.write_text(json.dumps(row | {"tests": "assert f() == 1\n"}) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(DartsError, match="1 problem\\(s\\) of .*code.jsonl have no `tests`") as error:
        SCORERS["code_tests"].problems(rows, None)
    assert "assert statements" in error.value.fix
    (problem,) = SCORERS["code_tests"].problems(rows, 1)
    assert SCORERS["code_tests"].passed(problem, "def f():\n    return 1\n", Checks(5.0))
    assert not SCORERS["code_tests"].passed(problem, "def f():\n    return 2\n", Checks(5.0))


def test_scorer_follows_the_config_and_defaults_for_demo_tasks() -> None:
    def data(heldout: str, **more: str) -> DataSpec:
        return DataSpec(calibration=heldout, heldout=heldout, **more)

    assert scorer_name(data("demo:code")) == "code_tests"
    assert scorer_name(data("demo:math")) == "math_exact"
    assert scorer_name(data("demo:instruct")) == "instruct_exact"  # follows the data, whatever the task's name
    assert scorer_name(data("mine.jsonl")) == "none"
    assert scorer_name(data("demo:math", scorer="none")) == "none"
    assert scorer_name(data("mine.jsonl", scorer="math_exact")) == "math_exact"


def test_answered_problems_need_an_answer_column(tmp_path: Path) -> None:
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"prompt": "2+2?", "response": "4"}) + "\n")
    with pytest.raises(DartsError, match="answer"):
        answered_problems(rows, None)
    rows.write_text("".join(json.dumps({"prompt": f"{i}+1?", "response": "?", "answer": str(i + 1)}) + "\n"
                            for i in range(5)))
    problems = answered_problems(rows, 3)
    assert [p.answer for p in problems] == ["1", "2", "3"]
    assert problems[0].messages == ({"role": "user", "content": "0+1?"},)


@pytest.fixture(scope="module")
def models(tiny_family):
    """Expert, merged model, and corrections whose greedy output is known: the instruct correction's
    position bias points every hidden state at one token's output embedding, so that token always wins."""
    expert, merged = load_causal_lm(tiny_family.experts["instruct"]), load_causal_lm(tiny_family.base)
    tokenizer = build_tiny_tokenizer()
    head = merged.get_output_embeddings().weight.detach()
    norms = head.norm(dim=1)
    norms[tokenizer.all_special_ids] = 0  # an end-of-turn token would end the answer at once
    token = int(norms.argmax())  # the longest row wins the dot product with itself
    torch.manual_seed(0)
    corrections = DartsCorrections(CorrectionSpec(("code", "instruct"), 64, rank=4, max_positions=32), ["final"])
    with torch.no_grad():
        corrections["final"].up[0] = torch.randn_like(corrections["final"].up[0])  # code: a random, real change
        corrections["final"].position[1] = 100 * head[token] / head[token].norm()
    return expert, merged, corrections, token


def steered(model, token: int):
    """A copy of `model` that says `token` and nothing else: its final norm's output points at the token's
    output embedding (the longer ones win the dot product with themselves)."""
    model = copy.deepcopy(model)
    row = model.get_output_embeddings().weight[token].detach().clone()
    model.model.norm.register_forward_hook(lambda module, args, output: output + 100 * row / row.norm())
    return model


def evaluated(
    tiny_family, monkeypatch, scorer: Scorer, task: str, expert, merged, corrections, settings: EvaluationSection,
    router: TaskRouter | None = None, base=None,
) -> dict[str, object]:
    """One task's results from the evaluator, as the pipeline and the ablation get them, with `scorer` as its
    registered scorer (held-out bias and NLL on the demo's instruct rows, which every task here reads)."""
    monkeypatch.setitem(SCORERS, scorer.name, scorer)
    heldout = str(demo_data()["instruct"]["heldout"])
    tasks = tuple(corrections.spec.tasks)
    config = parse_config({
        "sources": {"base": str(tiny_family.base), "experts": [
            {"task": t, "path": str(tiny_family.experts[t]), "data": {"calibration": heldout, "heldout": heldout}}
            for t in tasks]},
        "evaluation": settings.model_dump() | {"retention": False},  # retention: tests/test_retention.py
    })
    files = {t: TaskFiles(calibration=Path(heldout), heldout=Path(heldout), scorer=scorer.name) for t in tasks}
    evaluator = Evaluator(config, files, build_tiny_tokenizer(), progress=False)
    # The "base": another model than every other here (by default the math expert), scored in a pass of its own.
    base_passes = evaluator.base_side(base if base is not None else load_causal_lm(tiny_family.experts["math"]),
                                      tiny_family.experts["math"]).passes.get(task)
    side = evaluator.expert_side(tasks.index(task), expert, base_passes=base_passes)
    pairs = [(side, evaluator.merged_side(merged, side.index))]
    return evaluator.evaluate(merged, corrections, pairs, router=router)["tasks"][task]


def test_generated_scores_equal_a_direct_computation(models, tiny_family, monkeypatch) -> None:
    """Exact-reply scores of expert, merged and corrected, against answers made from known greedy outputs."""
    expert, merged, corrections, token = models
    tokenizer = build_tiny_tokenizer()
    # The tiny models all answer with blank lines. So that each model's replies are its own, the expert and the
    # base (the math expert) are steered as the instruct correction is: each to one token of its own.
    head = merged.get_output_embeddings().weight.detach()
    wins = (head @ (head / head.norm(dim=1, keepdim=True)).T).argmax(dim=0)  # the token each row's direction picks
    expert_token, base_token = [t for t in range(len(head)) if wins[t] == t and t != token and tokenizer.decode(
        [t]).strip() and t not in tokenizer.all_special_ids][:2]
    expert, base_model = steered(expert, expert_token), steered(load_causal_lm(tiny_family.experts["math"]), base_token)
    problems = answered_problems(demo_data()["instruct"]["heldout"], 10)
    conversations = [list(p.messages) for p in problems]
    settings = EvaluationSection(score_limit=10, max_new_tokens=6, generation_batch_size=10)
    # The same batch as the scorer's, so padding cannot change a greedy token.
    with CorrectedLM(merged, tokenizer, corrections) as lm:
        corrected = [c.text for c in lm.chat(conversations, tasks=["instruct"] * 10, max_new_tokens=6)]
        plain = [c.text for c in lm.chat(conversations, max_new_tokens=6)]
        coded = [c.text for c in lm.chat(conversations, tasks=["code"] * 10, max_new_tokens=6)]
    with CorrectedLM(expert, tokenizer) as lm:
        own = [c.text for c in lm.chat(conversations, max_new_tokens=6)]
    with CorrectedLM(base_model, tokenizer) as lm:
        base = [c.text for c in lm.chat(conversations, max_new_tokens=6)]
    assert corrected == [tokenizer.decode([token] * 6)] * 10  # the correction applies while generating
    # Planted answers: a model's own replies where it is to pass, so that corrected, merged, expert and base each
    # score something, and each its own share: 4, 1, 2 and 3 of the 10.
    replies = {"corrected": corrected, "merged": plain, "expert": own, "base": base}
    said_by = ["corrected"] * 4 + ["merged"] + ["expert"] * 2 + ["base"] * 3
    known = [replace(p, answer=replies[who][i]) for i, (p, who) in enumerate(zip(problems, said_by))]
    scorer = replace(SCORERS["instruct_exact"], problems=lambda heldout, limit: known)
    result = evaluated(tiny_family, monkeypatch, scorer, "instruct", expert, merged, corrections, settings,
                       base=base_model)

    def passes(texts):
        return [t.strip() == p.answer.strip() for t, p in zip(texts, known)]

    shares = {who: sum(passes(texts)) / 10 for who, texts in replies.items()}
    assert shares == {"corrected": 0.4, "merged": 0.1, "expert": 0.2, "base": 0.3}  # no two models said the same
    assert result["score_name"] == "instruct_exact" and result["score_n"] == 10 and "sandbox" not in result
    assert {who: result[f"score_{who}"] for who in replies} == pytest.approx(shares)
    comparison = paired_comparison(passes(corrected), passes(plain))
    assert (comparison.wins, comparison.losses) == (4, 1)
    assert (result["score_wins"], result["score_losses"], result["score_pvalue"]) == (
        comparison.wins, comparison.losses, comparison.pvalue)
    assert result["score_corrected_ci"] == list(wilson_interval(passes(corrected)))
    assert "canonical_nll_expert" not in result  # only scorers with reference solutions
    assert "score_routed" not in result  # no router, no routed score

    def constant_router(index: int) -> TaskRouter:  # always the same task, at full confidence
        d = merged.config.hidden_size
        return TaskRouter(("code", "instruct"), "final", torch.zeros(d), torch.ones(d), torch.zeros(2, d),
                          torch.tensor([50.0, -50.0]) if index == 0 else torch.tensor([-50.0, 50.0]))

    routed = evaluated(tiny_family, monkeypatch, scorer, "instruct", expert, merged, corrections, settings,
                       constant_router(1))
    assert routed["score_routed"] == routed["score_corrected"] == pytest.approx(0.4)
    misrouted = evaluated(tiny_family, monkeypatch, scorer, "instruct", expert, merged, corrections, settings,
                          constant_router(0))
    assert misrouted["score_routed"] == pytest.approx(sum(passes(coded)) / 10)  # code's correction's replies
    unscored = evaluated(tiny_family, monkeypatch, scorer, "instruct", expert, merged, corrections,
                         EvaluationSection(score_limit=0))
    assert "score_name" not in unscored and unscored["bias_after"] > 0  # a limit of 0: bias and NLL, no scores


def test_routed_answers_reuse_the_task_s_own_and_ask_the_rest_again(models, monkeypatch) -> None:
    """A router that sends half the problems elsewhere: the routed passes equal generating with the routed id,
    and only the problems routed elsewhere are answered again."""
    _, merged, corrections, _ = models
    tokenizer = build_tiny_tokenizer()
    problems = answered_problems(demo_data()["instruct"]["heldout"], 8)
    settings = EvaluationSection(score_limit=8, max_new_tokens=6, generation_batch_size=8)
    with CorrectedLM(merged, tokenizer, corrections) as lm:
        encoded = [lm.encode_chat(p.messages) for p in problems]
        answers = [c.text for c in lm.chat([list(p.messages) for p in problems], tasks=["instruct"] * 8,
                                           max_new_tokens=6)]
    # The instruct correction's own answers are right, anything else is wrong: a pass says which correction ran.
    known = [replace(p, answer=text) for p, text in zip(problems, answers)]
    features = prompt_features(merged, encoded, "final", pad_id(tokenizer), batch_size=8)
    direction = torch.randn(features.shape[1], generator=torch.Generator().manual_seed(0))
    projection = (features @ direction).sort().values
    split = float(projection[3] + projection[4]) / 2  # code above the split, instruct below: four each
    router = TaskRouter(("code", "instruct"), "final", torch.zeros_like(direction), torch.ones_like(direction),
                        torch.stack([50 * direction, -50 * direction]), torch.tensor([-50 * split, 50 * split]))
    scorer = SCORERS["instruct_exact"]
    generated: list[tuple[str | None, list[str]]] = []  # each generation routed_passes asks for: task, problems
    real_completions = task_scores.completions

    def spy(lm, task, problems, *args, **kwargs):
        generated.append((task, [p.id for p in problems]))
        return real_completions(lm, task, problems, *args, **kwargs)

    with CorrectedLM(merged, tokenizer, corrections, router) as lm:
        routes = lm.routes(encoded)
        corrected = problem_passes(lm, "instruct", known, scorer, settings)
        monkeypatch.setattr(task_scores, "completions", spy)
        routed = routed_passes(lm, "instruct", known, scorer, settings, corrected)
        monkeypatch.undo()
        direct = problem_passes(lm, ROUTED, known, scorer, settings)
    assert sorted(routes) == ["code"] * 4 + ["instruct"] * 4
    assert corrected == [True] * 8
    assert routed == direct == [route == "instruct" for route in routes]
    # One generation, of the four problems the router sends to code; instruct's own answers were reused.
    assert generated == [(ROUTED, [p.id for p, route in zip(known, routes) if route != "instruct"])]


def test_humaneval_solution_nll_equals_a_direct_computation(models, tiny_family, monkeypatch) -> None:
    expert, merged, corrections, _ = models
    tokenizer = build_tiny_tokenizer()
    # Planted beside two of HumanEval's: a problem whose prompt solves it and ends in a comment that the completion
    # continues (every completion ends at its first line break here), so no model's pass@1 is 0.
    anything = Problem(id="planted/0", prompt="def answer():\n    return 42\n\n\n# whatever comes next:",
                       answer=" x\n", test="def check(candidate):\n    assert candidate() == 42\n",
                       entry_point="answer")
    problems = humaneval_problems(2) + [anything]
    scorer = replace(SCORERS["humaneval"], problems=lambda heldout, limit: problems,
                     stop=(*SCORERS["humaneval"].stop, "\n", "\r"))
    settings = EvaluationSection(score_limit=3, max_new_tokens=4)
    answered: dict[str, list[str]] = {}  # "expert answers code" etc. -> the completions the scorer checked
    real_completions = task_scores.completions

    def spy(lm, task, problems, scorer, settings, desc="answers", progress=False):
        answered[desc] = real_completions(lm, task, problems, scorer, settings, desc, progress)
        return answered[desc]

    monkeypatch.setattr(task_scores, "completions", spy)
    result = evaluated(tiny_family, monkeypatch, scorer, "code", expert, merged, corrections, settings)
    assert result["score_name"] == "humaneval" and result["score_metric"] == "pass@1" and result["score_n"] == 3
    assert result["sandbox"] == sandbox_kind()  # which sandbox ran the code
    for model in ("base", "expert", "merged", "corrected"):  # pass@1: the sandbox by hand on what each wrote
        texts = answered[f"{model} answers code"]
        ran = [humaneval_check(p, t, Checks(settings.sandbox_timeout)).passed
               for p, t in zip(problems, texts)]
        assert ran[2], (model, texts[2])  # the planted problem passes
        assert result[f"score_{model}"] == sum(ran) / 3, (model, texts)

    def solution_nll(model, task_ids=None) -> float:
        total, count = 0.0, 0
        for problem in problems:
            prompt = tokenizer(problem.prompt)["input_ids"]
            ids = torch.tensor([prompt + tokenizer(problem.answer, add_special_tokens=False)["input_ids"]])
            with torch.no_grad():
                if task_ids is None:
                    logits = model(input_ids=ids).logits
                else:
                    with attach_corrections(model, corrections) as handle:
                        handle.set_tasks(task_ids)
                        logits = model(input_ids=ids).logits
            nll = F.cross_entropy(logits[0, :-1], ids[0, 1:], reduction="none")[len(prompt) - 1:]
            total, count = total + float(nll.sum()), count + nll.numel()
        return total / count

    assert result["canonical_nll_expert"] == pytest.approx(solution_nll(expert), rel=1e-4)
    assert result["canonical_nll_merged"] == pytest.approx(solution_nll(merged), rel=1e-4)
    assert result["canonical_nll_corrected"] == pytest.approx(solution_nll(merged, [0]), rel=1e-4)
    assert result["canonical_nll_corrected"] != pytest.approx(result["canonical_nll_merged"], rel=1e-4)
