"""The `ray job submit` entry point: one darts-dist command, run as the job's driver on the cluster.

    ray job submit --address http://HEAD:8265 --runtime-env jobs/runtime_env.yaml -- \\
        python jobs/run.py calibrate jobs/configs/llama2-7b.yaml

COMMAND is merge, calibrate, recalibrate, evaluate, register or serve-deploy; the rest are that command's
arguments, as `darts-dist COMMAND --help` lists them. The runtime env ships the working folder, so
this driver and every actor of the job import the darts_dist shipped with it, and
`DARTS_DIST_VERSION` (set there) pins the version the job accepts. Inside a job Ray sets
RAY_ADDRESS, so the command joins the job's cluster instead of starting one.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

# The working folder (this file's parent's parent) first: the shipped package, not an installed one.
sys.path.insert(0, str(Path(__file__).absolute().parent.parent))

import darts_dist  # noqa: E402
from darts_dist.cli import main as darts_dist_main  # noqa: E402

VERSION_ENV = "DARTS_DIST_VERSION"
COMMANDS = ("merge", "calibrate", "recalibrate", "evaluate", "register", "serve-deploy")  # darts-dist subcommands a job runs


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in COMMANDS:
        print(f"usage: python jobs/run.py {{{','.join(COMMANDS)}}} ARGS...\n\n{__doc__}", file=sys.stderr)
        return 2
    pinned = os.environ.get(VERSION_ENV)
    if pinned and pinned != darts_dist.__version__:
        print(f"error: this job pins darts-dist {pinned} ({VERSION_ENV}), but ships {darts_dist.__version__} "
              f"from {Path(darts_dist.__file__).parent}\nfix: submit from a checkout of darts-dist {pinned}, "
              f"or update {VERSION_ENV} in the runtime env", file=sys.stderr)
        return 2
    return darts_dist_main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
