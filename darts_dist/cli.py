"""`darts-dist`: the command line. Glue only; the work happens in pipeline's stages."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, get_args

from rich.console import Console
from rich.table import Table
from rich.text import Text

from darts_dist.config import (
    CORRECTIONS_FILE,
    ComputeDtype,
    RunConfig,
    TrackingSection,
    is_mergekit_yaml,
    load_config,
    packaged_config,
    read_yaml,
    updated,
)
from darts_dist.errors import DartsError
from darts_dist.logs import (
    VERBOSE_ENV,
    init_ray,
    keep_local_ray_on_loopback,
    quiet_library_notices,
    quiet_library_progress,
    show_progress_logs,
)
from darts_dist.options import add_config_flags, apply_config_flags
from darts_dist.redaction import redacted

if TYPE_CHECKING:  # for annotations only: these modules import torch and MLflow, which take seconds
    from darts_dist.pipeline import RunState
    from darts_dist.tracking.runs import Tracking

logger = logging.getLogger("darts_dist.cli")


DTYPES = get_args(ComputeDtype)
# The phases a calibrating command runs (the plan's roles it checks first): `evaluate` runs the evaluation alone.
RUN_PHASES = ("merge", "calibration", "evaluation", "registration")
# Wide enough for the result table when output goes to a file or CI log (rich assumes 80 there).
console = Console(width=None if sys.stdout.isatty() else 240)  # piped: wide enough for the score and plan tables
errors = Console(stderr=True, soft_wrap=True)  # paths in messages stay on one line

# Heavy imports (torch, transformers, mergekit) happen inside the commands, so `--help` and
# `validate` answer at once.


def command_config(path: Path, args: argparse.Namespace) -> RunConfig:
    """The YAML at `path` with the command line's config flags applied, all validated."""
    return apply_config_flags(load_config(path), args)


def print_tables(tables: Sequence[tuple[str, Sequence[str], Sequence[Sequence[str]]]]) -> None:
    for title, headers, rows in tables:
        table = Table(title=title)
        for index, heading in enumerate(headers):
            table.add_column(heading, justify="left" if index == 0 else "right")
        for row in rows:
            table.add_row(*row)
        console.print(table)


def print_evaluation(title: str, evaluation: dict) -> None:
    from darts_dist.evaluate.tables import evaluation_tables  # imports torch: only once an evaluation ran

    print_tables(evaluation_tables(title, evaluation))


@contextmanager
def _session(settings: TrackingSection, name: str, command: str) -> Iterator[Tracking]:
    """The command's MLflow session; it fails fast, before any model loads, if the store is unreachable."""
    from darts_dist.tracking.runs import session

    with session(settings, name, command) as tracking:
        # Said first, so the run can be found (and `darts-dist register`ed) even if the command fails.
        logger.info("mlflow: run %s at %s", tracking.run_id, tracking.uri)
        yield tracking


def _finish(report: dict, report_path: Path | None, default: Path, tracking: Tracking | None = None) -> None:
    from darts_dist.pipeline import write_report

    if tracking is not None and tracking.offline is not None:
        report.setdefault("tracking", {})["offline"] = tracking.offline
    path = write_report(report_path or default, report)
    console.print(f"report: {path}")
    if tracking is not None:
        tracking.log_json(tracking.run_id, report, "report.json")
        if tracking.offline is not None:
            kept = [str(p) for p in (report.get("corrections"),
                                     report.get("calibration", {}).get("job", {}).get("checkpoint_path")) if p]
            raise DartsError(
                f"the MLflow store {tracking.uri} stopped answering during the run ({tracking.offline}); the "
                f"results are complete ({', '.join(kept + [str(path)])}) but not all tracked, and nothing was registered",
                f"once the store answers again: darts-dist register {path}  (logs what is missing, then registers)",
            )


def _print_registration(state: RunState) -> None:
    tracked = state.report.get("tracking", {})
    if "model_uri" in tracked:
        console.print(f"registered: {tracked['model_uri']}; {tracked['decision']}")
    elif "decision" in tracked:
        console.print(tracked["decision"])


def cmd_validate(args: argparse.Namespace) -> None:
    data = read_yaml(args.config)
    if is_mergekit_yaml(data):
        from darts_dist.merge.mergekit import load_mergekit_yaml

        load_mergekit_yaml(args.config)
        console.print(f"{args.config}: valid mergekit YAML")
        return
    config = load_config(args.config)
    from darts_dist.merge.mergekit import check_merge_method

    check_merge_method(config.merge)
    console.print(f"{args.config}: valid darts-dist config for tasks {list(config.tasks)}")


