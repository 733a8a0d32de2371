"""vs_naive_loop: darts-dist's calibration against the Representation Surgery reference's way of doing it.

The reference (Yang et al., ICML 2024) trains in one process and, in every step, runs each task's
expert and the merged model on that step's minibatch before the update. darts-dist runs every
model once per row (experts streaming into the training worker) and trains on the stored features.
Both runs here: same machine, same calibration sets, same steps and minibatches (one seed), each
timed from its start (loading its models) to its trained corrections. The ratio is darts-dist's
wall time over the naive loop's; the naive loop's cost grows with the steps, darts-dist's barely.
"""

from __future__ import annotations

import time

import torch
from common import demo_setup, emit, note, parser

from darts_dist.calibrate.features import expert_targets
from darts_dist.calibrate.loop import build_corrections, calibration_loss
from darts_dist.calibrate.ray.job import job_plan, run_calibration_job
from darts_dist.config import RunConfig
from darts_dist.core import mask_positions, merged_hidden
from darts_dist.sources.data import calibration_sets
from darts_dist.sources.models import load_causal_lm, load_tokenizer
from darts_dist.sources.references import ResolvedSources


def naive_loop(config: RunConfig, sources: ResolvedSources, merged_dir) -> list[float]:
    """Surgery's loop: per step and task, the expert's and the merged model's forward on the minibatch, then Adam."""
    settings = config.calibration
    data = calibration_sets(config, sources.data, load_tokenizer(sources.base))
    tasks = list(data)
    experts = {task: load_causal_lm(sources.experts[task]) for task in tasks}
    merged = load_causal_lm(merged_dir)
    torch.manual_seed(settings.seed)
    corrections = build_corrections(tasks, merged.config.hidden_size, settings)
    optimizer = torch.optim.Adam(corrections.parameters(), lr=settings.learning_rate,
                                 weight_decay=settings.weight_decay)
    generator = torch.Generator().manual_seed(settings.seed)
    losses = []
    for _ in range(settings.steps):
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for index, task in enumerate(tasks):
            rows = data[task].subset(torch.randperm(len(data[task]), generator=generator)[: settings.batch_size])
            targets, entropy, _ = expert_targets(experts[task], rows.input_ids, rows.attention_mask, settings.layers)
            batch = {
                "attention_mask": rows.attention_mask, "response_mask": rows.response_mask,
                "positions": mask_positions(rows.attention_mask), "entropy": entropy, "targets": targets,
                "merged": merged_hidden(merged, rows.input_ids, rows.attention_mask, settings.layers),
            }
            loss = calibration_loss(corrections, batch, index, settings.beta_for(task), settings.weight_on_for(task))
            loss.backward()
            total += loss.item()
        optimizer.step()
        losses.append(total / len(tasks))
    return losses


def main() -> None:
    args = parser(__doc__.splitlines()[0], samples=32, steps=40).parse_args()
    config, sources, merged = demo_setup("naive", args)
    note(f"the naive loop: {args.steps} steps, each running every expert and the merged model")
    start = time.perf_counter()
    naive_losses = naive_loop(config, sources, merged)
    naive = time.perf_counter() - start
    note(f"naive {naive:.1f} s; now darts-dist")
    start = time.perf_counter()
    job = run_calibration_job(job_plan(config, sources, merged))
    ours = time.perf_counter() - start
    emit("vs_naive_loop", ours, naive, "s", speedup=round(naive / ours, 2),
         naive_seconds_per_step=round(naive / args.steps, 3),
         breakdown={k: round(v, 2) for k, v in job.timings.items()},
         final_loss={"darts_dist": round(job.losses[-1], 5), "naive": round(naive_losses[-1], 5)},
         samples_per_task=args.samples, steps=args.steps,
         model="tiny" if args.tiny else "SmolLM2-135M-Instruct + demo experts")


if __name__ == "__main__":
    main()
