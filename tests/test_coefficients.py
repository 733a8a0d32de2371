"""Learned merge coefficients, deep corrections and layer sets on the tiny family (layers 2, 3 and the final norm
are where its experts differ from the base)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import mlflow.pyfunc
import pandas as pd
import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file
from tiny_configs import family_config

from darts_dist.ablation import claims, over_seeds
from darts_dist.calibrate.coefficients import (
    fit_coefficients,
    fit_layers,
    layerwise_mergekit_config,
    read_task_vectors,
)
from darts_dist.calibrate.features import collect_features
from darts_dist.calibrate.layers import concrete_layers, with_concrete_layers
from darts_dist.calibrate.loop import build_corrections, train_corrections
from darts_dist.cli import main
from darts_dist.config import CalibrationSection, parse_config
from darts_dist.core import LayerwiseMerge, TokenizedSet, attach_corrections, capture_hidden, one_hot_tasks, run_from
from darts_dist.errors import DartsError
from darts_dist.generation import CorrectedLM
from darts_dist.merge.mergekit import run_merge
from darts_dist.run_folder import read_run_folder
from darts_dist.sources.data import TaskFiles, tokenized
from darts_dist.sources.models import load_causal_lm, load_tokenizer


def random_set(task: str, rows: int = 24, length: int = 20, seed: int = 0) -> TokenizedSet:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 200, (rows, length), generator=generator)
    mask = torch.ones_like(ids)
    return TokenizedSet(task=task, input_ids=ids, attention_mask=mask, response_mask=mask.bool(), has_boundary=False,
                        truncated=torch.zeros(rows, dtype=torch.bool))


def weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(next(Path(folder).glob("*.safetensors")))


def expert_with(base: Path, source: Path, prefixes: tuple[str, ...], out: Path) -> Path:
    """A copy of the base whose tensors under `prefixes` are `source`'s: base + a known task vector there only."""
    shutil.copytree(base, out)
    tensors, theirs = weights(base), weights(source)
    tensors |= {name: theirs[name] for name in tensors if name.startswith(prefixes)}
    save_file(tensors, str(next(out.glob("*.safetensors"))), metadata={"format": "pt"})
    return out


def fit(experts: dict[str, Path], base: Path, layers: list, init: float, steps: int = 150):
    vectors = read_task_vectors(base, experts)
    settings = CalibrationSection(batch_size=8, coefficients={"layers": layers, "steps": steps, "learning_rate": 0.05,
                                                              "init": init})
    features = []
    for index, (task, path) in enumerate(experts.items()):
        features.append(collect_features(task, index, random_set(task, seed=index), load_causal_lm(path), None,
                                         fit_layers(layers, vectors.num_layers), 8, progress=False))
    return vectors, fit_coefficients(features, load_causal_lm(base), vectors, [init] * len(experts), settings,
                                     progress=False)


def test_one_expert_of_a_known_task_vector_is_found_from_a_wrong_start(tiny_family) -> None:
    vectors, result = fit({"code": tiny_family.experts["code"]}, tiny_family.base, [2, 3, "final"], init=0.2)
    assert vectors.changed_layers() == [2, 3]
    table = result.table()
    for group in ("2", "3", "other"):  # the expert itself: base + 1 · its task vector
        assert table[group]["code"] == pytest.approx(1.0, abs=0.02)
    assert table["0"]["code"] == table["1"]["code"] == pytest.approx(0.2)  # no task vector there: never moved
    assert result.losses[-1] < 0.02 * result.losses[0]


def test_aligning_the_final_state_alone_fits_only_what_lies_past_the_layers(tiny_family) -> None:
    # The final norm runs on the expert's own last-layer output: only the tensors outside the layers (here the
    # norm the tiny experts changed) act there, and the changed layers below never run.
    _, result = fit({"code": tiny_family.experts["code"]}, tiny_family.base, ["final"], init=0.2, steps=80)
    table = result.table()
    assert result.owned == {"code": ["final"]}
    assert table["other"]["code"] == pytest.approx(1.0, abs=0.02)
    assert table["2"]["code"] == table["3"]["code"] == pytest.approx(0.2)