def cmd_merge(args: argparse.Namespace) -> None:
    from darts_dist.merge.mergekit import check_merge_method, load_mergekit_yaml, mergekit_model_paths, run_merge
    from darts_dist.tracking.runs import log_config, log_merge

    if args.out.exists() and not args.overwrite:
        raise DartsError(f"merge output folder {args.out.absolute()} already exists",
                         "choose a new --out folder, or pass --overwrite to replace it")
    # Both kinds of YAML are validated before the session opens; a mergekit YAML tracks to the defaults.
    config = None if is_mergekit_yaml(read_yaml(args.config)) else load_config(args.config)
    if config is not None:
        check_merge_method(config.merge)
    if config is None:
        mergekit_config = load_mergekit_yaml(args.config)
        settings, name = TrackingSection(), args.config.stem
    else:
        settings, name = config.tracking, config.name
    with _session(settings, name, "merge") as tracking:
        if config is None:
            sources = {f"model_{i}": path for i, path in enumerate(mergekit_model_paths(mergekit_config))}
            out = run_merge(mergekit_config, args.out, overwrite=args.overwrite)
        else:
            from darts_dist.merge.stage import merged_into
            from darts_dist.sources.references import resolve_sources

            log_config(tracking, config)
            resolved = resolve_sources(config)
            sources = {"base": resolved.base, **resolved.experts}
            out = merged_into(config, resolved, args.out, overwrite=args.overwrite)
        log_merge(tracking, out, sources)
    console.print(f"merged model: {out}")
    if args.report:
        _finish({"merged": str(out), "tracking": {"uri": tracking.uri, "run_id": tracking.run_id}},
                args.report, args.report)


def cmd_calibrate(args: argparse.Namespace) -> None:
    _calibrate(command_config(args.config, args), args, "calibrate")


def cmd_recalibrate(args: argparse.Namespace) -> None:
    from darts_dist.recalibrate import remove_traffic_copies, traffic_config

    config, traffic = traffic_config(command_config(args.config, args), args.from_traffic)
    try:
        console.print(f"recalibrating as {config.name} with captured prompts: " + ", ".join(
            f"{task} {traffic['used'][task]} of {count}" for task, count in traffic["captured"].items()))
        _calibrate(config, args, "recalibrate", {"traffic": traffic})
    finally:
        remove_traffic_copies(config)


def _print_products(report: dict) -> None:
    """What the calibration made: the learned merge (merge coefficients) and the corrections."""
    if "coefficients" in report:
        console.print(f"learned merge: {report['coefficients']['learned_merge']} (its mergekit YAML: mergekit_config.yml)")
    if "corrections" in report:
        console.print(f"corrections: {report['corrections']}")


def _calibrate(config: RunConfig, args: argparse.Namespace, command: str, notes: dict | None = None) -> None:
    from darts_dist.merge.mergekit import check_merge_method
    from darts_dist.pipeline import has_heldout, prepare, register_calibration, run_calibration, run_evaluation
    from darts_dist.plan.check import check_run

    check_merge_method(config.merge)
    check_run(config, RUN_PHASES)
    with _session(config.tracking, config.name, command) as tracking:
        state = prepare(config, tracking)
        state.report.update(notes or {})
        corrections = run_calibration(state)
        _print_products(state.report)
        # The registry's alias moves on held-out results, so evaluate whenever there is held-out data.
        if has_heldout(state):
            print_evaluation(f"{config.name}: held-out, merged vs. corrected", run_evaluation(state, corrections))
        with state.timed("registration"):
            register_calibration(state)
        _print_registration(state)
        _finish(state.report, args.report, config.run_dir / "calibration.json", tracking)


def cmd_evaluate(args: argparse.Namespace) -> None:
    from darts_dist.pipeline import prepare, run_evaluation
    from darts_dist.plan.check import check_run

    config = command_config(args.config, args)
    corrections = args.corrections or config.run_dir / CORRECTIONS_FILE
    if not config.calibration_method.trains_corrections and not corrections.is_file():
        corrections = None  # the learned merge alone, judged against the run's merge
    elif not corrections.is_file():
        raise DartsError(f"no corrections at {corrections}",
                         f"run `darts-dist calibrate {args.config}` first, or pass --corrections PATH")
    check_run(config, ("evaluation",))
    with _session(config.tracking, config.name, "evaluate") as tracking:
        state = prepare(config, tracking)
        print_evaluation(f"{config.name}: held-out, merged vs. corrected", run_evaluation(state, corrections))
        _finish(state.report, args.report, config.run_dir / "evaluation.json", tracking)


