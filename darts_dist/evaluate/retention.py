"""Retention: what merging (and correcting) costs outside the tasks.

General instructions ship with the package (`retention_set/instructions.jsonl`); the base model's own greedy
replies to them (chat template, up to MAX_REPLY_TOKENS) are what every model is scored on: how likely it finds
them (NLL per reply token; the base's own is its floor) and how many of their tokens it would choose itself
(agreement, teacher-forced; 1.0 for the base in the dtype that made them), each with a bootstrap interval over the
instructions. The demo's base ships its replies with a manifest naming its weights' hash (`python -m
darts_dist.evaluate.retention` remakes them); any other base makes its replies once, in its evaluation role, and
they are kept in the output cache with its other outputs.
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from darts_dist.core import ROUTED
from darts_dist.core.modeling_darts import MERGED
from darts_dist.errors import DartsError
from darts_dist.evaluate.statistics import ratio_interval
from darts_dist.fsutil import atomic_file
from darts_dist.generation import CorrectedLM
from darts_dist.logs import progress_bar
from darts_dist.sources.models import BUNDLED_MODEL, content_hash, resolve_path
from darts_dist.sources.output_cache import OutputCache, digest

SET_FOLDER = Path(__file__).absolute().parent / "retention_set"
INSTRUCTIONS = SET_FOLDER / "instructions.jsonl"
MANIFEST = SET_FOLDER / "manifest.json"
MAX_REPLY_TOKENS = 48
MAX_PROMPT_TOKENS = 64  # an instruction in the chat template, at most (tests/test_retention.py checks the shipped)
RETENTION_ROW_TOKENS = MAX_PROMPT_TOKENS + MAX_REPLY_TOKENS  # the longest row a model is scored on (the plan's)


@dataclass(frozen=True)
class RetentionRow:
    """One instruction as the base's tokenizer renders it, and the base's greedy reply (ids, and text to read)."""

    instruction: str
    prompt_ids: tuple[int, ...]
    reply_ids: tuple[int, ...]
    reply: str


@dataclass(frozen=True)
class RetentionScore:
    """One model on the retention set, instruction by instruction: its NLL of the base's reply (summed over the
    reply's tokens), the reply's token count, and how many of them are the model's own greedy choice."""

    nll: tuple[float, ...]
    tokens: tuple[int, ...]
    agreeing: tuple[int, ...]
    routed_to: tuple[str | None, ...] = ()  # a routed model's correction per instruction (None: none); else empty

    def summary(self) -> dict[str, object]:
        """NLL per reply token and token agreement with their 95% intervals (instructions resampled), the share of
        replies the model would give word for word, the counts, and for a routed model `routes`: how many
        instructions got each task's correction, and none ("merged": the uncorrected model, as its model id says)."""
        total = sum(self.tokens)
        summary = {
            "nll": sum(self.nll) / total, "nll_ci": list(ratio_interval(self.nll, self.tokens)),
            "agreement": sum(self.agreeing) / total, "agreement_ci": list(ratio_interval(self.agreeing, self.tokens)),
            "exact": sum(a == t for a, t in zip(self.agreeing, self.tokens)) / len(self.tokens),
            "n": len(self.tokens), "tokens": total,
        }
        if self.routed_to:
            summary["routes"] = {MERGED: self.routed_to.count(None)} | {
                task: self.routed_to.count(task) for task in sorted(set(self.routed_to) - {None})}
        return summary


def instructions() -> list[str]:
    return [json.loads(line)["instruction"] for line in INSTRUCTIONS.read_text().splitlines() if line.strip()]


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def shipped_rows(base_dir: Path) -> list[RetentionRow] | None:
    """The shipped replies when `base_dir` holds the weights they were made by (the manifest's hash), else None."""
    manifest = json.loads(MANIFEST.read_text())
    if content_hash(base_dir) != manifest["base_hash"]:
        return None
    replies = SET_FOLDER / manifest["replies"]
    if _sha256(replies) != manifest["replies_sha256"] or _sha256(INSTRUCTIONS) != manifest["instructions_sha256"]:
        raise DartsError(f"{replies} or {INSTRUCTIONS} differ from their checksums in {MANIFEST}",
                         "reinstall darts-dist, or remake the set: python -m darts_dist.evaluate.retention")
    return [RetentionRow(row["instruction"], tuple(row["prompt_ids"]), tuple(row["reply_ids"]), row["reply"])
            for row in map(json.loads, replies.read_text().splitlines())]


def base_rows(lm: CorrectedLM, identity: str | None, cache: OutputCache | None, base_dir: Path,
              batch_size: int) -> list[RetentionRow]:
    """The retention rows of the base `lm` (loaded from `base_dir`): the shipped ones when they are this base's,
    else its greedy replies, made here (`made_rows`)."""
    return shipped_rows(base_dir) or made_rows(lm, identity, cache, batch_size)


