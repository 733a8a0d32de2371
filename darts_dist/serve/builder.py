"""The Serve application built from what is served and its settings: replicas or autoscaling, concurrency, back
pressure, rolling updates; and `app_builder`, the import path Serve's config files name."""

from __future__ import annotations

import tempfile
from typing import Any

from pydantic import ValidationError
from ray.serve.config import AutoscalingConfig, BackpressureConfig
from ray.serve.deployment import Application

from darts_dist.config import ServeSection
from darts_dist.errors import DartsError
from darts_dist.serve.access import ApiKeys, resolve_api_key
from darts_dist.serve.deployment import DartsServer
from darts_dist.serve.follow import stop_follower
from darts_dist.serve.limits import RETRY_AFTER_S
from darts_dist.serve.model import ModelSource, resolve_model, serve_settings


def build_app(source: ModelSource, settings: ServeSection, api_key: ApiKeys | None = None) -> Application:
    """The Serve application: replicas (or autoscaling), concurrency, and one GPU each when `use_gpu`."""
    options: dict[str, Any] = {
        "max_ongoing_requests": settings.max_ongoing_requests,
        "max_queued_requests": settings.max_queued_requests,
        # Serve's own refusal past max_queued_requests: a 429 with Retry-After, like the replicas' own.
        "backpressure_config": BackpressureConfig(status_code=429, retry_after_s=RETRY_AFTER_S),
        "ray_actor_options": {"num_cpus": settings.num_cpus, "num_gpus": 1 if settings.use_gpu else 0},
        # A rolling update (a new version, `serve.follow_alias`) starts new replicas before it stops old ones,
        # and lets an old one finish its requests, streams too, for up to drain_timeout_s.
        "max_surge_percent": settings.max_surge_percent,
        "graceful_shutdown_timeout_s": settings.drain_timeout_s,
    }
    if settings.autoscaling_config is not None:
        try:
            AutoscalingConfig(**settings.autoscaling_config)
        except (ValidationError, ValueError, TypeError) as error:  # pydantic's and Ray's own validation errors
            raise DartsError(f"serve.autoscaling_config is not valid for Ray Serve: {error}",
                             "see Ray Serve's AutoscalingConfig (min_replicas, max_replicas, ...)") from None
        options["autoscaling_config"] = settings.autoscaling_config
    else:
        options["num_replicas"] = settings.num_replicas
    return DartsServer.options(**options).bind(source, settings, api_key)


def app_builder(args: dict[str, Any]) -> Application:
    """The import path for `serve deploy` / `serve run` (jobs/serve.yaml): `args` has `model` and optionally
    `tracking_uri`, `name`, `api_key_file` or `api_key` (else DARTS_DIST_API_KEY) and any key of the config's serve
    section."""
    args = dict(args)
    if "model" not in args:
        raise DartsError("the Serve application's args lack 'model'", "add args: {model: models:/NAME@ALIAS}")
    source, config = resolve_model(args.pop("model"), tracking=args.pop("tracking_uri", None),
                                   name=args.pop("name", None))
    flag, file = args.pop("api_key", None), args.pop("api_key_file", None)
    settings = serve_settings(config, **args)
    api_key = resolve_api_key(flag, file, settings.api_key_file)
    check_capture_folder(settings)
    stop_follower()  # a follower left by `serve-deploy` must not move this app; this one pins its version
    return build_app(source, settings, api_key)


def check_capture_folder(settings: ServeSection) -> None:
    """A capture folder the replicas cannot write to fails here, on the driver, before any replica starts."""
    if not settings.capture.enabled:
        return
    folder = settings.capture.dir
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".probe-"):
            pass
    except OSError as error:
        raise DartsError(f"serve.capture.dir {folder} is not a writable folder: {error}",
                         "point serve.capture.dir at a folder the server may write, or set capture.enabled: false")
