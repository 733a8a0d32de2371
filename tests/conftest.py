"""Shared test set-up: offline hubs, a throwaway cache, and a session-wide tiny model family."""

from __future__ import annotations

import os
import shutil
import tempfile
import time

# Set before anything imports huggingface_hub, transformers or Ray, which read them once.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
# Forced, not defaulted: tests must never read or fill the user's cache.
_TEST_CACHE = tempfile.mkdtemp(prefix="darts-dist-test-cache-")
os.environ["DARTS_DIST_CACHE"] = _TEST_CACHE
# Commands track to MLFLOW_TRACKING_URI first: one throwaway sqlite store (artifacts next to it),
# never an mlflow.db in the folder the tests run from.
os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{_TEST_CACHE}/mlflow.db"

import pytest  # noqa: E402

from darts_dist.sources.demo.tiny import TinyFamily, build_tiny_tokenizer, make_tiny_family  # noqa: E402


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "slow: starts a Ray job, a server process, a second Ray node or a full pipeline; "
        "the inner loop (-m 'not slow') leaves it out")


def is_slow(item: pytest.Item) -> bool:
    return item.get_closest_marker("slow") is not None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The inner loop's tests first (a stable sort keeps each tier's file order): a full run then measures the
    inner loop as it runs alone, for the tier guard, at no extra cost."""
    items.sort(key=is_slow)


# The tier guard: the inner loop must stay an inner loop. On when DARTS_DIST_TIER_GUARD is set (.ci/run sets it):
# a full run fails if the inner loop's tests took longer than INNER_LOOP_S from the session's start, or one of them
# (set-up, call and tear-down) longer than INNER_TEST_S: mark such a test slow or make it cheaper.
TIER_GUARD = "DARTS_DIST_TIER_GUARD"
INNER_LOOP_S = 240.0
INNER_TEST_S = 20.0
_TIER = {"start": 0.0, "inner_end": 0.0, "durations": {}, "slow": set()}


def pytest_sessionstart(session: pytest.Session) -> None:
    _TIER["start"] = time.monotonic()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if "slow" in report.keywords:
        return
    durations = _TIER["durations"]
    durations[report.nodeid] = durations.get(report.nodeid, 0.0) + report.duration
    if report.when == "teardown":
        _TIER["inner_end"] = time.monotonic()


def tier_violations() -> list[str]:
    """What breaks the inner loop's budget in this run, as lines for the summary; none if nothing does."""
    problems = [f"{nodeid} took {seconds:.1f} s (> {INNER_TEST_S:.0f} s for a test of the inner loop)"
                for nodeid, seconds in sorted(_TIER["durations"].items(), key=lambda kv: -kv[1])
                if seconds > INNER_TEST_S]
    inner = _TIER["inner_end"] - _TIER["start"] if _TIER["inner_end"] else 0.0
    if inner > INNER_LOOP_S:
        problems.append(f"the inner loop took {inner:.0f} s (> {INNER_LOOP_S:.0f} s)")
    return problems


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    if not _TIER["durations"]:
        return
    inner = _TIER["inner_end"] - _TIER["start"]
    terminalreporter.write_line(f"inner loop (not slow): {len(_TIER['durations'])} tests in {inner:.0f} s "
                                f"from the session's start")
    for line in tier_violations():
        terminalreporter.write_line(f"tier guard: {line}", red=bool(os.environ.get(TIER_GUARD)))


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if os.environ.get(TIER_GUARD) and tier_violations() and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_unconfigure(config: pytest.Config) -> None:
    shutil.rmtree(_TEST_CACHE, ignore_errors=True)


@pytest.fixture(scope="session")
def tiny_family(tmp_path_factory: pytest.TempPathFactory) -> TinyFamily:
    """A tiny base and three experts (code, math, instruct); read-only for tests, copy to modify."""
    return make_tiny_family(tmp_path_factory.mktemp("tiny_family"))


@pytest.fixture
def tiny_tokenizer():
    return build_tiny_tokenizer()


# The one Ray cluster of this test process, once a test asks for it (`ray_cluster`).
_SHARED_RAY = {"up": False}


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray cluster for every test that runs Ray in this process (a calibration job joins it, as it
    joins any cluster it finds): about 5 s to start, paid once. Logically oversubscribed, since Ray Data
    next to Ray Train deadlocks on 2 CPUs (DESIGN.md §4), and labelled expert_node for placement tests."""
    import ray

    ray.init(num_cpus=8, resources={"expert_node": 1}, include_dashboard=False)
    _SHARED_RAY["up"] = True
    yield
    _SHARED_RAY["up"] = False
    ray.shutdown()


@pytest.fixture(scope="module", autouse=True)
def no_ray_left_running():
    """Every test module leaves no Ray session of its own behind (the shared one stays): a later
    `calibrate` would join a leftover (e.g. one Ray Serve's helpers start on their own, sized to this
    machine's cores) instead of the cluster its job needs."""
    yield
    import ray

    if ray.is_initialized() and not _SHARED_RAY["up"]:
        ray.shutdown()
