"""lm-eval integration: `--model darts-dist` is lm-eval's `hf` model under darts-dist's correction. With
`task=merged` it answers every request as `--model hf` on the merged folder does, raw or chat-templated; under a
task its likelihoods are `CorrectedLM`'s; on the darts_demo tasks (with --apply_chat_template) it gives `darts-dist
evaluate`'s completions and score, under a task's correction, the router's or none; bad model_args stop with a
DartsError that names the fix."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from lm_eval import simple_evaluate
from lm_eval.api.instance import Instance
from lm_eval.models.huggingface import HFLM
from lm_eval.tasks import TaskManager
from test_generation import TASKS, strong_corrections

from darts_dist.calibrate.router import fit_router
from darts_dist.config import EvaluationSection
from darts_dist.core import ROUTED, ROUTER_FILE, prompt_features, save_corrections
from darts_dist.errors import DartsError
from darts_dist.evaluate.lm_eval_model import DartsLM
from darts_dist.evaluate.lm_eval_tasks import HELDOUT_SPLIT, TASKS_DIR, heldout_dataset, process_results
from darts_dist.evaluate.task_scores import SCORERS, problem_passes
from darts_dist.generation import CorrectedLM
from darts_dist.sources.corrections import corrections_metadata
from darts_dist.sources.demo.tasks import DEMO_SCORERS, DEMO_TASKS
from darts_dist.sources.references import demo_data

LIMIT = 3
MAX_NEW_TOKENS = 8
CODE = [f"def {name}(values, k={i}):" for i, name in enumerate(["scale", "shift", "clip", "norm"])]
MATH = [f"Ann has {i + 3} coins and finds {i} more. How many coins does she have?" for i in range(4)]


def make_run(folder: Path, base: Path, layers: tuple = ("final",)) -> Path:
    """A run folder as `calibrate` writes one: merged/ (`base` stands in), strong corrections for code and math at
    `layers`, and a router fit on code vs. word-problem prompts."""
    merged_dir = folder / "merged"
    shutil.copytree(base, merged_dir)
    hidden_size = json.loads((merged_dir / "config.json").read_text())["hidden_size"]
    save_corrections(folder / "corrections.safetensors", strong_corrections(hidden_size, layers=layers),
                     metadata=corrections_metadata(merged_dir))
    with CorrectedLM.load(merged_dir) as plain:
        features = prompt_features(plain.model, [plain.encode(p) for p in CODE + MATH], "final", plain.pad_id)
    fit_router(features, torch.tensor([0] * len(CODE) + [1] * len(MATH)), TASKS, "final",
               threshold=0.5).save(folder / ROUTER_FILE)
    return folder


@pytest.fixture(scope="module")
def run_dir(tiny_family, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_run(tmp_path_factory.mktemp("lm_eval_run"), tiny_family.base)


def lm_eval_math(run_dir: Path, task: str) -> tuple[float, list[str]]:
    """darts_demo_math's acc from lm-eval (chat-templated, as the demo tasks need) with `task=` as the correction,
    and its completions, problem by problem."""
    results = simple_evaluate(
        model="darts-dist", model_args={"run": str(run_dir), "task": task, "device": "cpu"},
        tasks=["darts_demo_math"], limit=LIMIT, batch_size=1, gen_kwargs={"max_gen_toks": MAX_NEW_TOKENS},
        apply_chat_template=True, log_samples=True,
        task_manager=TaskManager(include_path=str(TASKS_DIR), include_defaults=False),
    )
    samples = sorted(results["samples"]["darts_demo_math"], key=lambda sample: sample["doc_id"])
    return results["results"]["darts_demo_math"]["acc,none"], [sample["resps"][0][0] for sample in samples]


def darts_math(lm: CorrectedLM, task: str | None, monkeypatch: pytest.MonkeyPatch) -> tuple[float, list[str]]:
    """The same from darts-dist's own scoring of the first LIMIT held-out math problems."""
    texts: list[str] = []
    generate_ids = CorrectedLM.generate_ids

    def recorded(self: CorrectedLM, encoded, tasks=None, **options):
        done = generate_ids(self, encoded, tasks, **options)
        texts.extend(completion.text for completion in done)
        return done

    monkeypatch.setattr(CorrectedLM, "generate_ids", recorded)
    scorer = SCORERS[DEMO_SCORERS["math"]]
    problems = scorer.problems(demo_data()["math"]["heldout"], LIMIT)
    settings = EvaluationSection(score_limit=LIMIT, generation_batch_size=1, max_new_tokens=MAX_NEW_TOKENS)
    passes = problem_passes(lm, task, problems, scorer, settings)
    monkeypatch.undo()
    return sum(passes) / len(passes), texts