def _make_demo_experts(out: Path | None) -> None:
    from darts_dist.sources.references import make_demo_experts

    for task, made in make_demo_experts(out).items():
        console.print(f"{task}: {made['folder']} (training loss {made['first_loss']:.3f} -> {made['last_loss']:.3f}; "
                      f"the adapter keeps {made['kept']:.1%} of the change; held-out NLL base {made['nll']['base']:.3f}, "
                      f"expert {made['nll']['expert']:.3f}; adapter sha256 "
                      f"{made['files']['adapter_model.safetensors'][:16]})")


def cmd_demo(args: argparse.Namespace) -> None:
    from darts_dist.pipeline import prepare, register_calibration, run_calibration, run_evaluation
    from darts_dist.plan.check import check_run

    if args.make_experts:
        return _make_demo_experts(args.experts_out)
    name = "tiny" if args.tiny else "demo"
    config = command_config(packaged_config(name), args)
    logger.info("darts-dist demo (%s): run folder %s", name, config.run_dir)
    if args.ablate:  # the ablation table on the same config instead of one calibration
        return _ablate(config, args)
    if args.merge_methods or args.tune or args.validation_fraction is not None or args.seeds != 1 or args.basic \
            or args.variants:
        raise DartsError("--merge-methods, --tune, --validation-fraction, --seeds, --basic and --variants choose "
                         "what the ablation compares",
                         "add --ablate to run the ablation")
    check_run(config, RUN_PHASES)
    with _session(config.tracking, config.name, "demo") as tracking:
        state = prepare(config, tracking)
        corrections = run_calibration(state)
        _print_products(state.report)
        evaluation = run_evaluation(state, corrections)
        print_evaluation(f"darts-dist demo ({name}): held-out, merged vs. DARTS", evaluation)
        from darts_dist.evaluate.tables import retention_line

        if (retained := retention_line(evaluation)) is not None:
            console.print(retained)
        if not args.tiny:  # the shipped experts' documented scores: does this machine reproduce them?
            from darts_dist.sources.references import demo_reproduction

            state.report["reproduction"], line = demo_reproduction(evaluation)
            console.print(line)
        console.print(f"plots: {config.run_dir / 'plots'}")
        with state.timed("registration"):
            register_calibration(state)
        _print_registration(state)
        seconds = state.report["seconds"]
        console.print("time per stage: " + ", ".join(f"{stage} {value:.0f} s" for stage, value in seconds.items())
                      + f"; total {sum(seconds.values()):.0f} s")
        if "evaluation_cache" in state.report:
            console.print("output cache (evaluation.cache: the base's, experts' and merge's passes kept between runs): "
                          "{hits} read back, {misses} computed".format(**state.report["evaluation_cache"]))
        _finish(state.report, args.report, config.run_dir / "report.json", tracking)


def cmd_ablate(args: argparse.Namespace) -> None:
    _ablate(command_config(args.config, args), args)


def _ablate(config: RunConfig, args: argparse.Namespace) -> None:
    from darts_dist.ablation import ablation_tables, plan_ablation, run_ablation
    from darts_dist.plan.check import check_dtype

    check_dtype(config)
    methods = [m.strip() for m in args.merge_methods.split(",") if m.strip()] if args.merge_methods else None
    deep = [part.strip() for part in args.deep_layers.split(",") if part.strip()]
    variants = [v.strip() for v in args.variants.split(",") if v.strip()] if args.variants else None
    plan = plan_ablation(config, methods, trials=args.tune, validation_fraction=args.validation_fraction,
                         select=args.select, seeds=args.seeds, deep_layers=deep, extended=not args.basic,
                         variants=variants)
    with _session(config.tracking, config.name, "ablate") as tracking:
        report = run_ablation(plan, tracking)
        print_tables([(f"{config.name}: {title}", headers, rows) for title, headers, rows in ablation_tables(report)])
        _finish(report, args.report, config.run_dir / "ablation.json", tracking)


