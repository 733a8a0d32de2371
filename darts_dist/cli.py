"""`darts-dist`: the command line. Glue only; the work happens in pipeline's stages."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from importlib import resources
from pathlib import Path

from rich.console import Console
from rich.table import Table
from rich.text import Text

from darts_dist.config import RunConfig, is_mergekit_yaml, load_config, read_yaml
from darts_dist.errors import DartsError


# Wide enough for the result table when output goes to a file or CI log (rich assumes 80 there).
console = Console(width=None if sys.stdout.isatty() else 140)
errors = Console(stderr=True, soft_wrap=True)  # paths in messages stay on one line

TABLE_COLUMNS = {
    "bias_before": "bias merged",
    "bias_after": "bias corrected",
    "bias_reduction": "bias reduction",
    "weighted_bias_reduction": "entropy-weighted",
    "late_bias_reduction": "late (t>=64)",
    "nll_expert": "NLL expert",
    "nll_merged": "NLL merged",
    "nll_corrected": "NLL corrected",
    "nll_gap_closed": "NLL gap closed",
}


# Heavy imports (torch, transformers, mergekit) happen inside the commands, so `--help` and
# `validate` answer at once.


def packaged_config(name: str) -> Path:
    """A config shipped inside the package (the embedded demo and its tiny twin)."""
    return Path(str(resources.files("darts_dist") / "configs" / f"{name}.yaml"))


def _with_output_dir(config: RunConfig, output_dir: Path | None) -> RunConfig:
    return config if output_dir is None else config.model_copy(update={"output_dir": output_dir.absolute()})


def print_results(title: str, evaluation: dict) -> None:
    from darts_dist.evaluate import evaluation_rows

    table = Table(title=title)
    table.add_column("task")
    for heading in TABLE_COLUMNS.values():
        table.add_column(heading, justify="right")
    for row in evaluation_rows(evaluation["tasks"], list(TABLE_COLUMNS)):
        table.add_row(*row)
    console.print(table)


def _finish(report: dict, report_path: Path | None, default: Path) -> None:
    from darts_dist.pipeline import write_report

    path = write_report(report_path or default, report)
    console.print(f"report: {path}")


def cmd_validate(args: argparse.Namespace) -> None:
    data = read_yaml(args.config)
    if is_mergekit_yaml(data):
        from darts_dist.merge import load_mergekit_yaml

        load_mergekit_yaml(args.config)
        console.print(f"{args.config}: valid mergekit YAML")
        return
    config = load_config(args.config)
    console.print(f"{args.config}: valid darts-dist config for tasks {list(config.tasks)}")


def cmd_merge(args: argparse.Namespace) -> None:
    if args.out.exists() and not args.overwrite:
        raise DartsError(f"merge output folder {args.out.absolute()} already exists",
                         "choose a new --out folder, or pass --overwrite to replace it")
    data = read_yaml(args.config)
    if is_mergekit_yaml(data):
        from darts_dist.merge import load_mergekit_yaml, run_merge

        out = run_merge(load_mergekit_yaml(args.config), args.out, overwrite=args.overwrite)
    else:
        from darts_dist.merge import run_merge
        from darts_dist.pipeline import mergekit_config_for
        from darts_dist.sources import resolve_sources

        config = load_config(args.config)
        out = run_merge(mergekit_config_for(config, resolve_sources(config)), args.out, overwrite=args.overwrite)
    console.print(f"merged model: {out}")
    if args.report:
        _finish({"merged": str(out)}, args.report, args.report)


def cmd_calibrate(args: argparse.Namespace) -> None:
    from darts_dist.pipeline import prepare, run_calibration

    config = _with_output_dir(load_config(args.config), args.output_dir)
    state = prepare(config)
    console.print(f"corrections: {run_calibration(state)}")
    _finish(state.report, args.report, config.run_dir / "calibration.json")


def cmd_evaluate(args: argparse.Namespace) -> None:
    from darts_dist.pipeline import prepare, run_evaluation

    config = _with_output_dir(load_config(args.config), args.output_dir)
    corrections = args.corrections or config.run_dir / "corrections.safetensors"
    if not corrections.is_file():
        raise DartsError(f"no corrections at {corrections}",
                         f"run `darts-dist calibrate {args.config}` first, or pass --corrections PATH")
    state = prepare(config)
    print_results(f"{config.name}: held-out, merged vs. corrected", run_evaluation(state, corrections))
    _finish(state.report, args.report, config.run_dir / "evaluation.json")


def cmd_demo(args: argparse.Namespace) -> None:
    from darts_dist.pipeline import prepare, run_calibration, run_evaluation

    name = "tiny" if args.tiny else "demo"
    config = _with_output_dir(load_config(packaged_config(name)), args.output_dir)
    if args.steps is not None:
        config = config.model_copy(update={"calibration": config.calibration.model_copy(update={"steps": args.steps})})
    console.print(f"darts-dist demo ({name}): run folder {config.run_dir}")
    state = prepare(config)
    console.print(f"corrections: {run_calibration(state)}")
    evaluation = run_evaluation(state, Path(state.report["corrections"]))
    print_results(f"darts-dist demo ({name}): held-out, merged vs. DARTS", evaluation)
    console.print(f"plots: {config.run_dir / 'plots'}")
    _finish(state.report, args.report, config.run_dir / "report.json")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="darts-dist", description=__doc__.splitlines()[0].split(": ", 1)[1])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, help_text: str, func) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(func=func)
        return p

    demo = command("demo", "run the main job on the embedded default (SmolLM2-135M and its demo experts)", cmd_demo)
    demo.add_argument("--tiny", action="store_true", help="the same pipeline on tiny random models (about a minute)")
    demo.add_argument("--steps", type=int, default=None, help="override calibration.steps")

    merge = command("merge", "merge the experts with mergekit (CONFIG: a darts-dist or a mergekit YAML)", cmd_merge)
    merge.add_argument("config", type=Path)
    merge.add_argument("--out", type=Path, required=True, help="output folder of the merged model")
    merge.add_argument("--overwrite", action="store_true", help="replace an existing output folder")

    calibrate = command("calibrate", "merge (or reuse the merge), then calibrate DARTS corrections", cmd_calibrate)
    calibrate.add_argument("config", type=Path)

    evaluate = command("evaluate", "held-out bias by position and NLL: merged vs. corrected vs. expert", cmd_evaluate)
    evaluate.add_argument("config", type=Path)
    evaluate.add_argument("--corrections", type=Path, default=None, help="default: RUN_DIR/corrections.safetensors")

    validate = command("validate", "check a darts-dist or mergekit YAML without doing any work", cmd_validate)
    validate.add_argument("config", type=Path)

    for p in (demo, calibrate, evaluate):
        p.add_argument("--output-dir", type=Path, default=None, help="override the config's output_dir")
    for p in (demo, merge, calibrate, evaluate):
        p.add_argument("--report", type=Path, default=None, help="write a JSON report here")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except DartsError as error:
        errors.print(Text.assemble(("error: ", "bold red"), error.what), highlight=False)
        if error.fix:
            errors.print(Text.assemble(("fix: ", "bold"), error.fix), highlight=False)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