def test_a_task_scores_and_answers_as_darts_dist_evaluate(run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    scored = lm_eval_math(run_dir, "math")
    with CorrectedLM.load(run_dir / "merged", run_dir / "corrections.safetensors") as lm:
        # The same score from the same completions, problem by problem.
        assert scored == darts_math(lm, "math", monkeypatch)
        # Not a comparison of empty strings: the completions have text, and the correction is in it.
        texts = scored[1]
        assert len(texts) == LIMIT and all(text.strip() for text in texts)
        assert texts != darts_math(lm, None, monkeypatch)[1]


def test_routed_and_merged_are_the_routers_pick_and_no_correction(run_dir: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    with CorrectedLM.load(run_dir / "merged", run_dir / "corrections.safetensors",
                          router_path=run_dir / ROUTER_FILE) as lm:
        assert lm_eval_math(run_dir, "routed") == darts_math(lm, ROUTED, monkeypatch)
    with CorrectedLM.load(run_dir / "merged") as lm:
        assert lm_eval_math(run_dir, "merged") == darts_math(lm, None, monkeypatch)


QUESTIONS = ["What is 2 + 3?", "def add(a, b):", "Ann has 4 coins and finds 3 more. How many?"]
ANSWERS = [" It is 5.", "\n    return a + b"]


def requests_of(contexts: list[str]) -> tuple[list[Instance], list[Instance]]:
    """Loglikelihood requests (every context with every answer) and greedy generate_until requests."""
    pairs = [(c, a) for c in contexts for a in ANSWERS]
    likelihoods = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]
    settings = {"until": ["\n\n"], "max_gen_toks": MAX_NEW_TOKENS, "do_sample": False, "temperature": 0.0}
    generations = [Instance("generate_until", {}, (c, dict(settings)), i) for i, c in enumerate(contexts)]
    return likelihoods, generations


@pytest.mark.parametrize("chat", [False, True], ids=["raw", "chat_template"])
def test_merged_answers_as_lm_evals_hf_model_request_by_request(run_dir: Path, chat: bool) -> None:
    ours = DartsLM(run=str(run_dir), task="merged", device="cpu", batch_size=2)
    theirs = HFLM(pretrained=str(run_dir / "merged"), device="cpu", dtype="float32", batch_size=2)
    # lm-eval templates each context with the model's apply_chat_template (--apply_chat_template).
    contexts = [ours.apply_chat_template([{"role": "user", "content": q}]) if chat else q for q in QUESTIONS]
    if chat:
        assert contexts == [theirs.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
        assert contexts[0] != QUESTIONS[0] and ours.tokenizer_name == theirs.tokenizer_name
    likelihoods, generations = requests_of(contexts)
    got, want = ours.loglikelihood(likelihoods, True), theirs.loglikelihood(likelihoods, True)
    assert [g for _, g in got] == [g for _, g in want]
    assert [lp for lp, _ in got] == pytest.approx([lp for lp, _ in want], abs=1e-5)
    assert ours.generate_until(generations, True) == theirs.generate_until(generations, True)


@pytest.mark.parametrize("task", ["math", "routed"])
def test_likelihoods_are_the_corrected_models(run_dir: Path, task: str) -> None:
    name = ROUTED if task == "routed" else task
    model = DartsLM(run=str(run_dir), task=task, device="cpu", batch_size=3)
    lm = model.lm
    likelihoods, _ = requests_of(QUESTIONS[:2] + MATH[:1] + CODE[:1])
    # The tokens lm-eval scores: its own split of each pair into context and continuation tokens.
    pairs = [model._encode_pair(*request.args) for request in likelihoods]
    expected = lm.continuation_logprobs([c for c, _ in pairs], [x for _, x in pairs], [name] * len(pairs))
    got = model.loglikelihood(likelihoods, disable_tqdm=True)
    assert [g for _, g in got] == [g for _, g in expected]
    assert [lp for lp, _ in got] == pytest.approx([lp for lp, _ in expected], abs=1e-5)
    if task == "routed":  # both of the router's picks among the contexts: the grouping is exercised
        assert {"code", "math"} <= set(lm.routes([c for c, _ in pairs]))
    # A whole text, from the prefix token on, under the same correction (routed: routed on all of the text).
    text = "def add(a, b):\n    return a + b"
    tokens = model.tok_encode(text)
    expected = lm.continuation_logprobs([[model.prefix_token_id]], [tokens], [name],
                                        route_on=[[model.prefix_token_id, *tokens]])[0][0]
    assert model.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)],
                                       disable_tqdm=True) == [pytest.approx(expected, abs=1e-5)]
    lm.close()
    if task == "math":  # the correction is in the scores
        plain = DartsLM(run=str(run_dir), task="merged", device="cpu").loglikelihood(likelihoods[:1], True)[0][0]
        assert abs(plain - got[0][0]) > 1e-3