def cmd_merge_sweep(args: argparse.Namespace) -> None:
    from darts_dist.merge_sweep import DEFAULT_CANDIDATES, MergeCandidate, sweep_merges, sweep_table
    from darts_dist.plan.check import check_dtype

    config = command_config(args.config, args)
    check_dtype(config)
    candidates = [MergeCandidate.parse(text) for text in args.candidates] if args.candidates else DEFAULT_CANDIDATES
    with _session(config.tracking, config.name, "merge-sweep") as tracking:
        report = sweep_merges(config, candidates, tracking)
        print_tables([sweep_table(report)])
        console.print(f"best on validation: {report['best']}  (merge.method / merge.parameters for the config)")
        _finish(report, args.report, config.run_dir / "merge_sweep.json", tracking)


def cmd_register(args: argparse.Namespace) -> None:
    from darts_dist.plan.check import check_registration
    from darts_dist.tracking.registry import calibration_config, register_run
    from darts_dist.tracking.runs import connect, tracking_uri

    run_id, configured, report_path = _registration_target(args.run)
    client = connect(tracking_uri(configured))
    if report_path is not None:  # a run whose store went away: what it could not log first (its calibration run)
        _complete_offline_run(client, report_path)
    config = calibration_config(client, run_id)
    check_registration(updated(config, calibration=updated(config.calibration, dtype=args.dtype))
                       if args.dtype else config)
    registration = register_run(client, run_id, name=args.name, alias=args.alias, dtype=args.dtype)
    if report_path is not None:
        _record_registration(client, report_path, registration)
    console.print(f"registered: {registration.model_uri}; {registration.decision}")
    if args.report:
        _finish({"tracking": {"uri": client.tracking_uri, "run_id": run_id, **registration.to_dict()}},
                args.report, args.report)


def _gib(value: int) -> str:
    return f"{value / (1 << 30):.2f}"


def cmd_plan(args: argparse.Namespace) -> None:
    from darts_dist.plan import build_plan
    from darts_dist.plan.check import FIX
    from darts_dist.plan.cluster import gpu_memory, problems, read_nodes
    from darts_dist.sources.models import VOCABULARY_POLICY

    config = command_config(args.config, args)
    plan = build_plan(config)
    shapes = {"merged (the base's shape)": plan.merged, **{f"expert {t}": s for t, s in plan.experts.items()}}
    print_tables([("models (from config.json, meta device)",
                   ["model", "parameters", "vocabulary", "GiB fp32", "GiB bf16", "KV MiB/token bf16"],
                   [[name, f"{s.parameters:,}", f"{s.vocab_size:,}", _gib(s.weight_bytes("float32")),
                     _gib(s.weight_bytes("bfloat16")), f"{s.kv_bytes_per_token('bfloat16') / (1 << 20):.3f}"]
                    for name, s in shapes.items()])])
    added = {task: s.vocab_size - plan.merged.vocab_size for task, s in plan.experts.items()
             if s.vocab_size != plan.merged.vocab_size}
    console.print("vocabulary: " + (", ".join(f"expert {task} has {rows:+d} rows beside the base's "
                                              f"{plan.merged.vocab_size:,}" + (" (refused: fewer than the base's)"
                                                                               if rows < 0 else "")
                                              for task, rows in added.items())
                                    if added else "every expert has the base's") + f"; the policy: {VOCABULARY_POLICY}")
    parts = sorted({part for role in plan.roles for part in role.parts})
    print_tables([("roles: GiB per instance, at its peak", ["role", "count", "device", "resources", "peak stage",
                                                            *parts, "total"],
                   [[r.name, str(r.count), r.device, ", ".join(f"{k} {v:g}" for k, v in r.bundle.items() if v),
                     r.peak_stage or "-", *(_gib(r.parts[p]) if p in r.parts else "-" for p in parts), _gib(r.bytes)]
                    for r in plan.roles])])
    for role in plan.roles:
        if role.resident_bytes < role.bytes:
            console.print(f"{role.name}: {_gib(role.resident_bytes)} GiB resident at most (its mapped inputs are "
                          "weight files read once: page cache the system drops under pressure)")
    console.print(f"corrections: {plan.correction_parameters:,} parameters, {plan.correction_share:.3%} of the "
                  "model's")
    if args.address is None and args.resources is None:
        console.print("no cluster given (--address or --resources): fit not checked")
        return
    nodes = read_nodes(args.address, args.resources)
    gpu_bytes, said = gpu_memory(nodes, args.gpu_memory)
    console.print(f"cluster: {len(nodes)} node(s), {sum(n.get('CPU', 0) for n in nodes):g} CPUs, "
                  f"{sum(n.get('GPU', 0) for n in nodes):g} GPUs of {said}")
    found = problems(plan.roles, nodes, gpu_bytes)
    if found:
        raise DartsError("the cluster cannot hold this run:\n    " + "\n    ".join(found), FIX)
    console.print("fits: every phase's actors find a node" + ("" if gpu_bytes else "; GPU memory not checked"))


