"""Evaluation as a Ray job: each model's passes in a real Ray actor of its own, the merge's actor judging the
corrections and the router; every number and score equals the in-process evaluation's."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch

from darts_dist.calibrate.router import fit_run_router
from darts_dist.config import parse_config
from darts_dist.core import CorrectionSpec, DartsCorrections
from darts_dist.errors import DartsError
from darts_dist.evaluate.on_ray import uses_ray
from darts_dist.evaluate.stage import evaluate_stage
from darts_dist.plan.check import driver_holds_evaluation
from darts_dist.sources.corrections import save_corrections_for
from darts_dist.sources.output_cache import OutputCache
from darts_dist.sources.references import resolve_sources

pytestmark = pytest.mark.slow  # evaluation actors on Ray

TASKS = ("code", "math")


def _config(tiny_family, tmp_path: Path, executor: str, tasks: tuple[str, ...] = TASKS, **evaluation: object):
    return parse_config({
        "name": "on-ray",
        "output_dir": str(tmp_path / "runs"),
        "sources": {"base": str(tiny_family.base), "experts": [
            {"task": t, "path": str(tiny_family.experts[t]), "data": {"calibration": f"demo:{t}",
                                                                      "heldout": f"demo:{t}"}} for t in tasks]},
        "calibration": {"num_samples": 8, "max_length": 48, "batch_size": 4},
        "evaluation": {"score_limit": 3, "max_new_tokens": 6, "generation_batch_size": 3, "executor": executor,
                       **evaluation},
    })


def assert_close(got: object, want: object, path: str = "") -> None:
    """Equal, floats to 1e-5 (the actors run torch with other thread counts, which reorders sums)."""
    if isinstance(want, dict):
        assert got.keys() == want.keys(), path
        for key in want:
            assert_close(got[key], want[key], f"{path}.{key}")
    elif isinstance(want, list):
        assert len(got) == len(want), path
        for i, (g, w) in enumerate(zip(got, want)):
            assert_close(g, w, f"{path}[{i}]")
    elif isinstance(want, float) and not isinstance(got, bool):
        assert (math.isnan(got) and math.isnan(want)) or got == pytest.approx(want, rel=1e-5, abs=1e-7), path
    else:
        assert got == want, path


@pytest.fixture(scope="module")
def judged(tiny_family, tmp_path_factory):
    """Corrections and a router for a merge stand-in (a model no other actor holds, so no two actors share cache
    entries), and the in-process evaluation of them: what the Ray evaluation must give."""
    folder = tmp_path_factory.mktemp("on-ray")
    local = _config(tiny_family, folder, "in-process")
    sources = resolve_sources(local)
    merged_dir = tiny_family.experts["instruct"]
    torch.manual_seed(0)
    corrections = DartsCorrections(CorrectionSpec(TASKS, 64, rank=4, max_positions=8), ["final"])
    with torch.no_grad():
        for p in corrections.parameters():
            p.add_(0.1 * torch.randn_like(p))
    path = save_corrections_for(folder / "corrections.safetensors", corrections, merged_dir)
    router = Path(fit_run_router(local, sources.data, merged_dir, "final")["path"])
    want = evaluate_stage(local, sources, merged_dir, path, router, OutputCache(folder / "local-cache"),
                          driver_holds_models=lambda: driver_holds_evaluation(local))
    return merged_dir, path, router, want


def test_the_ray_evaluation_equals_the_in_process_one(tiny_family, tmp_path: Path, judged, ray_cluster) -> None:
    merged_dir, path, router, want = judged
    on_ray = _config(tiny_family, tmp_path, "ray")
    assert uses_ray(on_ray)
    cache = OutputCache(tmp_path / "ray-cache")
    got = evaluate_stage(on_ray, resolve_sources(on_ray), merged_dir, path, router, cache,
                         driver_holds_models=lambda: driver_holds_evaluation(on_ray))
    assert_close(got, want)
    scored = want["tasks"]["math"]
    assert scored["score_n"] == 3 and "score_base" in scored and "score_routed" in scored
    assert "nll_corrected" in scored and scored["bias_after"] != scored["bias_before"]
    # Retention too: the base actor made its replies and every actor scored them, the corrected model routed.
    assert set(want["retention"]) == {"base", "experts", "merged", "corrected"}
    assert want["retention"]["corrected"] != want["retention"]["merged"]
    # The actors computed every model's passes (base, two experts, merge) into the cache folder given.
    assert cache.counts()["misses"] >= 4 and cache.counts()["hits"] == 0
    assert any((tmp_path / "ray-cache").rglob("*.safetensors"))


def test_auto_evaluates_on_ray_only_with_a_gpu_per_model(tiny_family, tmp_path: Path, judged, ray_cluster) -> None:
    merged_dir, path, router, want = judged
    config = _config(tiny_family, tmp_path, "auto")
    assert not uses_ray(config)
    gpu = parse_config(config.model_dump(mode="json") | {"cluster": {"use_gpu": True}})
    assert uses_ray(gpu)
    assert not uses_ray(parse_config(gpu.model_dump(mode="json") | {"cluster": {"use_gpu": True,
                                                                                "executor": "in-process"}}))
    # A GPU cluster's config on a cluster without room for its actors (a resource no node has): this machine
    # holds the tiny models, so auto evaluates in-process, same numbers...
    missing = parse_config(gpu.model_dump(mode="json") | {"cluster": {
        "use_gpu": True, "expert_resources": {"no_such_node": 1}, "resource_wait_s": 2}})
    cache = OutputCache(tmp_path / "cache")
    assert driver_holds_evaluation(missing)
    assert_close(evaluate_stage(missing, resolve_sources(missing), merged_dir, path, router, cache,
                                driver_holds_models=lambda: driver_holds_evaluation(missing)), want)
    # ...and where the plan says it cannot hold them, it never evaluates on the driver: it waits, then refuses.
    with pytest.raises(DartsError, match="no room for 4 evaluation actors"):
        evaluate_stage(missing, resolve_sources(missing), merged_dir, path, router, cache,
                       driver_holds_models=lambda: False)


def test_a_model_an_actor_cannot_load_is_reported_as_the_input_error(
    tiny_family, tmp_path: Path, judged, ray_cluster
) -> None:
    _, path, router, _ = judged
    # Two actors (one expert and the broken merge; no base): each actor is a process of its own to start here.
    config = _config(tiny_family, tmp_path, "ray", tasks=TASKS[:1], score_base=False, retention=False)
    broken = Path(shutil.copytree(tiny_family.experts["instruct"], tmp_path / "broken"))
    (broken / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(DartsError, match="cannot load the weights"):
        evaluate_stage(config, resolve_sources(config), broken, path, router, OutputCache(tmp_path / "cache"),
                       driver_holds_models=lambda: driver_holds_evaluation(config))
