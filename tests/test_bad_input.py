"""The bad-input corpus: every case stops with `error:` + `fix:` lines and exit code 2, before any
expensive work, and leaves no partial artifact (no run folder, no temporary sibling).

Each case takes a valid tiny config (two tasks, local data files) and breaks one thing in it: a
config value, a model folder, a data file, or a corrections file. The server's bad requests are
in tests/test_serve.py.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file, save_file
from tiny_configs import family_config

from darts_dist.cli import main

TASKS = ("code", "math")


@pytest.fixture
def case(tiny_family, tmp_path: Path):
    """A valid config and the folders it names, which a case then breaks."""
    models = tmp_path / "models"
    shutil.copytree(tiny_family.base, models / "base")
    for task in TASKS:
        shutil.copytree(tiny_family.experts[task], models / task)
    config = family_config(tiny_family, tmp_path, "bad", lambda task, i: f"def f_{task}_{i}(x):\n    return x + {i}\n",
                           12, tasks=TASKS, output_dir=str(tmp_path / "out"),
                           calibration={"rank": 4, "max_positions": 16, "num_samples": 8, "max_length": 16, "steps": 2},
                           cluster={"executor": "in-process"})
    # Copies of the models, which a case may break.
    config["sources"]["base"] = str(models / "base")
    for expert in config["sources"]["experts"]:
        expert["path"] = str(models / expert["task"])
    return {"config": config, "root": tmp_path, "models": models, "data": tmp_path / "data"}


def config_path(case: dict) -> Path:
    """The case's config file (a case may have written a broken one itself)."""
    path = case["root"] / "run.yaml"
    if not path.exists():
        path.write_text(yaml.safe_dump(case["config"]))
    return path


def edit_config(change: Callable[[dict], None]) -> Callable[[dict], None]:
    def apply(c: dict) -> None:
        change(c["config"])
    return apply


def set_key(dotted: str, value: object) -> Callable[[dict], None]:
    def change(config: dict) -> None:
        *parents, last = dotted.split(".")
        node = config
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        node[last] = value
    return edit_config(change)


def drop_key(dotted: str) -> Callable[[dict], None]:
    def change(config: dict) -> None:
        *parents, last = dotted.split(".")
        node = config
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        del node[last]
    return edit_config(change)


def edit_model_config(task: str, **values: object) -> Callable[[dict], None]:
    def apply(c: dict) -> None:
        path = c["models"] / task / "config.json"
        config = json.loads(path.read_text())
        config.update(values)
        path.write_text(json.dumps(config))
    return apply


def corrupt_weights(c: dict) -> None:
    (c["models"] / "math" / "model.safetensors").write_bytes(b"\x00" * 64 + b"not a safetensors file")


def nan_weights(c: dict) -> None:
    path = c["models"] / "math" / "model.safetensors"
    weights = load_file(path)
    name = next(n for n in weights if n.endswith("mlp.down_proj.weight"))
    weights[name][0, 0] = float("nan")
    save_file(weights, path, metadata={"format": "pt"})


def no_config_json(c: dict) -> None:
    (c["models"] / "code" / "config.json").unlink()


def write_data(task: str, content: bytes) -> Callable[[dict], None]:
    def apply(c: dict) -> None:
        (c["data"] / f"{task}.jsonl").write_bytes(content)
    return apply


def mergekit_yaml_rejected(c: dict) -> None:
    (c["root"] / "mk.yaml").write_text(yaml.safe_dump({"merge_method": "task_arithmetic", "models": "not a list"}))
    c["config"]["merge"] = {"mergekit_yaml": str(c["root"] / "mk.yaml")}


def bad_yaml_syntax(c: dict) -> None:
    (c["root"] / "run.yaml").write_text("name: bad\nsources: [unclosed\n")


