"""Corrected generation: batched greedy output equals one prompt at a time, and corrections change it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from darts_dist.core import CorrectionSpec, DartsCorrections, save_corrections
from darts_dist.errors import DartsError
from darts_dist.generation import CorrectedLM

TASKS = ("code", "math")
PROMPTS = [
    "def add(a, b):",
    "Question: Tom has 12 apples. He gives 5 apples to Mary. How many apples does Tom have now?\nAnswer:",
    "Instruction: List three fruits",
]


def strong_corrections(hidden_size: int, seed: int = 0, layers: tuple = ("final",)) -> DartsCorrections:
    """Corrections far from the identity, so a corrected sequence cannot pass for an uncorrected one."""
    torch.manual_seed(seed)
    corrections = DartsCorrections(CorrectionSpec(TASKS, hidden_size, rank=4, max_positions=32), list(layers))
    with torch.no_grad():
        for p in corrections.parameters():
            p.copy_(torch.randn_like(p))
    return corrections


@pytest.fixture(scope="module")
def lm(tiny_family) -> CorrectedLM:
    # The tiny base stands in for a merged model: any causal LM with a tokenizer will do.
    merged = CorrectedLM.load(tiny_family.base)
    return CorrectedLM(merged.model, merged.tokenizer, strong_corrections(merged.model.config.hidden_size))


def test_batched_greedy_with_mixed_tasks_equals_each_prompt_alone(lm: CorrectedLM) -> None:
    tasks = ["code", None, "math"]
    batched = lm.generate(PROMPTS, tasks, max_new_tokens=12)
    alone = [lm.generate([p], [t], max_new_tokens=12)[0] for p, t in zip(PROMPTS, tasks)]
    assert batched == alone
    for completion, prompt in zip(batched, PROMPTS):
        assert completion.prompt_tokens == len(lm.tokenizer(prompt)["input_ids"])
        assert 1 <= completion.completion_tokens <= 12
        assert completion.finish_reason in ("stop", "length")


def test_a_correction_changes_the_output(lm: CorrectedLM) -> None:
    plain = lm.generate(PROMPTS, None, max_new_tokens=8)
    for task in TASKS:
        corrected = lm.generate(PROMPTS, [task] * len(PROMPTS), max_new_tokens=8)
        assert any(a.text != b.text for a, b in zip(plain, corrected)), task


def test_stop_strings_cut_the_text(lm: CorrectedLM) -> None:
    [full] = lm.generate(PROMPTS[:1], ["code"], max_new_tokens=16)
    assert len(full.text) > 6, full
    stop = full.text[3:6]
    [cut] = lm.generate(PROMPTS[:1], ["code"], max_new_tokens=16, stop=[stop, "never appears \x00"])
    assert cut.text == full.text[: full.text.find(stop)]
    assert cut.finish_reason == "stop"
    assert cut.completion_tokens <= full.completion_tokens


def test_seeded_sampling_is_reproducible(lm: CorrectedLM) -> None:
    first = lm.generate(PROMPTS, ["math"] * 3, max_new_tokens=8, temperature=1.0, top_p=0.9, seed=7)
    again = lm.generate(PROMPTS, ["math"] * 3, max_new_tokens=8, temperature=1.0, top_p=0.9, seed=7)
    assert first == again


def test_chat_applies_the_chat_template(lm: CorrectedLM) -> None:
    conversation = [{"role": "user", "content": "What is 17 + 26?"}]
    rendered = lm.chat_prompt(conversation)
    assert rendered.endswith("<|im_start|>assistant\n")
    # The tiny tokenizer adds no special tokens, so the rendered prompt generates the same reply.
    assert lm.chat([conversation], ["math"], max_new_tokens=6) == lm.generate([rendered], ["math"], max_new_tokens=6)


def test_bad_requests_are_refused(lm: CorrectedLM) -> None:
    with pytest.raises(DartsError, match="unknown task 'poetry'"):
        lm.generate(PROMPTS[:1], ["poetry"])
    with pytest.raises(DartsError, match="2 prompts but 1 tasks"):
        lm.generate(PROMPTS[:2], ["code"])
    with pytest.raises(DartsError, match="max_new_tokens"):
        lm.generate(PROMPTS[:1], max_new_tokens=0)


def test_load_refuses_corrections_of_another_model(tiny_family, tmp_path: Path) -> None:
    merged_dir = tmp_path / "merged"
    shutil.copytree(tiny_family.base, merged_dir)
    hidden_size = json.loads((merged_dir / "config.json").read_text())["hidden_size"]
    good = save_corrections(tmp_path / "good.safetensors", strong_corrections(hidden_size),
                            metadata={"hidden_size": hidden_size})
    assert CorrectedLM.load(merged_dir, good).tasks == TASKS
    bad = save_corrections(tmp_path / "bad.safetensors", strong_corrections(hidden_size),
                           metadata={"hidden_size": hidden_size + 1})
    with pytest.raises(DartsError, match="hidden_size"):
        CorrectedLM.load(merged_dir, bad)