def test_experts_of_disjoint_layers_each_get_their_own_layer(tiny_family, tmp_path: Path) -> None:
    experts = {"code": expert_with(tiny_family.base, tiny_family.experts["code"], ("model.layers.2.",),
                                   tmp_path / "code"),
               "math": expert_with(tiny_family.base, tiny_family.experts["math"], ("model.layers.3.",),
                                   tmp_path / "math")}
    vectors, result = fit(experts, tiny_family.base, [2, 3], init=0.5)
    assert result.owned == {"code": [2], "math": [3]}
    table = result.table()
    assert table["2"]["code"] == pytest.approx(1.0, abs=0.02)
    assert table["3"]["math"] == pytest.approx(1.0, abs=0.02)


def test_the_mergekit_yaml_alone_reproduces_the_learned_merge(tiny_family, tmp_path: Path) -> None:
    experts = {t: tiny_family.experts[t] for t in ("code", "math")}
    vectors, result = fit(experts, tiny_family.base, [2, 3, "final"], init=0.3, steps=20)
    config = layerwise_mergekit_config(tiny_family.base, experts, result, "float32")
    assert config["merge_method"] == "task_arithmetic"
    written = tmp_path / "learned.yml"
    written.write_text(yaml.safe_dump(config))
    # mergekit's own reading of the YAML, as `mergekit-yaml learned.yml OUT` would.
    merged = weights(run_merge(yaml.safe_load(written.read_text()), tmp_path / "out"))
    merge = LayerwiseMerge(vectors, [0.0, 0.0])
    merge.coefficients.data.copy_(result.coefficients)
    ours, base = merge(), weights(tiny_family.base)
    assert set(ours) < set(merged)
    difference = max(float((merged[name] - (ours[name].detach() if name in ours else base[name])).abs().max())
                     for name in merged)
    assert difference <= 1e-6
    assert any(float((merged[name] - base[name]).abs().max()) > 1e-3 for name in ours)  # the merge did something


def test_deep_corrections_equal_the_formula_applied_by_hand(tiny_family) -> None:
    model = load_causal_lm(tiny_family.base)
    settings = CalibrationSection(layers=[1, 3, "final"], rank=4, max_positions=8)
    corrections = build_corrections(["code", "math"], model.config.hidden_size, settings)
    with torch.no_grad():
        for p in corrections.parameters():
            p.copy_(0.1 * torch.randn_like(p))
    ids = random_set("code", rows=3, length=12).input_ids
    mask = torch.ones_like(ids)
    mask[0, 9:] = 0  # a padded row: its positions count from its own start

    def by_hand(layer, h):  # ĥ_t = h_t − U_k·ReLU(D_k·h_t) + P_k[min(t, T−1)], task k = 1
        c = corrections[layer]
        t = (mask.cumsum(1) - 1).clamp(0, 7)
        return h - torch.relu(h @ c.down[1].T) @ c.up[1].T + c.position[1][t]

    hooks = [m.register_forward_hook(lambda mod, a, out, layer=layer: by_hand(layer, out))
             for layer, m in ((1, model.model.layers[1]), (3, model.model.layers[3]), ("final", model.model.norm))]
    with torch.no_grad(), capture_hidden(model, ["final"]) as expected:
        want = model(input_ids=ids, attention_mask=mask).logits
    expected = {k: v.clone() for k, v in expected.items()}
    for hook in hooks:
        hook.remove()
    with torch.no_grad(), attach_corrections(model, corrections) as handle, capture_hidden(model, ["final"]) as got:
        handle.set_tasks([1, 1, 1])
        logits = model(input_ids=ids, attention_mask=mask).logits
        real = mask.bool()
        assert torch.allclose(got["final"][real], expected["final"][real], atol=1e-5)
        assert torch.allclose(logits[real], want[real], atol=1e-4)
        # Running from layer 1 on, given layer 0's output, is the same forward.
        with capture_hidden(model, [0]) as below:
            model(input_ids=ids, attention_mask=mask)
        given = below[0].clone()
        with run_from(model, 1, given):
            again = model(input_ids=ids, attention_mask=mask).logits
        assert torch.allclose(again[real], logits[real], atol=1e-5)


