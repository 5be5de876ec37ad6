"""pytest plugin: label every line coverage.py records with the test that ran it, in every process the test starts.

tests/tools/coverage_suite.sh loads it. In the pytest process it switches coverage.py's dynamic context at each phase
of each test (`NODEID|setup`, `NODEID|run`, `NODEID|teardown`). Processes started meanwhile (`megatron-rl` CLI runs,
their Ray actors and ranks, bench scripts) inherit `MRL_COV_CONTEXT`, which tests/tools/coverage.rc reads as their
static context, so their lines carry the same label.

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
    except ImportError:  # the plugin loaded without coverage.py: nothing to label
        return
    cov = coverage.Coverage.current()
    if cov is not None:
        cov.switch_context(label)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    _switch(f"{item.nodeid}|setup")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_call(item):
    _switch(f"{item.nodeid}|run")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_teardown(item):
    _switch(f"{item.nodeid}|teardown")
