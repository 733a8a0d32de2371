"""The demo tasks as lm-evaluation-harness tasks: `darts_demo_code`, `darts_demo_math`, `darts_demo_instruct` and
their group `darts_demo` (the YAML files beside this one), on the problems `darts-dist evaluate` scores, checked by
its own scorers. They are chat tasks: run them with lm-eval's `--apply_chat_template`, which puts each question
through the model's chat template as one user turn, as `darts-dist evaluate` does.

lm-eval imports the two functions below from the YAMLs (`!function`): `heldout_dataset` builds the documents from
the task's held-out file, `process_results` scores a completion. A document carries its darts-dist `Problem` whole,
so the check is the one darts-dist makes, not a re-implementation of it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path

from datasets import Dataset, DatasetDict

from darts_dist.config import DataSpec, EvaluationSection
from darts_dist.errors import DartsError
from darts_dist.evaluate.task_scores import SCORERS, Problem, code_checks
from darts_dist.sources.references import demo_data, scorer_name

# The folder lm-eval's TaskManager scans for these tasks (`include_path`).
TASKS_DIR = Path(__file__).parent
# The split the YAMLs name as `test_split`: the demo's held-out data, what every reported score is computed on.
HELDOUT_SPLIT = "heldout"


def heldout_dataset(
    demo_task: str, heldout: Mapping[str, str] | None = None, **metadata: object
) -> DatasetDict:
    """A demo task's held-out problems, in darts-dist's order, one document each, as the split "heldout".

    lm-eval calls this with the YAML's `dataset_kwargs` (`demo_task`) and the run's metadata, which holds the
    model_args, the YAML's version and `--metadata`: `--metadata '{"heldout": {"math": "mine.jsonl"}}'` scores a
    file of one's own (rows as the demo's: `messages` and `answer`, plus `tests` for code) instead of the demo's.
    """
    demo_files = demo_data()
    if demo_task not in demo_files:
        raise DartsError(f"unknown demo task {demo_task!r} in a darts_demo task's dataset_kwargs",
                         f"set demo_task to one of {sorted(demo_files)}")
    if heldout is not None and not isinstance(heldout, Mapping):
        raise DartsError(f"metadata heldout must map demo tasks to files, got {heldout!r}",
                         "give --metadata '{\"heldout\": {\"TASK\": \"FILE.jsonl\"}}'")
    own = (heldout or {}).get(demo_task)
    path = Path(own) if own is not None else demo_files[demo_task][HELDOUT_SPLIT]
    if not path.is_file():
        raise DartsError(f"the held-out file {path} given for {demo_task} does not exist",
                         "give --metadata '{\"heldout\": {\"TASK\": \"FILE.jsonl\"}}' an existing JSONL file")
    # The scorer darts-dist gives a task whose held-out data is the demo's: its one mapping of demo tasks to scorers.
    scorer = SCORERS[scorer_name(DataSpec(calibration=f"demo:{demo_task}", heldout=f"demo:{demo_task}"))]
    return DatasetDict({HELDOUT_SPLIT: Dataset.from_list([_document(p, scorer.name) for p in
                                                          scorer.problems(path, None)])})


def _document(problem: Problem, scorer: str) -> dict[str, str]:
    """An lm-eval document: the question (the user message lm-eval sends), the answer, and the Problem as JSON."""
    roles = [m["role"] for m in problem.messages]
    if roles != ["user"]:
        raise DartsError(f"problem {problem.id} asks with the turns {roles}, but an lm-eval request is one user "
                         "message", "give each row a single user turn before the assistant's reply")
    return {"question": problem.messages[0]["content"], "answer": problem.answer, "scorer": scorer,
            "problem": json.dumps(asdict(problem))}


def process_results(doc: Mapping[str, str], results: Sequence[str]) -> dict[str, float]:
    """acc: 1 when darts-dist's scorer passes the completion, else 0 (lm-eval's mean of it is the task score)."""
    fields = json.loads(doc["problem"])
    problem = Problem(**(fields | {"messages": tuple(fields["messages"])}))
    passed = SCORERS[doc["scorer"]].passed(problem, results[0], code_checks(EvaluationSection()))
    return {"acc": float(passed)}
