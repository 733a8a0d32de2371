"""The three demo tasks (code, math, instruct), made here from nothing that needs a download.

- code: functions and methods cut out of the standard library's own sources, plain text;
- math: GSM8K-style word problems from templates, with worked solutions ending `#### N`;
- instruct: verifiable instructions (reverse, sort, count, case, JSON, ...) with exact answers.

Each task gets a calibration and a held-out split, disjoint by text, written once per
settings and reused afterwards.
"""

from __future__ import annotations

import ast
import functools
import json
import operator
import random
import sys
import sysconfig
import textwrap
from collections.abc import Callable
from pathlib import Path

from darts_dist.errors import DartsError
from darts_dist.fsutil import atomic_dir

DEMO_TASKS = ("code", "math", "instruct")
# How each demo task's held-out answers are checked: a name in evaluate.task_scores.SCORERS.
DEMO_SCORERS = {"code": "humaneval", "math": "math_exact", "instruct": "instruct_exact"}

# Bump when a generator changes, so files written by an older version are not reused.
_GENERATOR_VERSION = 1
_MARKER = "meta.json"

# A fixed, sorted list so the code task is the same on every machine with the same Python.
# Modules missing from a given Python version are skipped.
_CODE_MODULES = (
    "argparse", "ast", "base64", "bisect", "calendar", "collections/__init__", "colorsys",
    "configparser", "contextlib", "copy", "csv", "dataclasses", "datetime", "difflib",
    "dis", "email/utils", "enum", "filecmp", "fileinput", "fnmatch", "fractions", "ftplib",
    "functools", "getopt", "gettext", "glob", "gzip", "heapq", "hmac", "html/parser",
    "http/cookies", "imaplib", "inspect", "ipaddress", "json/decoder", "json/encoder",
    "locale", "logging/__init__", "mailbox", "mimetypes", "netrc", "ntpath", "numbers",
    "operator", "optparse", "pathlib", "pickle", "pkgutil", "platform", "plistlib",
    "posixpath", "pprint", "queue", "quopri", "random", "sched", "secrets", "selectors",
    "shlex", "shutil", "smtplib", "socket", "statistics", "string", "subprocess",
    "tarfile", "tempfile", "textwrap", "threading", "timeit", "tokenize", "trace",
    "traceback", "typing", "urllib/parse", "uuid", "warnings", "wave", "weakref",
    "zipfile",
)
_CODE_MIN_LINES, _CODE_MAX_LINES = 6, 60


DEMO_SPLITS = ("train", "calibration", "heldout")


