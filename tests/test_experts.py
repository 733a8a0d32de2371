"""Demo experts: the bottom/top split, top-layer fine-tunes from a seed kept as low-rank adapters, written as the
package ships them, and the shipped ones checked against their manifest."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from darts_dist.core import mask_positions
from darts_dist.errors import DartsError
from darts_dist.sources.demo import experts as experts_module
from darts_dist.sources.demo.experts import (
    ADAPTER_FILES,
    IGNORE_INDEX,
    MANIFEST,
    SHIPPED_DIR,
    ExpertTraining,
    batch_targets,
    expert_report,
    frozen_bottom_features,
    make_experts,
    run_top,
    shipped_experts,
)
from darts_dist.sources.demo.tasks import DEMO_TASKS
from darts_dist.sources.models import BUNDLED_MODEL, load_causal_lm, materialize_adapter

# Big steps on few samples, so a 4-layer random model visibly learns in well under a second.
SETTINGS = ExpertTraining(top_layers=2, rank=4, steps=12, batch_size=4, max_length=96, learning_rate=2e-2,
                          num_samples=16)
LORA_WEIGHTS = tuple(f".{module}.weight" for module in experts_module.LORA_MODULES)


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
def made(tiny_family, train_files, tmp_path_factory) -> dict[str, Path]:
    """The tiny family's experts as the package would ship them: adapter folders and a manifest."""
    return make_experts(tiny_family.base, train_files, tmp_path_factory.mktemp("made") / "experts", SETTINGS,
                        base_name="tiny:base")


@pytest.fixture(scope="module")
def trained(tiny_family, made, tmp_path_factory) -> dict[str, Path]:
    """Each adapter merged into the base: the full expert folders a run loads."""
    out = tmp_path_factory.mktemp("merged")
    return {task: materialize_adapter(folder, tiny_family.base, out / task) for task, folder in made.items()}


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


def test_only_the_top_layers_linear_weights_change(tiny_family, trained):
    base = load_file(tiny_family.base / "model.safetensors")
    top = ("model.layers.2.", "model.layers.3.")
    for task, folder in trained.items():
        expert = load_file(folder / "model.safetensors")
        assert expert.keys() == base.keys(), task
        for name, tensor in base.items():
            if name.startswith(top) and name.endswith(LORA_WEIGHTS):
                assert not torch.equal(expert[name], tensor), f"{task}: {name} did not train"
            else:  # the bottom, the norms, the embeddings (tied to the lm_head)
                assert torch.equal(expert[name], tensor), f"{task}: {name} changed but is frozen"
        assert (folder / "tokenizer.json").is_file() and (folder / "config.json").is_file()


def test_the_adapter_is_each_changes_truncated_svd(tiny_family):
    """B·A of every adapted layer is the delta's best rank-r approximation (numpy's SVD as the reference); the share
    kept is its squared singular values' share; at full rank the adapter is the delta itself."""
    model = load_causal_lm(tiny_family.base)
    generator = torch.Generator().manual_seed(0)
    deltas = {name: torch.randn(param.shape, generator=generator)
              for name, param in experts_module._tuned_weights(model, start_layer=2).items()}
    for rank, settings in ((2, dataclasses.replace(SETTINGS, rank=2)), (None, dataclasses.replace(SETTINGS, rank=64))):
        adapter, kept = experts_module.low_rank_adapter(tiny_family.base, deltas, settings)
        modules = dict(adapter.base_model.model.named_modules())
        kept_reference = total = 0.0
        for name, delta in deltas.items():
            u, s, vh = np.linalg.svd(delta.double().numpy(), full_matrices=False)
            expected = (u[:, :rank] * s[:rank]) @ vh[:rank] if rank else delta.double().numpy()
            module = modules[name.removesuffix(".weight")]
            product = module.lora_B["default"].weight @ module.lora_A["default"].weight
            np.testing.assert_allclose(product.detach().double().numpy(), expected, atol=1e-5)
            kept_reference, total = kept_reference + (s[:rank] ** 2).sum(), total + (s**2).sum()
        assert kept == pytest.approx(kept_reference / total, rel=1e-9)


def test_training_lowers_the_training_loss(tiny_family, train_files, trained):
    report = expert_report(tiny_family.base, trained, train_files, max_length=SETTINGS.max_length)
    for task, nll in report.items():
        assert nll["expert"] < nll["base"] - 0.1, (task, nll)


