"""benchmarks/gpu_check.py, the GPU check, run here as it runs where there is no GPU: the whole job (a Ray calibration
with its router, evaluation and registration, a Ray Serve replica, an export loaded by transformers alone) in bf16
at a 7B model's width, 4096, on a family narrow elsewhere; so the width's path is known to work before a GPU ever
sees it. (It replaced tests/test_width.py's 0.7 B-parameter run of the same path: 5.4 GB written, 208 s.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).absolute().parent.parent
ROLES = ("calibration", "evaluation", "serving", "export")


@pytest.mark.slow
def test_the_gpu_check_runs_every_role_in_bf16_at_width_4096_and_prints_only_json_lines() -> None:
    # Every role and stage at their smallest, one decoder layer: the path is the question here, not its rates.
    args = ["--small", "--layers", "1", "--samples", "8", "--steps", "6", "--heldout", "6", "--problems", "1", "--requests", "2"]
    result = subprocess.run([sys.executable, "gpu_check.py", *args], cwd=REPO / "benchmarks", capture_output=True,
                            text=True, timeout=900, env={**os.environ, "RAY_AUTH_MODE": "disabled"})
    assert result.returncode == 0, result.stderr[-4000:]
    lines = {line["name"]: line for line in map(json.loads, result.stdout.splitlines())}
    for role in ROLES:
        assert lines[f"gpu_check.{role}"]["value"] > 0 and lines[f"gpu_check.{role}"]["unit"] == "tokens/s"
    assert {"gpu_check.memory.calibration worker", "gpu_check.memory.serving replica",
            "gpu_check.driver_peak_rss"} <= set(lines)
    assert all(line["baseline"] > 0 for name, line in lines.items() if name.startswith("gpu_check.memory."))
    assert set(lines["gpu_check.seconds"]["compute"].values()) == {"cpu bfloat16"}
    assert lines["gpu_check.serving"]["dtype"] == "bfloat16" and lines["gpu_check.export"]["dtype"] == "torch.bfloat16"
    # bf16 on the wire at width 4096: two bytes per dimension of h^k at the one loss layer, for each real token.
    calibration = lines["gpu_check.calibration"]
    assert calibration["hidden_size"] == 4096 and calibration["wire_bytes_per_token"] == 2 * 4096
