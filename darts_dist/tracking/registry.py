"""The model registry: the corrected merged model as an MLflow pyfunc, and the alias that only moves forward.

A calibration's model is logged to its run (merged model folder + corrections + task router,
code in `pyfunc_model.py`) and registered as a new version of a named model. The alias (default
`champion`) moves to the new version only when its held-out evaluation is at least as good
as the current holder's on `DECISIVE_METRIC`; serving loads `models:/NAME@ALIAS` (`fetch_model`).
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path

import pandas as pd
from mlflow.entities import Run, RunTag
from mlflow.entities.model_registry import ModelVersion
from mlflow.exceptions import MlflowException
from mlflow.models import Model, ModelSignature
from mlflow.store.artifact.utils.models import get_model_name_and_version
from mlflow.types import ColSpec, ParamSchema, ParamSpec, Schema
from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID

import mlflow
from darts_dist.config import RunConfig, parse_record
from darts_dist.core import ROUTER_FILE
from darts_dist.errors import DartsError
from darts_dist.fsutil import atomic_dir, cache_root
from darts_dist.sources.models import compute_label, model_dtype, resolve_device
from darts_dist.tracking.runs import CORRECTIONS_TAG, MERGED_DIR_TAG, STAGE_TAG, TRACKING_URI_ENV
from darts_dist.tracking.store import environment
from mlflow import MlflowClient

MERGED_ARTIFACT = "merged"
CORRECTIONS_ARTIFACT = "corrections"
ROUTER_ARTIFACT = "router"
PYFUNC_CODE = Path(__file__).with_name("pyfunc_model.py")
# Generation settings a request may pass as params; these are the defaults (greedy, 64 tokens). max_batch_size
# bounds the engine's running batch: a frame's rows join it as earlier ones finish.
PARAM_DEFAULTS: dict[str, object] = {
    "max_new_tokens": 64, "temperature": 0.0, "top_p": 1.0, "seed": 0, "stop": [], "chat": False,
    "max_batch_size": 32,
}
# The served model's quality on held-out data: mean over tasks of the corrected model's NLL
# (lower is better). NLL, not bias reduction, because bias reduction is relative to each run's
# own merge, so a worse merge with a larger repair could win; NLL compares the served models.
DECISIVE_METRIC = "eval.overall.nll_corrected"
# Tags that tie a run to its logged model and registered version, read by `darts-dist register`.
MODEL_URI_TAG = "darts.logged_model_uri"
VERSION_TAG = "darts.model_version"
DECISION_TAG = "darts.alias_decision"
# The code the model runs: this package, copied into the model (MLflow's code_paths), so the model loads
# where darts-dist is not installed; and the distributions that code imports, pinned to what logged it.
PACKAGE_DIR = Path(__file__).absolute().parent.parent
_REQUIREMENTS = ("mlflow", "torch", "transformers", "safetensors", "pandas", "pydantic", "pyyaml", "tqdm", "platformdirs")


def registered_model_name(config: RunConfig) -> str:
    """`tracking.registered_model`, else darts-dist-<config name>."""
    return config.tracking.registered_model or f"darts-dist-{config.name}"


def model_signature() -> ModelSignature:
    """prompt (+ optional task) in; text, finish reason and token counts out; generation settings as params."""
    inputs = Schema([ColSpec("string", "prompt"), ColSpec("string", "task", required=False)])
    outputs = Schema([
        ColSpec("string", "text"),
        ColSpec("string", "finish_reason"),
        ColSpec("long", "prompt_tokens"),
        ColSpec("long", "completion_tokens"),
    ])
    params = ParamSchema([
        ParamSpec("max_new_tokens", "long", PARAM_DEFAULTS["max_new_tokens"]),
        ParamSpec("temperature", "double", PARAM_DEFAULTS["temperature"]),
        ParamSpec("top_p", "double", PARAM_DEFAULTS["top_p"]),
        ParamSpec("seed", "long", PARAM_DEFAULTS["seed"]),
        ParamSpec("stop", "string", PARAM_DEFAULTS["stop"], shape=(-1,)),
        ParamSpec("chat", "boolean", PARAM_DEFAULTS["chat"]),
        ParamSpec("max_batch_size", "long", PARAM_DEFAULTS["max_batch_size"]),
    ])
    return ModelSignature(inputs=inputs, outputs=outputs, params=params)


def requirements() -> list[str]:
    """`name==version` of each distribution the model's code imports; a local build label (torch's +cpu) is
    dropped, so the pin installs from a package index (the CUDA build of the same version on a GPU node)."""
    return [f"{name}=={metadata.version(name).split('+')[0]}" for name in _REQUIREMENTS]


def log_pyfunc_model(
    uri: str, run_id: str, merged_dir: Path, corrections: Path | None, example_task: str | None,
    router: Path | None = None, dtype: str = "auto",
) -> str:
    """Log the pyfunc model (merged folder + corrections + router) to `run_id`; returns its `models:/m-...` URI.

    Its `model_config` says where it computes: `device` auto (CUDA where a GPU is visible, else the CPU) and `dtype`
    (a config.ComputeDtype: auto is bfloat16 on a GPU, float32 on a CPU); `mlflow.pyfunc.load_model(...,
    model_config=...)` overrides either. MLflow checks the input example by loading the model so and generating a
    few tokens, so a model that cannot load or generate is refused here, before anything is registered.
    """
    artifacts = {MERGED_ARTIFACT: str(merged_dir)}
    for name, path in ((CORRECTIONS_ARTIFACT, corrections), (ROUTER_ARTIFACT, router)):
        if path is not None:
            artifacts[name] = str(path)
    example = pd.DataFrame({"prompt": ["Question: What is 17 + 26?\nAnswer:"], "task": [example_task]})
    # log_model works on MLflow's active run and process-wide URI; set through the environment
    # (not mlflow.set_tracking_uri, which leaves it changed for the rest of the process).
    with environment(**{TRACKING_URI_ENV: uri}), mlflow.start_run(run_id=run_id):
        info = mlflow.pyfunc.log_model(
            name="model",
            python_model=str(PYFUNC_CODE),
            artifacts=artifacts,
            signature=model_signature(),
            input_example=(example, {"max_new_tokens": 4}),
            pip_requirements=requirements(),
            code_paths=[str(PACKAGE_DIR)],
            model_config={"device": "auto", "dtype": dtype},
        )
    MlflowClient(uri).set_tag(run_id, MODEL_URI_TAG, info.model_uri)
    return info.model_uri


def _logged_here(*args: object) -> tuple[str, str]:
    """`log_pyfunc_model(*args)`, and where its check computed: the device and dtype the pyfunc's `load_context`
    picks in this process (sources.models.compute_label)."""
    device = resolve_device("auto")
    return log_pyfunc_model(*args), compute_label(device, model_dtype(str(args[-1]), device))


def log_checked_model(
    config: RunConfig, uri: str, run_id: str, merged_dir: Path, corrections: Path | None, router: Path | None,
    dtype: str | None = None,
) -> tuple[str, str]:
    """`log_pyfunc_model` for a run of `config`, computing in `dtype` (default: the run's calibration.dtype); returns
    the logged model's URI and where its check computed. The check loads the model: where the config puts models
    on GPUs, in a Ray task with an expert actor's resources (a GPU), never on the driver, whose node (a cluster's
    head) may have neither a GPU nor the memory."""
    args = (uri, run_id, merged_dir, corrections, config.tasks[0], router, dtype or config.calibration.dtype)
    if config.models_on_gpus:
        # Imported here: the registered model's code imports this module, and Ray is not among its requirements.
        from darts_dist.ray_cluster.remote import run_as_expert

        return run_as_expert(config.cluster, "the logged model's check", _logged_here, *args)
    return _logged_here(*args)


@dataclass(frozen=True)
class Registration:
    """One registered version and what became of the alias."""

    name: str
    version: str
    model_uri: str  # models:/NAME/VERSION
    alias: str
    alias_version: str | None  # the version holding the alias after this registration
    promoted: bool
    decision: str

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def alias_decision(
    alias: str, candidate: float | None, holder: str | None, holder_value: float | None
) -> tuple[bool, str]:
    """Whether a new version takes the alias, and why, in words that go into the run's tags and the log."""
    metric = f"{DECISIVE_METRIC} (lower is better)"
    if candidate is None:
        return False, f"kept {alias!r}: this run has no held-out evaluation, so {metric} cannot be compared"
    if holder is None:
        return True, f"took {alias!r}: no version held it; {DECISIVE_METRIC} = {candidate:.6g}"
    if holder_value is None:
        return True, (f"took {alias!r} from version {holder}, which has no {DECISIVE_METRIC}; "
                      f"this run's is {candidate:.6g}")
    if candidate <= holder_value:
        return True, f"took {alias!r} from version {holder}: {metric} {candidate:.6g} <= {holder_value:.6g}"
    return False, f"kept {alias!r} on version {holder}: {metric} {candidate:.6g} > {holder_value:.6g}"