def cmd_export(args: argparse.Namespace) -> None:
    from darts_dist.export import export_model, read_source
    from darts_dist.plan.check import check_export

    source = read_source(args.source, tracking=args.tracking_uri)
    check_export(source.files.merged_dir)
    out = export_model(source, args.out, fmt=args.format, task=args.task, overwrite=args.overwrite, dtype=args.dtype)
    console.print(f"exported ({args.format}): {out}")


def cmd_serve(args: argparse.Namespace) -> None:
    if not os.environ.get("RAY_ADDRESS") and "ray" not in sys.modules:
        # The Ray node this command starts for itself keeps every listener on 127.0.0.1 (logs.LOOPBACK_RAY_ENV says
        # why); only Serve's HTTP proxy follows --host.
        keep_local_ray_on_loopback()
    from darts_dist.plan.check import check_serving
    from darts_dist.serve.access import resolve_api_key
    from darts_dist.serve.runner import run_foreground
    from darts_dist.serve.model import resolve_model, serve_settings

    source, config = resolve_model(args.model, tracking=args.tracking_uri, corrections=args.corrections,
                                   router=args.router, name=args.name)
    settings = serve_settings(config, args.config, host=args.host, port=args.port, dtype=args.dtype)
    check_serving(source, config, settings, os.environ.get("RAY_ADDRESS"))
    api_key = resolve_api_key(args.api_key, args.api_key_file, settings.api_key_file)
    run_foreground(source, settings, api_key, say=console.print)


def cmd_serve_deploy(args: argparse.Namespace) -> None:
    from darts_dist.plan.check import check_serving
    from darts_dist.serve.access import resolve_api_key
    from darts_dist.serve.runner import follows, start
    from darts_dist.serve.model import resolve_model, serve_settings

    address = args.address or os.environ.get("RAY_ADDRESS")
    if not address:
        raise DartsError("serve-deploy deploys onto a running Ray cluster, and none was named",
                         "pass --address HOST:PORT or set RAY_ADDRESS (a Ray job has it set: `ray job submit ... -- "
                         "python jobs/run.py serve-deploy MODEL_URI`); `darts-dist serve` serves from this machine")
    source, config = resolve_model(args.model, tracking=args.tracking_uri, corrections=args.corrections,
                                   router=args.router, name=args.name)
    settings = serve_settings(config, args.config, host=args.host, port=args.port, dtype=args.dtype)
    check_serving(source, config, settings, address)
    api_key = resolve_api_key(args.api_key, args.api_key_file, settings.api_key_file)
    init_ray(address=address)
    url = start(source, settings, api_key, detached=True)
    console.print(f"deployed {source.name} at {url}; it keeps serving on the cluster after this command "
                  "(`serve shutdown` removes it, and its alias follower with it)")
    if follows(source, settings):
        console.print(f"following {source.alias} every {settings.alias_poll_s:g} s (a detached actor, "
                      "darts-dist-alias-follower, in namespace darts-dist)")


REPORT_NAMES = ("report.json", "calibration.json")


def _complete_offline_run(client, report_path: Path) -> None:
    """A run whose store went away mid-way (its report says `offline`): log what it could not, first."""
    import json

    from darts_dist.pipeline import complete_tracking, write_report
    from darts_dist.tracking.runs import Tracking

    report = json.loads(report_path.read_text())
    tracked = report["tracking"]
    if "offline" not in tracked:
        return
    tracking = Tracking(client=client, uri=client.tracking_uri, experiment_id=tracked["experiment_id"],
                        run_id=tracked["run_id"], stages=dict(tracked["stage_runs"]))
    complete_tracking(tracking, report)
    if tracking.offline is not None:
        raise DartsError(f"the MLflow store {tracking.uri} stopped answering again ({tracking.offline})",
                         f"run `darts-dist register {report_path}` again once it answers")
    write_report(report_path, report)  # no longer offline
    console.print(f"tracked what the run could not log while the store was down ({report_path})")


