"""sandbox_check: what a code answer's check costs, now that the answer and its tests run in two sandboxed processes
(the verdict from the tests' own process, plain data between them).

Each line: seconds per check of reference solutions (the demo's code problems, then HumanEval's first problems, all
passing), under bubblewrap and under the limits alone, against the floor of one bare interpreter start
(`python -I -c pass`, no sandbox) measured in the same run; a check starts two sandboxed interpreters, so about
twice the floor plus bubblewrap's namespaces is the expected ratio.

    python benchmarks/sandbox_check.py [--problems 20]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

from common import emit

from darts_dist.evaluate import sandbox
from darts_dist.evaluate.sandbox import BWRAP, RLIMITS, Checks, run_sandboxed
from darts_dist.evaluate.task_scores import answered_problems, humaneval_check, humaneval_problems
from darts_dist.sources.references import demo_data


def interpreter_floor(repeats: int) -> float:
    """Seconds of one bare interpreter start, the best of `repeats`."""
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        subprocess.run([sandbox._interpreter(), "-I", "-c", "pass"], check=True)
        best = min(best, time.perf_counter() - started)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--problems", type=int, default=20, help="problems of each set (default 20)")
    args = p.parse_args()
    code = answered_problems(demo_data()["code"]["heldout"], args.problems)
    humaneval = humaneval_problems(args.problems)
    floor = interpreter_floor(10)
    kinds = [BWRAP, RLIMITS] if sandbox.sandbox_kind() == BWRAP else [RLIMITS]
    for kind in kinds:
        if kind == RLIMITS:
            sandbox._bwrap = lambda: None  # the fallback, as where bubblewrap cannot start
            sandbox._missing_sandbox.cache_clear()
        checks = Checks(10.0, limits=True)
        for name, run in (("demo_code", lambda p: run_sandboxed(p.answer, checks, tests=p.test)),
                          ("humaneval", lambda p: humaneval_check(p, p.answer, checks))):
            problems = code if name == "demo_code" else humaneval
            started = time.perf_counter()
            results = [run(problem) for problem in problems]
            seconds = (time.perf_counter() - started) / len(problems)
            emit(f"sandbox_check.{name}.{kind}", seconds, floor, "s/check", problems=len(problems),
                 passed=sum(r.passed for r in results), note="baseline: one bare interpreter start")
            print(f"{name} under {kind}: {seconds:.3f} s a check", file=sys.stderr)


if __name__ == "__main__":
    main()
