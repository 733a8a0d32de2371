"""gpu_check: the whole job in bf16 on one machine's GPU (or, without one, on its CPU, narrow): calibration,
evaluation, serving and export of a thin family, each role's tokens/s and peak memory against the plan.

On a GPU the family is 4096 wide (Llama-2-7B's width, vocabulary and heads, two decoder layers: `thin:llama2-7b`'s
shape), its math expert with one token its fine-tune added (WizardMath-7B's pad token: the vocabulary policy's
case); the job is `darts-dist calibrate` as a 7B user runs it (mergekit's merge on the GPU, expert actors and a
training worker sharing it through Ray, the router and registration checks in GPU tasks, evaluation in GPU actors),
then a Ray Serve replica answering completions, then `export` loaded by transformers alone. Without a GPU the same
path runs on the CPU in bf16 (`--small`, the slow test tier runs it) on a family as wide (4096) but narrow elsewhere
(a 2,048-row vocabulary, a 1,024-wide MLP, 8 KV heads: 0.11 B parameters a model against 0.7 B), so the width's
every dtype boundary and wire format is known to work before a GPU ever sees it.

Each line: a role's tokens/s with, as baseline, the merged model's bare forward at the calibration's batch (measured
last, in this process), or a role's peak memory (GiB) with the plan's bytes for it as baseline; the driver's peak
resident memory; the dtype and device every role reported; and the whole check's seconds.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import contextlib
import json
import multiprocessing
import resource
import sys
import time
import traceback
import urllib.request
from pathlib import Path

import torch
import yaml
from common import cpu_name, emit, note

from darts_dist.cli import main as darts_dist
from darts_dist.config import RunConfig, load_config
from darts_dist.fsutil import cache_root
from darts_dist.plan import build_plan
from darts_dist.sources.demo.tiny import THIN_SHAPES, FamilyShape, TinyFamily, make_tiny_family
from darts_dist.sources.references import demo_data

TASKS = ("code", "math", "instruct")
GIB = 1 << 30
SMALL = FamilyShape(hidden_size=4096, num_layers=2, intermediate_size=1024, num_heads=32, num_kv_heads=8,
                    vocab_size=2048, max_positions=4096, tie_embeddings=False, dtype="bfloat16")


def family(small: bool, layers: int | None) -> TinyFamily:
    """The thin (or small) family in bf16, cached, with `layers` decoder layers (None: the shape's two); its math
    expert carries one added token."""
    shape = SMALL if small else THIN_SHAPES["llama2-7b"]
    shape = dataclasses.replace(shape, num_layers=layers or shape.num_layers)
    name = f"gpu-check-{'small' if small else 'llama2-7b'}-{shape.num_layers}l"
    return make_tiny_family(cache_root() / "thin-family" / name, tasks=TASKS, shape=shape, added_tokens={"math": 1})


def built_family(small: bool, layers: int | None) -> TinyFamily:
    """`family`, made (on first use) in a process of its own: this process's peak memory is the driver's line."""
    context = multiprocessing.get_context("spawn")
    maker = context.Process(target=family, args=(small, layers))
    maker.start()
    maker.join()
    if maker.exitcode != 0:
        raise SystemExit(f"making the family failed (exit code {maker.exitcode})")
    return family(small, layers)  # cached now


def check_config(models: TinyFamily, out: Path, gpu: bool, args: argparse.Namespace) -> Path:
    """The run's YAML: one GPU shared by a training worker (half of it) and the three experts (the rest), as
    `darts-dist plan` lays out a one-GPU node; evaluation then takes an actor per model on the same GPU."""
    experts = len(TASKS)
    heldout = {}
    for task, files in demo_data().items():  # the first rows of each held-out set
        heldout[task] = out / f"heldout-{task}.jsonl"
        heldout[task].write_text("".join(Path(files["heldout"]).read_text().splitlines(keepends=True)[:args.heldout]))
    config = {
        "name": "gpu-check", "output_dir": str(out / "runs"),
        "sources": {"base": str(models.base), "experts": [
            {"task": t, "path": str(models.experts[t]),
             "data": {"calibration": f"demo:{t}", "heldout": str(heldout[t])}} for t in TASKS]},
        "merge": {"method": "task_arithmetic", "parameters": {"weight": 0.5}, "device": "auto"},
        "calibration": {"dtype": "bfloat16", "num_samples": args.samples, "steps": args.steps, "batch_size": 8,
                        "max_length": args.length, "max_positions": args.length, "rank": 16},
        "cluster": {"use_gpu": gpu, "num_workers": 1, "zero_stage": 0,
                    **({"worker_resources": {"GPU": 0.5}, "expert_resources": {"GPU": 0.5 / experts}} if gpu else {}),
                    "run_id": f"gpu-check-{time.strftime('%Y%m%d-%H%M%S')}"},
        # Retention on a GPU; on the CPU stand-in the base's 40 replies at width 4096 in bf16 cost a minute, and
        # bf16 retention is tests/test_retention.py's and the fake-GPU run's (tests/test_fake_gpus.py).
        "evaluation": {"score_limit": args.problems, "max_new_tokens": 32, "score_base": False, "retention": gpu},
        "tracking": {"uri": f"sqlite:///{out}/mlflow.db"},
        "serve": {"use_gpu": gpu, "max_batch_size": 16},
    }
    path = out / "gpu-check.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def real_tokens(config: RunConfig, split: str) -> int:
    """The real tokens of every task's calibration or held-out set, as the run tokenised them."""
    from darts_dist.sources.data import tokenized
    from darts_dist.sources.models import load_tokenizer
    from darts_dist.sources.references import resolve_sources

    sources = resolve_sources(config)
    tokenizer = load_tokenizer(sources.base)
    return sum(int(tokenized(sources.data[task], task, split, config.calibration, tokenizer).attention_mask.sum())
               for task in config.tasks)


def role_lines(config: RunConfig, report: dict, floor: float, driver_rss: int) -> None:
    """Tokens/s of calibration (its stage: startup, stream and training) and evaluation (its stage: every model's
    passes and answers, and the judging); each measured role's peak memory against the plan's bytes; the driver's
    peak resident memory against the plan's driver."""
    plan = build_plan(config)
    planned = {role.name: role.bytes for role in plan.roles}
    job, tokens = report["calibration"]["job"], real_tokens(config, "calibration")
    emit("gpu_check.calibration", tokens / report["seconds"]["calibration"], floor,
         "tokens/s", stage_seconds={k: round(v, 2) for k, v in job["seconds"].items()},
         compute=report["compute"]["calibration worker"], hidden_size=plan.merged.hidden_size,
         wire_bytes_per_token=job["stream"]["bytes"] / tokens)
    memory = job["memory"]
    for name, measured in [("calibration worker", max(memory["workers"])),
                           *((f"expert actor ({task})", peak) for task, peak in memory["experts"].items()),
                           *((f"evaluation actor ({model.removeprefix('expert ')})", peak)
                             for model, peak in report.get("evaluation_memory", {}).items())]:
        emit(f"gpu_check.memory.{name}", measured / GIB, planned[name] / GIB if name in planned else 0.0, "GiB",
             device=memory["device"], **({} if name in planned else {"note": "a role the plan has not"}))
    emit("gpu_check.evaluation", real_tokens(config, "heldout") / report["seconds"]["evaluation"], floor, "tokens/s",
         compute=sorted(set(how for role, how in report["compute"].items() if role.startswith("evaluation"))))
    emit("gpu_check.driver_peak_rss", driver_rss / GIB, plan.driver.resident_bytes / GIB, "GiB",
         note="this process's peak resident memory through the calibrate command (the family is made in a "
              "process of its own), against the plan's driver")


def serve_line(run_dir: Path, config: RunConfig, floor: float, requests: int) -> None:
    """The run folder served by one Ray Serve replica (a GPU of its own where there is one): `requests` concurrent
    greedy completions of 64 tokens; generated tokens/s and the replica's peak memory against the plan's."""
    from darts_dist.plan.check import check_serving
    from darts_dist.serve.model import resolve_model, serve_settings

    source, run_config = resolve_model(str(run_dir))
    settings = serve_settings(run_config, port=18000)
    role = check_serving(source, run_config, settings)
    # Ray's driver prints its workers' lines on stdout: here they go with the log, stdout keeps the JSON lines.
    with contextlib.redirect_stdout(sys.stderr):
        generated, seconds, health = _served(source, settings, requests)
    emit("gpu_check.serving", generated / seconds, floor, "tokens/s", requests=requests, generated=generated,
         device=health["device"], dtype=health["dtype"])
    emit("gpu_check.memory.serving replica", health["peak_memory_bytes"] / GIB, role.bytes / GIB, "GiB")


def _served(source, settings, requests: int) -> tuple[int, float, dict]:
    import ray
    from ray import serve

    from darts_dist.logs import init_ray
    from darts_dist.serve.runner import start

    init_ray(include_dashboard=False)
    try:
        url = start(source, settings)

        def complete(index: int) -> int:
            body = json.dumps({"model": f"{source.name}:{TASKS[index % 3]}", "prompt": f"Question {index}: 2 + 3?",
                               "max_tokens": 64, "temperature": 0, "ignore_eos": True}).encode()
            request = urllib.request.Request(f"{url}/completions", data=body,
                                             headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=600) as response:
                return json.loads(response.read())["usage"]["completion_tokens"]

        complete(0)  # the first request pays for the replica's warm-up
        started = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(requests) as pool:
            generated = sum(pool.map(complete, range(requests)))
        seconds = time.perf_counter() - started
        with urllib.request.urlopen(url.removesuffix("/v1") + "/healthz", timeout=60) as response:
            health = json.loads(response.read())
    finally:
        serve.shutdown()
        ray.shutdown()
    return generated, seconds, health


def export_line(run_dir: Path, out: Path, floor: float, device: torch.device) -> None:
    """`darts-dist export --dtype bfloat16`, loaded by transformers alone (trust_remote_code) onto the device:
    greedy tokens/s of 8 rows of 64 new tokens."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = out / "exported"
    with contextlib.redirect_stdout(sys.stderr):
        assert darts_dist(["export", str(run_dir), "--out", str(folder), "--dtype", "bfloat16", "--overwrite"]) == 0
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype="auto").to(device)
    tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
    tokenizer.padding_side = "left"
    batch = tokenizer([f"Question {i}: 2 + 3?" for i in range(8)], return_tensors="pt", padding=True).to(device)
    model.generate(**batch, max_new_tokens=4, do_sample=False)  # warm-up
    started = time.perf_counter()
    generated = model.generate(**batch, max_new_tokens=64, min_new_tokens=64, do_sample=False)
    seconds = time.perf_counter() - started
    emit("gpu_check.export", 8 * 64 / seconds, floor, "tokens/s", dtype=str(next(model.parameters()).dtype),
         device=str(next(model.parameters()).device), rows=generated.shape[0])


@torch.no_grad()
def forward_floor(run_dir: Path, config: RunConfig, device: torch.device) -> float:
    """The merged model's bare forward at the calibration's batch and length, tokens/s (the lines' baseline)."""
    from darts_dist.sources.models import load_causal_lm

    model = load_causal_lm(run_dir / "merged", dtype=torch.bfloat16, device=device)
    settings = config.calibration
    ids = torch.randint(0, model.config.vocab_size, (settings.batch_size, settings.max_length), device=device)
    model(input_ids=ids)
    if device.type == "cuda":
        torch.cuda.synchronize()
    started, repeats = time.perf_counter(), 5
    for _ in range(repeats):
        model(input_ids=ids)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return repeats * ids.numel() / (time.perf_counter() - started)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--small", action="store_true", help="4096 wide, narrow elsewhere (the default without a GPU)")
    p.add_argument("--samples", type=int, default=None, help="calibration samples per task (64 on a GPU, 16 small)")
    p.add_argument("--steps", type=int, default=None, help="calibration steps (100 on a GPU, 20 small)")
    p.add_argument("--length", type=int, default=None, help="calibration.max_length (512 on a GPU, 64 small)")
    p.add_argument("--heldout", type=int, default=None, help="held-out rows per task (200 on a GPU, 12 small)")
    p.add_argument("--problems", type=int, default=None, help="task-score problems per task (8 on a GPU, 2 small)")
    p.add_argument("--requests", type=int, default=None, help="concurrent served completions (16 on a GPU, 4 small)")
    p.add_argument("--layers", type=int, default=None, help="decoder layers of the family (default 2: the shape's)")
    args = p.parse_args()
    gpu = torch.cuda.is_available()
    small = args.small or not gpu
    defaults = {"samples": 16, "steps": 20, "length": 64, "heldout": 12, "problems": 2, "requests": 4} if small else \
        {"samples": 64, "steps": 100, "length": 512, "heldout": 200, "problems": 8, "requests": 16}
    for name, value in defaults.items():
        setattr(args, name, getattr(args, name) if getattr(args, name) is not None else value)
    device = torch.device("cuda" if gpu else "cpu")
    started = time.perf_counter()
    note(f"gpu_check on {torch.cuda.get_device_name(0) if gpu else cpu_name()}, 4096 wide{', narrow' if small else ''}")
    models = built_family(small, args.layers)
    out = cache_root() / "benchmarks" / "gpu-check" / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True)
    path = check_config(models, out, gpu, args)
    report_path = out / "report.json"
    with contextlib.redirect_stdout(sys.stderr):  # stdout carries the JSON lines alone; the tables go with the log
        code = darts_dist(["calibrate", str(path), "--report", str(report_path)])
    if code != 0:
        emit("gpu_check.calibrate", 0.0, 1.0, "exit code", exit_code=code)
        raise SystemExit(code)
    driver_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    report = json.loads(report_path.read_text())
    config = load_config(path)
    run_dir = config.run_dir
    floor = forward_floor(run_dir, config, device)
    failed = [name for name, stage in (
        ("roles", lambda: role_lines(config, report, floor, driver_rss)),
        ("serving", lambda: serve_line(run_dir, config, floor, args.requests)),
        ("export", lambda: export_line(run_dir, out, floor, device))) if not _ran(name, stage)]
    emit("gpu_check.seconds", time.perf_counter() - started, 480.0, "s", compute=report["compute"],
         device=torch.cuda.get_device_name(0) if gpu else "cpu",
         failed=failed, note="the whole check against its 8-minute aim on a GPU")
    if failed:
        raise SystemExit(1)


def _ran(name: str, stage) -> bool:
    """Run one stage of the check; a failure is a JSON line of its own (the other stages still run: a GPU
    machine's time is scarce, and one run should say as much as it can)."""
    try:
        stage()
    except Exception as error:  # noqa: BLE001 (reported, then the check fails at its end)
        note(traceback.format_exc())
        emit(f"gpu_check.{name}", 0.0, 1.0, "failed", error=f"{type(error).__name__}: {error}"[:2000])
        return False
    return True


if __name__ == "__main__":
    main()
