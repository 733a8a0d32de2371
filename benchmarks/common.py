"""What the benchmarks share: the demo set-up, the forward-pass floor, memory sampling, JSON lines.

Every benchmark prints one JSON line per result with at least `name`, `value`, `baseline`,
`ratio` (value / baseline) and `unit`; human-readable progress goes to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import functools
import json
import os
import platform
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil
import torch

# stdout carries only the JSON lines; DeepSpeed's logger writes to the stdout it finds when first imported.
with contextlib.redirect_stdout(sys.stderr):
    import deepspeed  # noqa: F401

from darts_dist.config import RunConfig, load_config, packaged_config, updated
from darts_dist.fsutil import cache_root
from darts_dist.merge.stage import merge_stage
from darts_dist.sources.data import calibration_sets
from darts_dist.sources.models import load_causal_lm, load_tokenizer, model_dtype, resolve_device
from darts_dist.sources.references import ResolvedSources, resolve_sources

# Ray's token auth is for shared clusters; a benchmark's local cluster is this process's own.
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
M_MMAP_THRESHOLD, MMAP_THRESHOLD = -3, 1 << 20  # glibc's mallopt parameter and the fixed threshold in bytes


def emit(name: str, value: float, baseline: float, unit: str, **details: object) -> None:
    """One result as a JSON line on stdout, with the machine's load averages: the machine may be shared,
    and timings taken next to other work are not comparable."""
    line = {"name": name, "value": round(value, 4), "baseline": round(baseline, 4),
            "ratio": round(value / baseline, 4) if baseline else None, "unit": unit, **details,
            "cpus": os.cpu_count(), "cpu": cpu_name(), "load_average": [round(x, 2) for x in os.getloadavg()]}
    print(json.dumps(line), flush=True)


@functools.cache
def cpu_name() -> str:
    """The CPU's model name: times differ between CPUs (bf16 instructions or none, vector widths)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def note(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def parser(description: str, samples: int, steps: int) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--tiny", action="store_true", help="the tiny random family instead of SmolLM2 and its demo experts")
    p.add_argument("--samples", type=int, default=samples, help="calibration samples per task")
    p.add_argument("--steps", type=int, default=steps, help="calibration steps")
    p.add_argument("--workers", type=int, default=1, help="calibration workers (cluster.num_workers)")
    p.add_argument("--zero-stage", type=int, default=0, choices=(0, 1, 2, 3))
    p.add_argument("--cpus-per-worker", type=float, default=1.0)
    return p


def demo_setup(name: str, args: argparse.Namespace, **cluster: object) -> tuple[RunConfig, ResolvedSources, Path]:
    """The demo config (or its tiny twin) resized by `args`, its sources, and its merged model (cached)."""
    config = load_config(packaged_config("tiny" if args.tiny else "demo"))
    # No validation split: the benchmarks measure calibration on every row they give it.
    settings = updated(config.calibration, num_samples=args.samples, steps=args.steps, validation_fraction=0.0)
    cluster_settings = updated(
        config.cluster, num_workers=args.workers, zero_stage=args.zero_stage, cpus_per_worker=args.cpus_per_worker,
        # A fresh run id: a benchmark must never resume (and so skip) an earlier run.
        run_id=f"{name}-{time.strftime('%Y%m%d-%H%M%S')}", **cluster,
    )
    out = cache_root() / "benchmarks" / ("tiny" if args.tiny else "demo")
    config = updated(config, output_dir=out, calibration=settings, cluster=cluster_settings)
    # stdout carries only the results' JSON lines; the stages' own messages go with the progress.
    with contextlib.redirect_stdout(sys.stderr):
        sources = resolve_sources(config)
        return config, sources, merge_stage(config, sources)


@torch.no_grad()
def forward_floor(config: RunConfig, sources: ResolvedSources, merged_dir: Path) -> dict[str, float]:
    """Seconds of the bare forward passes calibration needs, in this process, models already loaded (on
    the config's device and dtype): each expert on its own calibration rows (with logits: the entropy
    needs them), and the merged model on all rows (its decoder only: the final norm's output is the feature)."""
    settings = config.calibration
    device = resolve_device(settings.device)
    dtype = model_dtype(settings.dtype, device)
    data = calibration_sets(config, sources.data, load_tokenizer(sources.base))
    batches = {
        task: [(b["input_ids"].to(device), b["attention_mask"].to(device)) for b in rows.batches(settings.batch_size)]
        for task, rows in data.items()
    }

    def run(forward: Callable, task: str) -> float:
        start = time.perf_counter()
        for ids, mask in batches[task]:
            forward(input_ids=ids, attention_mask=mask)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    seconds = {}
    for task in data:
        expert = load_causal_lm(sources.experts[task], dtype=dtype, device=device)
        seconds[task] = run(expert, task)
        del expert
    merged = load_causal_lm(merged_dir, dtype=dtype, device=device)
    seconds["merged"] = sum(run(merged.model, task) for task in data)
    seconds["total"] = sum(seconds.values())
    return seconds


def ray_processes() -> Iterator[psutil.Process]:
    """This machine's Ray actor processes (their titles start with "ray::")."""
    for process in psutil.process_iter(["cmdline"]):
        cmdline = process.info["cmdline"] or []
        if cmdline and cmdline[0].startswith("ray::"):
            yield process


class PeakMemory:
    """Peak memory of this process and of Ray's worker and expert actors, sampled in a thread: `peak` is each
    kind's private memory (resident and not shared: RSS less the file-backed and shared-memory pages, which are
    the object store's blocks a process reads and the spilled feature files it maps, counted apart as the
    object store and the spilled disk, and which the kernel may drop), `peak_rss` its whole resident set."""

    KINDS = {"RayTrainWorker": "train_workers", "MapWorker": "expert_actors"}

    def __init__(self, interval: float = 0.25) -> None:
        self.interval = interval
        self.peak = {"driver": 0, "train_workers": 0, "expert_actors": 0}
        self.peak_rss = dict(self.peak)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> None:
        processes = [("driver", psutil.Process())]
        for process in ray_processes():
            kind = next((k for title, k in self.KINDS.items() if title in process.info["cmdline"][0]), None)
            if kind is not None:
                processes.append((kind, process))
        private, rss = dict.fromkeys(self.peak, 0), dict.fromkeys(self.peak, 0)
        for kind, process in processes:
            try:
                info = process.memory_info()
            except psutil.Error:  # it ended between listing and reading
                continue
            private[kind] = max(private[kind], info.rss - info.shared)  # the largest of its kind
            rss[kind] = max(rss[kind], info.rss)
        self.peak = {kind: max(self.peak[kind], private[kind]) for kind in self.peak}
        self.peak_rss = {kind: max(self.peak_rss[kind], rss[kind]) for kind in self.peak}

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    @contextmanager
    def watching(self) -> Iterator[PeakMemory]:
        self._thread.start()
        try:
            yield self
        finally:
            self._stop.set()
            self._thread.join()


def allocate_live_bytes_only() -> None:
    """Make the CPU's resident memory track live tensors, as torch's GPU peak does: glibc keeps a freed block under
    its dynamic mmap threshold (up to 32 MiB: a row of logits) in its heap, resident, until reused. A fixed 1 MiB
    threshold returns every larger block to the system when freed, in this process (mallopt) and in the Ray
    workers and server it starts (the environment, read when each process starts)."""
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(MMAP_THRESHOLD)
    ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
