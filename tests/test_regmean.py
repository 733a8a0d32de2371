"""RegMean: the closed form against least squares written out, its reduction's ends, the Grams a model's
forwards give, and the merge on the tiny family in-process, on Ray actors, and before DARTS in one run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from darts_dist.cli import main
from darts_dist.config import REGMEAN_RECORD, parse_config, updated
from darts_dist.core.regmean import GramRecorder, merge_linear, reduced
from darts_dist.errors import DartsError
from darts_dist.merge.mergekit import merge_methods, run_merge
from darts_dist.merge.regmean import regmean_merge
from darts_dist.sources.models import load_causal_lm
from darts_dist.sources.references import resolve_sources


def _problem(seed: int = 0, experts: int = 3, n_in: int = 6, n_out: int = 4):
    generator = torch.Generator().manual_seed(seed)
    xs = [torch.randn(20 + 7 * k, n_in, generator=generator, dtype=torch.float64) * (1 + k) for k in range(experts)]
    ws = [torch.randn(n_out, n_in, generator=generator, dtype=torch.float64) for _ in range(experts)]
    return xs, ws, [x.T @ x / len(x) for x in xs]


def test_the_merge_of_one_linear_is_the_least_squares_solution_over_every_experts_inputs() -> None:
    xs, ws, grams = _problem()
    # argmin_W Σ_k ‖X_k Wᵀ − X_k W_kᵀ‖² / n_k, by a least-squares solver over the stacked, scaled rows.
    rows = torch.cat([x / len(x) ** 0.5 for x in xs])
    targets = torch.cat([x @ w.T / len(x) ** 0.5 for x, w in zip(xs, ws)])
    expected = torch.linalg.lstsq(rows, targets).solution.T
    torch.testing.assert_close(merge_linear(grams, ws, alpha=1.0), expected, rtol=1e-10, atol=1e-10)


def test_alpha_zero_weighs_each_input_feature_by_its_mean_square() -> None:
    xs, ws, grams = _problem(seed=1)
    squares = torch.stack([torch.diagonal(g) for g in grams])  # [K, in]
    expected = sum(w * s for w, s in zip(ws, squares)) / squares.sum(dim=0)
    torch.testing.assert_close(merge_linear(grams, ws, alpha=0.0), expected, rtol=1e-10, atol=1e-10)
    # In between, only the off-diagonal entries are scaled.
    half = reduced(grams[0], 0.5)
    torch.testing.assert_close(torch.diagonal(half), torch.diagonal(grams[0]))
    torch.testing.assert_close(half - torch.diag_embed(torch.diagonal(half)),
                               0.5 * (grams[0] - torch.diag_embed(torch.diagonal(grams[0]))))


def test_one_expert_merges_to_itself() -> None:
    xs, ws, grams = _problem(seed=2, experts=1)
    torch.testing.assert_close(merge_linear(grams, ws, alpha=0.7), ws[0], rtol=1e-10, atol=1e-10)


def test_the_recorder_gives_each_linears_input_gram_over_real_tokens_only(tiny_family) -> None:
    model = load_causal_lm(tiny_family.experts["code"])
    ids = torch.tensor([[5, 9, 11, 14, 3], [7, 8, 2, 0, 0]])  # the second row right-padded
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    recorder = GramRecorder()
    with recorder.recording(model):
        recorder.run(model, ids, mask)
    assert recorder.tokens == 8
    # Linears fed one tensor share its Gram: q, k, v; gate and up.
    owner = recorder.owner
    assert owner["model.layers.1.self_attn.k_proj"] == owner["model.layers.1.self_attn.v_proj"] == \
        "model.layers.1.self_attn.q_proj"
    assert owner["model.layers.1.mlp.up_proj"] == "model.layers.1.mlp.gate_proj"
    assert len(set(owner.values())) == 4 * len(model.model.layers) and len(owner) == 7 * len(model.model.layers)
    # Against the inputs captured by hand, each row run alone at its own length (no pad in sight).
    for name in ("model.layers.2.self_attn.k_proj", "model.layers.2.self_attn.o_proj", "model.layers.3.mlp.down_proj"):
        module = dict(model.named_modules())[name]
        inputs = []
        handle = module.register_forward_pre_hook(lambda m, args: inputs.append(args[0][0].detach()))
        with torch.no_grad():
            for row, length in ((0, 5), (1, 3)):
                model(input_ids=ids[row:row + 1, :length])
        handle.remove()
        x = torch.cat(inputs)
        torch.testing.assert_close(recorder.gram(name), x.T @ x / 8, rtol=1e-4, atol=1e-5)


def _config(tiny_family, tmp_path: Path, tasks=("code", "math"), method: str = "regmean", **merge: object):
    return parse_config({
        "name": "regmean", "output_dir": str(tmp_path / "runs"),
        "sources": {"base": str(tiny_family.base), "experts": [
            {"task": t, "path": str(tiny_family.experts[t]), "data": {"calibration": f"demo:{t}", "heldout": f"demo:{t}"}}
            for t in tasks]},
        "merge": {"method": method, **merge},
        "calibration": {"num_samples": 16, "max_length": 48, "batch_size": 8, "rank": 4, "max_positions": 48,
                        "steps": 4},
        "evaluation": {"score_limit": 0},
        "cluster": {"executor": "in-process"},
    })


def _expected(tiny_family, config, sources) -> dict[str, torch.Tensor]:
    """Each linear's RegMean merge from Grams recorded here, expert by expert: what the merge must hold."""
    from darts_dist.sources.data import calibration_sets
    from darts_dist.sources.models import load_tokenizer

    sets = calibration_sets(config, sources.data, load_tokenizer(sources.base))
    grams, weights = {}, {}
    for task in config.tasks:
        model, recorder = load_causal_lm(sources.experts[task]), GramRecorder()
        with recorder.recording(model):
            for batch in sets[task].batches(8):
                recorder.run(model, batch["input_ids"], batch["attention_mask"])
        for name, linear in GramRecorder.linears(model).items():
            grams.setdefault(name, []).append(recorder.gram(name))
            weights.setdefault(name, []).append(linear.weight.detach())
    return {name + ".weight": merge_linear(grams[name], weights[name], config.merge.alpha).float() for name in grams}