CASES: dict[str, tuple[Callable[[dict], None], tuple[str, ...]]] = {
    # configs
    "missing sources": (drop_key("sources"), ("sources",)),
    "missing expert task": (drop_key("sources.experts.0.task"), ("task",)),
    "wrong type": (set_key("calibration.rank", "sixteen"), ("calibration.rank",)),
    "negative size": (set_key("calibration.num_samples", -4), ("calibration.num_samples",)),
    "zero steps": (set_key("calibration.steps", 0), ("calibration.steps",)),
    "misspelt key": (set_key("calibration.rnak", 4), ("rnak", "unknown key")),
    "unknown merge method": (set_key("merge.method", "averaging_magic"), ("averaging_magic",)),
    "unknown executor": (set_key("cluster.executor", "slurm"), ("cluster.executor",)),
    "zero stage out of range": (set_key("cluster.zero_stage", 4), ("cluster.zero_stage",)),
    "duplicate task": (set_key("sources.experts.1.task", "code"), ("code",)),
    "reserved task name": (set_key("sources.experts.1.task", "merged"), ("reserved",)),
    "yaml syntax": (bad_yaml_syntax, ("YAML",)),
    "mergekit yaml rejected": (mergekit_yaml_rejected, ("mergekit",)),
    # models
    "missing model folder": (set_key("sources.experts.1.path", "/nonexistent/expert"), ("/nonexistent/expert",)),
    "not a model folder": (no_config_json, ("config.json",)),
    "corrupt safetensors": (corrupt_weights, ("safetensors",)),
    "nan weights": (nan_weights, ("NaN",)),
    "vocabulary below the base's": (edit_model_config("math", vocab_size=99), ("vocab_size is 99, below", "tokenizer_source")),
    "mismatched layers": (edit_model_config("math", num_hidden_layers=7), ("layers",)),
    "mismatched architecture": (edit_model_config("math", architectures=["GPT2LMHeadModel"], model_type="gpt2"),
                                ("architecture",)),
    "unknown demo reference": (set_key("sources.experts.0.path", "demo:poetry"), ("demo:poetry",)),
    # data
    "missing data file": (set_key("sources.experts.0.data.calibration", "data/none.jsonl"), ("none.jsonl",)),
    "empty data file": (write_data("math", b""), ("empty",)),
    "non-utf8 data": (write_data("math", b'{"text": "caf\xe9"}\n'), ("UTF-8",)),
    "rows without text": (write_data("math", b'{"question": "1+1"}\n'), ("text",)),
    "task with no data": (drop_key("sources.experts.1.data"), ("math", "calibration data")),
    "longer than the model's context": (set_key("calibration.max_length", 100_000), ("max_length",)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_is_refused_cleanly(name: str, case: dict, capsys) -> None:
    breaks, expected = CASES[name]
    breaks(case)
    code = main(["calibrate", str(config_path(case))])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "error:" in err and "fix:" in err, err
    for text in expected:
        assert text in err, err
    out = case["root"] / "out"
    assert not out.exists() or not any(out.iterdir()), sorted(out.rglob("*"))


@pytest.mark.parametrize("key, method, hint", [("method", "task_arithmetc", "did you mean 'task_arithmetic'?"),
                                               ("others", "no_such_method_xyz", "use one of")])
def test_validate_refuses_a_merge_method_no_one_has(case: dict, capsys, key: str, method: str, hint: str) -> None:
    """`validate` (and `calibrate`, before its session opens) names a merge method neither mergekit nor darts-dist
    has, with the methods there are: not when the merge starts."""
    path = config_path(case)
    config = yaml.safe_load(path.read_text())
    config["merge"] = {"method": method} if key == "method" else {"method": "regmean", "others": {"method": method}}
    path.write_text(yaml.safe_dump(config))
    for command in ("validate", "calibrate"):
        assert main([command, str(path)]) == 2
        err = capsys.readouterr().err
        assert f"{method!r} is not a merge method darts-dist knows" in err and hint in err, err
        assert "'regmean'" in err and "'ties'" in err and "fix:" in err, err
    assert not (case["root"] / "out").exists()


def test_corrections_of_another_model_are_refused(case: dict, tiny_family, capsys) -> None:
    from darts_dist.core import CorrectionSpec, DartsCorrections, save_corrections

    other = DartsCorrections(CorrectionSpec(tasks=TASKS, hidden_size=128, rank=4, max_positions=16), ["final"])
    path = save_corrections(case["root"] / "other.safetensors", other, metadata={"hidden_size": 128})
    code = main(["evaluate", str(config_path(case)), "--corrections", str(path)])
    err = capsys.readouterr().err
    assert code == 2 and "hidden_size" in err and "fix:" in err, err