def test_deep_training_from_the_lowest_corrected_layer_equals_the_full_forward(tiny_family, monkeypatch) -> None:
    import darts_dist.calibrate.loop as loop

    merged = load_causal_lm(tiny_family.base)
    expert = load_causal_lm(tiny_family.experts["code"])
    settings = CalibrationSection(layers=[2, 3, "final"], loss_at="last", rank=4, max_positions=32, steps=6,
                                  batch_size=4, learning_rate=0.001)
    assert settings.loss_layers() == ["final"]
    features = [collect_features("code", 0, random_set("code", rows=12), expert, None, settings.loss_layers(), 4,
                                 progress=False)]
    assert list(features[0].targets) == ["final"]
    skipped = train_corrections(features, settings, merged, progress=False)
    monkeypatch.setattr(loop, "first_decoder_layer", lambda layers: 0)  # every step runs every layer
    full = train_corrections(features, settings, merged, progress=False)
    assert skipped.losses == pytest.approx(full.losses, rel=1e-5)
    assert skipped.losses[-1] < skipped.losses[0]


def test_layer_sets_become_layers_of_the_model(tiny_family) -> None:
    assert concrete_layers(["all"], 4, lambda: []) == [0, 1, 2, 3]
    assert concrete_layers(["every:2", "final"], 4, lambda: []) == [1, 3, "final"]
    assert concrete_layers(["final", 3], 4, lambda: []) == ["final", 3]  # no set: as written
    with pytest.raises(DartsError, match="out of range"):
        concrete_layers([7], 4, lambda: [])
    config = parse_config({
        "name": "sets", "sources": {"base": str(tiny_family.base),
                                    "experts": [{"task": "code", "path": str(tiny_family.experts["code"])}]},
        "calibration": {"method": "merge_coefficients+darts", "layers": ["changed", "final"]},
    })
    sources = SimpleNamespace(base=tiny_family.base, experts={"code": tiny_family.experts["code"]})
    concrete = with_concrete_layers(config, sources).calibration
    assert concrete.layers == [2, 3, "final"] and concrete.coefficients.layers == [2, 3, "final"]
    with pytest.raises(ValueError, match="every"):
        CalibrationSection(layers=["every:0"])


def test_claims_need_a_difference_beyond_two_standard_deviations() -> None:
    def variant(*gaps):
        return over_seeds([{"overall": {"nll_gap_closed": g}, "tasks": {}} for g in gaps])

    variants = {"merged": variant(0.0), "a": variant(0.90, 0.91, 0.92), "b": variant(0.80, 0.95, 0.70),
                "c": variant(0.60, 0.61, 0.62)}
    assert variants["a"]["overall"]["nll_gap_closed"] == pytest.approx(0.91)
    assert variants["a"]["overall_sd"]["nll_gap_closed"] == pytest.approx(0.01)
    found = claims(variants, {"nll_gap_closed": 1})
    assert any(c.startswith("a beats c") for c in found) and any(c.startswith("a beats merged") for c in found)
    assert not any(c.startswith(("a beats b", "b beats a", "b beats c")) for c in found)  # b's spread is too wide
    assert claims({"a": variant(0.9), "c": variant(0.1)}, {"nll_gap_closed": 1}) == []  # one seed: no spread