def test_a_regmean_merge_holds_each_linears_solution_the_others_by_mergekit_and_its_record(
    tiny_family, tmp_path: Path,
) -> None:
    config = _config(tiny_family, tmp_path, parameters={"alpha": 0.8})
    sources = resolve_sources(config)
    merged, fresh = regmean_merge(config, sources, progress=False)
    assert fresh and merged == config.merged_dir.absolute()
    tensors = load_file(next(merged.glob("*.safetensors")))
    expected = _expected(tiny_family, config, sources)
    assert len(expected) == 7 * 4
    for name, value in expected.items():
        torch.testing.assert_close(tensors[name], value, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    # Every other tensor is mergekit's linear merge (the experts' mean), as merge.others defaults to.
    means = run_merge({"merge_method": "linear", "models": [{"model": str(sources.experts[t]),
                                                             "parameters": {"weight": 1.0}} for t in config.tasks],
                       "dtype": "float32"}, tmp_path / "mean")
    for name, value in load_file(next(means.glob("*.safetensors"))).items():
        if name not in expected:
            torch.testing.assert_close(tensors[name], value, msg=lambda m, n=name: f"{n}: {m}")
    record = yaml.safe_load((merged / REGMEAN_RECORD).read_text())
    assert record["merge_method"] == "regmean" and record["parameters"] == {"alpha": 0.8}
    assert record["others"]["merge_method"] == "linear"
    assert record["grams"]["tasks"]["code"]["rows"] == 16 and record["grams"]["tasks"]["math"]["tokens"] > 16
    # The same merge again is reused; another alpha merges anew.
    assert regmean_merge(config, sources, progress=False) == (merged, False)
    other = updated(config, merge=updated(config.merge, parameters={"alpha": 0.1}))
    assert regmean_merge(other, sources, progress=False) == (merged, True)
    assert yaml.safe_load((merged / REGMEAN_RECORD).read_text())["parameters"] == {"alpha": 0.1}


def _mean_merge(config, sources, folder: Path) -> dict[str, torch.Tensor]:
    """mergekit's linear merge of the experts (merge.others' default): the tensors RegMean does not solve."""
    means = run_merge({"merge_method": "linear", "models": [{"model": str(sources.experts[t]),
                                                             "parameters": {"weight": 1.0}} for t in config.tasks],
                       "dtype": "float32"}, folder)
    return load_file(next(means.glob("*.safetensors")))


def _expected_plus(config, sources, means: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """RegMean++ written out with whole forwards: for each layer, every expert with the merge's embeddings and the
    layers merged so far below it in place of its own, its Grams at that layer, the layer's linears solved; the
    layer then merged into every expert's copy (its other tensors mergekit's)."""
    from darts_dist.sources.data import calibration_sets
    from darts_dist.sources.models import load_tokenizer

    sets = calibration_sets(config, sources.data, load_tokenizer(sources.base))
    originals = {task: load_causal_lm(sources.experts[task]) for task in config.tasks}
    carried = {task: load_causal_lm(sources.experts[task]) for task in config.tasks}
    for model in carried.values():
        model.load_state_dict({"model.embed_tokens.weight": means["model.embed_tokens.weight"]}, strict=False)
    solved: dict[str, torch.Tensor] = {}
    for layer in range(len(originals["code"].model.layers)):
        grams = {}
        for task, model in carried.items():
            recorder = GramRecorder()
            with recorder.recording(model):
                for batch in sets[task].batches(config.calibration.batch_size):
                    recorder.run(model, batch["input_ids"], batch["attention_mask"])
            for name in GramRecorder.linears(model, layer):
                grams.setdefault(name, []).append(recorder.gram(name))
        layer_solved = {name + ".weight": merge_linear(
            grams[name], [dict(originals[task].named_modules())[name].weight.detach() for task in config.tasks],
            config.merge.alpha).float() for name in grams}
        prefix = f"model.layers.{layer}."
        merged_layer = {name: value for name, value in means.items() if name.startswith(prefix)} | layer_solved
        for model in carried.values():
            model.load_state_dict(merged_layer, strict=False)
        solved |= layer_solved
    return solved


def test_a_regmean_plus_merge_solves_each_layer_on_the_states_the_merged_layers_below_give(
    tiny_family, tmp_path: Path,
) -> None:
    config = _config(tiny_family, tmp_path, method="regmean_plus", parameters={"alpha": 0.8})
    sources = resolve_sources(config)
    merged, fresh = regmean_merge(config, sources, progress=False)
    assert fresh
    tensors = load_file(next(merged.glob("*.safetensors")))
    means = _mean_merge(config, sources, tmp_path / "mean")
    expected = _expected_plus(config, sources, means)
    assert len(expected) == 7 * 4
    for name, value in expected.items():
        torch.testing.assert_close(tensors[name], value, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    for name, value in means.items():
        if name not in expected:
            torch.testing.assert_close(tensors[name], value, msg=lambda m, n=name: f"{n}: {m}")
    # Not RegMean's merge: a layer above one the experts changed is fed what the merged layer gives, not each
    # expert's own (the tiny experts change layers 2 and 3 from the base: layer 3's inputs differ).
    plain = _expected(tiny_family, config, sources)
    for name in ("model.layers.3.self_attn.q_proj.weight", "model.layers.3.mlp.down_proj.weight"):
        assert not torch.allclose(plain[name], expected[name], rtol=1e-3, atol=1e-4), name
    torch.testing.assert_close(plain["model.layers.2.mlp.down_proj.weight"],
                               expected["model.layers.2.mlp.down_proj.weight"])
    record = yaml.safe_load((merged / REGMEAN_RECORD).read_text())
    assert record["merge_method"] == "regmean_plus" and "RegMean++" in record["grams"]["statistic"]
    # In bf16 (the GPU's dtype; here on the CPU) the collectors carry bf16 states: the same merge to bf16's precision.
    bf16 = updated(config, output_dir=tmp_path / "bf16", calibration=updated(config.calibration, dtype="bfloat16"))
    low, _ = regmean_merge(bf16, sources, progress=False)
    low_tensors = load_file(next(low.glob("*.safetensors")))
    assert yaml.safe_load((low / REGMEAN_RECORD).read_text())["grams"]["compute_dtype"] == "bfloat16"
    for name, value in expected.items():
        torch.testing.assert_close(low_tensors[name], value, rtol=0.1, atol=0.02, msg=lambda m, n=name: f"{n}: {m}")
    # RegMean's record is another: a RegMean merge into the same folder is not taken for this one.
    regmean = updated(config, merge=updated(config.merge, method="regmean"))
    assert regmean_merge(regmean, sources, progress=False) == (merged, True)


def test_a_regmean_merge_of_one_expert_is_that_expert(tiny_family, tmp_path: Path) -> None:
    config = _config(tiny_family, tmp_path, tasks=("math",), parameters={"alpha": 0.5})
    merged, _ = regmean_merge(config, resolve_sources(config), progress=False)
    expert = load_file(next(tiny_family.experts["math"].glob("*.safetensors")))
    for name, value in load_file(next(merged.glob("*.safetensors"))).items():
        torch.testing.assert_close(value, expert[name], rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


def test_a_failed_regmean_merge_leaves_no_folder(tiny_family, tmp_path: Path, monkeypatch) -> None:
    from darts_dist.merge import regmean

    def failing(*args, **kwargs):
        raise DartsError("the solve failed", "nothing")

    monkeypatch.setattr(regmean, "_merge_linears", failing)
    config = _config(tiny_family, tmp_path)
    with pytest.raises(DartsError, match="the solve failed"):
        regmean_merge(config, resolve_sources(config), progress=False)
    assert not config.merged_dir.exists() and list(config.merged_dir.parent.iterdir()) == []


def test_regmean_settings_are_checked_with_the_config(tiny_family, tmp_path: Path) -> None:
    assert {"regmean", "regmean_plus"} <= set(merge_methods())
    for merge, message in (({"parameters": {"alpha": 1.5}}, "alpha is 1.5"),
                           ({"parameters": {"weight": 0.5}}, r"\['weight'\] are not regmean's"),
                           ({"mergekit_yaml": "x.yml"}, "remove one of them")):
        with pytest.raises(Exception, match=message):
            _config(tiny_family, tmp_path, **merge)
    with pytest.raises(Exception, match="merge.others sets how RegMean"):
        parse_config({"sources": {"base": "b", "experts": [{"task": "t", "path": "p"}]},
                      "merge": {"method": "ties", "others": {"method": "linear"}}})
    # The other tensors' method is checked by mergekit before any expert runs.
    config = _config(tiny_family, tmp_path, others={"method": "ties", "parameters": {"densty": 0.5}})
    with pytest.raises(DartsError, match="densty"):
        regmean_merge(config, resolve_sources(config), progress=False)


@pytest.mark.slow  # the session's Ray cluster
def test_grams_on_ray_actors_give_the_in_process_merge(tiny_family, tmp_path: Path, ray_cluster) -> None:
    """RegMean++ (its collectors carry their states and take each merged layer through Ray's object store; plain
    RegMean's Gram actors run on Ray in test_fake_gpus)."""
    config = _config(tiny_family, tmp_path / "local", method="regmean_plus", parameters={"alpha": 0.9})
    sources = resolve_sources(config)
    local, _ = regmean_merge(config, sources, progress=False)
    on_ray = updated(config, output_dir=tmp_path / "ray", cluster=updated(config.cluster, executor="ray"))
    remote, _ = regmean_merge(on_ray, sources, progress=False)
    ours, theirs = (load_file(next(folder.glob("*.safetensors"))) for folder in (local, remote))
    for name, value in ours.items():
        torch.testing.assert_close(theirs[name], value, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def test_regmean_then_darts_in_one_run(tiny_family, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    config = _config(tiny_family, tmp_path, parameters={"alpha": 0.9})
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    assert main(["calibrate", str(path)]) == 0
    report = json.loads((config.run_dir / "calibration.json").read_text())
    merged = Path(report["merged"])
    assert report["model"] == str(merged) and (merged / REGMEAN_RECORD).is_file()
    assert report["calibration"]["final_loss"] < report["calibration"]["first_loss"]
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    merge_run = client.get_run(report["tracking"]["stage_runs"]["merge"])
    assert merge_run.data.params["regmean.parameters.alpha"] == "0.9"
    assert merge_run.data.params["regmean.merge_method"] == "regmean"