def _record_registration(client, report_path: Path, registration) -> None:
    """The run's report (its folder's file, and the copy on its MLflow run) says what was registered, as the report
    of a run that registered itself does: the logged model, the version, the alias and the decision."""
    import json

    from darts_dist.pipeline import write_report
    from darts_dist.tracking.registry import MODEL_URI_TAG
    from darts_dist.tracking.runs import Tracking

    report = json.loads(report_path.read_text())
    tracked = report["tracking"]
    logged = client.get_run(tracked["stage_runs"]["calibration"]).data.tags[MODEL_URI_TAG]
    tracked.update({"logged_model_uri": logged, **registration.to_dict()})
    Tracking(client=client, uri=client.tracking_uri, experiment_id=tracked["experiment_id"],
             run_id=tracked["run_id"]).log_json(tracked["run_id"], report, "report.json")
    write_report(report_path, report)


def _registration_target(target: str) -> tuple[str, str, Path | None]:
    """(run id, configured tracking URI, report path or None) from a run id, a run folder or a report."""
    import json

    folder = Path(target)
    if not folder.exists():
        return target, TrackingSection().uri, None
    for path in [folder] if folder.is_file() else [folder / name for name in REPORT_NAMES]:
        if path.is_file():
            report = json.loads(path.read_text())
            if "run_id" in report.get("tracking", {}):
                return report["tracking"]["run_id"], report["config"]["tracking"]["uri"], path
    raise DartsError(f"{folder} holds no report of a tracked calibration ({' or '.join(REPORT_NAMES)})",
                     "pass the MLflow run id instead, or the folder a `calibrate` or `demo` run wrote")


Command = Callable[[str, str, Callable[[argparse.Namespace], None]], argparse.ArgumentParser]


def _run_commands(command: Command) -> dict[str, argparse.ArgumentParser]:
    """The commands that run the pipeline's stages, or check a config."""
    demo = command("demo", "run the main job on the embedded default (SmolLM2-135M and its demo experts)", cmd_demo)
    demo.add_argument("--tiny", action="store_true", help="the same pipeline on tiny random models (about a minute)")
    demo.add_argument("--ablate", action="store_true",
                      help="run the ablation (as `darts-dist ablate`) on the demo config instead of one calibration")
    demo.add_argument("--make-experts", action="store_true",
                      help="make the demo experts (fp32, seeded; about 15 minutes) and write them as the package "
                      "ships them, instead of running the demo")
    demo.add_argument("--experts-out", type=Path, default=None, metavar="DIR",
                      help="where --make-experts writes (default: the package's darts_dist/sources/demo/experts)")

    merge = command("merge", "merge the experts with mergekit (CONFIG: a darts-dist or a mergekit YAML)", cmd_merge)
    merge.add_argument("config", type=Path)
    merge.add_argument("--out", type=Path, required=True, help="output folder of the merged model")
    merge.add_argument("--overwrite", action="store_true", help="replace an existing output folder")

    calibrate = command("calibrate", "merge (or reuse the merge), calibrate DARTS corrections, evaluate them "
                        "(given held-out data) and register the model", cmd_calibrate)
    calibrate.add_argument("config", type=Path)
    recalibrate = command("recalibrate", "calibrate again with prompts a server captured (serve.capture), evaluate "
                          "and register: the alias moves only on a held-out evaluation at least as good", cmd_recalibrate)
    recalibrate.add_argument("config", type=Path, help="the config of the served model's calibration")
    recalibrate.add_argument("--from-traffic", type=Path, required=True, metavar="DIR",
                             help="the folder the server captured into (serve.capture.dir)")

    evaluate = command("evaluate", "held-out bias by position and NLL: merged vs. corrected vs. expert", cmd_evaluate)
    evaluate.add_argument("config", type=Path)
    evaluate.add_argument("--corrections", type=Path, default=None, help="default: RUN_DIR/corrections.safetensors")

    register = command("register", "register a tracked calibration as a new model version (if not yet)",
                       cmd_register)
    register.add_argument("run", metavar="RUN_ID_OR_RUN_DIR", help="an MLflow run id, or a run folder with its report")
    register.add_argument("--name", default=None, help="registered model name (default: the run's config)")
    register.add_argument("--alias", default=None, help="alias to decide on (default: the run's tracking.alias)")
    register.add_argument("--dtype", choices=DTYPES, default=None,
                          help="the dtype the registered model computes in, and its check before registration "
                          "(default: the run's calibration.dtype)")

    validate = command("validate", "check a darts-dist or mergekit YAML without doing any work", cmd_validate)
    validate.add_argument("config", type=Path)
    return {"demo": demo, "merge": merge, "calibrate": calibrate, "recalibrate": recalibrate, "evaluate": evaluate,
            "register": register}