def _run_metric(client: MlflowClient, run_id: str | None) -> float | None:
    return None if run_id is None else client.get_run(run_id).data.metrics.get(DECISIVE_METRIC)


def _alias_holder(client: MlflowClient, name: str, alias: str) -> tuple[str | None, float | None]:
    try:
        holder = client.get_model_version_by_alias(name, alias)
    except MlflowException:  # no version holds the alias yet
        return None, None
    return holder.version, _run_metric(client, holder.run_id)


def register_version(
    client: MlflowClient, name: str, logged_model_uri: str, run_id: str, alias: str
) -> Registration:
    """A new version of `name` from a logged model; the alias moves only on an evaluation at least as good.

    All or nothing: the alias is set last, in one call, and if anything before it fails, the run's
    tags, the version and a registered model made for it are removed again.
    """
    created = False
    try:
        client.get_registered_model(name)
    except MlflowException:
        client.create_registered_model(name, description="A merged LLM with its DARTS corrections (darts-dist).")
        created = True
    version = None
    tagged = False
    try:
        holder, holder_value = _alias_holder(client, name, alias)
        promoted, decision = alias_decision(alias, _run_metric(client, run_id), holder, holder_value)
        model_id = logged_model_uri.removeprefix("models:/")
        # MLflow's sqlite registry looks the logged model up through a client of the process-wide URI, not this
        # client's: pointed at this store for the call, or a store other than MLFLOW_TRACKING_URI's fails here.
        with environment(**{TRACKING_URI_ENV: client.tracking_uri}):
            version = client.create_model_version(
                name, source=logged_model_uri, run_id=run_id, model_id=model_id, tags={DECISION_TAG: decision}
            ).version
        client.log_batch(run_id, tags=[RunTag(VERSION_TAG, f"{name}/{version}"), RunTag(DECISION_TAG, decision)])
        tagged = True
        if promoted:
            client.set_registered_model_alias(name, alias, version)
    except BaseException:
        if tagged:
            for tag in (VERSION_TAG, DECISION_TAG):
                client.delete_tag(run_id, tag)
        if version is not None:
            client.delete_model_version(name, version)
        if created:
            client.delete_registered_model(name)
        raise
    return Registration(
        name=name,
        version=str(version),
        model_uri=f"models:/{name}/{version}",
        alias=alias,
        alias_version=str(version) if promoted else holder,
        promoted=promoted,
        decision=decision,
    )


