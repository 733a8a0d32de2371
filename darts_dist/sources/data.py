"""Calibration and held-out sets: reading local files with `datasets`, tokenising them for the model.

Three row formats are understood (`detect_format`):
- text: a `text` column (or the column named by `text_field`); every real token counts;
- chat: a `messages` column of {role, content} turns, rendered with the tokenizer's chat
  template; the assistant turns are the response;
- prompt_response: `prompt` plus `response` (or `completion`); rendered as a user/assistant
  chat when the tokenizer has a chat template, else concatenated; the response is the response.

Everything here is a plain function of its arguments (no module state, nothing written to
the Hugging Face cache), so a Ray Data actor can call `load_rows` and `tokenize_rows` itself.
"""

from __future__ import annotations

import ast
import codecs
import json
import logging
import tempfile
import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import datasets
from datasets.exceptions import DatasetGenerationError

from darts_dist.config import CalibrationSection, RunConfig
from darts_dist.core import TokenizedSet
from darts_dist.errors import DartsError
from darts_dist.sources.models import encode_prompt, encode_user_chat, encode_user_prompt, pad_id

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)
Format = Literal["text", "chat", "prompt_response"]
_FORMATS = ("text", "chat", "prompt_response")
_LOADERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text"}
_RESPONSE_FIELDS = ("response", "completion")
_USABLE = "`text`, `messages`, or `prompt` with `response`/`completion`"


@dataclass(frozen=True)
class TaskFiles:
    """One task's data files, resolved to local paths, and how its held-out answers are checked
    (a name of evaluate.task_scores.SCORERS, or "none")."""

    calibration: Path
    heldout: Path | None
    scorer: str = "none"
    text_field: str | None = None
    format: str = "auto"
    traffic: Path | None = None  # captured prompts (`traffic_prompts`), mixed into the calibration split


def split_rows(
    files: TaskFiles, split: Literal["calibration", "validation", "heldout"], settings: CalibrationSection,
    limit: int | None = None,
) -> datasets.Dataset:
    """A task's rows of one split: held-out; or validation, the rows held back from calibration for tuning;
    or calibration, the first `num_samples` (or `limit`) of the rest."""
    if split == "heldout":
        if files.heldout is None:
            raise DartsError("this task has no held-out data", "set its data.heldout")
        return load_rows(files.heldout, text_field=files.text_field)
    rows = calibration_split(load_rows(files.calibration, text_field=files.text_field),
                             settings.validation_fraction, split)
    count = settings.num_samples if limit is None else limit
    return rows.select(range(min(count, len(rows)))) if split == "calibration" else rows


def tokenized(
    files: TaskFiles, task: str, split: Literal["calibration", "validation", "heldout"],
    settings: CalibrationSection, tokenizer,
) -> TokenizedSet:
    """A task's calibration, validation or held-out set, tokenised with the base's tokenizer and cut to
    `max_length`: what calibration trains on and evaluation measures.

    With captured traffic (`files.traffic`), the calibration split is its last prompts, up to `traffic_share` of
    `num_samples` (`recalibrate` writes that many, spread over the captured window), after the calibration file's
    first rows for the rest.
    """
    traffic: list[list[int]] = []
    if split == "calibration" and files.traffic is not None:
        captured = traffic_rows(files.traffic)
        used = captured[len(captured) - traffic_count(settings, len(captured)):]
        traffic = [served_ids(tokenizer, row) for row in used]
        logger.info("calibrate: task %r takes %d of its %d samples from the %d prompts captured in %s", task,
                    len(traffic), settings.num_samples, len(captured), files.traffic)
    rows = split_rows(files, split, settings, limit=settings.num_samples - len(traffic))
    return tokenize_rows(rows, tokenizer, task, max_length=settings.max_length, fmt=files.format,
                         text_field=files.text_field, traffic=traffic)


def calibration_sets(config: RunConfig, data: Mapping[str, TaskFiles], tokenizer) -> dict[str, TokenizedSet]:
    """Every task's calibration set, tokenised; samples cut to `max_length` are said, once per task."""
    sets = {task: tokenized(data[task], task, "calibration", config.calibration, tokenizer)
            for task in config.tasks}
    for task, rows in sets.items():
        if rows.num_truncated:
            logger.info("calibrate: %d %s samples cut to max_length=%d", rows.num_truncated, task,
                        config.calibration.max_length)
    return sets