def _serving_commands(command: Command) -> None:
    """Serving (in the foreground or onto a cluster), the plan of a run's roles, and export."""
    serve = command("serve", "serve a model behind an OpenAI-compatible API (Ray Serve) until Ctrl-C", cmd_serve)
    deploy = command("serve-deploy", "deploy the same app onto a running Ray cluster and return (a Ray job's entry)",
                     cmd_serve_deploy)
    deploy.add_argument("--address", default=None, help="the cluster (default: RAY_ADDRESS, which a Ray job sets)")
    for p in (serve, deploy):
        p.add_argument("model", metavar="MODEL_URI",
                       help="models:/NAME@ALIAS, models:/NAME/VERSION, a run folder, or a merged model folder")
        p.add_argument("--host", default=None, help="address to bind (default: serve.host if it is a loopback "
                       "address, else 127.0.0.1: only this flag binds beyond this machine)")
        p.add_argument("--port", type=int, default=None, help="port (default: serve.port, 8000)")
        p.add_argument("--dtype", choices=DTYPES, default=None,
                       help="the replicas' compute dtype (auto: bfloat16 on GPUs, float32 on CPUs; default: serve.dtype, "
                       "and where that is auto the model's run's calibration.dtype)")
        p.add_argument("--api-key-file", type=Path, default=None,
                       help="require 'Authorization: Bearer KEY', a KEY per line of the file, `KEY` or `NAME KEY` "
                       "(else $DARTS_DIST_API_KEY)")
        p.add_argument("--api-key", default=None,
                       help="the key itself: every user of the machine sees it in `ps` (prefer --api-key-file)")
        p.add_argument("--config", type=Path, default=None,
                       help="a darts-dist YAML whose serve section to use (default: the model's own run config)")
        p.add_argument("--tracking-uri", default=None, help="the registry for models:/ URIs (default: "
                       "MLFLOW_TRACKING_URI, else sqlite:///mlflow.db)")
        p.add_argument("--name", default=None, help="model name in the served ids (default: the registered name)")
        p.add_argument("--corrections", type=Path, default=None, help="corrections file, for a merged model folder")
        p.add_argument("--router", type=Path, default=None, help="router file, for a merged model folder")

    plan = command("plan", "what each role of a run holds (from config.json files alone, no weights) and whether "
                   "a cluster has room for it", cmd_plan)
    plan.add_argument("config", type=Path)
    where = plan.add_mutually_exclusive_group()
    where.add_argument("--address", default=None, help="a running Ray cluster to check against (ADDR or auto)")
    where.add_argument("--resources", type=Path, default=None, metavar="FILE",
                       help="a JSON/YAML file shaped like ray.cluster_resources(), or a list of them (one per node)")
    plan.add_argument("--gpu-memory", type=float, default=None, metavar="GIB",
                      help="one GPU's memory (default: from the nodes' accelerator_type, else not checked)")

    export = command("export", "write the corrected model as a Hugging Face folder that transformers loads without "
                     "darts-dist (--format hf), or its correction alone (--format correction)", cmd_export)
    export.add_argument("source", metavar="SOURCE", help="a run folder, models:/NAME@ALIAS or models:/NAME/VERSION")
    export.add_argument("--out", type=Path, required=True, help="the folder to write")
    export.add_argument("--format", choices=("hf", "correction"), default="hf",
                        help="hf: weights, corrections, router, code, tokenizer, model card; correction: the "
                        "corrections and router alone (default hf)")
    export.add_argument("--task", default=None, metavar="TASK",
                        help="the correction applied when a call names none: a task, merged or routed "
                        "(default routed, given a router)")
    export.add_argument("--overwrite", action="store_true", help="replace an existing --out folder")
    export.add_argument("--dtype", choices=[name for name in DTYPES if name != "auto"], default=None,
                        help="the exported weights' dtype, which transformers loads with dtype='auto' (default: the "
                        "merged model's own)")
    export.add_argument("--tracking-uri", default=None, help="the registry for models:/ URIs (default: "
                        "MLFLOW_TRACKING_URI, else sqlite:///mlflow.db)")


