"""Experts whose fine-tunes added tokens (WizardMath-7B-V1.0's 32,001 rows beside Llama-2's 32,000): the run merges
them under the base's tokenizer (sources.models.VOCABULARY_POLICY), the plan says so, and an expert that numbers the
base's tokens otherwise is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from tiny_configs import family_config

from darts_dist.cli import main
from darts_dist.errors import DartsError
from darts_dist.sources.demo.tiny import make_tiny_family
from darts_dist.sources.models import check_vocabularies, load_causal_lm, read_model_info


@pytest.fixture(scope="module")
def added_family(tmp_path_factory: pytest.TempPathFactory):
    """The tiny family, its math expert with one token (and row) its fine-tune added."""
    return make_tiny_family(tmp_path_factory.mktemp("added"), tasks=("code", "math"), added_tokens={"math": 1})


def test_an_expert_with_an_added_token_merges_under_the_bases_tokenizer(added_family, tmp_path: Path,
                                                                          capsys) -> None:
    assert read_model_info(added_family.experts["math"]).vocab_size == read_model_info(added_family.base).vocab_size + 1
    config = family_config(added_family, tmp_path, "added", lambda task, i: f"{task} row {i}: " + "word " * (i % 7),
                           24, calibration={"rank": 4, "max_positions": 32, "num_samples": 12, "max_length": 32,
                                            "batch_size": 4, "steps": 6},
                           evaluation={"score_limit": 0}, cluster={"executor": "in-process"},
                           output_dir=str(tmp_path / "runs"))
    (tmp_path / "added.yaml").write_text(yaml.safe_dump(config))
    assert main(["plan", str(tmp_path / "added.yaml")]) == 0
    said = capsys.readouterr().out
    assert "expert math has +1 rows beside the base's 512" in said and "tokenizer_source" in said
    report = tmp_path / "report.json"
    assert main(["calibrate", str(tmp_path / "added.yaml"), "--report", str(report)]) == 0
    merged = tmp_path / "runs" / "added" / "merged"
    recipe = yaml.safe_load((merged / "mergekit_config.yml").read_text())
    assert recipe["tokenizer_source"] == str(added_family.base)
    assert load_causal_lm(merged).get_input_embeddings().weight.shape[0] == 512  # the added row dropped
    # The expert's own forwards kept its row: evaluation compared the merge with it on the base's tokens.
    math = json.loads(report.read_text())["variants"]["darts"]["tasks"]["math"]
    assert math["tokens"] > 0 and math["nll_corrected"] < math["nll_merged"]


def test_an_expert_numbering_the_bases_tokens_otherwise_is_refused(added_family, tmp_path: Path) -> None:
    moved = tmp_path / "moved"
    moved.mkdir()
    tokenizer = json.loads((added_family.experts["code"] / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    first, second = sorted(vocab, key=vocab.get)[300:302]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (moved / "tokenizer.json").write_text(json.dumps(tokenizer))
    for name in ("tokenizer_config.json", "config.json"):
        (moved / name).write_text((added_family.experts["code"] / name).read_text())
    check_vocabularies(added_family.base, {"math": added_family.experts["math"]})  # only adds: accepted
    with pytest.raises(DartsError, match=f"numbers the base's token {first!r} as {vocab[first]}") as error:
        check_vocabularies(added_family.base, {"code": moved})
    assert "policy" not in error.value.what and "tokenizer_source" in error.value.fix


def test_a_base_padded_past_its_tokenizer_keeps_its_rows_through_the_merge(tmp_path: Path) -> None:
    """A vocabulary padded for the hardware (rows no token reaches, as the thin families' 32000 beside 512 tokens):
    mergekit sizes a tokenizer_source merge to the tokenizer's tokens; the merge keeps the base's rows."""
    from darts_dist.sources.demo.tiny import FamilyShape

    padded = make_tiny_family(tmp_path / "padded", tasks=("code", "math"), shape=FamilyShape(vocab_size=600),
                              added_tokens={"math": 1})
    config = family_config(padded, tmp_path, "padded", lambda task, i: f"{task} {i}", 4)
    (tmp_path / "padded.yaml").write_text(yaml.safe_dump(config))
    assert main(["merge", str(tmp_path / "padded.yaml"), "--out", str(tmp_path / "merged")]) == 0
    merged, base = load_causal_lm(tmp_path / "merged"), load_causal_lm(padded.base)
    assert merged.config.vocab_size == 600
    rows = merged.get_input_embeddings().weight
    assert rows.shape[0] == 600 and torch.equal(rows[512:], base.get_input_embeddings().weight[512:])
    assert merged(input_ids=torch.tensor([[1, 2, 3]])).logits.shape[-1] == 600
