"""The whole job at a real 7B model's width on this machine: `thin:llama2-7b` (hidden 4096, vocab 32000, two decoder
layers), three experts in Ray actors, the Ray Data stream in bf16, a Train worker, MLflow tracking and registration,
and an answer served from the registered model. The grid of widths and lengths is benchmarks/scaling.py's."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest
import torch
import yaml
from safetensors import safe_open
from serving import free_port, serve_process

from darts_dist.cli import main
from darts_dist.generation import CorrectedLM
from darts_dist.sources.demo.tasks import long_texts
from darts_dist.sources.references import demo_data, resolve_model

pytestmark = pytest.mark.slow  # four 0.7 B-parameter models, made once per cache (~40 s), and a serving process

TASKS = ("code", "math", "instruct")
HIDDEN = 4096
LENGTH = 512


def test_the_whole_job_at_width_4096_streams_bf16_trains_registers_and_serves(ray_cluster, tmp_path: Path,
                                                                               monkeypatch) -> None:
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    samples = 2
    config = {
        "name": "wide",
        "sources": {
            "base": "thin:llama2-7b",
            "experts": [{"task": task, "path": f"thin:llama2-7b/{task}",
                         "data": {"calibration": str(long_texts(demo_data()[task]["calibration"], samples,
                                                                     tmp_path / f"{task}.jsonl"))}} for task in TASKS],
        },
        "merge": {"method": "task_arithmetic", "parameters": {"weight": 0.5}},
        "calibration": {"rank": 4, "max_positions": LENGTH, "num_samples": samples, "max_length": LENGTH,
                        "batch_size": 2, "steps": 4, "learning_rate": 0.01},
        "cluster": {"num_workers": 1, "zero_stage": 0},
        "tracking": {"experiment": "wide", "registered_model": "wide"},
    }
    path = tmp_path / "wide.yaml"
    path.write_text(yaml.safe_dump(config))
    assert main(["calibrate", str(path), "--output-dir", str(tmp_path / "runs")]) == 0
    run_dir = tmp_path / "runs" / "wide"
    report = json.loads((run_dir / "calibration.json").read_text())

    stream = report["calibration"]["job"]["stream"]
    tokens = len(TASKS) * samples * LENGTH  # every row is longer than LENGTH: cut there
    assert stream["rows"] == len(TASKS) * samples
    # bf16 on the wire: two bytes per dimension of h^k at the one loss layer, nothing more.
    assert stream["bytes"] == tokens * HIDDEN * 2
    assert json.loads((resolve_model("thin:llama2-7b") / "config.json").read_text())["hidden_size"] == HIDDEN
    with safe_open(run_dir / "corrections.safetensors", "pt") as corrections:  # fp32 corrections
        dtypes = {corrections.get_tensor(name).dtype for name in corrections.keys()}  # noqa: SIM118 - no __iter__
    assert dtypes == {torch.float32}
    assert report["tracking"]["model_uri"] == f"models:/wide/{report['tracking']['version']}"

    port = free_port()
    prompt = "def count_above(nums):"
    # Without a held-out evaluation no alias moves: the version is served by its number.
    with serve_process([report["tracking"]["model_uri"]], tmp_path, port, {"MLFLOW_TRACKING_URI": uri}, timeout_s=600):
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=300)
        served = client.completions.create(model="wide:code", prompt=prompt, max_tokens=4, temperature=0)
    with CorrectedLM.load(run_dir / "merged", run_dir / "corrections.safetensors") as lm:
        own = lm.generate([prompt], ["code"], max_new_tokens=4)[0]
    assert served.choices[0].text == own.text and served.usage.completion_tokens == own.completion_tokens
