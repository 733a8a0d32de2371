"""The YAML config: validation errors name the key path and the reason; paths resolve."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from darts_dist.config import is_mergekit_yaml, load_config, parse_config
from darts_dist.errors import DartsError

MINIMAL = {
    "sources": {
        "base": "models/base",
        "experts": [
            {"task": "code", "path": "models/code", "data": {"calibration": "data/code.jsonl"}},
            {"task": "math", "path": "/abs/math", "data": {"calibration": "demo:math", "heldout": "demo:math"}},
        ]
    }
}


def write(tmp_path: Path, data: object) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_defaults_and_relative_paths_resolve_against_the_config(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path.parent)
    config = load_config(write(tmp_path, MINIMAL))
    assert config.tasks == ("code", "math")
    assert config.sources.base == str(tmp_path / "models/base")
    assert config.sources.experts[0].path == str(tmp_path / "models/code")
    assert config.sources.experts[0].data.calibration == str(tmp_path / "data/code.jsonl")
    assert config.sources.experts[1].path == "/abs/math"
    assert config.sources.experts[1].data.calibration == "demo:math"  # references stay names
    assert config.output_dir == tmp_path.parent / "runs"  # outputs go where the user runs from
    assert config.calibration.layers == ["final"] and config.calibration.beta == 1.0


@pytest.mark.parametrize(
    ("patch", "where", "reason"),
    [
        ({"calibration": {"rnak": 4}}, "calibration.rnak", "unknown key"),
        ({"calibration": {"rank": -1}}, "calibration.rank", "greater than 0"),
        ({"calibration": {"beta": 1.5}}, "calibration.beta", "less than or equal to 1"),
        ({"calibration": {"layers": ["final", "final"]}}, "calibration.layers", "distinct"),
        ({"calibration": {"steps": "many"}}, "calibration.steps", "integer"),
        ({"cluster": {"zero_stage": 4}}, "cluster.zero_stage", "0, 1, 2 or 3"),
        ({"serve": {"port": 70000}}, "serve.port", "less than or equal to 65535"),
        ({"serve": {"max_request_bytes": 0}}, "serve.max_request_bytes", "greater than 0"),
        ({"serve": {"request_timeout_s": -1}}, "serve.request_timeout_s", "greater than 0"),
        ({"calibration": {"tasks": {"chat": {"beta": 0}}}}, "(top level)", "no expert has"),
        ({"cluster": {"use_gpu": True}, "calibration": {"device": "cpu"}}, "(top level)", "calibration.device: cpu"),
        ({"cluster": {"executor": "ray"}, "calibration": {"device": "cuda"}}, "(top level)", "set cluster.use_gpu"),
        ({"cluster": {"use_gpu": True, "num_workers": 2, "worker_resources": {"GPU": 0.5}}}, "(top level)",
         "two could share"),
        ({"bogus": 1}, "bogus", "unknown key"),
    ],
)
def test_bad_values_name_key_path_and_reason(patch: dict, where: str, reason: str) -> None:
    data = {**MINIMAL, **patch}
    with pytest.raises(DartsError) as info:
        parse_config(data, origin="run.yaml")
    message = str(info.value)
    assert f"{where}:" in message and reason in message and "run.yaml" in message


def test_missing_sections_and_duplicate_tasks_are_refused() -> None:
    with pytest.raises(DartsError, match="sources: Field required"):
        parse_config({"merge": {}})
    experts = [{"task": "code", "path": "a"}, {"task": "code", "path": "b"}]
    with pytest.raises(DartsError, match="repeated: \\['code'\\]"):
        parse_config({"sources": {"base": "b", "experts": experts}})


def test_broken_yaml_and_missing_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("sources: [unclosed\n")
    with pytest.raises(DartsError, match="not readable YAML"):
        load_config(bad)
    with pytest.raises(DartsError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")


def test_mergekit_yaml_is_recognised_and_redirected(tmp_path: Path) -> None:
    data = {"merge_method": "task_arithmetic", "base_model": "x", "models": []}
    assert is_mergekit_yaml(data) and not is_mergekit_yaml(MINIMAL)
    with pytest.raises(DartsError, match="mergekit YAML"):
        load_config(write(tmp_path, data))


def test_per_task_overrides() -> None:
    data = {**MINIMAL, "calibration": {"beta": 1.0, "tasks": {"math": {"beta": 0.25, "weight_on": "response"}}}}
    calibration = parse_config(data).calibration
    assert calibration.beta_for("math") == 0.25 and calibration.beta_for("code") == 1.0
    assert calibration.weight_on_for("math") == "response" and calibration.weight_on_for("code") == "all"


def test_every_calibration_method_is_in_its_registry() -> None:
    from typing import get_args

    from darts_dist.config import CALIBRATION_METHODS, CalibrationSection

    assert set(get_args(CalibrationSection.model_fields["method"].annotation)) == set(CALIBRATION_METHODS)
    assert {name for name, method in CALIBRATION_METHODS.items() if method.trains_corrections} == \
        {"darts", "merge_coefficients+darts"}