def calibration_run(client: MlflowClient, run_id: str) -> Run:
    """The calibration run a run id names: the run itself, or the calibration run nested under it."""
    try:
        run = client.get_run(run_id)
    except MlflowException as error:
        raise DartsError(f"no MLflow run {run_id!r} in {client.tracking_uri}: {error.message}",
                         "pass a run id from a report's tracking section, or the run folder itself") from None
    if run.data.tags.get(STAGE_TAG) == "calibration":
        return run
    children = client.search_runs(
        [run.info.experiment_id],
        filter_string=f"tags.`{MLFLOW_PARENT_RUN_ID}` = '{run_id}' and tags.`{STAGE_TAG}` = 'calibration'",
    )
    if not children:
        raise DartsError(f"MLflow run {run_id} has no calibration", "pass the run of a `calibrate` or `demo` command")
    return children[0]


def run_config(client: MlflowClient, run: Run) -> RunConfig:
    """The validated config a session logged on its parent run."""
    parent = run.data.tags.get(MLFLOW_PARENT_RUN_ID, run.info.run_id)
    with tempfile.TemporaryDirectory(prefix="darts-register-") as scratch:
        path = client.download_artifacts(parent, "config.json", scratch)
        return parse_record(json.loads(Path(path).read_text()), origin=f"run {parent}'s config.json")


def calibration_config(client: MlflowClient, run_id: str) -> RunConfig:
    """The config of the calibration a run id names (`calibration_run`)."""
    return run_config(client, calibration_run(client, run_id))


