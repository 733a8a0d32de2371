"""Merging through mergekit: results checked against the formulas computed by hand."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from darts_dist.errors import DartsError
from darts_dist.merge.mergekit import (
    build_mergekit_config,
    load_mergekit_yaml,
    merge_methods,
    mergekit_model_paths,
    run_merge,
)
from darts_dist.sources.demo.tiny import FamilyShape, make_tiny_family

WEIGHTS = {"code": 0.5, "math": 0.3, "instruct": 0.8}
TOP = "model.layers.3.mlp.down_proj.weight"  # perturbed in every expert
BOTTOM = "model.layers.0.self_attn.q_proj.weight"  # identical in all models


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(folder / "model.safetensors")


def _write_yaml(folder: Path, family, method: str, parameters: dict, density: float | None = None) -> Path:
    """A mergekit YAML in `folder` naming the family's models by paths relative to it."""
    folder.mkdir(parents=True, exist_ok=True)
    models = []
    for task, weight in WEIGHTS.items():
        model_parameters = {"weight": weight} | ({"density": density} if density is not None else {})
        models.append({"model": os.path.relpath(family.experts[task], folder), "parameters": model_parameters})
    config = {
        "merge_method": method,
        "base_model": os.path.relpath(family.base, folder),
        "models": models,
        "parameters": parameters,
        "dtype": "float32",
    }
    path = folder / "merge.yml"
    path.write_text(yaml.safe_dump(config))
    return path


def _deltas(family, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """θ0, the stacked deltas θ_k − θ0, and the stacked weights λ_k, in WEIGHTS' order."""
    base = _tensors(family.base)[name]
    deltas = torch.stack([_tensors(family.experts[task])[name] - base for task in WEIGHTS])
    weights = torch.tensor(list(WEIGHTS.values())).view(-1, *([1] * base.dim()))
    return base, deltas, weights


def test_task_arithmetic_from_yaml_equals_hand_computation(tiny_family, tmp_path, monkeypatch):
    config_path = _write_yaml(tmp_path / "configs", tiny_family, "task_arithmetic", {"lambda": 1.0})
    monkeypatch.chdir(tmp_path)  # not the YAML's folder: paths must resolve from the YAML
    merged = _tensors(run_merge(load_mergekit_yaml(config_path), tmp_path / "merged"))

    base, deltas, weights = _deltas(tiny_family, TOP)
    torch.testing.assert_close(merged[TOP], base + (weights * deltas).sum(0), rtol=0, atol=1e-6)
    assert not torch.allclose(merged[TOP], base)
    torch.testing.assert_close(merged[BOTTOM], _tensors(tiny_family.base)[BOTTOM])
    # Tied embeddings stay tied: no lm_head is written and the config still says so.
    assert "lm_head.weight" not in merged
    assert yaml.safe_load((tmp_path / "merged" / "config.json").read_text())["tie_word_embeddings"] is True


def test_ties_from_yaml_equals_hand_computation(tiny_family, tmp_path):
    density = 0.3
    config_path = _write_yaml(tmp_path, tiny_family, "ties", {"normalize": True}, density=density)
    merged = _tensors(run_merge(load_mergekit_yaml(config_path), tmp_path / "merged"))

    base, deltas, weights = _deltas(tiny_family, TOP)
    # mergekit's TIES: keep the int(density·n) largest |δ| of each expert (no rescale),
    # weight, elect the sign of the weighted sum (ties go to +), keep agreeing entries,
    # and divide by the summed weights of the entries kept (normalize).
    keep = int(density * base.numel())
    trimmed = torch.zeros_like(deltas)
    for k, delta in enumerate(deltas):
        top = delta.abs().flatten().argsort(descending=True)[:keep]
        trimmed[k].view(-1)[top] = delta.view(-1)[top]
    weighted = weights * trimmed
    elected = torch.where(weighted.sum(0) >= 0, 1.0, -1.0)
    agree = (weighted.sign() == elected).float()
    divisor = (weights * agree).sum(0)
    divisor[divisor == 0] = 1
    expected = base + (weighted * agree).sum(0) / divisor

    torch.testing.assert_close(merged[TOP], expected, rtol=0, atol=1e-6)
    # The trim matters: plain weighted averaging gives something else.
    assert not torch.allclose(merged[TOP], base + (weights * deltas).sum(0) / weights.sum(0), atol=1e-4)


def test_built_config_merges_like_the_equivalent_yaml(tiny_family, tmp_path):
    from_yaml = run_merge(
        load_mergekit_yaml(_write_yaml(tmp_path, tiny_family, "ties", {"normalize": True}, density=0.3)),
        tmp_path / "from_yaml",
    )
    config = build_mergekit_config(
        tiny_family.base,
        tiny_family.experts,
        "ties",
        parameters={"normalize": True, "density": 0.3},
        expert_parameters={task: {"weight": weight} for task, weight in WEIGHTS.items()},
    )
    built = run_merge(config, tmp_path / "built")

    expected, actual = _tensors(from_yaml), _tensors(built)
    assert expected.keys() == actual.keys()
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=0, atol=0)
    assert yaml.safe_load((built / "mergekit_config.yml").read_text()) == config
    assert mergekit_model_paths(config) == [tiny_family.base, *sorted(tiny_family.experts.values())]


