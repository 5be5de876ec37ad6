"""pytest plugin: label every line coverage.py records with the test that ran it, in every process the test starts.

tests/tools/coverage_suite.sh loads it. In the pytest process it switches coverage.py's dynamic context at each phase
of each test (`NODEID|setup`, `NODEID|run`, `NODEID|teardown`). Processes started meanwhile (`megatron-rl` CLI runs,
their Ray actors and ranks, bench scripts) get the label as their static context, so their lines carry it too.

What it cannot see: a process started by an earlier test and reused (a module fixture's Ray cluster, the gloo fork
server of `run_distributed`) keeps the label of the test that started it. A test's lines can then be credited to that
earlier test, never to a later one; tests/tools/redundant_tests.py, which reads these labels, says how it deals with
that.
"""
from __future__ import annotations

import os

import pytest

ENV = "MRL_COV_CONTEXT"


def _switch(label: str) -> None:
    os.environ[ENV] = label
    try:
        import coverage
        from coverage.config import CoverageConfig
    except ImportError:  # the plugin loaded without coverage.py: nothing to label
        return
    cov = coverage.Coverage.current()
    if cov is not None:
        cov.switch_context(label)
    # A child process does not read coverage.rc again: coverage.py's subprocess patch hands it the parent's config,
    # parsed once when this process started (its `context` expanded then, empty), through COVERAGE_PROCESS_CONFIG.
    # Hand children the label in that config, or every Ray actor and CLI run records its lines under no test.
    handed = os.environ.get("COVERAGE_PROCESS_CONFIG")
    if handed:
        config = CoverageConfig.deserialize(handed)
        config.context = label
        os.environ["COVERAGE_PROCESS_CONFIG"] = config.serialize()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    _switch(f"{item.nodeid}|setup")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_call(item):
    _switch(f"{item.nodeid}|run")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_teardown(item):
    _switch(f"{item.nodeid}|teardown")