@pytest.mark.slow
def test_learned_merge_with_deep_corrections_registers_loads_through_pyfunc(tiny_family, tmp_path: Path,
                                                                           monkeypatch) -> None:
    config = family_config(
        tiny_family, tmp_path, "learned", lambda task, i: f"def f_{task}_{i}(x):\n    return x * {i} + {i + 1}\n",
        12, output_dir=str(tmp_path / "runs"),
        calibration={"method": "merge_coefficients+darts", "layers": [2, "final"], "rank": 4, "max_positions": 16,
                     "num_samples": 8, "max_length": 16, "batch_size": 4, "steps": 6, "learning_rate": 0.001,
                     "coefficients": {"steps": 10, "learning_rate": 0.05}},
        evaluation={"score_limit": 0}, cluster={"executor": "in-process"}, tracking={"registered_model": "learned-tiny"})
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    assert main(["calibrate", str(path)]) == 0
    run_dir = tmp_path / "runs" / "learned"
    report = json.loads((run_dir / "calibration.json").read_text())
    learned = run_dir / "learned-merge"
    assert report["coefficients"]["learned_merge"] == str(learned)
    assert (learned / "mergekit_config.yml").is_file() and (learned / "coefficients.json").is_file()
    table = report["coefficients"]["table"]
    assert table["2"] != {"code": 0.5, "math": 0.5}  # fitted away from the start
    # The learned merge is the table's: base + Σ coefficient × task vector, in layer 2 and outside the layers.
    base, merged = weights(tiny_family.base), weights(learned)
    experts = {t: weights(tiny_family.experts[t]) for t in ("code", "math")}
    groups = {name: "2" if name.startswith("model.layers.2.") else "other" for name in base
              if name.startswith("model.layers.2.") or name == "model.norm.weight"}
    for name, group in groups.items():
        expected = base[name] + sum(table[group][t] * (experts[t][name] - base[name]) for t in experts)
        torch.testing.assert_close(merged[name], expected, rtol=1e-5, atol=1e-6,
                                   msg=lambda message, name=name: f"{name}: {message}")
    # The evaluation judges the learned merge with its corrections against the run's task-arithmetic merge: their
    # held-out NLL by hand, each row on its own.
    evaluation = report["variants"]["darts"]["tasks"]["code"]
    rows = tmp_path / "data" / "code.jsonl"
    heldout = tokenized(TaskFiles(rows, rows), "code", "heldout", CalibrationSection(max_length=16),
                        load_tokenizer(tiny_family.base))

    def heldout_nll(model) -> float:
        total, count = 0.0, 0
        for row in range(len(heldout)):
            ids = heldout.input_ids[row:row + 1, :int(heldout.attention_mask[row].sum())]
            with torch.no_grad():
                logits = model(input_ids=ids).logits
            total += float(torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:], reduction="sum"))
            count += ids.shape[1] - 1
        return total / count

    with CorrectedLM.load(run_dir / "merged") as plain:
        assert evaluation["nll_merged"] == pytest.approx(heldout_nll(plain.model), rel=1e-5)
    with CorrectedLM.load(learned, run_dir / "corrections.safetensors") as corrected:
        with corrected.weighted(one_hot_tasks(torch.tensor([corrected.task_index("code")]), len(corrected.tasks))):
            assert evaluation["nll_corrected"] == pytest.approx(heldout_nll(corrected.model), rel=1e-5)
    assert report["tracking"]["model_uri"] == "models:/learned-tiny/1"
    model = mlflow.pyfunc.load_model("models:/learned-tiny@champion")
    out = model.predict(pd.DataFrame({"prompt": ["def add(a, b):"], "task": ["code"]}),
                        params={"max_new_tokens": 6})
    own = CorrectedLM.load(learned, run_dir / "corrections.safetensors").generate(["def add(a, b):"], ["code"],
                                                                                  max_new_tokens=6)[0]
    assert out.to_dict(orient="records")[0]["text"] == own.text
    assert read_run_folder(run_dir).merged_dir == learned  # what `darts-dist serve RUN_DIR` serves
