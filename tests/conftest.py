"""Shared test set-up: offline hubs, a throwaway cache, and a session-wide tiny model family."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

# Set before anything imports huggingface_hub, transformers or Ray, which read them once.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
# Ray Train's controller polls its workers every 2 s (so a run's start and end each wait up to a poll) and starts a
# preemption watcher per run, a process of its own: about 4 s of every test's Ray run on 2 cores. Users keep Ray's
# defaults; no test here is about either.
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")
os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")
# Forced, not defaulted: tests must never read or fill the user's cache. Removed when the session ends: the
# thin 4096-wide family alone is 5.4 GB.
_TEST_CACHE = tempfile.mkdtemp(prefix="darts-dist-test-cache-")
atexit.register(shutil.rmtree, _TEST_CACHE, ignore_errors=True)
os.environ["DARTS_DIST_CACHE"] = _TEST_CACHE
# Commands track to MLFLOW_TRACKING_URI first: one throwaway sqlite store (artifacts next to it),
# never an mlflow.db in the folder the tests run from.
_SESSION_TRACKING_URI = os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{_TEST_CACHE}/mlflow.db"

import pytest  # noqa: E402

from darts_dist.sources.demo.tiny import TinyFamily, build_tiny_tokenizer, make_tiny_family  # noqa: E402

# The test tiers (the `slow` marker, the inner loop first) and their guard.
pytest_plugins = ["tier_guard"]


@pytest.fixture(scope="session")
def tiny_family(tmp_path_factory: pytest.TempPathFactory) -> TinyFamily:
    """A tiny base and three experts (code, math, instruct); read-only for tests, copy to modify."""
    return make_tiny_family(tmp_path_factory.mktemp("tiny_family"))


@pytest.fixture
def tiny_tokenizer():
    return build_tiny_tokenizer()


@pytest.fixture(autouse=True)
def tracking_store_kept():
    """Every test leaves MLFLOW_TRACKING_URI as the session set it: one that unsets it (MLflow's own
    `_use_tracking_uri` does, restoring a process-wide URI that was never set) sends every later command's runs to
    ./mlflow.db in the folder the tests run from."""
    yield
    assert os.environ.get("MLFLOW_TRACKING_URI") == _SESSION_TRACKING_URI, (
        f"this test left MLFLOW_TRACKING_URI={os.environ.get('MLFLOW_TRACKING_URI')!r}: set it for a block with "
        "darts_dist.tracking.store.environment or monkeypatch.setenv")


FAKE_GPUS = 4
RAY_CLUSTER_CPUS = 8
# The one Ray cluster of this test process, once a test asks for it (`ray_cluster`).
_SHARED_RAY = {"up": False}


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray cluster for every test that runs Ray in this process (a calibration job joins it, as it
    joins any cluster it finds): about 5 s to start, paid once. Logically oversubscribed, since Ray Data
    next to Ray Train deadlocks on 2 CPUs (DESIGN.md §4), labelled expert_node for placement tests, and given 4 GPUs
    it does not have (Ray takes the count as given): a GPU cluster's layout, rehearsed on CPUs (test_fake_gpus)."""
    import ray

    ray.init(num_cpus=RAY_CLUSTER_CPUS, num_gpus=FAKE_GPUS, resources={"expert_node": 1}, include_dashboard=False)
    _SHARED_RAY["up"] = True
    yield
    _SHARED_RAY["up"] = False
    ray.shutdown()


def pytest_collection_finish(session: pytest.Session) -> None:
    users = [item.nodeid for item in session.items if "ray_cluster" in getattr(item, "fixturenames", ())]
    _SHARED_RAY["last_user"] = users[-1] if users else None


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """The shared cluster stops after its last user (the tier guard runs its users' modules first): the tests after
    it start servers and clusters of their own, which should not share 2 cores with its idle processes."""
    if item.nodeid == _SHARED_RAY.get("last_user") and _SHARED_RAY["up"]:
        import ray

        ray.shutdown()
        _SHARED_RAY["up"] = False


@pytest.fixture(scope="module", autouse=True)
def no_ray_left_running():
    """Every test module leaves no Ray session of its own behind (the shared one stays): a later
    `calibrate` would join a leftover (e.g. one Ray Serve's helpers start on their own, sized to this
    machine's cores) instead of the cluster its job needs."""
    yield
    import ray

    if ray.is_initialized() and not _SHARED_RAY["up"]:
        ray.shutdown()