def make_demo_data(
    out_dir: Path, n_train: int = 256, n_calibration: int = 160, n_heldout: int = 64, seed: int = 0
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
            # The code task reads this interpreter's stdlib, which differs between versions.
            "python": f"{sys.version_info.major}.{sys.version_info.minor}" if task == "code" else None,
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
    """Draw rows until `n` have distinct keys, so no text appears in both splits."""
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


def _code_rows(rng: random.Random, n: int) -> list[dict]:
    snippets = sorted(set(_stdlib_functions()))
    if len(snippets) < n:
        raise DartsError(
            f"the standard library gave {len(snippets)} usable functions, {n} were asked for",
            fix="ask for fewer demo samples (n_train + n_calibration + n_heldout)",
        )
    rng.shuffle(snippets)
    return [{"text": s} for s in snippets[:n]]


@functools.lru_cache(maxsize=1)
def _stdlib_functions() -> tuple[str, ...]:
    """Top-level functions and methods of top-level classes, dedented, decorators included.

    Cached per process: parsing ~80 modules takes about a second and its result only
    depends on the interpreter.
    """
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for module in _CODE_MODULES:
        path = stdlib / f"{module}.py"
        if not path.is_file():
            continue
        source = path.read_text(encoding="utf-8")
        lines = source.splitlines()
        tree = ast.parse(source)
        nodes = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
            nodes += [n for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        for node in nodes:
            start = min([node.lineno] + [d.lineno for d in node.decorator_list])
            text = textwrap.dedent("\n".join(lines[start - 1 : node.end_lineno])) + "\n"
            if _CODE_MIN_LINES <= text.count("\n") <= _CODE_MAX_LINES:
                found.append(text)
    return tuple(found)


# --- math ---------------------------------------------------------------------------------

_PEOPLE = (
    ("Ava", "she"), ("Ben", "he"), ("Chloe", "she"), ("Diego", "he"), ("Emma", "she"),
    ("Farid", "he"), ("Grace", "she"), ("Hiro", "he"), ("Isla", "she"), ("James", "he"),
    ("Kira", "she"), ("Liam", "he"), ("Maya", "she"), ("Noah", "he"), ("Olivia", "she"),
    ("Pedro", "he"), ("Quinn", "she"), ("Ravi", "he"), ("Sofia", "she"), ("Tom", "he"),
    ("Uma", "she"), ("Victor", "he"), ("Wen", "she"), ("Yusuf", "he"), ("Zara", "she"),
)


def _step(text: str, expr: str) -> tuple[str, int]:
    """One solution line in GSM8K's style: `... 3*4 = <<3*4=12>>12 ...`, and its value."""
    value = _eval_int(expr)
    return text.format(calc=f"{expr} = <<{expr}={value}>>{value}"), value


_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def _eval_int(expr: str) -> int:
    """Evaluate + - * / on integers; the templates choose numbers that divide exactly."""

    def walk(node: ast.expr) -> float:
        if isinstance(node, ast.Constant):
            return node.value
        return _OPERATORS[type(node.op)](walk(node.left), walk(node.right))

    value = walk(ast.parse(expr, mode="eval").body)
    if not float(value).is_integer():
        raise ValueError(f"demo math step {expr} = {value} is not an integer")
    return int(value)


def _two_people(rng: random.Random) -> list[tuple[str, str]]:
    """Two different (name, pronoun) pairs."""
    return rng.sample(_PEOPLE, 2)


def _math_shopping(rng: random.Random) -> tuple[str, list[str], int]:
    (name, pron), _ = _two_people(rng)
    item_a, item_b = rng.sample(("notebooks", "pens", "apples", "stickers", "candles", "mugs", "socks"), 2)
    a, b = rng.randint(2, 9), rng.randint(2, 9)
    pa, pb = rng.randint(2, 15), rng.randint(1, 12)
    cost_a, cost_b = a * pa, b * pb
    bill = (cost_a + cost_b) // 20 * 20 + rng.choice((20, 40, 100))
    problem = (
        f"{name} buys {a} {item_a} at ${pa} each and {b} {item_b} at ${pb} each. "
        f"{pron.capitalize()} pays with ${bill}. How much change does {pron} get back?"
    )
    s1, v1 = _step(f"The {item_a} cost {{calc}} dollars.", f"{a}*{pa}")
    s2, v2 = _step(f"The {item_b} cost {{calc}} dollars.", f"{b}*{pb}")
    s3, v3 = _step("Altogether that is {calc} dollars.", f"{v1}+{v2}")
    s4, v4 = _step(f"So {name} gets {{calc}} dollars back.", f"{bill}-{v3}")
    return problem, [s1, s2, s3, s4], v4


def _math_rate(rng: random.Random) -> tuple[str, list[str], int]:
    (name, pron), _ = _two_people(rng)
    rate, hours, minutes = rng.randint(12, 90), rng.randint(1, 5), rng.choice((10, 15, 20, 30, 40, 45))
    problem = (
        f"{name} types {rate} words per minute. How many words does {pron} type "
        f"in {hours} hours and {minutes} minutes?"
    )
    s1, v1 = _step("There are {calc} minutes in the full hours.", f"{hours}*60")
    s2, v2 = _step("Adding the extra minutes gives {calc} minutes.", f"{v1}+{minutes}")
    s3, v3 = _step(f"So {name} types {{calc}} words.", f"{v2}*{rate}")
    return problem, [s1, s2, s3], v3


def _math_ages(rng: random.Random) -> tuple[str, list[str], int]:
    (older, _), (younger, _) = _two_people(rng)
    times, age, years = rng.randint(2, 5), rng.randint(3, 15), rng.randint(2, 12)
    problem = (
        f"{older} is {times} times as old as {younger}. {younger} is {age} years old. "
        f"What will be the sum of their ages in {years} years?"
    )
    s1, v1 = _step(f"{older} is {{calc}} years old now.", f"{times}*{age}")
    s2, v2 = _step(f"In {years} years {older} will be {{calc}}.", f"{v1}+{years}")
    s3, v3 = _step(f"In {years} years {younger} will be {{calc}}.", f"{age}+{years}")
    s4, v4 = _step("The sum of their ages will be {calc}.", f"{v2}+{v3}")
    return problem, [s1, s2, s3, s4], v4


def _math_sharing(rng: random.Random) -> tuple[str, list[str], int]:
    (name, pron), (friend, _) = _two_people(rng)
    thing = rng.choice(("stickers", "marbles", "cookies", "cards", "shells"))
    denominator, cousins, m = rng.randint(2, 5), rng.randint(2, 6), rng.randint(1, 6)
    # total = d * k * m makes both the fraction and the equal split exact.
    total = denominator * cousins * m
    word = {2: "half", 3: "a third", 4: "a quarter", 5: "a fifth"}[denominator]
    problem = (
        f"{name} has {total} {thing}. {pron.capitalize()} gives {word} of them to {friend} "
        f"and shares the rest equally among {cousins} cousins. How many {thing} does each cousin get?"
    )
    s1, v1 = _step(f"{name} gives {friend} {{calc}} {thing}.", f"{total}/{denominator}")
    s2, v2 = _step(f"That leaves {{calc}} {thing}.", f"{total}-{v1}")
    s3, v3 = _step(f"Each cousin gets {{calc}} {thing}.", f"{v2}/{cousins}")
    return problem, [s1, s2, s3], v3


def _math_bakery(rng: random.Random) -> tuple[str, list[str], int]:
    trays, per_tray, days = rng.randint(2, 9), rng.choice((6, 8, 10, 12, 15, 18, 20, 24)), rng.randint(2, 7)
    box = rng.choice([b for b in (2, 3, 4, 5, 6, 8, 10, 12) if (trays * per_tray * days) % b == 0])
    problem = (
        f"A bakery bakes {trays} trays of muffins each day with {per_tray} muffins on each tray. "
        f"It packs the muffins in boxes of {box}. How many boxes does it fill in {days} days?"
    )
    s1, v1 = _step("Each day the bakery bakes {calc} muffins.", f"{trays}*{per_tray}")
    s2, v2 = _step(f"In {days} days it bakes {{calc}} muffins.", f"{v1}*{days}")
    s3, v3 = _step("That fills {calc} boxes.", f"{v2}/{box}")
    return problem, [s1, s2, s3], v3


def _math_percent(rng: random.Random) -> tuple[str, list[str], int]:
    (name, _), _ = _two_people(rng)
    percent = rng.choice((10, 20, 25, 30, 40, 50, 60, 75))
    stock = rng.randint(2, 12) * 20
    later = rng.randint(1, stock - stock * percent // 100 - 1)
    problem = (
        f"{name}'s shop has {stock} shirts. On Monday {percent}% of them are sold, and on "
        f"Tuesday {later} more are sold. How many shirts are left?"
    )
    s1, v1 = _step("On Monday {calc} shirts are sold.", f"{stock}*{percent}/100")
    s2, v2 = _step("After Monday {calc} shirts are left.", f"{stock}-{v1}")
    s3, v3 = _step("After Tuesday {calc} shirts are left.", f"{v2}-{later}")
    return problem, [s1, s2, s3], v3


_MATH_TEMPLATES = (_math_shopping, _math_rate, _math_ages, _math_sharing, _math_bakery, _math_percent)


def _math_row(rng: random.Random) -> tuple[str, dict]:
    problem, steps, answer = rng.choice(_MATH_TEMPLATES)(rng)
    solution = "\n".join(steps) + f"\n#### {answer}"
    row = {
        "messages": [{"role": "user", "content": problem}, {"role": "assistant", "content": solution}],
        "answer": str(answer),
    }
    return problem, row


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
