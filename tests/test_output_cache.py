"""The output cache: a repeat evaluation reads back what the base, an expert and the merge computed (held-out
passes, greedy answers, the router's features) and gives the same numbers without running them; anything a
result depends on (weights, device, token ids, settings) changing misses it."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from darts_dist.calibrate import router as router_module
from darts_dist.calibrate.router import fit_run_router
from darts_dist.config import load_config, parse_config
from darts_dist.core import CorrectionSpec, DartsCorrections, TaskRouter
from darts_dist.evaluate.evaluator import Evaluator
from darts_dist.sources.data import TaskFiles
from darts_dist.sources.demo.tiny import build_tiny_tokenizer
from darts_dist.sources.models import load_causal_lm, model_identity
from darts_dist.sources.output_cache import OutputCache, digest
from darts_dist.sources.references import demo_data, resolve_sources

from test_router import write_run


def test_entries_are_computed_once_and_an_unreadable_one_again(tmp_path: Path) -> None:
    calls = []

    def compute() -> dict[str, torch.Tensor]:
        calls.append(1)
        return {"x": torch.arange(6.0).view(2, 3), "mask": torch.tensor([True, False])}

    first = OutputCache(tmp_path).tensors("k", compute)
    again = OutputCache(tmp_path).tensors("k", compute)  # another process: read from disk
    assert len(calls) == 1 and torch.equal(again["x"], first["x"]) and torch.equal(again["mask"], first["mask"])
    (tmp_path / "tensors" / "k.safetensors").write_bytes(b"not safetensors")
    cache = OutputCache(tmp_path)
    assert torch.equal(cache.tensors("k", compute)["x"], first["x"]) and len(calls) == 2
    assert cache.counts() == {"hits": 0, "misses": 1}

    asked = []

    def answer(missing: list[int]) -> list[str]:
        asked.append(missing)
        return [f"answer {i}" for i in missing]

    cache = OutputCache(tmp_path)
    assert cache.entries("t", ["a", "b"], answer) == ["answer 0", "answer 1"]
    # A longer list: only the new item is answered, the others read back where they stand now.
    assert cache.entries("t", ["c", "a", "b"], answer) == ["answer 0", "answer 0", "answer 1"]
    assert asked == [[0, 1], [0]]
    assert not list(tmp_path.rglob(".*tmp*"))  # written under temporary names, then renamed


def test_digests_tell_dtype_shape_and_values_apart() -> None:
    x = torch.arange(4)
    keys = {digest(x), digest(x.float()), digest(x.view(2, 2)), digest(x + 1), digest([0, 1, 2, 3])}
    assert len(keys) == 5 and digest(x) == digest(torch.arange(4))


def test_identity_follows_weights_device_and_dtype(tiny_family, tmp_path: Path) -> None:
    cpu = torch.device("cpu")
    copy = Path(shutil.copytree(tiny_family.experts["math"], tmp_path / "math"))
    same = model_identity(copy, torch.float32, cpu)
    assert same == model_identity(tiny_family.experts["math"], torch.float32, cpu)  # content, not path
    assert same != model_identity(copy, torch.bfloat16, cpu)
    assert same != model_identity(tiny_family.experts["code"], torch.float32, cpu)
    weights = load_file(copy / "model.safetensors")
    name = next(iter(weights))
    weights[name] = weights[name] + 1e-3
    save_file(weights, str(copy / "model.safetensors"), metadata={"format": "pt"})
    assert model_identity(copy, torch.float32, cpu) != same


class ForwardCount:
    """How often a model's forward ran."""

    def __init__(self, *models: torch.nn.Module) -> None:
        self.calls = 0
        for model in models:
            model.register_forward_hook(self._count)

    def _count(self, *_: object) -> None:
        self.calls += 1


@pytest.fixture(scope="module")
def family(tiny_family):
    heldout = demo_data()["math"]["heldout"]
    config = parse_config({
        "sources": {"base": str(tiny_family.base), "experts": [
            {"task": t, "path": str(tiny_family.experts[t]), "data": {"calibration": str(heldout),
                                                                      "heldout": str(heldout)}}
            for t in ("code", "math")]},
        "calibration": {"max_length": 64, "batch_size": 4},
        # Retention's own reading back: tests/test_retention.py (in batches of 3 its replies cost most of a minute).
        "evaluation": {"score_limit": 3, "max_new_tokens": 4, "generation_batch_size": 3, "retention": False},
    })
    files = {t: TaskFiles(calibration=heldout, heldout=heldout, scorer="math_exact") for t in ("code", "math")}
    torch.manual_seed(1)
    corrections = DartsCorrections(CorrectionSpec(("code", "math"), 64, rank=4, max_positions=8), ["final"])
    with torch.no_grad():
        for p in corrections.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return config, files, corrections


