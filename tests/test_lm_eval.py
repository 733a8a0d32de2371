"""lm-eval integration: `--model darts-dist` on the darts_demo tasks gives `darts-dist evaluate`'s prompts, completions
and score, under a task's correction, the router's or none; likelihoods are the corrected model's; bad model_args
stop with a DartsError that names the fix."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from lm_eval import simple_evaluate
from lm_eval.api.instance import Instance
from lm_eval.tasks import TaskManager
from test_generation import TASKS, strong_corrections

from darts_dist.calibrate.corrections import corrections_metadata
from darts_dist.calibrate.features import prompt_features
from darts_dist.calibrate.router import fit_router
from darts_dist.config import EvaluationSection
from darts_dist.core import ROUTED, ROUTER_FILE, save_corrections
from darts_dist.errors import DartsError
from darts_dist.evaluate.lm_eval_model import DartsLM
from darts_dist.evaluate.lm_eval_tasks import HELDOUT_SPLIT, TASKS_DIR, heldout_dataset, process_results
from darts_dist.evaluate.task_scores import SCORERS, problem_passes
from darts_dist.generation import CorrectedLM
from darts_dist.sources.demo.tasks import DEMO_SCORERS, DEMO_TASKS
from darts_dist.sources.references import demo_data

LIMIT = 3
MAX_NEW_TOKENS = 8
CODE = [f"def {name}(values, k={i}):" for i, name in enumerate(["scale", "shift", "clip", "norm"])]
MATH = [f"Ann has {i + 3} coins and finds {i} more. How many coins does she have?" for i in range(4)]


@pytest.fixture(scope="module")
def run_dir(tiny_family, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run folder as `calibrate` writes one: merged/ (the tiny base stands in), strong corrections for code and
    math, and a router fit on code vs. word-problem prompts."""
    folder = tmp_path_factory.mktemp("lm_eval_run")
    merged_dir = folder / "merged"
    shutil.copytree(tiny_family.base, merged_dir)
    hidden_size = json.loads((merged_dir / "config.json").read_text())["hidden_size"]
    save_corrections(folder / "corrections.safetensors", strong_corrections(hidden_size),
                     metadata=corrections_metadata(merged_dir))
    with CorrectedLM.load(merged_dir) as plain:
        features = prompt_features(plain.model, [plain.encode(p) for p in CODE + MATH], "final", plain.pad_id)
    fit_router(features, torch.tensor([0] * len(CODE) + [1] * len(MATH)), TASKS, "final",
               threshold=0.5).save(folder / ROUTER_FILE)
    return folder


# One sequence CorrectedLM.generate_ids generated, as the model saw it: prompt token ids, task, max_new_tokens,
# and its text (lm-eval asks one batch at a time, darts-dist all problems at once: the sequences must agree).
Call = tuple[list[int], str | None, int, str]


@pytest.fixture
def generated(monkeypatch: pytest.MonkeyPatch) -> list[Call]:
    """Every generation of the test, recorded: lm-eval's and darts-dist's both end in CorrectedLM.generate_ids."""
    calls: list[Call] = []
    generate_ids = CorrectedLM.generate_ids

    def recorded(self: CorrectedLM, encoded, tasks=None, **options):
        done = generate_ids(self, encoded, tasks, **options)
        calls.extend((list(ids), task, options["max_new_tokens"], c.text) for ids, task, c in zip(encoded, tasks, done))
        return done

    monkeypatch.setattr(CorrectedLM, "generate_ids", recorded)
    return calls


def lm_eval_math(run_dir: Path, task: str, generated: list[Call]) -> tuple[float, list[Call]]:
    """darts_demo_math's acc from lm-eval with `task=` as the correction, and its generations (taken from
    `generated`), after checking that lm-eval's samples hold their texts."""
    results = simple_evaluate(
        model="darts-dist", model_args={"run": str(run_dir), "task": task, "device": "cpu"},
        tasks=["darts_demo_math"], limit=LIMIT, batch_size=1, gen_kwargs={"max_gen_toks": MAX_NEW_TOKENS},
        log_samples=True, task_manager=TaskManager(include_path=str(TASKS_DIR), include_defaults=False),
    )
    samples = sorted(results["samples"]["darts_demo_math"], key=lambda sample: sample["doc_id"])
    calls = generated[:]
    generated.clear()
    assert [sample["resps"][0][0] for sample in samples] == [call[3] for call in calls]
    return results["results"]["darts_demo_math"]["acc,none"], calls


