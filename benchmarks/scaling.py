"""scaling: how the calibration job's cost grows with the model's width, the sequence length and the compute dtype.

One whole Ray calibration job per point of hidden size x sequence length x compute dtype, on thin models (a real
model's width, two decoder layers, vocabulary 32000; 4096 is `thin:llama2-7b`): three experts in actors, the stream
in its wire dtype (`calibration.wire_dtype: auto`: the compute dtype, and bf16 from width 2048 on for fp32 experts),
one Train worker whose feature store spills past `--feature-mb`. Each point gets enough tokens that the stream's fixed
start (every expert loading its model and running its first batch: the job's `first_rows`) is at most
`--fixed-share` (20%) of its stream: a point above it runs again with the tokens that bring it there (and the
width's later points start from them). The grid runs `--repeats` times. Per point and repeat, JSON lines:
- `scaling_wire`: bytes on the wire per token (hidden states, ids, masks, entropy) against hidden x the wire's item
  size x the streamed layers + the 10 bytes of ids, masks and entropy (target: within 5%);
- `scaling_stream`: the stream's seconds, its fixed start and the fixed share, against the smallest point's
  seconds per token x hidden, times this point's tokens x hidden (ratio 1: linear in tokens x hidden);
- `scaling_marginal`: what a further token costs the stream, the stream's seconds after its fixed start per token
  that came after it, against the narrowest width's of the same length and dtype scaled by hidden (ratio 1: linear
  in hidden);
- `scaling_worker_memory`: the worker's measured peak against the plan's (target: within 20%);
- `scaling_spill`: spilled bytes per token against the bytes a token's fields take (no padding: <= 1.05; all but the
  last `--feature-mb` spill);
then per length and dtype `scaling_fit`: the exponent of the marginal cost per token against hidden (target
0.9-1.1), its mean and standard deviation over the repeats with each repeat's; and a log-log PNG of time and memory
per point (`--plot`). `--efficiency 1,2` adds calibration_efficiency at those multiples of the demo's calibration
tokens (SmolLM2, as benchmarks/calibration_efficiency.py runs it; the demo's calibration set has 256 rows a task,
so 2 is the most it holds).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
from common import PeakMemory, allocate_live_bytes_only, emit, note

from darts_dist.calibrate.ray.job import job_plan, run_calibration_job
from darts_dist.config import parse_config
from darts_dist.merge.stage import merge_stage
from darts_dist.plan import build_plan
from darts_dist.sources.demo.tasks import DEMO_TASKS, long_texts
from darts_dist.sources.demo.tiny import THIN_SHAPES, TinyFamily
from darts_dist.sources.models import load_tokenizer
from darts_dist.sources.references import demo_data, resolve_sources, thin_family

WIDTHS = (576, 1024, 2048, 4096)
LENGTHS = (512,)
DTYPES = ("float32", "bfloat16")
TOKEN_FIELD_BYTES = 4 + 1 + 1 + 4  # per token on the wire: input id (int32), two masks (bool), entropy (fp32)
STORED_TOKEN_BYTES = 8 + 8 + 1 + 4  # per token in the worker's store: ids and attention mask int64, response mask, entropy


def family_of_width(hidden: int) -> TinyFamily:
    """The thin family of `hidden`: `thin:llama2-7b`'s at 4096, else its proportions (head dimension 64)."""
    if hidden == THIN_SHAPES["llama2-7b"].hidden_size:
        return thin_family("llama2-7b", THIN_SHAPES["llama2-7b"])
    heads = hidden // 64
    return thin_family(f"h{hidden}", replace(THIN_SHAPES["llama2-7b"], hidden_size=hidden, num_heads=heads,
                                            num_kv_heads=heads,
                                            intermediate_size=round(hidden * 11008 / 4096 / 64) * 64))


def forward_flops(shape_config: dict, tokens: int) -> float:
    """Forward FLOPs of `tokens` through a Llama of this config.json (2 per multiply-add; attention's scores left
    out, as they are a few percent at these lengths and widths)."""
    h, i, v = shape_config["hidden_size"], shape_config["intermediate_size"], shape_config["vocab_size"]
    kv = h * shape_config["num_key_value_heads"] // shape_config["num_attention_heads"]
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * i
    return 2.0 * tokens * (shape_config["num_hidden_layers"] * per_layer + h * v)


