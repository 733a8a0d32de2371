"""The tier guard on a suite of its own: the inner loop runs first, and a run fails when it outgrows its budget."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

TESTS = Path(__file__).parent
SUITE = """
import time
import pytest

@pytest.mark.slow
def test_a_slow_one():
    pass

def test_quick():
    pass

def test_lingers():
    time.sleep({linger})
"""


def run_suite(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, linger: float, guard: bool):
    """The plugin as the suite loads it, with a 0.2 s budget per inner-loop test."""
    pytester.makeconftest(f"import sys\nsys.path.insert(0, {str(TESTS)!r})\nimport tier_guard\n"
                          "tier_guard.INNER_TEST_S = 0.2\npytest_plugins = ['tier_guard']\n")
    pytester.makepyfile(test_suite=SUITE.format(linger=linger))
    if guard:
        monkeypatch.setenv("DARTS_DIST_TIER_GUARD", "1")
    else:
        monkeypatch.delenv("DARTS_DIST_TIER_GUARD", raising=False)
    return pytester.runpytest_subprocess("-v", "-p", "no:cacheprovider")


def test_the_inner_loop_runs_first_and_a_slow_inner_test_fails_the_guarded_run(pytester, monkeypatch) -> None:
    result = run_suite(pytester, monkeypatch, linger=0.5, guard=True)
    ran = [line.split("::")[1].split()[0] for line in result.outlines if "::test_" in line and "PASSED" in line]
    assert ran == ["test_quick", "test_lingers", "test_a_slow_one"]
    assert result.ret == pytest.ExitCode.TESTS_FAILED  # every test passed: the guard failed the run
    result.stdout.fnmatch_lines(["*tier guard: test_suite.py::test_lingers took 0.5 s (> 0.2 s*mark it slow"])
    result.stdout.fnmatch_lines(["inner loop (not slow): 2 tests in * s from the session's start"])


def test_without_the_guard_it_only_reports_and_within_budget_it_passes(pytester, monkeypatch) -> None:
    unguarded = run_suite(pytester, monkeypatch, linger=0.5, guard=False)
    assert unguarded.ret == pytest.ExitCode.OK
    unguarded.stdout.fnmatch_lines(["*tier guard: test_suite.py::test_lingers took*"])
    within = run_suite(pytester, monkeypatch, linger=0.0, guard=True)
    assert within.ret == pytest.ExitCode.OK
    assert "tier guard:" not in within.stdout.str()
