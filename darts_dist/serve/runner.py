"""Running the app: deploy it (or roll it over to a new version), start Serve's HTTP proxy with an alias follower
where asked, and `darts-dist serve` in the foreground until Ctrl-C."""

from __future__ import annotations

import functools
import logging
import os
import signal
import time
from collections.abc import Callable

import ray
from ray import serve
from ray.serve.exceptions import RayServeException

from darts_dist.config import ServeSection
from darts_dist.logs import init_ray
from darts_dist.serve.access import ApiKeys, warn_if_exposed
from darts_dist.serve.builder import build_app, check_capture_folder
from darts_dist.serve.follow import start_follower, stop_follower
from darts_dist.serve.metrics import metrics_url
from darts_dist.serve.model import ModelSource

logger = logging.getLogger(__name__)
APP_NAME = "darts-dist"


def follows(source: ModelSource, settings: ServeSection) -> bool:
    """Whether a server of `source` follows its alias: asked to, and serving models:/NAME@ALIAS."""
    return settings.follow_alias and source.alias is not None


def app_exists() -> bool:
    """Whether this app is still deployed (Serve itself may be gone: `serve shutdown`)."""
    try:
        return APP_NAME in serve.status().applications
    except RayServeException:  # no Serve instance on the cluster any more
        return False


def deploy(source: ModelSource, settings: ServeSection, api_key: ApiKeys | None) -> None:
    """Deploy (or roll over to) the app on `source`; returns once its replicas run, raises if they cannot start."""
    serve.run(build_app(source, settings, api_key), name=APP_NAME, route_prefix="/", blocking=False)


def start(source: ModelSource, settings: ServeSection, api_key: ApiKeys | None = None, detached: bool = False) -> str:
    """Start Serve's HTTP proxy on settings.host:port and deploy the app; returns its OpenAI base URL. With
    `serve.follow_alias` a follower starts too (`detached`: it outlives this driver).

    Returns once every replica has loaded the model.
    """
    if settings.follow_alias and not follows(source, settings):
        # A registered config may ask to follow; serving one pinned version or a run folder is still meant.
        logger.warning("serve.follow_alias is set, but %s is no models:/NAME@ALIAS: serving it without following",
                       source.registered or "a local model")
    check_capture_folder(settings)
    warn_if_exposed(settings.host, api_key)
    # request_timeout_s: the proxy answers 408 to a request still unanswered then (its own end-to-end bound).
    serve.start(http_options={"host": settings.host, "port": settings.port,
                              "request_timeout_s": settings.request_timeout_s})
    stop_follower()  # one left by an earlier deploy must not move this app
    deploy(source, settings, api_key)
    if follows(source, settings):
        start_follower(source, functools.partial(deploy, settings=settings, api_key=api_key), app_exists,
                       settings.alias_poll_s, detached)
    return f"http://{settings.host}:{settings.port}/v1"


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def run_foreground(
    source: ModelSource, settings: ServeSection, api_key: ApiKeys | None, say: Callable[[str], None] = print
) -> None:
    """`darts-dist serve`: serve until Ctrl-C (or SIGTERM), then shut Serve down.

    On a cluster this process joined (RAY_ADDRESS) only the app is deleted; a cluster it started
    itself is shut down with it.
    """
    joined = ray.is_initialized() or bool(os.environ.get("RAY_ADDRESS"))
    if not ray.is_initialized():
        init_ray(include_dashboard=False)
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        url = start(source, settings, api_key)
        say(f"serving {source.name} at {url} (GET /v1/models lists the model ids; Ctrl-C stops)")
        say(f"Prometheus metrics (darts_serve_* and Ray Serve's own) at {metrics_url()}")
        if follows(source, settings):
            say(f"following {source.alias} (version {source.version} now) every {settings.alias_poll_s:g} s")
        if settings.capture.enabled:
            say(f"capturing served prompts (no responses) in {settings.capture.dir}, at most "
                f"{settings.capture.max_bytes} bytes")
        while True:
            time.sleep(1)
    except KeyboardInterrupt:
        logger.info("stopping the server")
    finally:
        stop_follower()
        if joined:
            serve.delete(APP_NAME)
        else:
            serve.shutdown()
            ray.shutdown()
    logger.info("server stopped")
