"""serve_overhead: what the DARTS correction costs when served, corrected vs. the uncorrected merged model.

One Ray Serve app (the real `darts-dist serve` deployment) with the demo model: the same held-out
prompts of the three demo tasks go to `NAME:<their task>` (corrected) and to `NAME:merged`, greedy,
at concurrency 1 and 16, the two variants alternating within each round so that the machine's
drift hits both alike. Per concurrency: completion tokens/s, the replica's CPU seconds per token
(its process's user + system time: less noisy than wall time on a shared machine), and p50/p99
request latency. Target: corrected ≥ 0.97 × uncorrected throughput. Defaults take a few minutes.

The corrections are the demo's shape (rank, T, tasks) with small random values: serving costs the
same whatever the values, and a calibration would add minutes. `--corrections` serves real ones.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import statistics
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import ray
import torch
from common import demo_setup, emit, note, parser
from ray import serve

from darts_dist.calibrate.loop import build_corrections
from darts_dist.config import ServeSection
from darts_dist.core import save_corrections
from darts_dist.fsutil import cache_root
from darts_dist.serve.runner import start
from darts_dist.serve.model import ModelSource
from darts_dist.sources.corrections import corrections_metadata
from darts_dist.sources.data import load_rows, prompts_of
from darts_dist.sources.models import load_tokenizer, read_model_info
from darts_dist.tracking.registry import ModelFiles

NAME = "demo"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def random_corrections(config, merged_dir: Path, seed: int = 0) -> Path:
    """Corrections of the demo's shape with small nonzero values, so every correction term really computes."""
    torch.manual_seed(seed)
    corrections = build_corrections(config.tasks, read_model_info(merged_dir).hidden_size, config.calibration)
    with torch.no_grad():
        for p in corrections.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    return save_corrections(cache_root() / "benchmarks" / "serve" / f"corrections-{seed}.safetensors", corrections,
                            metadata=corrections_metadata(merged_dir))


def task_prompts(config, sources, merged_dir: Path, per_task: int) -> list[tuple[str, str]]:
    """(task, prompt text) pairs from each task's held-out data, as a client would send them."""
    tokenizer = load_tokenizer(merged_dir)
    pairs = []
    for expert in config.sources.experts:
        rows = load_rows(sources.data[expert.task].heldout, text_field=expert.data.text_field)
        rows = rows.select(range(min(per_task, len(rows))))
        pairs += [(expert.task, p) for p in prompts_of(rows, tokenizer, expert.data.format, expert.data.text_field)]
    return pairs


def complete(url: str, model: str, prompt: str, max_tokens: int) -> tuple[float, int]:
    """One greedy completion of exactly max_tokens: its latency in seconds and the tokens it generated."""
    # ignore_eos: both variants generate exactly max_tokens, so per-request costs weigh alike per token.
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True}).encode()
    request = urllib.request.Request(f"{url}/completions", data=body, headers={"Content-Type": "application/json"})
    start_time = time.perf_counter()
    with urllib.request.urlopen(request, timeout=600) as response:
        reply = json.loads(response.read())
    return time.perf_counter() - start_time, reply["usage"]["completion_tokens"]


def replica_cpu_seconds() -> float:
    """User + system CPU seconds of the Serve replica processes so far (Ray titles them ServeReplica:...)."""
    total = 0.0
    for process in psutil.process_iter(["cmdline"]):
        if any("ServeReplica" in part for part in process.info["cmdline"] or ()):
            with contextlib.suppress(psutil.Error):
                times = process.cpu_times()
                total += times.user + times.system
    return total


def phase(url: str, requests: list[tuple[str, str]], concurrency: int,
          max_tokens: int) -> tuple[float, float, int, list]:
    """Send every (model id, prompt) with `concurrency` in flight: wall seconds, the replica's CPU seconds, tokens,
    latencies."""
    started, cpu = time.perf_counter(), replica_cpu_seconds()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda r: complete(url, r[0], r[1], max_tokens), requests))
    return (time.perf_counter() - started, replica_cpu_seconds() - cpu, sum(t for _, t in results),
            [s for s, _ in results])


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def main() -> None:
    p = parser(__doc__.splitlines()[0], samples=128, steps=400)
    p.add_argument("--requests", type=int, default=8, help="requests per variant and round (at least the concurrency)")
    p.add_argument("--rounds", type=int, default=4, help="rounds; the variants' order alternates between rounds")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    p.add_argument("--corrections", type=Path, default=None, help="a corrections file of this merged model")
    args = p.parse_args()
    config, sources, merged_dir = demo_setup("serve", args)
    corrections = args.corrections or random_corrections(config, merged_dir)
    cpus = os.cpu_count() or 1
    # The replica takes every core, as a serving machine would give it; batches of up to 16 sequences.
    settings = ServeSection(port=free_port(), num_cpus=cpus, max_batch_size=16, max_ongoing_requests=64)
    source = ModelSource(NAME, files=ModelFiles(NAME, merged_dir, corrections, None, config))
    # The replica's request logs would drown the results; its errors still reach the HTTP replies.
    ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False)
    try:
        note("starting Serve with the demo model")
        url = start(source, settings)
        prompts = task_prompts(config, sources, merged_dir, per_task=max(args.requests, max(args.concurrency)))
        variants = {"corrected": lambda task: f"{NAME}:{task}", "merged": lambda task: f"{NAME}:merged"}
        for model_id in (f"{NAME}:{config.tasks[0]}", f"{NAME}:merged"):  # warm-up: first calls pay one-off costs
            complete(url, model_id, prompts[0][1], 4)
        for concurrency in args.concurrency:
            totals = {name: {"seconds": 0.0, "cpu": 0.0, "tokens": 0, "latencies": []} for name in variants}
            # At least as many requests as the concurrency per phase, so that the running batch fills.
            count = max(args.requests, concurrency)
            for round_index in range(args.rounds):
                order = list(variants) if round_index % 2 == 0 else list(variants)[::-1]
                # Each round takes the next prompts, spread over the tasks.
                chosen = [prompts[(round_index * count + i * 7) % len(prompts)] for i in range(count)]
                for name in order:
                    seconds, cpu, tokens, latencies = phase(url, [(variants[name](t), text) for t, text in chosen],
                                                            concurrency, args.max_tokens)
                    totals[name]["seconds"] += seconds
                    totals[name]["cpu"] += cpu
                    totals[name]["tokens"] += tokens
                    totals[name]["latencies"] += latencies
                    note(f"c={concurrency} round {round_index + 1} {name}: {tokens / seconds:.1f} tokens/s")
            speed = {name: t["tokens"] / t["seconds"] for name, t in totals.items()}
            details = {"concurrency": concurrency, "requests": count * args.rounds,
                       "max_tokens": args.max_tokens, "tokens": {n: t["tokens"] for n, t in totals.items()},
                       "model": "tiny" if args.tiny else "SmolLM2-135M-Instruct demo merge"}
            emit(f"serve_tokens_per_s_c{concurrency}", speed["corrected"], speed["merged"], "tokens/s",
                 target_ratio=0.97, **details)
            cpu_per_token = {name: t["cpu"] / t["tokens"] for name, t in totals.items()}
            emit(f"serve_cpu_s_per_token_c{concurrency}", cpu_per_token["corrected"], cpu_per_token["merged"],
                 "CPU s/token", **details)
            for q in (50, 99):
                emit(f"serve_latency_p{q}_c{concurrency}", percentile(totals["corrected"]["latencies"], q),
                     percentile(totals["merged"]["latencies"], q), "s", **details)
    finally:
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()
