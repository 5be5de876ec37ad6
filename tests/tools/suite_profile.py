"""Where the test suite's time goes: per test, per fixture and per file, with the expensive starts each one makes.

Two uses:

    # run the suite (or part of it) with this file as a pytest plugin; it writes one JSON record per event
    .venv/bin/python -m pytest -p tests.tools.suite_profile --suite-profile=/tmp/prof.jsonl tests/...
    # print the tables (files by time, the slowest tests and fixtures, what each file starts)
    .venv/bin/python tests/tools/suite_profile.py /tmp/prof.jsonl [--top 40] [--markdown]

`bash launch/run_tests.sh --profile FILE` does the first (the whole default tier). What is counted, in the pytest
process, during each test's setup, call and teardown (so a module fixture's starts count against the first test that
needs it, where they are paid):
- `ray`: `ray.init` calls (a Ray cluster started or joined);
- `engines`: vLLM engines built in this process (`VLLMGenerator`) or as Ray actors (`RemoteGenerator` handles);
- `groups`: Ray worker groups (`WorkerGroup`: policy, teacher, environment ranks);
- `spawns`: multiprocessing spawns (`run_distributed`'s gloo ranks, one per rank);
- `procs`: subprocesses (`megatron-rl` CLI runs, bench scripts, torchrun, slurm daemons, shellcheck, ...).
Starts made inside a subprocess (a CLI run's own Ray cluster and engines) are not seen: they count as that one `procs`.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time
from pathlib import Path

_FIELDS = ("ray", "engines", "groups", "spawns", "procs")


# --------------------------------------------------------------------------------------------------------------------
# the pytest plugin
# --------------------------------------------------------------------------------------------------------------------
class _Recorder:
    def __init__(self, path: str, *, records_tests: bool = True):
        # appended to: under pytest-xdist every worker writes its tests' lines to the same file (one write per line),
        # and launch/run_tests.sh's serial phase adds its own run; run_tests.sh empties the file first
        self.out = open(path, "a", buffering=1)
        self.records_tests = records_tests  # False in xdist's controller: its workers record their own tests
        self.current: str | None = None  # nodeid of the test whose setup/call/teardown is running
        self.counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.fixture_stack: list[tuple[str, str, float]] = []

    def count(self, what: str) -> None:
        self.counts[self.current or "<collection>"][what] += 1

    def write(self, rec: dict) -> None:
        self.out.write(json.dumps(rec) + "\n")


_rec: _Recorder | None = None


def _wrap(owner, attr: str, what: str) -> None:
    orig = getattr(owner, attr, None)
    if orig is None or getattr(orig, "_suite_profile", False):
        return

    def wrapper(*a, **kw):
        if _rec is not None:
            _rec.count(what)
        return orig(*a, **kw)

    wrapper._suite_profile = True
    wrapper.__wrapped__ = orig
    setattr(owner, attr, wrapper)


def _wrap_init(cls, what: str) -> None:
    orig = cls.__init__

    def __init__(self, *a, **kw):
        if _rec is not None and type(self) is cls:
            _rec.count(what)
        orig(self, *a, **kw)

    cls.__init__ = __init__


def pytest_addoption(parser):
    parser.addoption("--suite-profile", default=None, help="write per-test/per-fixture timings and starts (JSONL)")


def pytest_configure(config):
    global _rec
    path = config.getoption("--suite-profile")
    if not path:
        return
    # xdist's controller only times the whole run (the start and end records); each worker records its tests
    controller = not os.environ.get("PYTEST_XDIST_WORKER") and bool(getattr(config.option, "numprocesses", None))
    _rec = _Recorder(path, records_tests=not controller)
    import multiprocessing.process
    import subprocess

    _wrap_init(subprocess.Popen, "procs")
    _wrap(multiprocessing.process.BaseProcess, "start", "spawns")
    # The project's own classes are patched without importing anything heavy here: triton must not be imported
    # before tests/kernels/conftest.py sets TRITON_INTERPRET, and these modules import lazily.
    import importlib.abc
    import importlib.util

    targets = {
        "ray": lambda m: _wrap(m, "init", "ray"),
        "megatron_rl.generation.vllm_generator": lambda m: _wrap_init(m.VLLMGenerator, "engines"),
        "megatron_rl.generation.actor": lambda m: _wrap_init(m.RemoteGenerator, "engines"),
        "megatron_rl.distributed.worker_group": lambda m: _wrap_init(m.WorkerGroup, "groups"),
    }

    class _PatchOnImport(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name not in targets:
                return None
            sys.meta_path.remove(self)
            try:
                spec = importlib.util.find_spec(name)
            finally:
                sys.meta_path.insert(0, self)
            if spec is None or spec.loader is None:
                return spec
            loader, patch = spec.loader, targets[name]

            class _Loader(importlib.abc.Loader):
                def create_module(self, spec):
                    return loader.create_module(spec)

                def exec_module(self, module):
                    loader.exec_module(module)
                    patch(module)

            spec.loader = _Loader()
            return spec

    for name, patch in targets.items():
        if name in sys.modules:
            patch(sys.modules[name])
    sys.meta_path.insert(0, _PatchOnImport())
    if _rec.records_tests and os.environ.get("PYTEST_XDIST_WORKER"):
        return  # the controller writes the run's start and end
    _rec.write({"kind": "start", "t": time.time(), "pid": os.getpid()})


def pytest_runtest_logstart(nodeid, location):
    if _rec is not None:
        _rec.current = nodeid


def pytest_runtest_logreport(report):
    if _rec is None or not _rec.records_tests:
        return
    c = _rec.counts.get(report.nodeid, collections.Counter())
    rec = {"kind": "phase", "test": report.nodeid, "phase": report.when, "s": round(report.duration, 3),
           "outcome": report.outcome, "end": round(time.time(), 2),  # when it ended, and on which xdist worker
           "worker": os.environ.get("PYTEST_XDIST_WORKER", "")}
    if report.when == "teardown":
        rec.update({k: c.get(k, 0) for k in _FIELDS})
    _rec.write(rec)


import pytest  # noqa: E402  (the hookwrapper's decorator)


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef, request):
    t0 = time.perf_counter()
    yield
    if _rec is not None:
        s = time.perf_counter() - t0
        if s >= 0.05:
            _rec.write({"kind": "fixture", "name": fixturedef.argname, "scope": fixturedef.scope,
                        "test": _rec.current, "s": round(s, 3)})


def pytest_sessionfinish(session, exitstatus):
    if _rec is not None:
        if not os.environ.get("PYTEST_XDIST_WORKER"):
            _rec.write({"kind": "end", "t": time.time(), "exit": int(exitstatus)})
        _rec.out.close()


# --------------------------------------------------------------------------------------------------------------------
# the report
# --------------------------------------------------------------------------------------------------------------------
def load(path: str) -> tuple[dict, list, float]:
    tests: dict[str, dict] = {}
    fixtures: list[dict] = []
    wall = 0.0
    t_start = None
    for line in open(path):
        r = json.loads(line)
        if r["kind"] == "start":
            t_start = r["t"]
        elif r["kind"] == "end" and t_start is not None:  # one pair per pytest run (run_tests.sh: two phases)
            wall += r["t"] - t_start
            t_start = None
        elif r["kind"] == "phase":
            t = tests.setdefault(r["test"], {"s": 0.0, "outcome": "passed", **{k: 0 for k in _FIELDS}})
            t["s"] += r["s"]
            if r["outcome"] != "passed" and t["outcome"] == "passed":
                t["outcome"] = r["outcome"]
            for k in _FIELDS:
                t[k] += r.get(k, 0)
        elif r["kind"] == "fixture":
            fixtures.append(r)
    return tests, fixtures, wall


def _fmt(rows: list[list], header: list[str], markdown: bool) -> str:
    rows = [[str(c) for c in r] for r in rows]
    if markdown:
        out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
        out += ["| " + " | ".join(r) + " |" for r in rows]
        return "\n".join(out)
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    line = lambda r: "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))  # noqa
    return "\n".join([line(header)] + [line(r) for r in rows])


def report(path: str, top: int = 30, markdown: bool = False) -> str:
    tests, fixtures, wall = load(path)
    total = sum(t["s"] for t in tests.values())
    files: dict[str, dict] = {}
    for nodeid, t in tests.items():
        f = files.setdefault(nodeid.split("::")[0], {"s": 0.0, "n": 0, **{k: 0 for k in _FIELDS}})
        f["s"] += t["s"]
        f["n"] += 1
        for k in _FIELDS:
            f[k] += t[k]
    parts = [f"{len(tests)} tests, {total / 60:.1f} min in tests"
             + (f", {wall / 60:.1f} min wall" if wall else "")]
    frows = sorted(files.items(), key=lambda kv: -kv[1]["s"])
    parts.append("\nFiles by time:\n" + _fmt(
        [[name, f["n"], f"{f['s']:.1f}", f"{100 * f['s'] / max(total, 1e-9):.1f}", *(f[k] for k in _FIELDS)]
         for name, f in frows[:top]], ["file", "tests", "s", "%", *_FIELDS], markdown))
    trows = sorted(tests.items(), key=lambda kv: -kv[1]["s"])
    parts.append(f"\nSlowest {top} tests (setup + call + teardown):\n" + _fmt(
        [[name, f"{t['s']:.1f}", t["outcome"], *(t[k] for k in _FIELDS)] for name, t in trows[:top]],
        ["test", "s", "outcome", *_FIELDS], markdown))
    fx = sorted(fixtures, key=lambda r: -r["s"])
    parts.append(f"\nSlowest {top} fixture set-ups:\n" + _fmt(
        [[r["name"], r["scope"], f"{r['s']:.1f}", r["test"]] for r in fx[:top]],
        ["fixture", "scope", "s", "first needed by"], markdown))
    starts = {k: sum(f[k] for f in files.values()) for k in _FIELDS}
    parts.append("\nStarts in all: " + ", ".join(f"{k} {v}" for k, v in starts.items()))
    return "\n".join(parts)


def slowest(path: str, n: int) -> str:
    """launch/run_tests.sh's closing table: one list over both of its phases (pytest's --durations has one per run)."""
    tests, _, wall = load(path)
    failed = sum(t["outcome"] == "failed" for t in tests.values())
    rows = sorted(tests.items(), key=lambda kv: -kv[1]["s"])[:n]
    return (f"{len(tests)} tests ({failed} with a failed phase), {wall / 60:.1f} min wall, "
            f"{sum(t['s'] for t in tests.values()) / 60:.1f} min in tests. Slowest {n} (setup + call + teardown):\n"
            + _fmt([[name, f"{t['s']:.1f}", t["outcome"]] for name, t in rows], ["test", "s", "outcome"], False))


def file_costs(path: str) -> dict[str, float]:
    """Seconds per test file (setup + call + teardown of its tests), for `tests/tools/file_costs.json`: the order in
    which the parallel phase hands out files (tests/conftest.py, heaviest first)."""
    tests, _, _ = load(path)
    costs: dict[str, float] = collections.Counter()
    for nodeid, t in tests.items():
        costs[nodeid.split("::")[0]] += t["s"]
    return {f: round(s, 1) for f, s in sorted(costs.items(), key=lambda kv: -kv[1])}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("path")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--slowest", type=int, default=0, help="print only the run's time and its N slowest tests")
    ap.add_argument("--write-costs", metavar="JSON", help="write seconds per file (tests/tools/file_costs.json)")
    a = ap.parse_args(argv)
    if a.write_costs:
        Path(a.write_costs).write_text(json.dumps(file_costs(a.path), indent=0) + "\n")
        return 0
    print(slowest(a.path, a.slowest) if a.slowest else report(a.path, a.top, a.markdown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
