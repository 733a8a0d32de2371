"""evaluation_efficiency: wall time of `evaluate` ÷ wall time of the bare forward and generation passes it needs.

Same machine, same run. `evaluate` is the evaluate stage as `darts-dist evaluate CONFIG` runs it
(`evaluate.stage.evaluate_stage`): models loaded, every expert's held-out and reference-answer passes, the merged
and corrected passes, the tallies, and the task scores of the base, each expert, the merged and the corrected
model, generated and checked. The floor is the same models' forward passes over the same batches (logits
included; for the corrected model, the LM head again on the tokens NLL counts) and the same greedy answers
from the same generation engine, models already loaded, nothing tallied or checked. Defaults: the demo's models and every held-out sample, 20 scored problems per task, corrections at
their start (the identity: answers as long as the merged model's).

Then the same stage again on the output cache its first run filled (`evaluation.cache`, in a folder of this
run's own, so nothing the user's runs kept is read): `evaluation_repeat`'s ratio is the repeat's wall time ÷
the first run's, what a repeat `darts-dist demo` pays for its evaluation.
"""

from __future__ import annotations

import functools
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from common import demo_setup, emit, note, parser

from darts_dist.calibrate.loop import build_corrections
from darts_dist.config import RunConfig, updated
from darts_dist.evaluate.evaluator import Evaluator
from darts_dist.evaluate.stage import evaluate_stage
from darts_dist.evaluate.task_scores import canonical_set, completions
from darts_dist.generation import CorrectedLM
from darts_dist.plan.check import driver_holds_evaluation
from darts_dist.sources.corrections import save_corrections_for
from darts_dist.sources.data import tokenized
from darts_dist.sources.models import load_causal_lm, load_tokenizer, model_dtype, read_model_info, resolve_device
from darts_dist.sources.output_cache import OutputCache
from darts_dist.sources.references import ResolvedSources


def timed(work: Callable[[], object]) -> float:
    start = time.perf_counter()
    work()
    return time.perf_counter() - start


@torch.no_grad()
def evaluation_floor(config: RunConfig, sources: ResolvedSources, merged_dir, corrections) -> dict[str, float]:
    """Seconds of the bare passes: forwards (expert and merged over each task's held-out and reference-answer
    batches) and generation (base, expert, merged and corrected answers to each task's scored problems)."""
    settings = config.calibration
    device = resolve_device(settings.device)
    dtype = model_dtype(settings.dtype, device)
    tokenizer = load_tokenizer(sources.base)
    evaluator = Evaluator(config, sources.data, tokenizer, progress=False)
    batches, scorers, problems = {}, {}, {}
    for task in config.tasks:
        scorers[task], problems[task] = evaluator.scored_problems(task)
        scorer = scorers[task]
        sets = [tokenized(sources.data[task], task, "heldout", settings, tokenizer)]
        if scorer is not None and scorer.canonical_nll and problems[task]:
            sets.append(canonical_set(problems[task], tokenizer, task))
        batches[task] = [(b["input_ids"].to(device), b["attention_mask"].to(device), b["response_mask"].to(device))
                         for rows in sets for b in rows.batches(settings.batch_size)]

    def forwards(model, task: str) -> float:
        return timed(lambda: [model(input_ids=ids, attention_mask=mask) for ids, mask, _ in batches[task]])

    def merged_and_corrected(model, task: str) -> float:
        """The merged pass (decoder, then LM head), and the corrected passes' own work at the final layer: the LM
        head again on the tokens NLL counts (their hidden states are the merged pass's, corrected; the
        correction itself is not counted)."""
        head = model.get_output_embeddings()

        def run() -> None:
            for ids, mask, counted in batches[task]:
                hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
                head(hidden)
                head(hidden[:, :-1][counted[:, 1:]])
        return timed(run)

    def answers(lm: CorrectedLM, task: str, corrected: str | None) -> float:
        if scorers[task] is None or not problems[task]:
            return 0.0
        return timed(lambda: completions(lm, corrected, problems[task], scorers[task], config.evaluation))

    seconds = {"forward": 0.0, "generation": 0.0}
    if evaluator.scores_base:
        base = load_causal_lm(sources.base, dtype=dtype, device=device)
        with CorrectedLM(base, tokenizer) as lm:
            seconds["generation"] += sum(answers(lm, task, None) for task in config.tasks)
        del base
    merged = load_causal_lm(merged_dir, dtype=dtype, device=device)
    for task in config.tasks:
        expert = load_causal_lm(sources.experts[task], dtype=dtype, device=device)
        seconds["forward"] += forwards(expert, task) + merged_and_corrected(merged, task)
        with CorrectedLM(expert, tokenizer) as lm:
            seconds["generation"] += answers(lm, task, None)
        del expert
        with CorrectedLM(merged, tokenizer) as lm:
            seconds["generation"] += answers(lm, task, None)
        with CorrectedLM(merged, tokenizer, corrections.to(device)) as lm:
            seconds["generation"] += answers(lm, task, task)
    seconds["total"] = seconds["forward"] + seconds["generation"]
    return seconds


def main() -> None:
    cli = parser(__doc__.splitlines()[0], samples=128, steps=1)
    cli.add_argument("--score-limit", type=int, default=20, help="scored problems per task (evaluation.score_limit)")
    cli.add_argument("--executor", choices=("in-process", "ray"), default="in-process",
                     help="evaluation.executor: one model after another here, or each in a Ray actor of its own")
    args = cli.parse_args()
    config, sources, merged_dir = demo_setup("evaluation", args)
    config = updated(config, evaluation=updated(config.evaluation, score_limit=args.score_limit,
                                                executor=args.executor))
    torch.manual_seed(0)
    corrections = build_corrections(config.tasks, read_model_info(merged_dir).hidden_size, config.calibration)
    path = save_corrections_for(config.run_dir / "evaluation-efficiency.safetensors", corrections, merged_dir)
    note("timing the bare forward and generation passes")
    floor = evaluation_floor(config, sources, merged_dir, corrections)
    note(f"floor {floor['total']:.1f} s; now the evaluate stage")
    model = "tiny" if args.tiny else "SmolLM2-135M-Instruct + demo experts"
    with tempfile.TemporaryDirectory(prefix="evaluation-cache-") as folder:
        first = OutputCache(Path(folder))
        holds = functools.partial(driver_holds_evaluation, config)
        wall = timed(lambda: evaluate_stage(config, sources, merged_dir, path, cache=first, driver_holds_models=holds))
        emit("evaluation_efficiency", wall, floor["total"], "s", target_ratio=1.3,
             floor={k: round(v, 2) for k, v in floor.items()}, score_limit=args.score_limit, model=model,
             executor=args.executor, output_cache=first.counts())
        note(f"evaluate {wall:.1f} s (output cache filled); now a repeat on that cache")
        repeat = OutputCache(Path(folder))
        again = timed(lambda: evaluate_stage(config, sources, merged_dir, path, cache=repeat,
                                             driver_holds_models=holds))
        emit("evaluation_repeat", again, wall, "s", score_limit=args.score_limit, model=model,
             executor=args.executor, output_cache=repeat.counts())


if __name__ == "__main__":
    main()