def test_yaml_paths_fall_back_to_the_working_directory(tiny_family, tmp_path, monkeypatch):
    monkeypatch.chdir(tiny_family.base.parent)
    config_path = tmp_path / "merge.yml"
    config_path.write_text(yaml.safe_dump({
        "merge_method": "task_arithmetic",
        "base_model": "base",
        "models": [{"model": "code", "parameters": {"weight": 1.0}}],
    }))
    config = load_mergekit_yaml(config_path)
    assert config["base_model"] == str(tiny_family.base)
    assert config["models"][0]["model"] == str(tiny_family.experts["code"])


def test_revisions_and_lora_references_keep_their_parts_with_absolute_paths(tiny_family, tmp_path):
    """mergekit's `path@revision+lora` references: each path resolved next to the YAML, the rest kept as it was."""
    (tmp_path / "adapters" / "code-lora").mkdir(parents=True)
    shutil.copytree(tiny_family.experts["code"], tmp_path / "code")
    config_path = tmp_path / "merge.yml"
    config_path.write_text(yaml.safe_dump({
        "merge_method": "task_arithmetic",
        "base_model": str(tiny_family.base),
        "models": [{"model": "code@main+adapters/code-lora", "parameters": {"weight": 1.0}}],
    }))
    config = load_mergekit_yaml(config_path)
    assert config["models"][0]["model"] == f"{tmp_path / 'code'}@main+{tmp_path / 'adapters' / 'code-lora'}"
    config_path.write_text(config_path.read_text().replace("code@main+", "code@a@b+"))
    with pytest.raises(DartsError, match="is not a model reference"):
        load_mergekit_yaml(config_path)


def test_a_bug_inside_the_merge_is_not_reported_as_bad_input(tiny_family, tmp_path, monkeypatch):
    """Only the errors mergekit raises for inputs it cannot merge become `error:` / `fix:`; anything else is
    a bug, and keeps its traceback."""
    def broken(*args, **kwargs):
        raise AttributeError("a bug, not a bad input")

    monkeypatch.setattr("darts_dist.merge.mergekit.mergekit_run_merge", broken)
    config = build_mergekit_config(tiny_family.base, {"code": tiny_family.experts["code"]}, "task_arithmetic",
                                   parameters={"weight": 0.5})
    with pytest.raises(AttributeError, match="a bug"):
        run_merge(config, tmp_path / "out" / "merged")
    assert list((tmp_path / "out").iterdir()) == []


