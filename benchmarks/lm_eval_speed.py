"""lm_eval_speed: lm-eval likelihood scoring of the corrected model against lm-eval's own `hf` model on the merge.

The demo merge (SmolLM2-135M-Instruct; `--tiny`: the tiny family) with corrections of the demo's shape and a router,
as a run folder and as the folder `darts-dist export` writes. Requests: multiple-choice style, each held-out prompt
with four continuations. Timed in one process, one after another, each after a warm-up pass: `--model hf` on the
merged folder (the baseline), `--model darts-dist` with task=merged, a task and routed, and `--model hf` on the
exported folder (trust_remote_code) under a task and routed; every model is loaded first, then each round times
every variant once, in turn, so that the machine's drift weighs on all alike. One JSON line each: the median
seconds over the rounds, and its ratio to the baseline's median.
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from pathlib import Path

from common import demo_setup, emit, note, parser
from lm_eval.api.instance import Instance
from lm_eval.models.huggingface import HFLM
from serve_load import fit_demo_router
from serve_overhead import random_corrections, task_prompts

from darts_dist.config import CORRECTIONS_FILE, MERGED_FOLDER
from darts_dist.core import ROUTER_FILE
from darts_dist.evaluate.lm_eval_model import DartsLM
from darts_dist.export import export_model, read_source

CHOICES = [" yes", " no", " 42", "\n    return x"]


def seconds(model, requests: list[Instance]) -> float:
    start = time.perf_counter()
    model.loglikelihood(requests, disable_tqdm=True)
    return time.perf_counter() - start


def main() -> None:
    p = parser(__doc__.splitlines()[0], samples=128, steps=400)
    p.add_argument("--prompts", type=int, default=16, help="held-out prompts per task")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    config, sources, merged_dir = demo_setup("lm-eval-speed", args)
    pairs = task_prompts(config, sources, merged_dir, per_task=args.prompts)
    requests = [Instance("loglikelihood", {}, (text, choice), i)
                for i, (text, choice) in enumerate((text, c) for _, text in pairs for c in CHOICES)]
    task = config.tasks[1]
    with tempfile.TemporaryDirectory(prefix="lm-eval-speed-") as scratch:
        run = Path(scratch) / "run"
        run.mkdir()
        (run / MERGED_FOLDER).symlink_to(merged_dir)
        shutil.copyfile(random_corrections(config, merged_dir), run / CORRECTIONS_FILE)
        shutil.copyfile(fit_demo_router(config, sources, merged_dir), run / ROUTER_FILE)
        exported = export_model(read_source(str(run)), Path(scratch) / "exported")
        common = {"device": "cpu", "batch_size": args.batch_size}
        variants = {
            "hf merged": lambda: HFLM(pretrained=str(merged_dir), dtype="float32", **common),
            "darts-dist task=merged": lambda: DartsLM(run=str(run), task="merged", **common),
            f"darts-dist task={task}": lambda: DartsLM(run=str(run), task=task, **common),
            "darts-dist task=routed": lambda: DartsLM(run=str(run), task="routed", **common),
            f"hf exported darts_task={task}": lambda: HFLM(pretrained=str(exported), trust_remote_code=True,
                                                          dtype="float32", darts_task=task, **common),
            "hf exported darts_task=routed": lambda: HFLM(pretrained=str(exported), trust_remote_code=True,
                                                         dtype="float32", darts_task="routed", **common),
        }
        models = {name: make() for name, make in variants.items()}
        for name, model in models.items():  # warm-up: allocations, lm-eval's caches of its own
            seconds(model, requests)
        rounds: dict[str, list[float]] = {name: [] for name in models}
        for round_ in range(args.rounds):
            note(f"round {round_ + 1} of {args.rounds}: {len(requests)} loglikelihood requests per variant")
            for name, model in models.items():
                rounds[name].append(seconds(model, requests))
    times = {name: statistics.median(values) for name, values in rounds.items()}
    baseline = times["hf merged"]
    model = "tiny" if args.tiny else "SmolLM2-135M-Instruct demo merge"
    for name, value in times.items():
        emit(f"lm_eval_loglikelihood {name}", value, baseline, "s", model=model, requests=len(requests),
             batch_size=args.batch_size, baseline_name="hf merged", rounds=[round(t, 3) for t in rounds[name]])


if __name__ == "__main__":
    main()
