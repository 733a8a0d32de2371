"""`darts-dist-lm-eval`: lm-evaluation-harness's own command line, with the darts-dist model and the darts_demo
tasks added, e.g. `darts-dist-lm-eval --model darts-dist --model_args run=runs/demo,task=math --tasks darts_demo_math`.

lm-eval 0.4.13 finds models only in its own registry (no entry points for other packages' models) and tasks only
in its own folder or `--include_path`, so this imports the model (which registers it) and puts the tasks' folder on
the include path, before any `--include_path` of the user's; every other flag is lm-eval's, unchanged.
"""

from __future__ import annotations

import sys


def main() -> None:
    """What `lm_eval` does (lm_eval.__main__.cli_evaluate), with TASKS_DIR on the include path."""
    try:
        from lm_eval._cli import HarnessCLI
        from lm_eval.utils import setup_logging
    except ModuleNotFoundError as error:  # the command is installed with darts-dist, lm-eval only with its extra
        sys.exit(f"error: {error}\nfix: pip install 'darts-dist[lm-eval]'")
    from darts_dist.evaluate import lm_eval_model  # noqa: F401  registers the model "darts-dist"
    from darts_dist.evaluate.lm_eval_tasks import TASKS_DIR

    setup_logging()
    parser = HarnessCLI()
    args = parser.parse_args()
    # `run`, `ls` and `validate` take --include_path; lm-eval's TaskManager also takes a list of folders.
    if hasattr(args, "include_path"):
        args.include_path = [str(TASKS_DIR), *([args.include_path] if args.include_path else [])]
    parser.execute(args)


if __name__ == "__main__":
    main()
