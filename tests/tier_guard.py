"""The test tiers and their guard, as a pytest plugin (tests/conftest.py loads it).

`@pytest.mark.slow` marks a test that starts a Ray job, a server process, a second Ray node or a full
pipeline; `-m "not slow"` is the inner loop. A full run puts the inner loop's tests first, so it measures the
inner loop as that runs alone, at no extra cost. With DARTS_DIST_TIER_GUARD set (.ci/run sets it), a run fails
when the inner loop took longer than INNER_LOOP_S from the session's start, or one of its tests (set-up, call
and tear-down) longer than INNER_TEST_S: such a test gets cheaper or marked slow, so the tiers cannot rot.

Always: a test of the inner loop that starts Ray (`ray.init`, in this process) fails, naming the fix; a hung test
fails at its timeout (pyproject's `timeout` for the inner loop, SLOW_TEST_TIMEOUT_S for a slow test without a
`@pytest.mark.timeout` of its own), not at CI's limit.
"""

from __future__ import annotations

import functools
import os
import time

import pytest

TIER_GUARD = "DARTS_DIST_TIER_GUARD"
INNER_LOOP_S = 240.0
INNER_TEST_S = 20.0
SLOW_TEST_TIMEOUT_S = 600.0
_tier = {"start": 0.0, "inner_end": 0.0, "durations": {}, "running": None}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "slow: starts a Ray job, a server process, a second Ray node or a full pipeline; "
        "the inner loop (-m 'not slow') leaves it out")
    _refuse_ray_in_the_inner_loop()


def is_slow(item: pytest.Item) -> bool:
    return item.get_closest_marker("slow") is not None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Stable: each tier keeps its file order, but for the modules that use the session's shared Ray cluster
    # (conftest's `ray_cluster`), which run first in the slow tier: the cluster stops after its last user.
    shared = {getattr(item, "module", None) for item in items if "ray_cluster" in getattr(item, "fixturenames", ())}
    items.sort(key=lambda item: (is_slow(item), is_slow(item) and getattr(item, "module", None) not in shared))
    for item in items:
        if is_slow(item) and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(SLOW_TEST_TIMEOUT_S))


def _refuse_ray_in_the_inner_loop() -> None:
    """`ray.init` (every way Ray starts in a process: darts-dist's init_ray, Ray Data's and Train's auto-init) fails
    the running test unless it is slow: a Ray cluster costs the inner loop 5-30 s on 2 cores."""
    try:
        import ray
    except ImportError:
        return
    if getattr(ray.init, "_tier_guarded", False):
        return
    start = ray.init

    @functools.wraps(start)
    def guarded(*args, **kwargs):
        item = _tier["running"]
        if item is not None and not is_slow(item):
            pytest.fail(f"{item.nodeid} started Ray in the inner loop: mark it @pytest.mark.slow, or test the "
                        "code without a cluster", pytrace=False)
        return start(*args, **kwargs)

    guarded._tier_guarded = True
    ray.init = guarded


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    _tier["running"] = item
    try:
        return (yield)
    finally:
        _tier["running"] = None


def pytest_sessionstart(session: pytest.Session) -> None:
    _tier["start"] = time.monotonic()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if "slow" in report.keywords:
        return
    durations = _tier["durations"]
    durations[report.nodeid] = durations.get(report.nodeid, 0.0) + report.duration
    if report.when == "teardown":
        _tier["inner_end"] = time.monotonic()


def inner_loop_seconds() -> float:
    return _tier["inner_end"] - _tier["start"] if _tier["inner_end"] else 0.0


def violations() -> list[str]:
    """What breaks the inner loop's budget in this run, one line each; none if nothing does."""
    problems = [f"{nodeid} took {seconds:.1f} s (> {INNER_TEST_S:g} s for a test of the inner loop): make it "
                "cheaper or mark it slow"
                for nodeid, seconds in sorted(_tier["durations"].items(), key=lambda kv: -kv[1])
                if seconds > INNER_TEST_S]
    if inner_loop_seconds() > INNER_LOOP_S:
        problems.append(f"the inner loop took {inner_loop_seconds():.0f} s (> {INNER_LOOP_S:g} s)")
    return problems


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    if not _tier["durations"]:
        return
    terminalreporter.write_line(f"inner loop (not slow): {len(_tier['durations'])} tests in "
                                f"{inner_loop_seconds():.0f} s from the session's start")
    for line in violations():
        terminalreporter.write_line(f"tier guard: {line}", red=bool(os.environ.get(TIER_GUARD)))


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if os.environ.get(TIER_GUARD) and violations() and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
