"""Demo experts on tiny models: the bottom/top split, what trains, and the cache."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from darts_dist.core import mask_positions
from darts_dist.errors import DartsError
from darts_dist.sources.demo import experts as experts_module
from darts_dist.sources.demo.experts import (
    IGNORE_INDEX,
    ExpertTraining,
    batch_targets,
    expert_report,
    frozen_bottom_features,
    make_experts,
    resolved_precision,
    run_top,
)
from darts_dist.sources.models import load_causal_lm

# Big steps on few samples, so a 4-layer random model visibly learns in well under a second.
SETTINGS = ExpertTraining(top_layers=2, steps=12, batch_size=4, max_length=96, learning_rate=1e-2, num_samples=16)


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture(scope="module")
def train_files(tmp_path_factory) -> dict[str, Path]:
    """A text task (loss on every token) and a chat task (loss on the assistant's tokens)."""
    folder = tmp_path_factory.mktemp("expert-data")
    code = [{"text": f"def scale_{i}(values):\n    return [v * {i} for v in values]\n"} for i in range(20)]
    math = [
        {
            "messages": [
                {"role": "user", "content": f"What is {a} + {a + 3}?"},
                {"role": "assistant", "content": f"{a} + {a + 3} = {2 * a + 3}. The answer is {2 * a + 3}."},
            ]
        }
        for a in range(20)
    ]
    return {"code": _write_jsonl(folder / "code.jsonl", code), "math": _write_jsonl(folder / "math.jsonl", math)}


@pytest.fixture(scope="module")
def trained(tiny_family, train_files) -> dict[str, Path]:
    return make_experts(tiny_family.base, train_files, settings=SETTINGS)


def _batch() -> dict[str, torch.Tensor]:
    """Three right-padded rows of different lengths, the first four tokens of each a prompt."""
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, 500, (3, 20), generator=generator)
    attention_mask = torch.ones(3, 20, dtype=torch.long)
    attention_mask[1, 12:] = 0
    attention_mask[2, 5:] = 0
    response_mask = attention_mask.bool()
    response_mask[:, :4] = False
    return {"input_ids": input_ids, "attention_mask": attention_mask, "response_mask": response_mask}


@pytest.mark.parametrize("top_layers", [1, 2, 4])
def test_bottom_then_top_equals_the_full_forward(tiny_family, top_layers):
    model = load_causal_lm(tiny_family.base)
    batch = _batch()
    (features,) = frozen_bottom_features(model, [batch], top_layers)
    with torch.no_grad():
        split = model.lm_head(run_top(model, features))
        full = model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            position_ids=mask_positions(batch["attention_mask"]),
        ).logits
    real = batch["attention_mask"].bool()
    torch.testing.assert_close(split[real], full[real], rtol=1e-5, atol=1e-5)


def test_targets_are_the_next_response_token():
    batch = _batch()
    targets = batch_targets(batch)
    # Row 2 has 5 real tokens and only the last is a response token: only the logits at
    # position 3 predict it. Row 0 has no padding, so only its last position has no target.
    assert targets[2].tolist() == [IGNORE_INDEX] * 3 + [int(batch["input_ids"][2, 4])] + [IGNORE_INDEX] * 16
    assert (targets[0, 3:19] == batch["input_ids"][0, 4:]).all() and targets[0, 19] == IGNORE_INDEX


def test_top_layers_out_of_range_is_a_user_error(tiny_family):
    model = load_causal_lm(tiny_family.base)
    with pytest.raises(DartsError, match="top_layers=5"):
        frozen_bottom_features(model, [_batch()], top_layers=5)


def test_only_the_top_layers_and_final_norm_change(tiny_family, trained):
    base = load_file(tiny_family.base / "model.safetensors")
    top = ("model.layers.2.", "model.layers.3.", "model.norm.")
    for task, folder in trained.items():
        expert = load_file(folder / "model.safetensors")
        assert expert.keys() == base.keys(), task
        for name, tensor in base.items():
            if name.startswith(top):
                assert not torch.equal(expert[name], tensor), f"{task}: {name} did not train"
            else:
                assert torch.equal(expert[name], tensor), f"{task}: {name} changed but is frozen"
        assert (folder / "tokenizer.json").is_file() and (folder / "config.json").is_file()


