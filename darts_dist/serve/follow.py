"""Following an alias (`serve.follow_alias`): the served app moves to whichever version `models:/NAME@ALIAS` names.

A follower polls the registry every `serve.alias_poll_s`. When the alias names another version, it deploys the
same app on that version; Ray Serve rolls the replicas over (with `serve.max_surge_percent` > 0, each new
replica loads and passes its health check before an old one stops, and an old one finishes its requests before
it goes), so requests keep being answered throughout. A version whose replicas fail to start is set aside (the
old replicas go on serving, and the app is deployed on them again) until the alias moves once more. A registry
that does not answer is retried at the next poll; the server serves on.

The follower runs as a Ray actor, so `darts-dist serve` and `serve-deploy` (where it outlives the command,
detached) follow the same way.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

import ray
from mlflow.exceptions import MlflowException

from darts_dist.errors import DartsError
from darts_dist.logs import show_progress_logs
from darts_dist.serve.model import ModelSource
from darts_dist.tracking.registry import model_version
from darts_dist.tracking.runs import connect

logger = logging.getLogger(__name__)
FOLLOWER_NAME = "darts-dist-alias-follower"
FOLLOWER_NAMESPACE = "darts-dist"

Deploy = Callable[[ModelSource], None]  # deploys the app on a source; returns once its replicas run
Exists = Callable[[], bool]  # whether the app is still deployed


class AliasFollower:
    """Moves the app to the version the alias names; `poll` is one look at the registry."""

    def __init__(self, source: ModelSource, deploy: Deploy, exists: Exists, poll_s: float) -> None:
        self.source = source
        self.deploy = deploy
        self.exists = exists
        self.poll_s = poll_s
        self.failed: str | None = None  # the version whose replicas failed to start, until the alias moves on

    def named(self) -> ModelSource:
        """The source the alias names now."""
        version = model_version(connect(self.source.tracking_uri), self.source.alias)
        return dataclasses.replace(self.source, registered=f"models:/{version.name}/{version.version}")

    def poll(self) -> bool:
        """Look at the alias once; move the app if it names a version neither served nor failed just now.
        Whether the app moved."""
        target = self.named()
        if target.version != self.failed:
            self.failed = None  # the alias moved on: a version that failed before may be tried again later
        if target.registered == self.source.registered or target.version == self.failed:
            return False
        logger.info("%s moved from version %s to %s: rolling the replicas over", self.source.alias,
                    self.source.version, target.version)
        started = time.monotonic()
        try:
            self.deploy(target)
        except Exception as error:  # noqa: BLE001 - Serve's deploy failure; with a surge the old replicas still serve
            self.failed = target.version
            logger.error("version %s did not start (%s); deploying version %s again (its replicas reload), until "
                         "%s moves on", target.version, error, self.source.version, self.source.alias)
            self.deploy(self.source)
            return False
        self.source = target
        logger.info("serving %s (version %s): rolling update done in %.1f s", target.alias, target.version,
                    time.monotonic() - started)
        return True

    def follow(self) -> None:
        """Poll until the app is gone. Whatever fails (the registry not answering, a deploy) is logged and
        tried again at the next poll: the server serves on."""
        show_progress_logs()  # in a Ray actor: its lines reach the driver's console (or the actor's log file)
        logger.info("following %s every %g s, from version %s", self.source.alias, self.poll_s, self.source.version)
        while True:
            time.sleep(self.poll_s)
            try:
                if not self.exists():
                    logger.info("the app serving %s is gone; no longer following", self.source.alias)
                    return
                self.poll()
            except (DartsError, MlflowException, OSError) as error:
                logger.warning("could not read %s (serving version %s on): %s", self.source.alias,
                               self.source.version, error)
            except Exception:  # noqa: BLE001 - a follower that stops would leave the server silently pinned
                logger.exception("following %s failed this time (serving version %s on)", self.source.alias,
                                 self.source.version)


def stop_follower(timeout_s: float = 30.0) -> None:
    """Stop the cluster's follower, if it has one (an app deleted or deployed anew must not be moved by it),
    and wait until its name is free."""
    if not ray.is_initialized():  # no cluster joined: no follower of it to stop
        return
    try:
        ray.kill(ray.get_actor(FOLLOWER_NAME, namespace=FOLLOWER_NAMESPACE))
    except ValueError:  # none
        return
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:  # ray.kill returns before the actor is gone
        try:
            ray.get_actor(FOLLOWER_NAME, namespace=FOLLOWER_NAMESPACE)
        except ValueError:
            return
        time.sleep(0.1)


def start_follower(source: ModelSource, deploy: Deploy, exists: Exists, poll_s: float,
                   detached: bool) -> ray.actor.ActorHandle:
    """The follower as a named Ray actor (one per cluster: `start` stops an earlier deploy's first), returned once
    it is following; `detached` outlives the driver that starts it (`serve-deploy`), until the app is gone."""
    actor = ray.remote(AliasFollower).options(
        name=FOLLOWER_NAME, namespace=FOLLOWER_NAMESPACE, lifetime="detached" if detached else None, num_cpus=0,
    ).remote(source, deploy, exists, poll_s)
    # Its process has started and built it: an alias moved after the server says it follows is not missed.
    ray.get(actor.__ray_ready__.remote())
    actor.follow.remote()
    return actor
