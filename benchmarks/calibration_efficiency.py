"""calibration_efficiency: wall time of `calibrate` ÷ wall time of the bare forward passes it needs.

Same machine, same run. The floor is each expert on its own calibration tokens plus the merged
model on all of them, timed in this process with the models already loaded. `calibrate` is the
whole Ray job as `darts-dist calibrate CONFIG` runs it: tokenising, a local Ray cluster started
on the fly, expert actors streaming into the training worker, the training steps, checkpoints.
Defaults: the demo's models and data (SmolLM2-135M and its three experts), 128 samples per task, 400 steps;
`--cpu-schedule concurrent|turns` measures either way of sharing the cores (default: the job's).
"""

from __future__ import annotations

import contextlib
import sys
import time

from common import demo_setup, emit, forward_floor, note, parser

from darts_dist.calibrate.ray.job import job_plan, run_calibration_job


def main() -> None:
    cli = parser(__doc__.splitlines()[0], samples=128, steps=400)
    cli.add_argument("--cpu-schedule", choices=("concurrent", "turns"), default="concurrent",
                     help="cluster.cpu_schedule: how the experts and the worker share this machine's cores")
    args = cli.parse_args()
    config, sources, merged = demo_setup("efficiency", args, cpu_schedule=args.cpu_schedule)
    note("timing the bare forward passes")
    floor = forward_floor(config, sources, merged)
    note(f"floor {floor['total']:.1f} s; now the whole calibration job")
    start = time.perf_counter()
    with contextlib.redirect_stdout(sys.stderr):  # stdout carries only the JSON line; Ray prints raylet warnings
        job = run_calibration_job(job_plan(config, sources, merged))
    wall = time.perf_counter() - start
    breakdown = {**job.timings, "outside_the_job": wall - job.timings["total"]}
    emit("calibration_efficiency", wall, floor["total"], "s", target_ratio=1.2, cpu_schedule=args.cpu_schedule,
         breakdown={k: round(v, 2) for k, v in breakdown.items()},
         floor={k: round(v, 2) for k, v in floor.items()},
         rows=int(job.stream["rows"]), steps=len(job.losses), workers=args.workers, zero_stage=args.zero_stage,
         model="tiny" if args.tiny else "SmolLM2-135M-Instruct + demo experts")


if __name__ == "__main__":
    main()