def point_config(family: TinyFamily, length: int, dtype: str, samples: int, data: dict[str, Path], out: Path,
                 args: argparse.Namespace):
    return parse_config({
        "name": f"scaling-{family.base.parent.name}-{length}-{dtype}",
        "output_dir": str(out),
        "sources": {"base": str(family.base),
                    "experts": [{"task": task, "path": str(family.experts[task]),
                                 "data": {"calibration": str(data[task])}} for task in DEMO_TASKS]},
        "merge": {"method": "task_arithmetic", "parameters": {"weight": 0.5}},
        "calibration": {"rank": 4, "max_positions": length, "num_samples": samples, "max_length": length,
                        # about 1024 tokens a batch, and a batch of every task for each worker
                        "batch_size": max(1, min(8, 1024 // length, samples // args.workers)), "steps": args.steps,
                        "learning_rate": 0.01, "dtype": dtype},
        "cluster": {"num_workers": args.workers, "zero_stage": args.zero_stage, "feature_memory_mb": args.feature_mb,
                    "run_id": f"scaling-{time.strftime('%Y%m%d-%H%M%S')}"},
    })


def run_point(hidden: int, length: int, dtype: str, tokens: int, args: argparse.Namespace,
              out: Path) -> dict[str, object]:
    """One Ray calibration job at (hidden, length, dtype) on `tokens` calibration tokens a task; its measures."""
    family = family_of_width(hidden)
    samples = max(args.workers, tokens // length)  # every worker needs a row of every task
    data = {task: long_texts(demo_data()[task]["calibration"], samples, out / f"{task}-{samples}.jsonl")
            for task in DEMO_TASKS}
    config = point_config(family, length, dtype, samples, data, out, args)
    with contextlib.redirect_stdout(sys.stderr):
        sources = resolve_sources(config)
        merged = merge_stage(config, sources)
        plan = job_plan(config, sources, merged)
    counted = sum(int(rows.attention_mask.sum()) for rows in plan.data.values())
    planned = next(role for role in build_plan(config).roles if role.name == "calibration worker")
    note(f"scaling: hidden {hidden}, {length} tokens, {dtype}, {samples} samples per task ({counted} tokens)")
    # stdout carries only the JSON lines; Ray's driver prints its raylets' warnings there.
    with PeakMemory().watching() as processes, contextlib.redirect_stdout(sys.stderr):
        job = run_calibration_job(plan)
    shutil.rmtree(config.run_dir)  # its merged model, before the next point writes its own
    shape = json.loads((family.base / "config.json").read_text())
    used_rows = len(load_tokenizer(family.base))
    wire = config.calibration.wire_dtype_for(hidden, config.cluster.use_gpu)
    return {"hidden": hidden, "length": length, "dtype": dtype, "samples": samples, "tokens": counted, "job": job,
            "wire_bytes": 4 if wire == "float32" else 2,
            # Only fp32 points map the merged model's fp32 file as it is; bf16 ones cast it, every row resident.
            "unread_embedding_bytes": (shape["vocab_size"] - used_rows) * hidden * 4 if dtype == "float32" else 0,
            "zero_stage": args.zero_stage,
            "planned_worker": planned.bytes, "processes": processes.peak,
            "flops": forward_flops(shape, counted) * 2}  # each token through its expert and the merged model


def fixed_share(point: dict[str, object]) -> float:
    """The share of the point's stream its fixed start took (every expert's first rows)."""
    job = point["job"]
    return job.stream["first_rows_seconds"] / job.timings["stream"]


def marginal(point: dict[str, object]) -> float:
    """Stream seconds a further token costs: the stream's time after every expert's first rows, per token that came
    after them (the steady rate: early experts' rows during the others' start are left out)."""
    job = point["job"]
    return (job.timings["stream"] - job.stream["first_rows_seconds"]) / max(job.stream["steady_tokens"], 1)


def sized_point(hidden: int, length: int, dtype: str, args: argparse.Namespace, out: Path,
                needed: dict[tuple[int, str], int]) -> dict[str, object]:
    """A point whose fixed start is at most `args.fixed_share` of its stream: run at the tokens its width and dtype
    needed before (at least `--tokens`); above the share, again with the tokens that bring it there (20% more, at
    most `--max-tokens` a task), which the width's later points start from."""
    tokens = max(args.tokens, needed.get((hidden, dtype), 0))
    point = run_point(hidden, length, dtype, tokens, args, out)
    share = fixed_share(point)
    note(f"scaling: stream {point['job'].timings['stream']:.1f} s, fixed start {share:.0%}, "
         f"{marginal(point) * 1e3:.2f} ms a further token")
    if share > args.fixed_share and tokens < args.max_tokens:
        fixed = point["job"].stream["first_rows_seconds"]
        variable = max(point["job"].timings["stream"] - fixed, 1e-3)
        wanted = tokens * fixed * (1 - args.fixed_share) / (args.fixed_share * variable)
        tokens = min(args.max_tokens, int(1.2 * wanted) + 1)
        note(f"scaling: its fixed start was {share:.0%} of the stream: again with {tokens} tokens a task")
        point = run_point(hidden, length, dtype, tokens, args, out)
        note(f"scaling: stream {point['job'].timings['stream']:.1f} s, fixed start {fixed_share(point):.0%}, "
             f"{marginal(point) * 1e3:.2f} ms a further token")
    needed[(hidden, dtype)] = tokens
    return point


def emit_point(point: dict[str, object], seconds_per_unit: float, wire_layers: int, repeat: int,
               narrowest: float) -> None:
    job, hidden, tokens = point["job"], point["hidden"], point["tokens"]
    counts = {"hidden": hidden, "length": point["length"], "dtype": point["dtype"], "repeat": repeat,
              "samples_per_task": point["samples"], "tokens": tokens, "workers": len(job.memory["workers"]),
              "zero_stage": point["zero_stage"]}
    wire_item = point["wire_bytes"]
    emit("scaling_wire", job.stream["bytes"] / tokens + TOKEN_FIELD_BYTES,
         hidden * wire_item * wire_layers + TOKEN_FIELD_BYTES, "bytes/token", target_ratio=[0.95, 1.05], **counts)
    emit("scaling_stream", job.timings["stream"], seconds_per_unit * tokens * hidden, "s",
         fixed_seconds=round(job.stream["first_rows_seconds"], 2), fixed_share=round(fixed_share(point), 3),
         forward_tflops=round(point["flops"] / 1e12, 3), job_seconds=round(job.timings["total"], 1), **counts)
    emit("scaling_marginal", marginal(point), narrowest * hidden, "s/token",
         steady_tokens=job.stream["steady_tokens"], **counts)
    # On a CPU the merged model's fp32 weight file is memory-mapped, and an embedding row is resident only once a
    # token reads it: the thin models' tokenizer reaches 512 of their 32000 rows. The plan counts every row, as a
    # GPU (which copies the weights) and a real tokenizer's data need; beside it, the plan less the unread rows.
    unread = point["unread_embedding_bytes"] if job.memory["device"] == "cpu" else 0
    measured = max(job.memory["workers"])
    emit("scaling_worker_memory", measured, point["planned_worker"], "bytes", target_ratio=[0.8, 1.2],
         device=job.memory["device"], unread_embedding_bytes=unread,
         ratio_to_plan_less_unread_rows=round(measured / (point["planned_worker"] - unread), 4), **counts)
    hidden_fields = 2 * hidden * wire_item  # the target and the merged state kept per token
    emit("scaling_spill", job.stream["spilled_bytes"] / tokens, hidden_fields + STORED_TOKEN_BYTES,
         "bytes/token", target_ratio=[0, 1.05], spilled_bytes=job.stream["spilled_bytes"],
         expert_actor_peak=max(job.memory["experts"].values()), object_store_peak=job.object_store_peak_bytes,
         process_private_peak=point["processes"], **counts)


def fit_exponent(x: list[float], y: list[float]) -> float:
    """The slope of log y against log x: y ~ x^slope."""
    return float(np.polyfit(np.log(x), np.log(y), 1)[0])


def plot(points: list[dict[str, object]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (time_axis, memory_axis) = plt.subplots(1, 2, figsize=(11, 4.2))
    for length, dtype in sorted({(p["length"], p["dtype"]) for p in points}):
        row = sorted((p for p in points if (p["length"], p["dtype"]) == (length, dtype)), key=lambda p: p["hidden"])
        label = f"{length} tokens, {dtype}"
        time_axis.loglog([p["hidden"] for p in row], [marginal(p) for p in row], "o", label=label)
        memory_axis.loglog([p["hidden"] for p in row], [max(p["job"].memory["workers"]) / 2**30 for p in row], "o-",
                           label=f"worker, {label}")
        memory_axis.loglog([p["hidden"] for p in row], [max(p["job"].memory["experts"].values()) / 2**30 for p in row],
                           "s--", label=f"expert actor, {label}")
    time_axis.set(xlabel="hidden size", ylabel="stream seconds per token", title="Marginal cost per token")
    memory_axis.set(xlabel="hidden size", ylabel="peak GiB", title="Peak memory per role")
    for axis in (time_axis, memory_axis):
        axis.grid(True, which="both", alpha=0.3)
        axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def efficiency(multiples: list[int]) -> None:
    """calibration_efficiency at multiples of the demo's calibration tokens, each in its own process."""
    import subprocess

    for multiple in multiples:
        note(f"scaling: calibration_efficiency at {multiple}x the demo's calibration tokens")
        result = subprocess.run([sys.executable, str(Path(__file__).with_name("calibration_efficiency.py")),
                                 "--samples", str(128 * multiple), "--steps", "400"], capture_output=True, text=True, check=False)
        sys.stderr.write(result.stderr[-2000:])
        for line in result.stdout.splitlines():
            if not line.startswith("{"):  # a line of Ray's that reached stdout
                continue
            record = json.loads(line)
            emit("scaling_efficiency", record["value"], record["baseline"], "s", multiple=multiple,
                 breakdown=record["breakdown"], rows=record["rows"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--widths", default=",".join(map(str, WIDTHS)))
    p.add_argument("--lengths", default=",".join(map(str, LENGTHS)))
    p.add_argument("--dtypes", default=",".join(DTYPES), help="calibration.dtype of each point (the compute dtype)")
    p.add_argument("--repeats", type=int, default=2, help="runs of the whole grid, for the spread")
    p.add_argument("--tokens", type=int, default=2048, help="calibration tokens per task a point starts from")
    p.add_argument("--max-tokens", type=int, default=32768, help="the most calibration tokens per task a point gets")
    p.add_argument("--fixed-share", type=float, default=0.2, help="the stream's fixed start's largest share")
    p.add_argument("--default-allocator", action="store_true",
                   help="measure with glibc's dynamic mmap threshold (see benchmarks/plan_accuracy.py)")
    p.add_argument("--steps", type=int, default=2, help="training steps per point (training is not what is measured)")
    p.add_argument("--zero-stage", type=int, default=0, choices=(0, 1, 2, 3))
    p.add_argument("--workers", type=int, default=1, help="calibration workers (e.g. 2 with --zero-stage 3)")
    p.add_argument("--feature-mb", type=int, default=1, help="the worker's feature memory; past it rows spill")
    p.add_argument("--efficiency", default="", help="multiples of the demo's calibration tokens, e.g. 1,2")
    p.add_argument("--plot", type=Path, default=Path("scaling.png"))
    args = p.parse_args()
    if not args.default_allocator:
        allocate_live_bytes_only()  # the worker's peak against the plan, as plan_accuracy measures it
    grid = [(hidden, length, dtype) for dtype in args.dtypes.split(",") for length in map(int, args.lengths.split(","))
            for hidden in map(int, args.widths.split(","))]
    needed: dict[tuple[int, str], int] = {}
    runs = []
    with tempfile.TemporaryDirectory(prefix="scaling-") as out:  # a merged model per point: 2.7 GB at 4096
        for repeat in range(args.repeats):
            runs.append([sized_point(*point, args, Path(out), needed) for point in grid])
    for repeat, points in enumerate(runs):
        smallest = min(points, key=lambda p: p["tokens"] * p["hidden"])
        seconds_per_unit = smallest["job"].timings["stream"] / (smallest["tokens"] * smallest["hidden"])
        for point in points:
            narrowest = min((q for q in points if (q["length"], q["dtype"]) == (point["length"], point["dtype"])),
                            key=lambda q: q["hidden"])
            emit_point(point, seconds_per_unit, 1, repeat, marginal(narrowest) / narrowest["hidden"])
    for length, dtype in sorted({(p["length"], p["dtype"]) for p in runs[0]}):
        exponents = []
        for points in runs:
            row = sorted((q for q in points if (q["length"], q["dtype"]) == (length, dtype)), key=lambda q: q["hidden"])
            if len(row) > 1:
                exponents.append(fit_exponent([q["hidden"] for q in row], [marginal(q) for q in row]))
        if exponents:
            emit("scaling_fit", float(np.mean(exponents)), 1.0, "exponent", target_ratio=[0.9, 1.1],
                 sd=round(float(np.std(exponents, ddof=1)), 4) if len(exponents) > 1 else None,
                 repeats=[round(e, 4) for e in exponents], length=length, dtype=dtype,
                 fitted="marginal stream seconds per token against hidden",
                 tokens_per_task={f"{h}": t for (h, d), t in needed.items() if d == dtype})
    plot([point for points in runs for point in points], args.plot)
    note(f"scaling: plot at {args.plot}")
    if args.efficiency:
        efficiency([int(m) for m in args.efficiency.split(",")])


if __name__ == "__main__":
    main()