def served_ids(tokenizer: PreTrainedTokenizerBase, row: dict) -> list[int]:
    """A captured prompt's tokens as the server read them: special-token text from users is text. A chat captured
    before its messages were kept is its rendered text, markers and all."""
    if row.get("messages") is not None:
        return encode_user_chat(tokenizer, row["messages"])[1]
    if row["chat"]:
        return encode_prompt(tokenizer, row["prompt"], rendered=True)
    return encode_user_prompt(tokenizer, row["prompt"])


def traffic_count(settings: CalibrationSection, captured: int) -> int:
    """How many of a task's `captured` prompts its calibration takes: traffic_share of num_samples, at most all."""
    return min(captured, round(settings.traffic_share * settings.num_samples))


def traffic_rows(path: Path) -> list[dict]:
    """A task's captured prompts, oldest first: a JSONL of {"prompt": text, "chat": bool} rows (a chat's with its
    "messages"), as `darts-dist recalibrate` writes them (resolve_sources has checked the file exists)."""
    rows = []
    for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        try:
            row = json.loads(line)
            if not isinstance(row["prompt"], str) or not isinstance(row["chat"], bool):
                raise TypeError("prompt must be a string and chat a boolean")
            if not isinstance(row.get("messages", []), list):
                raise TypeError("messages, where given, must be a list of {role, content}")
        except (ValueError, TypeError, KeyError) as error:
            raise DartsError(f"traffic file {path}, line {number}, is not a {{prompt, chat}} row: {error!r}",
                             "write it with `darts-dist recalibrate --from-traffic`") from None
        rows.append(row)
    return rows


def load_rows(
    path: Path,
    text_field: str | None = None,
    sample_by: Literal["paragraph", "line", "document"] = "paragraph",
) -> datasets.Dataset:
    """Read a .jsonl/.json, .parquet or .txt file into an in-memory `datasets.Dataset`.

    A .txt file gives one `text` row per blank-line-separated paragraph by default
    (`sample_by="line"` for one per line, `"document"` for the whole file as one row);
    blank samples are dropped and paragraphs lose their leading and trailing newlines.
    Code with blank lines inside functions belongs in a JSONL file, one `text` per sample. Raises DartsError naming the file when it
    is missing, has an unknown extension, is empty, is not UTF-8, or has rows without a
    usable field.
    """
    path = Path(path)
    if not path.is_file():
        raise DartsError(
            f"data file {path} does not exist" if not path.exists() else f"data file {path} is not a file",
            fix="give the path of a local .jsonl, .json, .parquet or .txt file",
        )
    loader = _LOADERS.get(path.suffix.lower())
    if loader is None:
        raise DartsError(
            f"data file {path} has the extension {path.suffix or '(none)'!r}; "
            f"expected one of {sorted(_LOADERS)}",
            fix="convert it to JSONL (one JSON object per line) or rename it to its real format",
        )
    if path.stat().st_size == 0:
        raise DartsError(f"data file {path} is empty", fix="give a file with at least one sample")
    if loader != "parquet":
        _check_utf8(path)

    options = {"sample_by": sample_by} if loader == "text" else {}
    # A private cache folder, deleted at once: with keep_in_memory the rows live in RAM,
    # so nothing lands in ~/.cache/huggingface and concurrent callers cannot collide.
    with tempfile.TemporaryDirectory(prefix="darts-data-") as cache_dir:
        try:
            ds = datasets.load_dataset(
                loader, data_files=str(path), split="train", keep_in_memory=True, cache_dir=cache_dir, **options
            )
        # datasets wraps the parser's error (pyarrow's are ValueErrors); show the innermost one.
        except (DatasetGenerationError, ValueError, OSError) as err:
            cause = err
            while cause.__cause__ is not None:
                cause = cause.__cause__
            raise DartsError(
                f"data file {path} could not be read as {loader}: {type(cause).__name__}: {cause}",
                fix=f"check that the file is valid {'JSON Lines (one object per line)' if loader == 'json' else loader}",
            ) from err
    if loader == "text":
        ds = ds.filter(lambda row: bool(row["text"].strip()), keep_in_memory=True)
        if sample_by == "paragraph":
            # Runs of 3+ newlines leave newlines at a paragraph's ends; indentation stays.
            ds = ds.map(lambda row: {"text": row["text"].strip("\n")}, keep_in_memory=True)
    if len(ds) == 0:
        raise DartsError(f"data file {path} has no rows", fix="give a file with at least one sample")
    _check_rows(ds, text_field, label=f"data file {path}")
    return ds


