"""plan_accuracy: what `darts-dist plan` says each role holds, beside the peak memory the role measures itself
(darts_dist.memory) in a real run of the demo's models: calibration on Ray (3 expert actors, 1 worker), evaluation
on Ray (an actor per model), the router and MLflow on the driver, then a server filled to its KV budget.

One JSON line per role: value = measured bytes, baseline = planned bytes, ratio = measured / planned (the plan's
target: within 20%). On the CPU the measure is the process's resident memory above what it held before
loading its model; on a GPU, torch's peak allocation.

    python benchmarks/plan_accuracy.py [--steps 20] [--samples 32]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml
from common import allocate_live_bytes_only, emit, note

# Everything `calibrate` imports, imported before the driver's measure starts: its peak is then the driver's work
# (the merge, the router's model, MLflow's check of the logged model), not the code's own pages.
import darts_dist.calibrate.ray.job  # noqa: F401,E402  isort: skip
import darts_dist.pipeline  # noqa: F401,E402  isort: skip
import darts_dist.tracking.registry  # noqa: F401,E402  isort: skip
import mergekit.merge  # noqa: F401,E402  isort: skip
import mlflow.pyfunc  # noqa: F401,E402  isort: skip
import sklearn.linear_model  # noqa: F401,E402  isort: skip

from darts_dist.cli import main as cli
from darts_dist.config import load_config, packaged_config, updated
from darts_dist.memory import PeakMemory
from darts_dist.plan import build_plan
from darts_dist.plan.roles import Role

REPO = Path(__file__).absolute().parent.parent


def demo_config(out: Path, args: argparse.Namespace) -> Path:
    """The demo's models and batch shapes, fewer steps and problems (memory does not grow with either), evaluation
    on Ray (so each model's actor measures itself)."""
    config = load_config(packaged_config("demo"))
    config = updated(
        config, name="plan-accuracy", output_dir=out,
        calibration=updated(config.calibration, steps=args.steps, num_samples=args.samples, validation_fraction=0.0),
        evaluation=updated(config.evaluation, score_limit=args.problems, generation_batch_size=args.problems,
                           executor="ray"),
        tracking=updated(config.tracking, uri=f"sqlite:///{out}/mlflow.db"),
        cluster=updated(config.cluster, run_id=f"plan-accuracy-{time.strftime('%Y%m%d-%H%M%S')}"),
    )
    path = out / "config.yaml"
    path.write_text(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False))
    return path


def serve_at_budget(run_dir: Path, settings, port: int) -> int:
    """Serve the run, fill the batch to its KV budget (max_batch_size rows of max_batch_tokens / rows tokens each,
    half prompt, half answer), and return the replica's peak memory from /healthz."""
    env = {**os.environ, "RAY_ADDRESS": ""}
    server = subprocess.Popen([sys.executable, "-m", "darts_dist.cli", "serve", str(run_dir), "--port", str(port)],
                              env=env, stdout=sys.stderr, stderr=sys.stderr)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(f"{base}/healthz", timeout=5) as response:
                    if json.loads(response.read()).get("peak_memory_bytes") is not None:
                        break
            if time.monotonic() > deadline or server.poll() is not None:
                raise RuntimeError("the server did not start")
            time.sleep(2)
        with urllib.request.urlopen(f"{base}/v1/models", timeout=30) as response:
            merged = next(m["id"] for m in json.loads(response.read())["data"] if m["id"].endswith(":merged"))
        rows = settings.max_batch_size
        per_row = settings.max_batch_tokens // rows
        # About per_row / 2 tokens of text: a number and a space are a token each for SmolLM2's tokenizer.
        prompts = [" ".join(str((i * 7 + j) % 10) for j in range(per_row // 4)) for i in range(rows)]

        def complete(prompt: str) -> None:
            body = json.dumps({"model": merged, "prompt": prompt, "max_tokens": per_row // 2,
                               "temperature": 0, "ignore_eos": True}).encode()
            request = urllib.request.Request(f"{base}/v1/completions", body, {"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=900) as response:
                response.read()

        with ThreadPoolExecutor(rows) as pool:
            list(pool.map(complete, prompts))
        with urllib.request.urlopen(f"{base}/healthz", timeout=30) as response:
            return json.loads(response.read())["peak_memory_bytes"]
    finally:
        server.terminate()
        server.wait(timeout=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--samples", type=int, default=32)
    p.add_argument("--problems", type=int, default=8,
                   help="evaluation.score_limit and generation_batch_size: one full batch of answers per task")
    p.add_argument("--port", type=int, default=8471)
    p.add_argument("--default-allocator", action="store_true",
                   help="measure with glibc's dynamic mmap threshold (freed blocks stay resident; see the docs)")
    args = p.parse_args()
    if not args.default_allocator:
        allocate_live_bytes_only()
    out = Path(tempfile.mkdtemp(prefix="plan-accuracy-"))
    path = demo_config(out, args)
    config = load_config(path)
    roles: dict[str, Role] = {role.name: role for role in build_plan(config).roles}
    note(f"plan-accuracy: running the demo's models in {out}")
    driver = PeakMemory()
    report = out / "report.json"
    with contextlib.redirect_stdout(sys.stderr):
        assert cli(["calibrate", str(path), "--report", str(report)]) == 0
    measured = {"driver": driver.stop()}
    result = json.loads(report.read_text())
    memory = result["calibration"]["job"]["memory"]
    measured["calibration worker"] = max(memory["workers"])
    measured |= {f"expert actor ({task})": peak for task, peak in memory["experts"].items()}
    names = {"merged": "merged", "base": "base", **{f"expert {t}": t for t in config.tasks}}
    measured |= {f"evaluation actor ({names[model]})": peak for model, peak in result["evaluation_memory"].items()}
    measured["serving replica"] = serve_at_budget(config.run_dir, config.serve, args.port)
    for name, peak in measured.items():
        role = roles[name]
        details = {"stages": result["driver_memory"]} if name == "driver" else {}
        emit("plan_accuracy", peak, role.bytes, "bytes", role=name, device="cpu",
             planned=role.parts, peak_stage=role.peak_stage, **details)


if __name__ == "__main__":
    main()
