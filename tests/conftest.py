"""Suite-wide rules.

In CI (`CI` set, as `.ci/run` runs) a test skipped for a missing asset fails instead: set-up (`launch/setup_env.sh`,
`launch/run_tests.sh`) installs the embedded model, its tokenizer, Slurm and shellcheck, so their absence there is a
broken set-up, and a skip would count the test as coverage it did not give. On a developer's machine the same test
skips with its pointer to the set-up step. Skips for what CI machines cannot have (a CUDA device, the NVIDIA ptxas)
stay skips.
"""
from __future__ import annotations

import os

import pytest

pytest_plugins = ("pytester",)  # tests/unit/test_ci_asset_skips.py runs small suites under these rules

# substrings of the skip reasons the suite gives for a missing asset that set-up provides
_ASSET_REASONS = ("setup_env.sh", "SmolLM2 tokenizer", "embedded model", "embedded SmolLM2", "not prepared",
                  "shellcheck not installed", "slurm", "Slurm")


def _in_ci() -> bool:
    return os.environ.get("CI", "").lower() not in ("", "0", "false", "no")


def asset_skip_reason(report) -> str | None:
    """The skip reason of `report` if it names a missing set-up asset, else None."""
    if not report.skipped or not isinstance(report.longrepr, tuple):
        return None
    reason = str(report.longrepr[2])
    return reason if any(s in reason for s in _ASSET_REASONS) else None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if _in_ci() and getattr(report, "wasxfail", None) is None:
        reason = asset_skip_reason(report)
        if reason is not None:
            report.outcome = "failed"
            report.longrepr = (f"CI: a set-up asset is missing, so this test cannot be skipped ({reason}); "
                               "launch/run_tests.sh installs it")


# --------------------------------------------------------------------------------------------------------------------
# Under pytest-xdist (launch/run_tests.sh's parallel phase, `--dist loadfile --no-loadscope-reorder`) the workers are
# handed whole files in collection order, so the files are collected heaviest first: a 4-minute file handed out last
# would run alone while the other worker idles. Seconds per file come from a profile of the default tier
# (tests/tools/file_costs.json, written by `tests/tools/suite_profile.py PROFILE --write-costs`); a file not listed
# counts as a small one. Within a file the order is unchanged.
_COSTS = os.path.join(os.path.dirname(__file__), "tools", "file_costs.json")
_NEW_FILE_S = 5.0


def pytest_collection_modifyitems(session, config, items):
    if not (os.environ.get("PYTEST_XDIST_WORKER") or getattr(config.option, "numprocesses", None)):
        return
    import json

    try:
        with open(_COSTS) as f:
            costs = json.load(f)
    except (OSError, ValueError):
        return
    first = {}
    for i, item in enumerate(items):
        first.setdefault(item.nodeid.split("::")[0], i)
    items.sort(key=lambda it: (-costs.get(it.nodeid.split("::")[0], _NEW_FILE_S), first[it.nodeid.split("::")[0]]))


# --------------------------------------------------------------------------------------------------------------------
# Ray workers forked from a preloaded server (tests/worker_fork_server.py), one per pytest process.
def pytest_collection_finish(session):
    from tests import worker_fork_server

    if worker_fork_server.wanted([item.nodeid for item in session.items]):
        worker_fork_server.start()


def pytest_sessionfinish(session, exitstatus):
    from tests import worker_fork_server

    worker_fork_server.stop()