def register_run(client: MlflowClient, run_id: str, name: str | None = None, alias: str | None = None,
                 dtype: str | None = None) -> Registration:
    """Register a tracked calibration after the fact (`darts-dist register`), logging its model first if needed (in
    `dtype`, default the run's calibration.dtype; checked where `log_checked_model` says)."""
    run = calibration_run(client, run_id)
    tags = run.data.tags
    if VERSION_TAG in tags:
        raise DartsError(f"run {run.info.run_id} is already registered as {tags[VERSION_TAG]}",
                         "calibrate again for a new version, or serve that one")
    config = run_config(client, run)
    logged = tags.get(MODEL_URI_TAG)
    if logged is None:
        merged_dir, corrections = Path(tags[MERGED_DIR_TAG]), Path(tags[CORRECTIONS_TAG])
        missing = [str(p) for p in (merged_dir, corrections) if not p.exists()]
        if missing:
            raise DartsError(f"run {run.info.run_id}'s files are gone: {missing}",
                             "register from the machine and folder where the run wrote them")
        # The router a calibration fits is written next to its corrections (pipeline.run_calibration).
        router = corrections.with_name(ROUTER_FILE)
        logged, _ = log_checked_model(config, client.tracking_uri, run.info.run_id, merged_dir, corrections,
                                      router if router.is_file() else None, dtype)
    return register_version(client, name or registered_model_name(config), logged, run.info.run_id,
                            alias or config.tracking.alias)


@dataclass(frozen=True)
class ModelFiles:
    """A servable model on local disk: the merged model folder, and its corrections and router where it has them."""

    name: str
    merged_dir: Path
    corrections: Path | None
    router: Path | None
    config: RunConfig | None  # the config of the run that made it, where known


def model_version(client: MlflowClient, uri: str) -> ModelVersion:
    """The registered version a `models:/` URI names: models:/NAME@ALIAS, models:/NAME/VERSION, or the latest
    (models:/NAME/latest), as MLflow itself reads them (its parser is internal: mlflow is pinned)."""
    try:
        named = get_model_name_and_version(client, uri)
        if len(named) != 2:  # MLflow reads models:/X as the logged model X, which no registry version holds
            raise DartsError(f"{uri!r} names a logged model (or a registered one without a version or alias)",
                             "write models:/NAME@ALIAS, models:/NAME/VERSION or models:/NAME/latest")
        return client.get_model_version(*named)
    except MlflowException as error:
        raise DartsError(f"{uri} is not in the registry at {client.tracking_uri}: {error.message}",
                         "check the name and alias or version (MLFLOW_TRACKING_URI picks the registry)") from None


def version_config(client: MlflowClient, version: ModelVersion) -> RunConfig | None:
    """The config of the session that calibrated a version; None for a version without one."""
    if not version.run_id:
        return None
    try:
        return run_config(client, client.get_run(version.run_id))
    except (MlflowException, OSError, DartsError):
        return None


def fetch_model(client: MlflowClient, uri: str, cache: Path | None = None) -> ModelFiles:
    """Download a registered version's pyfunc artifacts (once: versions never change) and find its parts.

    The download goes to `cache` (default: the darts-dist cache) under the registry, name and version,
    atomically, so replicas that start together on one machine share one finished copy.
    """
    version = model_version(client, uri)
    registry = hashlib.sha256(client.tracking_uri.encode()).hexdigest()[:12]
    folder = (cache or cache_root() / "served") / registry / version.name / str(version.version)
    if not folder.is_dir():
        try:
            with atomic_dir(folder) as scratch, environment(**{TRACKING_URI_ENV: client.tracking_uri}):
                mlflow.artifacts.download_artifacts(artifact_uri=f"models:/{version.name}/{version.version}",
                                                    dst_path=str(scratch))
        except FileExistsError:  # another replica finished the same download first
            pass
    artifacts = Model.load(str(folder)).flavors["python_function"].get("artifacts", {})
    paths = {name: folder / spec["path"] for name, spec in artifacts.items()}
    if MERGED_ARTIFACT not in paths:
        raise DartsError(f"{uri} (version {version.version}) has no merged model artifact",
                         "register a model logged by darts-dist (`darts-dist calibrate` or `register`)")
    return ModelFiles(name=version.name, merged_dir=paths[MERGED_ARTIFACT], corrections=paths.get(CORRECTIONS_ARTIFACT),
                      router=paths.get(ROUTER_ARTIFACT), config=version_config(client, version))