def test_the_adapters_are_written_as_shipped(made):
    """fp16 adapter weights of the top layers only, the base named by reference, every file in the manifest."""
    manifest = json.loads((next(iter(made.values())).parent / MANIFEST).read_text())
    assert manifest["settings"] == dataclasses.asdict(SETTINGS) and sorted(manifest["experts"]) == sorted(made)
    for task, folder in made.items():
        config = json.loads((folder / "adapter_config.json").read_text())
        assert config["base_model_name_or_path"] == "tiny:base" and config["layers_to_transform"] == [2, 3]
        assert config["r"] == config["lora_alpha"] == SETTINGS.rank  # PEFT's scale alpha / r is 1: B·A is the delta
        weights = load_file(folder / "adapter_model.safetensors")
        assert weights and all(tensor.dtype == torch.float16 for tensor in weights.values())
        assert {name.split(".layers.")[1].split(".")[0] for name in weights} == {"2", "3"}
        record = manifest["experts"][task]
        assert sorted(record["files"]) == sorted(ADAPTER_FILES) and record["last_loss"] < record["first_loss"]
        assert 0.0 < record["kept"] <= 1.0
    assert shipped_experts(next(iter(made.values())).parent) == made  # the checksums hold


def test_the_same_settings_make_the_same_adapters(tiny_family, train_files, made, tmp_path):
    again = make_experts(tiny_family.base, {"math": train_files["math"]}, tmp_path / "again", SETTINGS,
                         base_name="tiny:base")
    for name in ADAPTER_FILES:
        assert (again["math"] / name).read_bytes() == (made["math"] / name).read_bytes(), name


def test_a_changed_adapter_is_refused(made, tmp_path):
    copy = tmp_path / "experts"
    copy.mkdir()
    for task, folder in made.items():
        (copy / task).mkdir()
        for name in ADAPTER_FILES:
            (copy / task / name).write_bytes((folder / name).read_bytes())
    (copy / MANIFEST).write_text((made["code"].parent / MANIFEST).read_text())
    weights = bytearray((copy / "math" / "adapter_model.safetensors").read_bytes())
    weights[-1] ^= 1
    (copy / "math" / "adapter_model.safetensors").write_bytes(bytes(weights))
    with pytest.raises(DartsError, match="'math' .* does not match its checksum"):
        shipped_experts(copy)
    (copy / MANIFEST).unlink()
    with pytest.raises(DartsError, match="no demo experts") as error:
        shipped_experts(copy)
    assert "--make-experts" in error.value.fix


def test_an_interrupted_make_leaves_the_folder_as_it_was(tiny_family, train_files, made, tmp_path, monkeypatch):
    out = tmp_path / "experts"
    out.mkdir()
    (out / "kept.txt").write_text("the experts made before")
    calls = []

    def second_task_fails(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return [1.0, 0.5]

    monkeypatch.setattr(experts_module, "train_top", second_task_fails)
    with pytest.raises(KeyboardInterrupt):
        make_experts(tiny_family.base, train_files, out, SETTINGS, base_name="tiny:base")
    assert [path.name for path in out.iterdir()] == ["kept.txt"]


def test_the_shipped_experts_match_their_manifest_and_name_the_bundled_base():
    """What the package ships: an adapter per demo task on SmolLM2's top 8 layers, each at most 5 MB (15 MB in
    all), every file as the manifest records it."""
    experts = shipped_experts()
    assert sorted(experts) == sorted(DEMO_TASKS)
    sizes = []
    for task, folder in experts.items():
        config = json.loads((folder / "adapter_config.json").read_text())
        assert config["base_model_name_or_path"] == BUNDLED_MODEL, task
        assert config["layers_to_transform"] == list(range(22, 30)), task
        sizes.append(sum((folder / name).stat().st_size for name in ADAPTER_FILES))
    assert max(sizes) <= 5 << 20 and sum(sizes) <= 15 << 20, sizes
    assert json.loads((SHIPPED_DIR / MANIFEST).read_text())["settings"]["precision"] == "fp32"


def test_missing_training_file_is_a_user_error(tiny_family, tmp_path):
    with pytest.raises(DartsError, match="not found"):
        make_experts(tiny_family.base, {"code": tmp_path / "nope.jsonl"}, tmp_path / "out", SETTINGS)


def test_chat_rows_with_no_response_within_max_length_are_a_user_error(tiny_family, train_files, tmp_path):
    too_short = dataclasses.replace(SETTINGS, max_length=8)
    with pytest.raises(DartsError, match="no training row"):
        make_experts(tiny_family.base, {"math": train_files["math"]}, tmp_path / "out", too_short)
    assert not (tmp_path / "out").exists()


def test_settings_out_of_range_are_a_user_error():
    with pytest.raises(DartsError, match="out of range"):
        ExpertTraining(steps=0)
    with pytest.raises(DartsError, match="out of range"):
        ExpertTraining(rank=0)
    with pytest.raises(DartsError, match="precision='fp16'"):
        ExpertTraining(precision="fp16")