def calibration_split(
    ds: datasets.Dataset, validation_fraction: float, split: Literal["calibration", "validation"]
) -> datasets.Dataset:
    """The rows calibration trains on, or the validation rows held back from them for tuning.

    Validation is the file's last round(fraction·N) rows (at least one when the fraction is
    positive), so the training rows stay the file's first ones: a run without validation and
    one with it train on the same rows as long as the file has enough of them.
    """
    if not 0 <= validation_fraction < 1:
        raise DartsError(f"validation_fraction must be in [0, 1), got {validation_fraction}")
    count = 0 if validation_fraction == 0 else max(1, round(validation_fraction * len(ds)))
    if count >= len(ds):
        raise DartsError(
            f"a validation split of {validation_fraction:.0%} leaves none of the {len(ds)} calibration rows to train on",
            fix="lower calibration.validation_fraction or give more calibration rows",
        )
    if split == "validation":
        if count == 0:
            raise DartsError("no validation split: calibration.validation_fraction is 0",
                             fix="set calibration.validation_fraction, e.g. 0.2")
        return ds.select(range(len(ds) - count, len(ds)))
    return ds.select(range(len(ds) - count))


def detect_format(ds: datasets.Dataset, text_field: str | None = None) -> Format:
    """The row format of `ds`: `text_field` if given, else messages > prompt/response > text."""
    return _detect(ds.column_names, text_field, label="the dataset")


def tokenize_rows(
    ds: datasets.Dataset,
    tokenizer,
    task: str,
    max_length: int,
    max_samples: int | None = None,
    fmt: str = "auto",
    text_field: str | None = None,
    traffic: Sequence[Sequence[int]] = (),
) -> TokenizedSet:
    """Tokenise the first `max_samples` rows of `ds` into a right-padded `TokenizedSet`, then the `traffic`
    prompts (token ids, every token counting as response).

    text: `tokenizer(text)` with its default special tokens (BOS where it adds one).
    chat: the chat template's rendering; the response mask covers each assistant turn's
    tokens up to its end-of-turn token, found as the tokens after the conversation
    prefix rendered with `add_generation_prompt=True`.
    prompt_response: a user/assistant chat when the tokenizer has a chat template, else
    `tokenizer(prompt) + tokenizer(response)` with the boundary at the prompt's length.
    Samples longer than `max_length` are cut (counted in `num_truncated`); samples of
    fewer than 2 tokens are dropped, as there is nothing to predict in them.
    """
    if max_length < 2:
        raise DartsError(f"max_length must be at least 2 tokens, got {max_length}")
    if max_samples is not None:
        if max_samples < 1:
            raise DartsError(f"max_samples must be at least 1, got {max_samples}", "leave it unset to use every row")
        ds = ds.select(range(min(max_samples, len(ds))))
    fmt = _resolve_format(ds, fmt, text_field)
    label = f"task {task!r}"
    _check_rows(ds, text_field, label=label, fmt=fmt)
    if fmt == "chat":
        _require_chat_template(tokenizer, label)

    samples = [_encode_row(tokenizer, row, fmt, text_field, f"{label}, row {index}") for index, row in enumerate(ds)]
    # A captured prompt has no answer: all of it is what the corrected model will read.
    samples += [(list(ids), [True] * len(ids)) for ids in traffic]

    kept = [(ids[:max_length], mask[:max_length], len(ids) > max_length) for ids, mask in samples if len(ids) >= 2]
    if not kept:
        raise DartsError(
            f"{label}: none of its {len(ds)} rows gave 2 or more tokens",
            fix="check that the rows hold text in the field the format reads",
        )
    return TokenizedSet.from_rows(task, [(ids, mask) for ids, mask, _ in kept], pad_id(tokenizer),
                                  has_boundary=fmt != "text", truncated=[cut for _, _, cut in kept])


