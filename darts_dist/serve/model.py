"""What a darts-dist server serves: the model (a registered version, a run folder or loose files), the
model ids it answers to, and the serving settings, all settled on the driver before Serve starts."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from darts_dist.config import RunConfig, ServeSection, TrackingSection, load_config, served_by, updated
from darts_dist.core import ROUTED
from darts_dist.errors import DartsError
from darts_dist.run_folder import read_run_folder
from darts_dist.serve.access import bound_host
from darts_dist.tracking.registry import (
    ModelFiles,
    fetch_model,
    model_version,
    registered_model_name,
    version_config,
)
from darts_dist.tracking.runs import TRACKING_URI_ENV, connect, tracking_uri
from darts_dist.tracking.store import environment

MERGED_ID = "merged"


@dataclass(frozen=True)
class ModelSource:
    """What each replica loads: a registered version (fetched on the replica's own node) or local files."""

    name: str
    registered: str | None = None  # models:/NAME/VERSION, pinned on the driver
    tracking_uri: str | None = None
    files: ModelFiles | None = None
    alias: str | None = None  # the models:/NAME@ALIAS it was pinned from, which a follower watches

    @property
    def version(self) -> str | None:
        """The registered version served (None: local files)."""
        return None if self.registered is None else self.registered.rsplit("/", 1)[1]

    def fetch(self) -> ModelFiles:
        if self.files is not None:
            return self.files
        return fetch_model(connect(self.tracking_uri), self.registered)


def model_ids(name: str, tasks: Sequence[str], routed: bool) -> dict[str, str | None]:
    """Each served model id and the task it generates under (None: no correction, ROUTED: the router's pick)."""
    ids: dict[str, str | None] = {f"{name}:{task}": task for task in tasks}
    if routed:
        ids[name] = ROUTED
    ids[f"{name}:{MERGED_ID}"] = None
    return ids


def resolve_model(
    model: str,
    tracking: str | None = None,
    corrections: Path | None = None,
    router: Path | None = None,
    name: str | None = None,
) -> tuple[ModelSource, RunConfig | None]:
    """The model to serve and the config of the run that made it (its `serve` section), checked on the driver.

    `model`: models:/NAME@ALIAS or models:/NAME/VERSION (from the registry at `tracking`, else
    MLFLOW_TRACKING_URI, else sqlite:///mlflow.db); a run folder; or a merged model folder, with
    `corrections` and `router` files given apart.
    """
    if model.startswith("models:/"):
        # An explicit URI wins over MLFLOW_TRACKING_URI; either way a relative sqlite file becomes absolute,
        # so replicas running in other folders open the same registry.
        with environment(**({TRACKING_URI_ENV: tracking} if tracking else {})):
            uri = tracking_uri(TrackingSection().uri)
        client = connect(uri)
        version = model_version(client, model)
        # Pinned to the version the alias names now: a replica added later (autoscaling, a restart)
        # must serve the same model even if the alias has moved on.
        pinned = f"models:/{version.name}/{version.version}"
        alias = model if "@" in model else None
        return (ModelSource(name=name or version.name, registered=pinned, tracking_uri=uri, alias=alias),
                version_config(client, version))
    folder = Path(model).absolute()
    if not folder.is_dir():
        raise DartsError(f"{model} is neither a models:/ URI nor a folder",
                         "pass models:/NAME@ALIAS, a run folder, or a merged model folder")
    if (folder / "config.json").is_file():
        files, config = ModelFiles(name or folder.name, folder, corrections, router, None), None
    else:
        try:
            run = read_run_folder(folder, corrections, router)
        except DartsError as error:  # what serve takes besides: a registered model, loose files
            raise DartsError(error.what, "pass models:/NAME@ALIAS, the folder a `calibrate` or `demo` run wrote, or "
                                         "a merged model folder with --corrections") from None
        config = run.config
        files = ModelFiles(name or (registered_model_name(config) if config is not None else folder.name),
                           run.merged_dir, run.corrections, run.router, config)
    missing = [str(p) for p in (files.merged_dir, files.corrections, files.router) if p is not None and not p.exists()]
    if missing:
        raise DartsError(f"files of the model to serve are missing: {missing}", "check the paths, or calibrate again")
    return ModelSource(name=files.name, files=files), config


def serve_settings(config: RunConfig | None, override: Path | None = None, **values: Any) -> ServeSection:
    """The serve section: defaults < the model's run config < a --config YAML < explicit values (None: unset); a
    host beyond loopback only as an explicit value (`access.bound_host`).

    `serve.dtype: auto` becomes the model's run's compute dtype (`calibration.dtype`; the --config YAML's where the
    model has no run config), so the replicas compute as the run evaluated the model. The capture folder becomes
    absolute here, on the driver: replicas run in other working folders.
    """
    given = load_config(override) if override is not None else config
    settings = given.serve if given is not None else ServeSection()
    settings = updated(settings, **{key: value for key, value in values.items() if value is not None})
    settings = updated(settings, host=bound_host(settings.host, values.get("host")))
    run = config or given
    if values.get("dtype") is None and run is not None:  # an explicit --dtype auto stays auto
        settings = served_by(settings, run)
    return updated(settings, capture=updated(settings.capture, dir=settings.capture.dir.expanduser().absolute()))