def test_yaml_with_a_missing_model_path_names_it(tiny_family, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config_path = tmp_path / "merge.yml"
    config_path.write_text(yaml.safe_dump({
        "merge_method": "task_arithmetic",
        "base_model": str(tiny_family.base),
        "models": [{"model": "./experts/nowhere", "parameters": {"weight": 1.0}}],
    }))
    with pytest.raises(DartsError, match=r"experts/nowhere.*not found") as error:
        load_mergekit_yaml(config_path)
    assert str(config_path) in str(error.value)


def test_broken_yaml_names_the_file(tmp_path):
    config_path = tmp_path / "merge.yml"
    config_path.write_text("merge_method: ties\nmodels: [\n")
    with pytest.raises(DartsError, match="merge.yml"):
        load_mergekit_yaml(config_path)


def test_unknown_method_lists_the_valid_ones(tiny_family):
    assert {"task_arithmetic", "ties", "dare_ties", "dare_linear", "della", "breadcrumbs", "linear", "slerp"} <= set(
        merge_methods()
    )
    with pytest.raises(DartsError, match="unknown merge method 'tie'") as error:
        build_mergekit_config(tiny_family.base, tiny_family.experts, "tie")
    assert "task_arithmetic" in str(error.value) and "dare_ties" in str(error.value)


def test_misspelt_parameter_is_refused_not_ignored(tiny_family):
    with pytest.raises(DartsError, match="densty") as error:
        build_mergekit_config(tiny_family.base, tiny_family.experts, "ties", parameters={"densty": 0.5})
    assert "density" in str(error.value)


def test_method_input_count_is_checked_before_merging(tiny_family):
    with pytest.raises(DartsError, match="slerp.*2 inputs"):
        build_mergekit_config(tiny_family.base, tiny_family.experts, "slerp", parameters={"t": 0.5})


def test_incompatible_expert_is_refused_before_any_weight_loads(tiny_family, tmp_path):
    other = make_tiny_family(tmp_path / "other", tasks=("code",), shape=FamilyShape(hidden_size=32, num_layers=2))
    config = build_mergekit_config(
        tiny_family.base, {"small": other.experts["code"]}, "task_arithmetic", parameters={"weight": 1.0}
    )
    with pytest.raises(DartsError, match="hidden_size") as error:
        run_merge(config, tmp_path / "merged")
    assert "num_layers" in str(error.value)
    assert not (tmp_path / "merged").exists()


def test_failed_merge_leaves_no_output(tiny_family, tmp_path):
    corrupt = tmp_path / "corrupt"
    shutil.copytree(tiny_family.experts["math"], corrupt)
    (corrupt / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not a header")
    config = build_mergekit_config(
        tiny_family.base, {"code": tiny_family.experts["code"], "math": corrupt}, "task_arithmetic",
        parameters={"weight": 0.5},
    )
    out_dir = tmp_path / "out" / "merged"
    with pytest.raises(DartsError, match="mergekit could not merge"):
        run_merge(config, out_dir)
    assert list((tmp_path / "out").iterdir()) == []  # neither the folder nor a temp sibling


def test_existing_output_needs_overwrite(tiny_family, tmp_path):
    out_dir = tmp_path / "merged"
    out_dir.mkdir()
    (out_dir / "stale.txt").write_text("old")
    config = build_mergekit_config(tiny_family.base, tiny_family.experts, "task_arithmetic", parameters={"weight": 0.3})
    with pytest.raises(DartsError, match="already exists"):
        run_merge(config, out_dir)
    run_merge(config, out_dir, overwrite=True)
    assert (out_dir / "model.safetensors").is_file() and not (out_dir / "stale.txt").exists()


def test_a_second_merge_reads_sources_as_they_are_now(tiny_family, tmp_path):
    expert = tmp_path / "expert"
    shutil.copytree(tiny_family.experts["code"], expert)
    config = build_mergekit_config(tiny_family.base, {"code": expert}, "task_arithmetic", parameters={"weight": 1.0})
    first = _tensors(run_merge(config, tmp_path / "first"))

    state = _tensors(expert)
    state[TOP] = state[TOP] + 1.0
    (expert / "model.safetensors").unlink()  # a new file, as a re-trained expert would be
    save_file(state, expert / "model.safetensors", metadata={"format": "pt"})
    second = _tensors(run_merge(config, tmp_path / "second"))
    torch.testing.assert_close(second[TOP], first[TOP] + 1.0)