def made_rows(lm: CorrectedLM, identity: str | None, cache: OutputCache | None,
              batch_size: int) -> list[RetentionRow]:
    """The base `lm`'s greedy replies to the instructions, kept in the output cache when the model has an
    `identity`."""
    # As a chat, where the base has a chat template (a request to /v1/chat/completions), else the plain text.
    prompts = [lm.encode_chat([{"role": "user", "content": text}]) if lm.tokenizer.chat_template else lm.encode(text)
               for text in instructions()]

    def replies(missing: list[int]) -> list[list[int]]:
        made = []
        for start in progress_bar(range(0, len(missing), batch_size), desc="base retention replies", unit="batch"):
            chunk = [prompts[i] for i in missing[start:start + batch_size]]
            made += [list(c.token_ids) for c in lm.generate_ids(chunk, max_new_tokens=MAX_REPLY_TOKENS)]
        return made

    if cache is None or identity is None:
        reply_ids = replies(list(range(len(prompts))))
    else:
        key = digest("retention replies", identity, MAX_REPLY_TOKENS, sorted(lm.eos_ids), batch_size)
        reply_ids = cache.entries(key, [digest(p) for p in prompts], replies)
    return [RetentionRow(text, tuple(prompt), tuple(ids), lm.tokenizer.decode(ids, skip_special_tokens=True))
            for text, prompt, ids in zip(instructions(), prompts, reply_ids)]


def score(lm: CorrectedLM, rows: Sequence[RetentionRow], batch_size: int) -> RetentionScore:
    """`lm` on the rows, teacher-forced, a request without a task as served: the router's pick where `lm` has a
    router, else the uncorrected model."""
    routed = lm.router is not None and bool(lm.tasks)
    scores = []
    for start in range(0, len(rows), batch_size):
        chunk = rows[start:start + batch_size]
        scores += lm.continuation_scores([r.prompt_ids for r in chunk], [r.reply_ids for r in chunk],
                                         [ROUTED] * len(chunk) if routed else None)
    return RetentionScore(tuple(-s.logprob for s in scores), tuple(s.tokens for s in scores),
                          tuple(s.agreeing for s in scores), tuple(s.task for s in scores) if routed else ())


def retention_fields(retained: dict[str, object]) -> dict[str, object]:
    """An evaluation's overall retention numbers (`Evaluator.evaluate`'s "retention"): each model's NLL of the
    base's replies and agreement with them, with the intervals of the merge's and the corrected model's; the
    experts' as their mean."""
    fields: dict[str, object] = {}
    experts = [s for s in retained["experts"].values() if s is not None]
    for metric in ("nll", "agreement"):
        for model in ("base", "merged", "corrected"):
            summary = retained.get(model)
            if summary is not None:
                fields[f"retention_{metric}_{model}"] = summary[metric]
                if model != "base":
                    fields[f"retention_{metric}_{model}_ci"] = summary[f"{metric}_ci"]
        if experts:
            fields[f"retention_{metric}_experts"] = sum(s[metric] for s in experts) / len(experts)
    served = retained.get("corrected") or {}
    if "routes" in served:
        fields["retention_uncorrected_share"] = served["routes"][MERGED] / served["n"]
    return fields


def write_shipped(base: str, folder: Path = SET_FOLDER) -> Path:
    """Make `base`'s replies (fp32, on the CPU, greedy) and write them with the manifest: the maintainers' step
    after the instructions or the bundled base change."""
    import transformers

    from darts_dist import __version__

    base_dir = resolve_path(base)
    with CorrectedLM.load(base_dir, device="cpu", dtype=torch.float32) as lm:
        rows = made_rows(lm, None, None, batch_size=8)
    replies = folder / f"{base_dir.name}.jsonl"
    with atomic_file(replies) as tmp:
        tmp.write_text("".join(json.dumps({"instruction": r.instruction, "prompt_ids": list(r.prompt_ids),
                                           "reply_ids": list(r.reply_ids), "reply": r.reply}) + "\n" for r in rows))
    manifest = {
        "base": base, "base_hash": content_hash(base_dir), "replies": replies.name,
        "replies_sha256": _sha256(replies), "instructions_sha256": _sha256(INSTRUCTIONS), "rows": len(rows),
        "decoding": f"greedy, the tokenizer's chat template, up to {MAX_REPLY_TOKENS} tokens, float32 on a CPU",
        "made_with": f"python -m darts_dist.evaluate.retention {base}",
        "versions": {"darts-dist": __version__, "torch": torch.__version__, "transformers": transformers.__version__},
    }
    with atomic_file(folder / MANIFEST.name) as tmp:
        tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    return replies


if __name__ == "__main__":
    print(write_shipped(sys.argv[1] if len(sys.argv) > 1 else BUNDLED_MODEL))
