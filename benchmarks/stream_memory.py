"""stream_memory: peak memory of the driver, the workers and the object store at 1x and 4x the calibration set.

The same calibration run twice, on N and on 4N samples per task (each run its own local cluster).
Streaming keeps memory flat: the object store holds a bounded window of hidden states (the stream's window,
in tokens), and each training worker keeps features in memory up to `cluster.feature_memory_mb` and spills
the rest to its local disk, so only the disk grows. A process's memory is its private memory (common.PeakMemory:
resident, less the object store's pages it reads and the spilled files it maps, which the object store and
the disk lines count); its whole resident set is printed too. Target: every memory ratio (4x over 1x) at most 1.2.
"""

from __future__ import annotations

import argparse
import time

from common import PeakMemory, demo_setup, emit, note, parser

from darts_dist.calibrate.ray.job import job_plan, run_calibration_job
from darts_dist.config import RunConfig, updated
from darts_dist.fsutil import cache_root
from darts_dist.sources.references import demo_data, resolve_sources

TARGET = 1.2


def with_repeated_data(config: RunConfig, samples: int) -> RunConfig:
    """The config reading calibration files that repeat the demo's rows enough times for `samples` per task."""
    out = cache_root() / "benchmarks" / "data"
    out.mkdir(parents=True, exist_ok=True)
    experts = []
    for expert in config.sources.experts:
        rows = demo_data()[expert.task]["calibration"].read_text().splitlines()
        path = out / f"{expert.task}-{samples}.jsonl"
        path.write_text("\n".join((rows * (samples // len(rows) + 1))[:samples]) + "\n")
        experts.append(updated(expert, data=updated(expert.data, calibration=str(path))))
    return updated(config, sources=updated(config.sources, experts=experts))


def measure(args, samples: int) -> dict[str, float]:
    sized = argparse.Namespace(**{**vars(args), "samples": samples})
    config, sources, merged = demo_setup(f"memory-{samples}", sized, feature_memory_mb=args.feature_memory_mb,
                                         stream_buffer_mb=args.stream_buffer_mb)
    config = with_repeated_data(config, samples)
    plan = job_plan(config, resolve_sources(config), merged)
    memory = PeakMemory()
    start = time.perf_counter()
    with memory.watching():
        job = run_calibration_job(plan)
    note(f"{samples} samples per task: {time.perf_counter() - start:.1f} s, {job.stream['rows']:.0f} rows")
    return {**memory.peak, **{f"{kind}_rss": value for kind, value in memory.peak_rss.items()},
            "object_store": job.object_store_peak_bytes, "spilled_disk": job.stream["spilled_bytes"],
            "hidden_states_streamed": job.stream["bytes"]}


def main() -> None:
    # 160 and 640 samples per task (the demo's 256 calibration rows, cut or repeated): large enough for the
    # stream to reach its steady state, where the object store holds its full window, in both runs. (At 80 a
    # task's 10 batches were about twice its window of tokens: the 1x run ended before the window stayed full.)
    p = parser(__doc__.splitlines()[0], samples=160, steps=20)
    p.add_argument("--feature-memory-mb", type=int, default=16, help="cluster.feature_memory_mb (both runs spill)")
    p.add_argument("--stream-buffer-mb", type=int, default=2, help="cluster.stream_buffer_mb")
    args = p.parse_args()
    sizes = [args.samples, 4 * args.samples]
    small, large = (measure(args, samples) for samples in sizes)
    for kind in ("driver", "train_workers", "expert_actors", "object_store"):
        emit(f"stream_memory.{kind}", large[kind] / 2**20, small[kind] / 2**20, "MiB", target_ratio=TARGET,
             samples_per_task=sizes)
    # The whole resident sets, for the record: they also count object-store blocks a process reads and the spilled
    # feature files a worker maps, which grow with the set but are the object store's and the disk's.
    for kind in ("spilled_disk", "hidden_states_streamed", "driver_rss", "train_workers_rss", "expert_actors_rss"):
        emit(f"stream_memory.{kind}", large[kind] / 2**20, small[kind] / 2**20, "MiB",
             samples_per_task=sizes)


if __name__ == "__main__":
    main()