def _ablation_commands(command: Command, demo: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """`ablate` and `merge-sweep`; the ablation's flags also on `demo` (demo --ablate)."""
    ablate = command("ablate", "the ablation table: merged, Surgery, +entropy, +position, DARTS, per merge method; "
                     "deep DARTS, learned merge coefficients (+DARTS), TALL masks and EMR",
                     cmd_ablate)
    ablate.add_argument("config", type=Path)
    for p in (demo, ablate):
        p.add_argument("--merge-methods", default=None, metavar="M1,M2",
                       help="merge methods to compare, mergekit's, regmean or regmean_plus (default: the config's, "
                       "task_arithmetic, ties)")
        p.add_argument("--tune", type=int, default=0, metavar="TRIALS",
                       help="tune Surgery and DARTS with this many paired trials each on a validation split (default 0)")
        p.add_argument("--validation-fraction", type=float, default=None,
                       help="share of the calibration data held back for tuning (default: the config's, else 0.2)")
        p.add_argument("--select", default="nll_gap_closed",
                       help="validation metric tuning maximises (default nll_gap_closed)")
        p.add_argument("--seeds", type=int, default=1,
                       help="train every variant with this many seeds; the tables give mean ± sd (default 1)")
        p.add_argument("--deep-layers", default="changed,final", metavar="L1,L2",
                       help="deep DARTS's surgery layers: indices, final, all, every:N, changed (default changed,final)")
        p.add_argument("--basic", action="store_true",
                       help="only merged, Surgery, +entropy, +position and DARTS (no deep DARTS, no learned coefficients, "
                       "no TALL or EMR)")
        p.add_argument("--variants", default=None, metavar="V1,V2",
                       help="only these of merged, surgery, entropy, position, darts, deep, coefficients, tall, emr, "
                       "rank16, rank64 (DARTS at that rank), darts+logits (DARTS with the logit term) (default all "
                       "but the ranked ones and darts+logits; deep DARTS and the learned coefficients need darts)")
    sweep = command("merge-sweep", "score candidate merges on the validation split and name the best", cmd_merge_sweep)
    sweep.add_argument("config", type=Path)
    sweep.add_argument("--candidates", nargs="+", default=None, metavar="METHOD[:K=V,...]",
                       help="merges to try, e.g. task_arithmetic:weight=0.5 ties:weight=1,density=0.5 "
                       "(default: task arithmetic at 0.3, 0.5, 0.7, 1.0 and TIES at density 0.5)")
    return {"ablate": ablate, "merge-sweep": sweep}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="darts-dist", description="Merge fine-tuned decoder LLMs with mergekit and repair the merge with DARTS.")
    parser.add_argument("--verbose", action="store_true",
                        help="show Ray's own log lines too (they go to Ray's log files otherwise)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, help_text: str, func: Callable[[argparse.Namespace], None]) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(func=func)
        return p

    runs = _run_commands(command)
    _serving_commands(command)
    ablations = _ablation_commands(command, runs["demo"])
    demo, merge, calibrate, recalibrate, evaluate, register = (runs[name] for name in (
        "demo", "merge", "calibrate", "recalibrate", "evaluate", "register"))
    ablate, sweep = ablations["ablate"], ablations["merge-sweep"]
    add_config_flags(demo, "--steps")
    add_config_flags(recalibrate, "--traffic-share", "--traffic-client-share")
    for p in (demo, calibrate, recalibrate, evaluate, ablate, sweep):
        add_config_flags(p, "--score-limit", "--sandbox", "--output-dir")
    for p in (demo, calibrate, recalibrate):
        add_config_flags(p, "--address", "--in-process")
    for p in (demo, calibrate, recalibrate, evaluate, ablate, sweep):
        add_config_flags(p, "--dtype")
    for p in (demo, merge, calibrate, recalibrate, evaluate, register, ablate, sweep):
        p.add_argument("--report", type=Path, default=None, help="write a JSON report here")
    return parser




def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.verbose:
        os.environ[VERBOSE_ENV] = "1"
    show_progress_logs()
    quiet_library_progress()
    quiet_library_notices()
    try:
        args.func(args)
    except DartsError as error:
        errors.print(Text.assemble(("error: ", "bold red"), redacted(error.what)), highlight=False)
        if error.fix:
            errors.print(Text.assemble(("fix: ", "bold"), redacted(error.fix)), highlight=False)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
