"""The three demo tasks (code, math, instruct), made here from nothing that needs a download.

- code: function-from-specification problems with their own unit tests (pass@1 in the sandbox);
- math: one- and two-step word problems with worked solutions ending `#### N` (GSM8K's format);
- instruct: verifiable instructions (reverse, sort, count, case, JSON, ...) with exact answers.

Each task gets a calibration and a held-out split, disjoint by text, written once per
settings and reused afterwards.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from darts_dist.errors import DartsError
from darts_dist.fsutil import atomic_dir, atomic_file

DEMO_TASKS = ("code", "math", "instruct")
# How each demo task's held-out answers are checked: a name in evaluate.task_scores.SCORERS.
DEMO_SCORERS = {"code": "code_tests", "math": "math_exact", "instruct": "instruct_exact"}

# Bump when a generator changes, so files written by an older version are not reused.
_GENERATOR_VERSION = 2
_MARKER = "meta.json"

DEMO_SPLITS = ("train", "calibration", "heldout")


def make_demo_data(
    out_dir: Path, n_train: int = 512, n_calibration: int = 256, n_heldout: int = 200, seed: int = 0
) -> dict[str, dict[str, Path]]:
    """Write `out_dir/<task>/{train,calibration,heldout}.jsonl` for every demo task; return their paths.

    `train` fine-tunes the demo experts, `calibration` is DARTS's unlabeled set, `heldout`
    is what every reported number is computed on; the three share no text. Deterministic
    for a seed. A task folder is written atomically together with a marker of its settings;
    a later call with the same settings reuses it untouched.
    """
    sizes = {"train": n_train, "calibration": n_calibration, "heldout": n_heldout}
    if min(sizes.values()) < 1:
        raise DartsError(
            f"demo data sizes must be positive, got {sizes}",
            fix="ask for at least one sample per split and task",
        )
    out_dir = Path(out_dir)
    paths: dict[str, dict[str, Path]] = {}
    for task in DEMO_TASKS:
        settings = {
            "task": task,
            "sizes": sizes,
            "seed": seed,
            "version": _GENERATOR_VERSION,
        }
        task_dir = out_dir / task
        files = {split: task_dir / f"{split}.jsonl" for split in DEMO_SPLITS}
        if not _is_current(task_dir, settings, files.values()):
            rows = _GENERATORS[task](random.Random(f"{task}-{seed}"), sum(sizes.values()))
            with atomic_dir(task_dir, overwrite=True) as tmp:
                start = 0
                for split in DEMO_SPLITS:
                    _write_jsonl(tmp / f"{split}.jsonl", rows[start : start + sizes[split]])
                    start += sizes[split]
                # The marker goes last: its presence means the files beside it are complete.
                (tmp / _MARKER).write_text(json.dumps(settings, sort_keys=True) + "\n")
        paths[task] = files
    return paths


def _is_current(task_dir: Path, settings: dict, files) -> bool:
    marker = task_dir / _MARKER
    if not marker.is_file() or not all(f.is_file() for f in files):
        return False
    try:
        return json.loads(marker.read_text()) == settings
    except (OSError, ValueError):
        return False


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def _unique(rng: random.Random, make: Callable[[random.Random], tuple[str, dict]], n: int, task: str) -> list[dict]:
    """Draw rows until `n` have distinct keys (what a problem asks, whatever its wording), so no problem appears
    in two splits."""
    rows: dict[str, dict] = {}
    for _ in range(n * 50):
        key, row = make(rng)
        rows.setdefault(key, row)
        if len(rows) == n:
            return list(rows.values())
    raise DartsError(
        f"the {task} demo generator produced only {len(rows)} distinct samples, {n} were asked for",
        fix="ask for fewer demo samples (n_train + n_calibration + n_heldout)",
    )


# --- code ---------------------------------------------------------------------------------
# Function-from-specification problems: a one-line spec, a one-line reference solution and
# unit tests computed from a reference implementation. Each family draws its function name,
# argument name and constant, so held-out problems are new instances of what the expert saw.


@dataclass(frozen=True)
class _CodeFamily:
    names: tuple[str, ...]
    kind: Literal["numbers", "text", "words"]  # what the argument is
    spec: str  # {arg}, {k}, {c} filled in
    body: str  # the solution's return expression, same fields
    reference: Callable[..., object]  # (value, k, c) -> the expected result
    k_range: tuple[int, int] = (2, 9)  # the constant k, where the spec has one


_NUMBER_ARGS, _TEXT_ARGS, _WORD_ARGS = ("xs", "nums", "values", "items"), ("s", "text", "word"), ("words", "names")
_CODE_FAMILIES = (
    _CodeFamily(("sum_above", "total_above", "add_big", "big_sum", "sum_over", "high_total"), "numbers",
                "returns the sum of the numbers in the list `{arg}` that are greater than {k}",
                "sum(x for x in {arg} if x > {k})", lambda v, k, c: sum(x for x in v if x > k), (1, 40)),
    _CodeFamily(("count_above", "how_many_above", "count_greater", "num_above", "above_count", "count_big"),
                "numbers", "returns how many numbers in the list `{arg}` are greater than {k}",
                "sum(1 for x in {arg} if x > {k})", lambda v, k, c: sum(1 for x in v if x > k), (0, 40)),
    _CodeFamily(("scale", "times_k", "multiply_all", "scaled", "stretch", "multiplied"), "numbers",
                "returns a new list with every number of `{arg}` multiplied by {k}",
                "[x * {k} for x in {arg}]", lambda v, k, c: [x * k for x in v], (2, 20)),
    _CodeFamily(("shift", "add_to_all", "plus_k", "shifted", "raise_by", "offset"), "numbers",
                "returns a new list with {k} added to every number of `{arg}`",
                "[x + {k} for x in {arg}]", lambda v, k, c: [x + k for x in v], (1, 30)),
    _CodeFamily(("keep_below", "below_k", "small_ones", "under", "less_than", "low_items"), "numbers",
                "returns the numbers of `{arg}` that are less than {k}, in order",
                "[x for x in {arg} if x < {k}]", lambda v, k, c: [x for x in v if x < k], (0, 40)),
    _CodeFamily(("sum_multiples", "multiples_total", "add_multiples", "divisible_sum", "sum_divisible",
                 "multiple_sum"), "numbers",
                "returns the sum of the numbers in `{arg}` that are divisible by {k}",
                "sum(x for x in {arg} if x % {k} == 0)", lambda v, k, c: sum(x for x in v if x % k == 0), (2, 12)),
    _CodeFamily(("powers", "raise_all", "to_power", "power_list", "exponents", "powered"), "numbers",
                "returns a new list with every number of `{arg}` raised to the power {k}",
                "[x ** {k} for x in {arg}]", lambda v, k, c: [x**k for x in v], (2, 5)),
    _CodeFamily(("largest", "max_item", "biggest", "top_value", "maximum", "peak"), "numbers",
                "returns the largest number in the list `{arg}`, or {k} when the list is empty",
                "max({arg}, default={k})", lambda v, k, c: max(v, default=k), (-9, 9)),
    _CodeFamily(("last_k", "tail_items", "take_last", "ending", "final_items", "last_few"), "numbers",
                "returns the last {k} items of the list `{arg}`",
                "{arg}[-{k}:]", lambda v, k, c: v[-k:], (1, 6)),
    _CodeFamily(("first_k", "head_items", "take_first", "opening", "first_few", "leading"), "numbers",
                "returns the first {k} items of the list `{arg}`",
                "{arg}[:{k}]", lambda v, k, c: v[:k], (1, 6)),
    _CodeFamily(("count_letter", "letter_count", "occurrences", "tally", "how_many", "count_char"), "text",
                "returns how many times the letter '{c}' occurs in the string `{arg}`",
                "{arg}.count('{c}')", lambda v, k, c: v.count(c)),
    _CodeFamily(("repeat_text", "echo", "times_text", "repeated", "copies", "duplicate"), "text",
                "returns the string `{arg}` repeated {k} times",
                "{arg} * {k}", lambda v, k, c: v * k, (2, 6)),
    _CodeFamily(("drop_letter", "remove_letter", "strip_letter", "without", "erase", "delete_char"), "text",
                "returns the string `{arg}` with every letter '{c}' removed",
                "{arg}.replace('{c}', '')", lambda v, k, c: v.replace(c, "")),
    _CodeFamily(("starting_with", "words_from", "pick_words", "initial", "begins_with", "select_words"), "words",
                "returns the strings of the list `{arg}` that start with the letter '{c}', in order",
                "[w for w in {arg} if w.startswith('{c}')]", lambda v, k, c: [w for w in v if w.startswith(c)]),
    _CodeFamily(("of_length", "exact_length", "sized", "pick_length", "length_is", "with_length"), "words",
                "returns the strings of the list `{arg}` that have exactly {k} characters, in order",
                "[w for w in {arg} if len(w) == {k}]", lambda v, k, c: [w for w in v if len(w) == k], (4, 8)),
    _CodeFamily(("longer_than", "long_words", "keep_long", "lengthy", "over_length", "big_words"), "words",
                "returns the strings of the list `{arg}` that are longer than {k} characters, in order",
                "[w for w in {arg} if len(w) > {k}]", lambda v, k, c: [w for w in v if len(w) > k], (4, 7)),
)
CODE_INSTRUCTION = "Reply with the code only."
_CODE_LETTERS = "abcdeilnorst"
_CODE_TESTS = 5
# Bodies that ignore the specification: tests that any of them passes would say nothing.
_TRIVIAL_BODIES = (lambda v: v, lambda v: [], lambda v: 0, lambda v: "", lambda v: None)


def _code_input(rng: random.Random, kind: str, k: int) -> object:
    if kind == "numbers":
        # Numbers at the constant's edge (k, k + 1) now and then: what tells `> k` from `>= k` or `> k + 1`.
        return [rng.choice((k, k + 1)) if rng.random() < 0.15 else rng.randint(-20, 60)
                for _ in range(rng.randint(0, 8))]
    if kind == "text":
        return "".join(rng.choice(_CODE_LETTERS) for _ in range(rng.randint(0, 12)))
    return rng.sample(_WORDS, rng.randint(0, 7))


def _discriminating(family: _CodeFamily, k: int, c: str, inputs: list) -> bool:
    """Whether the tests fail every trivial body, and every neighbouring constant (k ± 1, another letter):
    only a solution that does what the specification says, with its constant, passes them all."""
    expected = [family.reference(v, k, c) for v in inputs]

    def passes(answer: Callable[[object], object]) -> bool:
        return all(answer(v) == e for v, e in zip(inputs, expected))

    wrong_constants = [(k - 1, c), (k + 1, c)] if "{k}" in family.spec else []
    if "{c}" in family.spec:
        wrong_constants += [(k, other) for other in _CODE_LETTERS if other != c]
    return not any(passes(body) for body in _TRIVIAL_BODIES) and not any(
        passes(lambda v, k2=k2, c2=c2: family.reference(v, k2, c2)) for k2, c2 in wrong_constants)


def _code_row(rng: random.Random) -> tuple[str, dict]:
    family = rng.choice(_CODE_FAMILIES)
    name = rng.choice(family.names)
    arg = rng.choice({"numbers": _NUMBER_ARGS, "text": _TEXT_ARGS, "words": _WORD_ARGS}[family.kind])
    # The letter from the inputs' own alphabet (and the words' initials), so tests are not all zeros.
    k, c = rng.randint(*family.k_range), rng.choice(_CODE_LETTERS)
    for _ in range(1000):
        inputs = [_code_input(rng, family.kind, k) for _ in range(_CODE_TESTS)]
        if _discriminating(family, k, c, inputs):
            break
    else:
        raise ValueError(f"no discriminating tests for {family.names[0]} with k={k}, c={c!r}")
    fields = {"arg": arg, "k": k, "c": c}
    prompt = f"Write a Python function `{name}({arg})` that {family.spec.format(**fields)}. {CODE_INSTRUCTION}"
    solution = f"def {name}({arg}):\n    return {family.body.format(**fields)}\n"
    tests = "".join(f"assert {name}({v!r}) == {family.reference(v, k, c)!r}\n" for v in inputs)
    row = {
        "messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": solution}],
        "answer": solution,
        "tests": tests,
        "entry_point": name,
    }
    # Distinct by what the problem asks (the function, its name and constant), not by the argument's name: a
    # held-out problem is never a training one renamed.
    key = f"{family.names[0]}|{name}|{k if '{k}' in family.spec else ''}|{c if '{c}' in family.spec else ''}"
    return key, row


def _code_rows(rng: random.Random, n: int) -> list[dict]:
    return _unique(rng, _code_row, n, "code")


# --- math ---------------------------------------------------------------------------------
# One- and two-step word problems with small numbers, solved in GSM8K's answer format: the
# calculation, then `#### N`.

_PEOPLE = (
    ("Ava", "she"), ("Ben", "he"), ("Chloe", "she"), ("Diego", "he"), ("Emma", "she"),
    ("Farid", "he"), ("Grace", "she"), ("Hiro", "he"), ("Isla", "she"), ("James", "he"),
    ("Kira", "she"), ("Liam", "he"), ("Maya", "she"), ("Noah", "he"), ("Olivia", "she"),
    ("Pedro", "he"), ("Quinn", "she"), ("Ravi", "he"), ("Sofia", "she"), ("Tom", "he"),
    ("Uma", "she"), ("Victor", "he"), ("Wen", "she"), ("Yusuf", "he"), ("Zara", "she"),
)
_THINGS = ("apples", "pens", "stickers", "marbles", "cookies", "cards", "shells", "books", "coins", "flowers")


def _math_problem(rng: random.Random) -> tuple[str, list[str], int]:
    """(problem, calculation lines, answer) from one of seven templates."""
    (name, pron), (friend, _) = rng.sample(_PEOPLE, 2)
    thing = rng.choice(_THINGS)
    kind = rng.randrange(7)
    if kind == 0:
        a, b = rng.randint(2, 60), rng.randint(2, 40)
        return (f"{name} has {a} {thing}. {pron.capitalize()} gets {b} more. How many {thing} does {pron} have now?",
                [f"{a} + {b} = {a + b}"], a + b)
    if kind == 1:
        a = rng.randint(10, 90)
        b = rng.randint(1, a - 1)
        return (f"{name} has {a} {thing} and gives {b} of them to {friend}. How many {thing} does {name} have left?",
                [f"{a} - {b} = {a - b}"], a - b)
    if kind == 2:
        a, b = rng.randint(2, 25), rng.randint(2, 12)
        return (f"Each box holds {a} {thing}. How many {thing} are in {b} boxes?", [f"{a} * {b} = {a * b}"], a * b)
    if kind == 3:
        each, groups = rng.randint(2, 20), rng.randint(2, 10)
        total = each * groups
        return (f"{name} shares {total} {thing} equally among {groups} friends. How many {thing} does each friend get?",
                [f"{total} / {groups} = {each}"], each)
    if kind == 4:
        a, b = rng.randint(2, 12), rng.randint(2, 25)
        return (f"{name} buys {a} {thing} at ${b} each. How many dollars does {pron} spend?",
                [f"{a} * {b} = {a * b}"], a * b)
    if kind == 5:
        a, b = rng.randint(5, 50), rng.randint(2, 30)
        c = rng.randint(1, a + b - 1)
        return (f"{name} has {a} {thing}, buys {b} more and then gives {c} to {friend}. "
                f"How many {thing} does {name} have now?",
                [f"{a} + {b} = {a + b}", f"{a + b} - {c} = {a + b - c}"], a + b - c)
    packs, per_pack, extra = rng.randint(2, 9), rng.randint(2, 12), rng.randint(1, 30)
    return (f"{name} buys {packs} packs of {per_pack} {thing} and already has {extra}. "
            f"How many {thing} does {pron} have in all?",
            [f"{packs} * {per_pack} = {packs * per_pack}", f"{packs * per_pack} + {extra} = {packs * per_pack + extra}"],
            packs * per_pack + extra)


def _math_row(rng: random.Random) -> tuple[str, dict]:
    problem, steps, answer = _math_problem(rng)
    solution = "\n".join(steps) + f"\n#### {answer}"
    row = {
        "messages": [{"role": "user", "content": problem}, {"role": "assistant", "content": solution}],
        "answer": str(answer),
    }
    # Distinct by the calculation, not the names and objects around it: a held-out problem is never a training
    # one retold.
    return solution, row


def _math_rows(rng: random.Random, n: int) -> list[dict]:
    return _unique(rng, _math_row, n, "math")


# --- instruct -----------------------------------------------------------------------------

_WORDS = (
    "apple", "river", "stone", "cloud", "garden", "window", "silver", "forest", "candle",
    "rocket", "pepper", "island", "mirror", "planet", "bottle", "castle", "dragon", "engine",
    "feather", "guitar", "harbor", "jacket", "kettle", "ladder", "marble", "needle", "orange",
    "pencil", "quartz", "ribbon", "saddle", "tunnel", "umbrella", "violin", "wallet", "yellow",
    "zebra", "anchor", "basket", "copper", "desert", "echo", "falcon", "glacier", "honey",
    "iris", "jungle", "lemon", "meadow", "nectar", "ocean", "puzzle", "rabbit", "sunset",
    "tiger", "valley", "walnut", "winter", "breeze", "coffee",
)
_VOWELS = set("aeiou")
INSTRUCT_KINDS = (
    "reverse_words", "sort_ascending", "sort_descending", "count_vowels", "count_words",
    "uppercase", "lowercase", "json_list", "repeat", "first_letters", "max_number",
)


def _words(rng: random.Random, low: int = 3, high: int = 7) -> list[str]:
    return rng.sample(_WORDS, rng.randint(low, high))


def _numbers(rng: random.Random) -> list[int]:
    return rng.sample(range(1, 100), rng.randint(4, 8))


def _instruct_task(rng: random.Random, kind: str) -> tuple[str, str]:
    """(instruction with its input on the last line, exact answer) for one instruction kind."""
    if kind == "reverse_words":
        words = _words(rng)
        return "Reverse the order of these words. Reply with the words only.\n" + " ".join(words), " ".join(words[::-1])
    if kind in ("sort_ascending", "sort_descending"):
        numbers = _numbers(rng)
        order = "ascending" if kind == "sort_ascending" else "descending"
        answer = sorted(numbers, reverse=kind == "sort_descending")
        return (
            f"Sort these numbers in {order} order. Reply with the numbers separated by spaces.\n"
            + " ".join(map(str, numbers)),
            " ".join(map(str, answer)),
        )
    if kind == "count_vowels":
        word = rng.choice(_WORDS)
        return (
            "How many vowels (a, e, i, o, u) does this word have? Reply with the number only.\n" + word,
            str(sum(c in _VOWELS for c in word)),
        )
    if kind == "count_words":
        words = _words(rng, 2, 12)
        return "How many words are in this line? Reply with the number only.\n" + " ".join(words), str(len(words))
    if kind in ("uppercase", "lowercase"):
        sentence = " ".join(w.capitalize() if rng.random() < 0.5 else w for w in _words(rng))
        answer = sentence.upper() if kind == "uppercase" else sentence.lower()
        return f"Rewrite this sentence in {kind} letters. Reply with the sentence only.\n" + sentence, answer
    if kind == "json_list":
        words = _words(rng)
        return (
            "Write these words as a JSON list of strings. Reply with the JSON only.\n" + " ".join(words),
            json.dumps(words),
        )
    if kind == "repeat":
        word, times = rng.choice(_WORDS), rng.randint(2, 6)
        return (
            f"Repeat this word {times} times, separated by single spaces. Reply with the result only.\n" + word,
            " ".join([word] * times),
        )
    if kind == "first_letters":
        words = _words(rng)
        return (
            "Write the first letter of each word, joined without spaces. Reply with the letters only.\n"
            + " ".join(words),
            "".join(w[0] for w in words),
        )
    if kind == "max_number":
        numbers = _numbers(rng)
        return (
            "Which is the largest of these numbers? Reply with the number only.\n" + " ".join(map(str, numbers)),
            str(max(numbers)),
        )
    raise ValueError(kind)


def _instruct_row(rng: random.Random) -> tuple[str, dict]:
    kind = rng.choice(INSTRUCT_KINDS)
    prompt, answer = _instruct_task(rng, kind)
    row = {
        "messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}],
        "answer": answer,
        "kind": kind,
    }
    return prompt, row


def _instruct_rows(rng: random.Random, n: int) -> list[dict]:
    return _unique(rng, _instruct_row, n, "instruct")


_GENERATORS: dict[str, Callable[[random.Random, int], list[dict]]] = {
    "code": _code_rows,
    "math": _math_rows,
    "instruct": _instruct_rows,
}


def long_texts(task_file: Path, count: int, out: Path) -> Path:
    """`count` plain-text rows ({"text": ...}) at `out`, each a demo task file's conversations i, i + count, ... run
    together: sequences as long as the measure of cost at 512-2048 tokens needs, where one problem is ~100 tokens."""
    conversations = [json.loads(line)["messages"] for line in Path(task_file).read_text().splitlines()]
    texts = ["\n\n".join(m["content"] for messages in conversations[i::count] for m in messages) for i in range(count)]
    with atomic_file(out) as tmp:
        tmp.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    return out