@pytest.mark.parametrize("task", ["math", "routed"])
def test_batched_generation_is_the_corrected_models(run_dir: Path, task: str) -> None:
    """Left-padded batches of mixed lengths answer as darts-dist's engine does, prompt by prompt: the correction's
    positions count from each prompt's first real token."""
    name = ROUTED if task == "routed" else task
    model = DartsLM(run=str(run_dir), task=task, device="cpu", batch_size=len(QUESTIONS) + 1)
    # Chat-templated under a task; raw when routed (the tiny router, fit on raw prompts, picks code for every
    # templated one).
    contexts = [q if task == "routed" else model.apply_chat_template([{"role": "user", "content": q}])
                for q in QUESTIONS + CODE[:1]]
    _, generations = requests_of(contexts)
    encoded = [model.tok_batch_encode([context])[0][0].tolist() for context in contexts]
    assert len({len(ids) for ids in encoded}) > 1
    if task == "routed":  # rows of one batch under different picks
        assert len(set(model.lm.routes(encoded))) > 1
    expected = model.lm.generate_ids(encoded, [name] * len(encoded), max_new_tokens=MAX_NEW_TOKENS,
                                     stop=["\n\n"], temperature=0.0)
    assert model.generate_until(generations, True) == [completion.text for completion in expected]
    model.lm.close()


def test_the_yamls_generate_as_the_scorers_do() -> None:
    loaded = TaskManager(include_path=str(TASKS_DIR), include_defaults=False).load(["darts_demo"])
    assert set(loaded["tasks"]) == {f"darts_demo_{task}" for task in DEMO_TASKS}
    for task in DEMO_TASKS:
        scorer = SCORERS[DEMO_SCORERS[task]]
        settings = loaded["tasks"][f"darts_demo_{task}"].config.generation_kwargs
        assert (settings["until"], settings["max_gen_toks"], settings["do_sample"]) == (
            list(scorer.stop), scorer.max_new_tokens, False)


def test_a_document_passes_by_darts_dists_own_check() -> None:
    for task in DEMO_TASKS:
        doc = heldout_dataset(task)[HELDOUT_SPLIT][0]
        assert (process_results(doc, [doc["answer"]]), process_results(doc, ["no"])) == ({"acc": 1.0}, {"acc": 0.0})


def test_a_file_of_ones_own_is_scored_instead(tmp_path: Path) -> None:
    mine = tmp_path / "mine.jsonl"
    rows = [{"messages": [{"role": "user", "content": f"What is {i} + {i}?"},
                          {"role": "assistant", "content": f"#### {2 * i}"}], "answer": str(2 * i)} for i in range(2)]
    mine.write_text("".join(json.dumps(row) + "\n" for row in rows))
    manager = TaskManager(include_path=str(TASKS_DIR), include_defaults=False,
                          metadata={"heldout": {"math": str(mine)}})
    docs = manager.load(["darts_demo_math"])["tasks"]["darts_demo_math"].test_docs()
    assert [(doc["question"], doc["answer"]) for doc in docs] == [("What is 0 + 0?", "0"), ("What is 1 + 1?", "2")]


def test_bad_model_args_name_the_fix(run_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(DartsError, match="unknown task 'chemistry'") as error:
        simple_evaluate(model="darts-dist", model_args={"run": str(run_dir), "task": "chemistry", "device": "cpu"},
                        tasks=["darts_demo_math"], limit=1,
                        task_manager=TaskManager(include_path=str(TASKS_DIR), include_defaults=False))
    assert "name one of those tasks" in error.value.fix
    with pytest.raises(DartsError, match="no-such-run does not exist") as error:
        DartsLM(run=str(tmp_path / "no-such-run"), task="math")
    assert "the folder a `calibrate` or `demo` run wrote" in error.value.fix
    (tmp_path / "empty-run").mkdir()
    with pytest.raises(DartsError, match="empty-run is neither a model folder") as error:
        DartsLM(run=str(tmp_path / "empty-run"), task="math")
    assert "the folder a `calibrate` or `demo` run wrote" in error.value.fix
    with pytest.raises(DartsError, match="missing.*gone.safetensors"):
        DartsLM(merged=str(run_dir / "merged"), corrections=str(tmp_path / "gone.safetensors"), task="math")
    with pytest.raises(DartsError, match="exactly one of run= and merged="):
        DartsLM(task="math")
    with pytest.raises(DartsError, match="unknown dtype 'float8'"):
        DartsLM(run=str(run_dir), task="math", dtype="float8")