def darts_math(lm: CorrectedLM, task: str | None, generated: list[Call]) -> tuple[float, list[Call]]:
    """The same from darts-dist's own scoring of the first LIMIT held-out math problems."""
    scorer = SCORERS[DEMO_SCORERS["math"]]
    problems = scorer.problems(demo_data()["math"]["heldout"], LIMIT)
    settings = EvaluationSection(score_limit=LIMIT, generation_batch_size=1, max_new_tokens=MAX_NEW_TOKENS)
    passes = problem_passes(lm, task, problems, scorer, settings)
    calls = generated[:]
    generated.clear()
    return sum(passes) / len(passes), calls


def test_a_task_scores_and_answers_as_darts_dist_evaluate(run_dir: Path, generated: list[Call]) -> None:
    scored = lm_eval_math(run_dir, "math", generated)
    with CorrectedLM.load(run_dir / "merged", run_dir / "corrections.safetensors") as lm:
        # The same score from the same prompt tokens, task, length and completions, problem by problem.
        assert scored == darts_math(lm, "math", generated)
        # Not a comparison of empty strings: the completions have text, and the correction is in it.
        texts = [call[3] for call in scored[1]]
        assert len(texts) == LIMIT and all(text.strip() for text in texts)
        assert texts != [call[3] for call in darts_math(lm, None, generated)[1]]


def test_routed_and_merged_are_the_routers_pick_and_no_correction(run_dir: Path, generated: list[Call]) -> None:
    with CorrectedLM.load(run_dir / "merged", run_dir / "corrections.safetensors",
                          router_path=run_dir / ROUTER_FILE) as lm:
        assert lm_eval_math(run_dir, "routed", generated) == darts_math(lm, ROUTED, generated)
    with CorrectedLM.load(run_dir / "merged") as lm:
        assert lm_eval_math(run_dir, "merged", generated) == darts_math(lm, None, generated)


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


def test_likelihoods_are_the_corrected_models(run_dir: Path) -> None:
    model = DartsLM(run=str(run_dir), task="math", device="cpu")
    lm = model.lm
    context, continuation = "What is 2 + 3?", " It is 5."
    prompt = lm.encode_chat([{"role": "user", "content": context}])
    answer = lm.tokenizer(continuation, add_special_tokens=False)["input_ids"]
    ids = torch.tensor([prompt + answer])
    with lm.weighted(torch.tensor([[0.0, 1.0]])), torch.no_grad():
        log_probs = lm.model(input_ids=ids).logits.float().log_softmax(-1)[0]
    expected = sum(log_probs[len(prompt) - 1 + i, token].item() for i, token in enumerate(answer))
    greedy = lm.chat([[{"role": "user", "content": context}]], tasks=["math"], max_new_tokens=3)[0]
    requests = [Instance("loglikelihood", {}, (context, continuation), 0),
                Instance("loglikelihood", {}, (context, greedy.text), 1)]
    (logprob, is_greedy), (_, greedy_is_greedy) = model.loglikelihood(requests, disable_tqdm=True)
    assert logprob == pytest.approx(expected, abs=1e-4)
    assert (is_greedy, greedy_is_greedy) == (False, True)
    # A whole text, from the BOS (or EOS) token on, under the same correction.
    text = "def add(a, b):\n    return a + b"
    prefix = lm.tokenizer.bos_token_id if lm.tokenizer.bos_token_id is not None else lm.tokenizer.eos_token_id
    tokens = [prefix, *lm.tokenizer(text, add_special_tokens=False)["input_ids"]]
    with lm.weighted(torch.tensor([[0.0, 1.0]])), torch.no_grad():
        log_probs = lm.model(input_ids=torch.tensor([tokens])).logits.float().log_softmax(-1)[0]
    expected = sum(log_probs[i, token].item() for i, token in enumerate(tokens[1:]))
    assert model.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)],
                                       disable_tqdm=True) == [pytest.approx(expected, abs=1e-4)]


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
    with pytest.raises(DartsError, match="fixed batch size"):
        DartsLM(run=str(run_dir), task="math", batch_size="auto")
    with pytest.raises(DartsError, match="chat template itself") as error:
        simple_evaluate(model="darts-dist", model_args={"run": str(run_dir), "task": "math", "device": "cpu"},
                        tasks=["darts_demo_math"], limit=1, apply_chat_template=True,
                        task_manager=TaskManager(include_path=str(TASKS_DIR), include_defaults=False))
    assert error.value.fix == "drop --apply_chat_template"