def test_training_lowers_the_training_loss(tiny_family, train_files, trained):
    report = expert_report(tiny_family.base, trained, train_files, max_length=SETTINGS.max_length)
    for task, nll in report.items():
        assert nll["expert"] < nll["base"] - 0.1, (task, nll)


def test_cache_is_reused_when_nothing_changed(tiny_family, train_files, trained, monkeypatch):
    mtimes = {task: (folder.stat().st_mtime_ns, (folder / "model.safetensors").stat().st_mtime_ns)
              for task, folder in trained.items()}

    def no_training(*args, **kwargs):
        raise AssertionError("an unchanged expert was trained again")

    monkeypatch.setattr(experts_module, "train_top", no_training)
    again = make_experts(tiny_family.base, train_files, settings=SETTINGS)
    assert again == trained
    for task, folder in again.items():
        assert (folder.stat().st_mtime_ns, (folder / "model.safetensors").stat().st_mtime_ns) == mtimes[task]


def test_cache_is_rebuilt_when_settings_or_data_change(tiny_family, train_files, trained, tmp_path):
    code_only = {"code": train_files["code"]}
    # fp32 is also the settings change: whatever "auto" means here, this path gets exercised.
    fp32 = make_experts(tiny_family.base, code_only, settings=dataclasses.replace(SETTINGS, precision="fp32"))
    assert fp32["code"].parent != trained["code"].parent
    assert json.loads((fp32["code"] / "darts_expert.json").read_text())["settings"]["precision"] == "fp32"

    changed = tmp_path / "code.jsonl"
    changed.write_text(train_files["code"].read_text() + json.dumps({"text": "def extra():\n    pass\n"}) + "\n")
    new_data = make_experts(tiny_family.base, {"code": changed}, settings=SETTINGS)
    assert new_data["code"].parent not in (trained["code"].parent, fp32["code"].parent)


def test_a_given_out_root_is_rebuilt_when_the_settings_differ(tiny_family, train_files, tmp_path):
    math_only = {"math": train_files["math"]}
    first = make_experts(tiny_family.base, math_only, tmp_path, dataclasses.replace(SETTINGS, steps=2))
    before = load_file(first["math"] / "model.safetensors")
    second = make_experts(tiny_family.base, math_only, tmp_path, dataclasses.replace(SETTINGS, steps=4))
    assert second == first == {"math": tmp_path / "math"}
    after = load_file(second["math"] / "model.safetensors")
    assert not torch.equal(before["model.norm.weight"], after["model.norm.weight"])


def test_auto_precision_is_recorded_as_what_it_resolved_to(trained):
    recorded = json.loads((trained["math"] / "darts_expert.json").read_text())["settings"]["precision"]
    assert recorded == resolved_precision("auto") in ("bf16", "fp32")
    with pytest.raises(DartsError, match="precision='fp16'"):
        resolved_precision("fp16")


def test_missing_training_file_is_a_user_error(tiny_family, tmp_path):
    with pytest.raises(DartsError, match="not found"):
        make_experts(tiny_family.base, {"code": tmp_path / "nope.jsonl"}, settings=SETTINGS)


def test_chat_rows_with_no_response_within_max_length_are_a_user_error(tiny_family, train_files):
    too_short = dataclasses.replace(SETTINGS, max_length=8)
    with pytest.raises(DartsError, match="no training row"):
        make_experts(tiny_family.base, {"math": train_files["math"]}, settings=too_short)


def test_settings_out_of_range_are_a_user_error():
    with pytest.raises(DartsError, match="out of range"):
        ExpertTraining(steps=0)
    with pytest.raises(DartsError, match="precision='fp16'"):
        ExpertTraining(precision="fp16")
