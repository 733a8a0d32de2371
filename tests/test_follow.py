"""The alias follower against a real (sqlite) registry, with the deploy recorded: what it deploys, when, and what it
does when a deploy fails or the app goes away. The whole loop with a real server: test_live_loop.py."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from darts_dist.config import CaptureSection, ServeSection
from darts_dist.errors import DartsError
from darts_dist.serve.builder import check_capture_folder
from darts_dist.serve.follow import AliasFollower
from darts_dist.serve.model import ModelSource
from darts_dist.tracking.runs import connect

ALIAS = "models:/m@champion"


class Deploys:
    """A deploy that records the versions it was asked for and fails for those in `failing` (once each)."""

    def __init__(self, failing: set[str] = frozenset(), always_fail: bool = False) -> None:
        self.versions: list[str] = []
        self.failing = set(failing)
        self.always_fail = always_fail

    def __call__(self, source: ModelSource) -> None:
        self.versions.append(source.version)
        if self.always_fail or source.version in self.failing:
            self.failing.discard(source.version)
            raise RuntimeError(f"replicas of version {source.version} failed to start")


@pytest.fixture
def registry(tmp_path: Path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = connect(uri)
    client.create_registered_model("m")
    for _ in range(3):
        client.create_model_version("m", source=str(tmp_path))
    client.set_registered_model_alias("m", "champion", "1")
    return uri, client


def follower(uri: str, deploy: Deploys, exists=lambda: True) -> AliasFollower:
    source = ModelSource(name="m", registered="models:/m/1", tracking_uri=uri, alias=ALIAS)
    return AliasFollower(source, deploy, exists, poll_s=0.01)


def test_the_follower_moves_with_the_alias_and_sets_a_failed_version_aside_until_it_moves_on(registry) -> None:
    uri, client = registry
    deploys = Deploys(failing={"2"})
    watcher = follower(uri, deploys)
    assert not watcher.poll() and deploys.versions == []  # the alias still names the served version
    client.set_registered_model_alias("m", "champion", "2")
    assert not watcher.poll()  # version 2 fails to start: version 1 is deployed again
    assert deploys.versions == ["2", "1"] and watcher.source.version == "1"
    assert not watcher.poll() and deploys.versions == ["2", "1"]  # set aside while the alias names it
    client.set_registered_model_alias("m", "champion", "3")
    assert watcher.poll() and watcher.source.version == "3"
    client.set_registered_model_alias("m", "champion", "2")  # named again after another version: tried again
    assert watcher.poll() and watcher.source.version == "2"
    assert deploys.versions == ["2", "1", "3", "2"]


def test_the_follower_survives_failures_and_ends_when_the_app_is_gone(registry) -> None:
    uri, client = registry
    client.set_registered_model_alias("m", "champion", "2")
    checks: list[int] = []  # one per poll: the follower asks whether the app is still there first

    def exists() -> bool:
        checks.append(len(checks))
        return len(checks) <= 5  # gone at the sixth poll

    deploys = Deploys(always_fail=True)  # the deploy and its fallback both fail, every time
    watcher = follower(uri, deploys, exists=exists)
    crashed: list[BaseException] = []

    def follow() -> None:  # a follower thread that died of the failures would end too: record how it ended
        try:
            watcher.follow()
        except BaseException as error:
            crashed.append(error)

    thread = threading.Thread(target=follow)
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive() and not crashed, crashed
    assert len(checks) == 6  # it polled on after the failures, and stopped because the app went
    # Version 2 failed (and so did the fallback to 1); set aside while the alias names it, it is not tried again.
    assert deploys.versions == ["2", "1"] and watcher.source.version == "1"


def test_a_capture_folder_that_cannot_be_written_is_refused_before_serving(tmp_path: Path) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    with pytest.raises(DartsError, match="not a writable folder"):
        check_capture_folder(ServeSection(capture=CaptureSection(enabled=True, dir=blocked)))
    check_capture_folder(ServeSection(capture=CaptureSection(enabled=True, dir=tmp_path / "new")))
    assert (tmp_path / "new").is_dir()