def _encode_row(tokenizer, row: dict, fmt: str, text_field: str | None, where: str) -> tuple[list[int], list[bool]]:
    """One row's token ids and response mask, by its format (`tokenize_rows`)."""
    if fmt == "text":
        # verbose=False: the "longer than the model's maximum" warning is moot, rows are cut later.
        ids = tokenizer(row[text_field or "text"], verbose=False)["input_ids"]
        return ids, [True] * len(ids)
    if fmt == "chat":
        return _encode_chat(tokenizer, row["messages"], where)
    if tokenizer.chat_template is not None:
        messages = [{"role": "user", "content": row["prompt"]}, {"role": "assistant", "content": _response(row)}]
        return _encode_chat(tokenizer, messages, where)
    # Tokenised apart and joined, so the boundary falls exactly at the prompt's length.
    prompt = tokenizer(row["prompt"], verbose=False)["input_ids"]
    response = tokenizer(_response(row), add_special_tokens=False, verbose=False)["input_ids"]
    return prompt + response, [False] * len(prompt) + [True] * len(response)


def prompts_of(ds: datasets.Dataset, tokenizer, fmt: str = "auto", text_field: str | None = None) -> list[str]:
    """The prompt part of each row, as a string ready for generation or routing.

    chat: the turns before the first assistant turn, rendered with the chat template and
    `add_generation_prompt=True`; prompt_response: the prompt as one user turn, the same
    way (the bare prompt when the tokenizer has no chat template). Rendered chat strings
    already hold their special tokens: tokenise them with `add_special_tokens=False`.
    text: for Python code that starts with a function or class, its header and docstring
    (the header alone when it has none), as HumanEval's prompts are; for anything else,
    the first half of its words, with the original spacing.
    """
    fmt = _resolve_format(ds, fmt, text_field)
    _check_rows(ds, text_field, label="the dataset", fmt=fmt)
    if fmt == "text":
        return [_text_prompt(text) for text in ds[text_field or "text"]]
    if fmt == "prompt_response" and tokenizer.chat_template is None:
        return list(ds["prompt"])
    _require_chat_template(tokenizer, "the dataset")
    prompts = []
    for row in ds:
        if fmt == "chat":
            messages = list(row["messages"])
            first_reply = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), len(messages))
            messages = messages[:first_reply]
        else:
            messages = [{"role": "user", "content": row["prompt"]}]
        prompts.append(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    return prompts


def _check_utf8(path: Path) -> None:
    """Fail with the byte offset and line of the first byte that is not UTF-8."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset, line = 0, 1
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            pending = len(decoder.getstate()[0])
            try:
                decoder.decode(chunk)
            except UnicodeDecodeError as err:
                # err.start indexes the pending bytes of the last chunk followed by this chunk.
                bad = offset - pending + err.start
                line += chunk[: max(err.start - pending, 0)].count(b"\n")
                raise DartsError(
                    f"data file {path} is not UTF-8: byte {bad} (line {line}) "
                    f"is {err.object[err.start : err.start + 1]!r}",
                    fix="re-encode the file as UTF-8 (e.g. `iconv -f latin1 -t utf-8`)",
                ) from None
            offset += len(chunk)
            line += chunk.count(b"\n")
        try:
            decoder.decode(b"", final=True)
        except UnicodeDecodeError:
            raise DartsError(
                f"data file {path} is not UTF-8: it ends inside a multi-byte character at byte {offset}",
                fix="re-encode the file as UTF-8",
            ) from None


def _detect(columns: Sequence[str], text_field: str | None, label: str) -> Format:
    if text_field is not None:
        if text_field not in columns:
            raise DartsError(
                f"{label} has no column {text_field!r} (text_field); its columns are {list(columns)}",
                fix="set text_field to one of those columns, or leave it unset",
            )
        return "text"
    if "messages" in columns:
        return "chat"
    if "prompt" in columns and any(f in columns for f in _RESPONSE_FIELDS):
        return "prompt_response"
    if "text" in columns:
        return "text"
    raise DartsError(
        f"{label} has no usable field: its columns are {list(columns)}, expected {_USABLE}",
        fix="rename the column that holds the samples, or name it with text_field",
    )


def _resolve_format(ds: datasets.Dataset, fmt: str, text_field: str | None) -> Format:
    if fmt == "auto":
        return detect_format(ds, text_field)
    if fmt not in _FORMATS:
        raise DartsError(f"unknown data format {fmt!r}", fix=f"use 'auto' or one of {list(_FORMATS)}")
    return fmt


def _check_rows(ds: datasets.Dataset, text_field: str | None, label: str, fmt: Format | None = None) -> None:
    """Every row must hold what its format reads; name the first row that does not."""
    fmt = fmt or _detect(ds.column_names, text_field, label)
    needed = {
        "text": [text_field or "text"],
        "chat": ["messages"],
        "prompt_response": ["prompt", next((f for f in _RESPONSE_FIELDS if f in ds.column_names), "response")],
    }[fmt]
    missing = [c for c in needed if c not in ds.column_names]
    if missing:
        raise DartsError(
            f"{label} is read as {fmt} but has no column(s) {missing}; its columns are {ds.column_names}",
            fix=f"use format 'auto', or give rows with {_USABLE}",
        )
    for column in needed:
        for index, value in enumerate(ds[column]):
            if column == "messages":
                ok = isinstance(value, list) and len(value) > 0 and all(
                    isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                    for m in value
                )
            else:
                ok = isinstance(value, str)
            if not ok:
                expected = "a non-empty list of {role, content} strings" if column == "messages" else "a string"
                raise DartsError(
                    f"{label}: row {index} has {column}={value!r:.80}, expected {expected}",
                    fix=f"give every row {_USABLE}",
                )


def _response(row: dict) -> str:
    return next(row[f] for f in _RESPONSE_FIELDS if row.get(f) is not None)


def _require_chat_template(tokenizer, label: str) -> None:
    if tokenizer.chat_template is None:
        raise DartsError(
            f"{label} is chat data but the tokenizer has no chat template",
            fix="use the instruct model's tokenizer, or set the data format to 'text'",
        )


def _encode_chat(tokenizer, messages: list[dict], label: str) -> tuple[list[int], list[bool]]:
    """Token ids of a conversation and a mask that is True on each assistant turn's tokens.

    An assistant turn spans from the end of the prefix rendered with the generation
    prompt to the end of the conversation rendered through that turn, less trailing
    whitespace tokens (ChatML's newline after <|im_end|>), which the model never generates.
    """

    def encode(turns: list[dict], generation_prompt: bool) -> list[int]:
        text = tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=generation_prompt)
        # The template writes its own special tokens; adding them again would double BOS.
        return tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]

    messages = [{"role": m["role"], "content": m["content"]} for m in messages]
    ids = encode(messages, generation_prompt=False)
    mask = [False] * len(ids)
    for turn, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = len(prompt := encode(messages[:turn], generation_prompt=True))
        through = encode(messages[: turn + 1], generation_prompt=False)
        if ids[:start] != prompt or ids[: len(through)] != through:
            raise DartsError(
                f"{label}: the chat template does not render the conversation up to assistant turn {turn} "
                "as a prefix of the whole conversation, so the response tokens cannot be located",
                fix="use format 'text' for this data, or a tokenizer whose chat template renders turns incrementally",
            )
        end = len(through)
        while end > start and not tokenizer.decode(ids[end - 1 : end]).strip():
            end -= 1
        mask[start:end] = [True] * (end - start)
    return ids, mask


def _text_prompt(text: str) -> str:
    """HumanEval-style prompt of code (header + docstring), else the first half of the words."""
    code = textwrap.dedent(text)
    try:
        first = ast.parse(code).body[0]
    except (SyntaxError, IndexError):
        first = None
    if isinstance(first, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        # Through the docstring when there is one, else the header up to the first statement.
        body = first.body[0]
        end = body.end_lineno if ast.get_docstring(first, clean=False) is not None else body.lineno - 1
        if end >= first.lineno:
            return "".join(code.splitlines(keepends=True)[:end])
    words = text.split()
    if len(words) < 2:
        return text
    # Cut right after word n/2, keeping the text's own spacing before it.
    position = 0
    for word in words[: len(words) // 2]:
        position = text.index(word, position) + len(word)
    return text[:position]