def _evaluate(tiny_family, family, cache: OutputCache, expert_path: Path | None = None,
              config=None) -> tuple[dict, int, int]:
    """A whole evaluation of the math task (base answers, expert and merged sides, corrections judged) with fresh
    models; returns the results and how often the base and expert, and the merged model, ran outside the corrected
    passes."""
    default, files, corrections = family
    config = config or default
    cpu, fp32 = torch.device("cpu"), torch.float32
    expert_path = expert_path or tiny_family.experts["math"]
    base, expert, merged = (load_causal_lm(p) for p in (tiny_family.base, expert_path, tiny_family.experts["code"]))
    evaluator = Evaluator(config, files, build_tiny_tokenizer(), progress=False, cache=cache)
    expert_runs, merged_runs = ForwardCount(base, expert), ForwardCount(merged)
    base_passes = evaluator.base_side(base, tiny_family.base, model_identity(tiny_family.base, fp32, cpu)).passes["math"]
    side = evaluator.expert_side(1, expert, base_passes=base_passes, identity=model_identity(expert_path, fp32, cpu))
    plain = evaluator.merged_side(merged, 1, identity=model_identity(tiny_family.experts["code"], fp32, cpu))
    counted = (expert_runs.calls, merged_runs.calls)
    return evaluator.evaluate(merged, corrections, [(side, plain)]), *counted


def test_a_repeat_evaluation_reads_back_the_same_numbers_without_running_the_models(
    tiny_family, family, tmp_path: Path
) -> None:
    first, expert_runs, merged_runs = _evaluate(tiny_family, family, OutputCache(tmp_path))
    assert expert_runs > 0 and merged_runs > 0
    cache = OutputCache(tmp_path)
    again, expert_runs, merged_runs = _evaluate(tiny_family, family, cache)
    assert (expert_runs, merged_runs) == (0, 0)
    assert again == first  # every number, score and interval, exactly
    assert cache.counts()["misses"] == 0 and cache.counts()["hits"] >= 4
    assert first["tasks"]["math"]["score_n"] == 3 and "nll_corrected" in first["tasks"]["math"]

    # Without the cache (config) everything runs and gives the same numbers.
    config = family[0]
    off = parse_config(config.model_dump(mode="json") | {"evaluation": {**config.evaluation.model_dump(),
                                                                         "cache": False}})
    uncached, expert_runs, merged_runs = _evaluate(tiny_family, family, cache, config=off)
    assert expert_runs > 0 and merged_runs > 0 and uncached == first


def test_another_expert_misses_the_cache(tiny_family, family, tmp_path: Path) -> None:
    _evaluate(tiny_family, family, OutputCache(tmp_path))
    changed = Path(shutil.copytree(tiny_family.experts["math"], tmp_path / "retrained"))
    weights = load_file(changed / "model.safetensors")
    save_file({k: v * 1.01 for k, v in weights.items()}, str(changed / "model.safetensors"), metadata={"format": "pt"})
    _, expert_runs, merged_runs = _evaluate(tiny_family, family, OutputCache(tmp_path), expert_path=changed)
    assert expert_runs > 0  # the retrained expert runs (its passes and answers), the base and merge do not
    assert merged_runs == 0


def test_the_router_reads_its_features_back(tiny_family, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("DARTS_DIST_CACHE", str(tmp_path / "cache"))  # not the features other tests kept
    config = load_config(write_run(tiny_family, tmp_path))
    data = resolve_sources(config).data
    first = fit_run_router(config, data, tiny_family.base, "final")
    assert first["output_cache"]["misses"] > 0
    weights = TaskRouter.load(Path(first["path"])).weight.clone()

    def no_model(*args, **kwargs):
        raise AssertionError("the merged model was loaded although its features were kept")

    monkeypatch.setattr(router_module, "load_causal_lm", no_model)
    again = fit_run_router(config, data, tiny_family.base, "final")
    assert again["output_cache"] == {"hits": first["output_cache"]["misses"], "misses": 0}
    assert torch.equal(TaskRouter.load(Path(again["path"])).weight, weights)
    assert {k: v for k, v in again.items() if k != "output_cache"} == {
        k: v for k, v in first.items() if k != "output_cache"}
