"""Demo tasks and data loading/tokenisation: what each later stage relies on."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import datasets
import pytest
import torch

from darts_dist.core import TokenizedSet
from darts_dist.errors import DartsError
from darts_dist.evaluate.sandbox import Checks
from darts_dist.evaluate.task_scores import SCORERS, answered_problems, check_instruct_answer, extract_math_answer
from darts_dist.sources.data import detect_format, load_rows, prompts_of, tokenize_rows
from darts_dist.sources.demo.tasks import DEMO_TASKS, make_demo_data
from darts_dist.sources.demo.tiny import build_tiny_tokenizer


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> dict[str, dict[str, Path]]:
    return make_demo_data(tmp_path_factory.mktemp("demo"), n_train=96, n_calibration=160, n_heldout=64, seed=0)


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def _key(row: dict) -> str:
    return row["text"] if "text" in row else row["messages"][0]["content"]


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


# --- demo tasks ---------------------------------------------------------------------------


def test_demo_data_counts_disjoint_and_deterministic(demo, tmp_path):
    assert set(demo) == set(DEMO_TASKS)
    sizes = {"train": 96, "calibration": 160, "heldout": 64}
    for task, files in demo.items():
        keys = {}
        for split, size in sizes.items():
            rows = _rows(files[split])
            keys[split] = {_key(r) for r in rows}
            assert len(rows) == len(keys[split]) == size, f"{task} {split}: wrong count or duplicates"
        assert not keys["train"] & keys["calibration"], f"{task}: train and calibration share samples"
        assert not keys["train"] & keys["heldout"], f"{task}: train and held-out share samples"
        assert not keys["calibration"] & keys["heldout"], f"{task}: calibration and held-out share samples"

    again = make_demo_data(tmp_path / "again", n_train=96, n_calibration=160, n_heldout=64, seed=0)
    other = make_demo_data(tmp_path / "other", n_train=96, n_calibration=160, n_heldout=64, seed=1)
    for task in DEMO_TASKS:
        for split in sizes:
            assert again[task][split].read_bytes() == demo[task][split].read_bytes(), (task, split)
        assert other[task]["calibration"].read_bytes() != demo[task]["calibration"].read_bytes(), task


def test_demo_data_is_reused_and_rebuilt_on_new_settings(tmp_path):
    first = make_demo_data(tmp_path, n_calibration=8, n_heldout=4)
    stamps = {t: first[t]["calibration"].stat().st_mtime_ns for t in DEMO_TASKS}
    second = make_demo_data(tmp_path, n_calibration=8, n_heldout=4)
    assert second == first
    assert {t: second[t]["calibration"].stat().st_mtime_ns for t in DEMO_TASKS} == stamps
    third = make_demo_data(tmp_path, n_calibration=10, n_heldout=4)
    assert all(len(_rows(third[t]["calibration"])) == 10 for t in DEMO_TASKS)


def _calc(expr: str) -> float:
    """Evaluate an arithmetic expression of integers and + - * / without eval."""
    def walk(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp):
            left, right = walk(node.left), walk(node.right)
            ops = {ast.Add: left + right, ast.Sub: left - right, ast.Mult: left * right}
            return ops[type(node.op)] if type(node.op) in ops else left / right
        raise AssertionError(f"unexpected expression {expr!r}")
    return walk(ast.parse(expr, mode="eval").body)


def test_math_solutions_are_arithmetically_correct(demo):
    rows = _rows(demo["math"]["calibration"]) + _rows(demo["math"]["heldout"])
    steps = set()
    for row in rows:
        user, assistant = row["messages"]
        assert (user["role"], assistant["role"]) == ("user", "assistant")
        *calcs, last = assistant["content"].splitlines()
        assert last == f"#### {row['answer']}" and 1 <= len(calcs) <= 2
        steps.add(len(calcs))
        known = set(re.findall(r"\d+", user["content"]))
        for line in calcs:
            expr, value = line.split(" = ")
            assert _calc(expr) == int(value), line
            # every operand is in the problem or an earlier step, and the last step is the answer
            assert set(re.findall(r"\d+", expr)) <= known, (line, user["content"])
            known.add(value)
        assert value == row["answer"] == extract_math_answer(assistant["content"])
    assert steps == {1, 2}  # one- and two-step problems both


def test_extract_math_answer():
    assert extract_math_answer("so 3*4 = <<3*4=12>>12\n#### 1,200") == "1200"
    assert extract_math_answer("#### 5 then #### 7 apples") == "7"
    assert extract_math_answer("The answer is 42.") == "42"
    assert extract_math_answer("It is -3.0 degrees") == "-3"
    assert extract_math_answer("no number here") is None


def test_code_rows_solutions_pass_their_tests_and_wrong_ones_do_not(demo):
    rows = _rows(demo["code"]["calibration"]) + _rows(demo["code"]["heldout"])
    scorer = SCORERS["code_tests"]
    problems = answered_problems(demo["code"]["heldout"], 12)
    for row in rows:
        user, assistant = row["messages"]
        assert f"`{row['entry_point']}(" in user["content"] and assistant["content"] == row["answer"]
        tree = ast.parse(row["answer"])
        assert isinstance(tree.body[0], ast.FunctionDef) and tree.body[0].name == row["entry_point"]
        assert row["tests"].count("assert ") == 5
        exec(row["answer"] + row["tests"], {})  # our own generated code and tests, not a model's
        # The tests tell a solution from bodies that ignore the specification.
        argument = ast.parse(row["answer"]).body[0].args.args[0].arg
        for body in (argument, "[]", "0", "''", "None"):
            trivial = f"def {row['entry_point']}({argument}):\n    return {body}\n"
            with pytest.raises(AssertionError):
                exec(trivial + row["tests"], {})
    # Through the scorer (the sandbox): the reference passes, fenced or not; a wrong body fails its tests.
    for problem in problems:
        assert scorer.passed(problem, problem.answer, Checks(5.0))
        assert scorer.passed(problem, f"Here you go:\n```python\n{problem.answer}```\nIt works.", Checks(5.0))
    failing = [not scorer.passed(p, p.answer.replace("return ", "return None and "), Checks(5.0)) for p in problems]
    assert sum(failing) >= len(problems) - 2  # a test input may make the wrong body right by chance


def _recompute(kind: str, instruction: str) -> str:
    first_line, data = instruction.split("\n")
    words = data.split()
    if kind == "reverse_words":
        return " ".join(reversed(words))
    if kind in ("sort_ascending", "sort_descending"):
        return " ".join(map(str, sorted(map(int, words), reverse=kind == "sort_descending")))
    if kind == "count_vowels":
        return str(sum(c in "aeiou" for c in data))
    if kind == "count_words":
        return str(len(words))
    if kind == "uppercase":
        return data.upper()
    if kind == "lowercase":
        return data.lower()
    if kind == "json_list":
        return json.dumps(words)
    if kind == "repeat":
        times = int(re.search(r"(\d+) times", first_line).group(1))
        return " ".join([data] * times)
    if kind == "first_letters":
        return "".join(w[0] for w in words)
    if kind == "max_number":
        return str(max(map(int, words)))
    raise AssertionError(f"unknown kind {kind}")


def test_instruct_answers_are_correct(demo):
    rows = _rows(demo["instruct"]["calibration"]) + _rows(demo["instruct"]["heldout"])
    assert len({row["kind"] for row in rows}) >= 8
    for row in rows:
        user, assistant = row["messages"]
        assert assistant["content"] == row["answer"]
        assert _recompute(row["kind"], user["content"]) == row["answer"], row
        assert check_instruct_answer(f"  {row['answer']}\n", row["answer"])
        assert not check_instruct_answer(row["answer"] + " extra", row["answer"])


# --- tokenisation -------------------------------------------------------------------------


def _runs(mask: torch.Tensor) -> list[tuple[int, int]]:
    """[start, end) of each run of True."""
    runs, start = [], None
    for i, value in enumerate(mask.tolist() + [False]):
        if value and start is None:
            start = i
        elif not value and start is not None:
            runs.append((start, i))
            start = None
    return runs


def test_chat_response_mask_covers_exactly_the_assistant_turns(tmp_path, tiny_tokenizer):
    rows = [
        {"messages": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "hi"}]},
        {"messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Add 2 and 3."},
            {"role": "assistant", "content": "2 + 3 = 5"},
            {"role": "user", "content": "And times 4?"},
            {"role": "assistant", "content": "5 * 4 = 20, so the answer is 20."},
        ]},
    ]
    ds = load_rows(_write_jsonl(tmp_path / "chat.jsonl", rows))
    assert detect_format(ds) == "chat"
    data = tokenize_rows(ds, tiny_tokenizer, "demo", max_length=512)
    assert data.has_boundary and len(data) == 2 and data.num_truncated == 0
    for i, row in enumerate(rows):
        replies = [m["content"] for m in row["messages"] if m["role"] == "assistant"]
        spans = _runs(data.response_mask[i])
        decoded = [tiny_tokenizer.decode(data.input_ids[i, a:b]) for a, b in spans]
        assert decoded == [reply + "<|im_end|>" for reply in replies]

    # right padding: real tokens first, then pad tokens that are masked everywhere
    lengths = data.attention_mask.sum(dim=1)
    assert lengths[0] < lengths[1] == data.input_ids.shape[1]
    for i, n in enumerate(lengths.tolist()):
        assert data.attention_mask[i, :n].all() and not data.attention_mask[i, n:].any()
        assert (data.input_ids[i, n:] == tiny_tokenizer.pad_token_id).all()
        assert not data.response_mask[i, n:].any()


def test_prompt_response_rows(tmp_path, tiny_tokenizer):
    rows = [{"prompt": "Name a colour.", "completion": "blue"}, {"prompt": "Count to 3.", "completion": "1 2 3"}]
    ds = load_rows(_write_jsonl(tmp_path / "pr.jsonl", rows))
    assert detect_format(ds) == "prompt_response"
    as_chat = tokenize_rows(ds, tiny_tokenizer, "t", max_length=512)
    spans = _runs(as_chat.response_mask[1])
    assert [tiny_tokenizer.decode(as_chat.input_ids[1, a:b]) for a, b in spans] == ["1 2 3<|im_end|>"]

    plain = build_tiny_tokenizer()
    plain.chat_template = None
    joined = tokenize_rows(ds, plain, "t", max_length=512)
    prompt_len = len(plain("Count to 3.")["input_ids"])
    n = int(joined.attention_mask[1].sum())
    assert not joined.response_mask[1, :prompt_len].any() and joined.response_mask[1, prompt_len:n].all()
    assert plain.decode(joined.input_ids[1, :n]) == "Count to 3.1 2 3"
    assert prompts_of(ds, plain) == ["Name a colour.", "Count to 3."]


def test_text_rows_mask_every_token_and_count_truncation(tmp_path, tiny_tokenizer):
    texts = ["a short line", "x", "a much longer line of plain text " * 4, "two words"]
    ds = load_rows(_write_jsonl(tmp_path / "text.jsonl", [{"text": t} for t in texts]))
    full = [len(tiny_tokenizer(t)["input_ids"]) for t in texts]
    max_length = 8
    assert full[1] < 2 and full[2] > max_length >= full[0]
    data = tokenize_rows(ds, tiny_tokenizer, "text", max_length=max_length)
    assert not data.has_boundary
    assert len(data) == 3, "the one-token row is dropped"
    assert data.num_truncated == sum(n > max_length for n in full if n >= 2)
    assert data.input_ids.shape[1] == max_length
    assert torch.equal(data.response_mask, data.attention_mask.bool())
    assert data.subset([1]).num_truncated == 1 and data.subset([0, 2]).num_truncated == 0

    limited = tokenize_rows(ds, tiny_tokenizer, "text", max_length=64, max_samples=1)
    assert len(limited) == 1 and limited.attention_mask.sum() == full[0]


def test_batches_and_subset_trim_to_their_longest_row(tiny_tokenizer):
    ds = datasets.Dataset.from_list([{"text": "word " * n} for n in (2, 9, 3, 4, 12)])
    data = tokenize_rows(ds, tiny_tokenizer, "t", max_length=512)
    lengths = data.attention_mask.sum(dim=1)
    batches = list(data.batches(2))
    assert [b["input_ids"].shape[0] for b in batches] == [2, 2, 1]
    expected = [int(lengths[0:2].max()), int(lengths[2:4].max()), int(lengths[4])]
    assert [b["input_ids"].shape[1] for b in batches] == expected
    assert torch.equal(batches[1]["input_ids"], data.input_ids[2:4, : batches[1]["input_ids"].shape[1]])
    assert set(batches[0]) == {"input_ids", "attention_mask", "response_mask"}
    sub = data.subset([3, 0])
    assert isinstance(sub, TokenizedSet) and sub.input_ids.shape == (2, int(lengths[3]))
    assert torch.equal(sub.input_ids[1, : lengths[0]], data.input_ids[0, : lengths[0]])


def test_demo_sets_tokenize_and_give_prompts(demo, tiny_tokenizer):
    for task in DEMO_TASKS:
        ds = load_rows(demo[task]["heldout"])
        data = tokenize_rows(ds, tiny_tokenizer, task, max_length=256, max_samples=8)
        assert len(data) == 8 and data.has_boundary
        prompts = prompts_of(ds.select(range(3)), tiny_tokenizer)
        for row, prompt in zip(ds.select(range(3)), prompts):
            # the conversation up to the assistant's reply, which is all that is missing
            whole = tiny_tokenizer.apply_chat_template(row["messages"], tokenize=False)
            assert whole == prompt + row["messages"][1]["content"] + "<|im_end|>\n"


# --- reading files ------------------------------------------------------------------------


def test_parquet_and_txt_inputs_load(tmp_path, tiny_tokenizer):
    parquet = tmp_path / "rows.parquet"
    datasets.Dataset.from_list([{"text": "first sample"}, {"text": "second sample"}]).to_parquet(str(parquet))
    ds = load_rows(parquet)
    assert ds["text"] == ["first sample", "second sample"]
    assert len(tokenize_rows(ds, tiny_tokenizer, "p", max_length=32)) == 2

    txt = tmp_path / "notes.txt"
    txt.write_text("one paragraph\nover two lines\n\n\n\nsecond paragraph\n\n  \n\nthird\n", encoding="utf-8")
    assert load_rows(txt)["text"] == ["one paragraph\nover two lines", "second paragraph", "third"]
    assert len(load_rows(txt, sample_by="line")) == 4
    assert detect_format(load_rows(txt)) == "text"


def test_text_field_names_the_column(tmp_path, tiny_tokenizer):
    path = _write_jsonl(tmp_path / "code.jsonl", [{"code": "def f():\n    return 1\n", "id": 1}])
    with pytest.raises(DartsError, match="code.jsonl"):
        load_rows(path)
    ds = load_rows(path, text_field="code")
    assert detect_format(ds, text_field="code") == "text"
    assert len(tokenize_rows(ds, tiny_tokenizer, "c", max_length=64, text_field="code")) == 1
    with pytest.raises(DartsError, match="'body'"):
        load_rows(path, text_field="body")


@pytest.mark.parametrize(
    "name, content",
    [
        ("missing.jsonl", None),
        ("empty.jsonl", b""),
        ("latin1.jsonl", '{"text": "caf\u00e9"}\n'.encode("latin-1")),
        ("nofield.jsonl", b'{"question": "q", "answer": "a"}\n'),
        ("partial.jsonl", b'{"text": "fine"}\n{"title": "no text here"}\n'),
        ("bad.jsonl", b'{"text": "unterminated\n'),
        ("rows.csv", b"text\nhello\n"),
        ("blank.txt", b"\n\n  \n"),
    ],
)
def test_bad_inputs_name_the_file(tmp_path, name, content):
    path = tmp_path / name
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(DartsError, match=re.escape(name)) as err:
        load_rows(path)
    assert err.value.fix, "every data error says how to fix it"
    if name == "latin1.jsonl":
        assert "byte 13" in str(err.value)


def test_tokenize_rejects_unusable_rows(tiny_tokenizer):
    with pytest.raises(DartsError, match="row 1"):
        tokenize_rows(datasets.Dataset.from_list([{"text": "ok"}, {"text": None}]), tiny_tokenizer, "t", 16)
    with pytest.raises(DartsError, match="no chat template"):
        plain = build_tiny_tokenizer()
        plain.chat_template = None
        chat = [{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}]
        tokenize_rows(datasets.Dataset.from_list(chat), plain, "t", 64)
    with pytest.raises(DartsError, match="gave 2 or more tokens"):
        tokenize_rows(datasets.Dataset.from_list([{"text": ""}]), tiny_tokenizer, "t", 16)
