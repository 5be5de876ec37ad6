"""Which tests run no line that the rest of the suite does not run too: the candidates for the opt-in `slow` tier.

    bash tests/tools/coverage_suite.sh /tmp/cov                 # the default tier, every line labelled by test
    .venv/bin/python tests/tools/redundant_tests.py /tmp/cov [--top 40] [--drop NODEID_SUBSTRING ...]

It reads the labels tests/tools/cov_context.py gives each line (`NODEID|setup`, `|run`, `|teardown`, in the test
process and in every process the test started) and the suite profile the same run wrote (seconds per test). Then,
most expensive first, it drops a test when every line it ran is still run by a test not dropped, and prints:
- every dropped test, its seconds and the kept test that runs most of its lines (the one to name in its docstring);
- for the costliest kept tests, how many lines only they run, and one of them;
- the lines of `megatron_rl/` and `kernels/` run before and after the drops (they must be equal).

`--drop` names tests to drop on top (a substring of the node id): their lines that nothing else runs are listed.

The labels' limit (tests/tools/cov_context.py): a process started by one test and reused by later ones (a module
fixture's Ray cluster, the gloo fork server) carries the first test's label, so the later tests' lines there count
as the first test's. Lines labelled `|setup` or `|teardown` (module fixtures are set up and torn down inside one
test's phases) count as their file's: they stay covered while a test of that file is kept. What a dropped test ran
in processes an earlier test started can still hide under that test's label, so each dropped test is printed with
what it started itself (from the profile: Ray clusters, engines, worker groups, gloo ranks, subprocesses): a test
that started nothing but uses a module fixture's processes needs a reading of its code before it goes.
"""
from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path


def _load_lines(cov_dir: Path):
    """{context label: set of (file, line)} for every label coverage.py recorded."""
    from coverage import CoverageData

    data = CoverageData(basename=str(cov_dir / ".coverage"))
    data.read()
    by_ctx: dict[str, set] = collections.defaultdict(set)
    for f in data.measured_files():
        short = f.split("/megatron_rl/", 1)[-1] if "/megatron_rl/" in f else f.rsplit("/kernels/", 1)[-1]
        short = ("megatron_rl/" if "/megatron_rl/" in f else "kernels/") + short
        for line, ctxs in (data.contexts_by_lineno(f) or {}).items():
            for c in ctxs:
                by_ctx[c].add((short, line))
    return by_ctx


_STARTS = ("ray", "engines", "groups", "spawns", "procs")


def _load_costs(profile: Path) -> tuple[dict[str, float], dict[str, str]]:
    """Seconds per test and what it started (the profile's counts, written with its teardown record)."""
    costs: dict[str, float] = collections.defaultdict(float)
    starts: dict[str, str] = {}
    for raw in profile.read_text().splitlines():
        rec = json.loads(raw)
        if rec.get("kind") == "phase":
            costs[rec["test"]] += float(rec.get("s", 0.0))
            if "procs" in rec:
                starts[rec["test"]] = " ".join(f"{k}={rec.get(k, 0)}" for k in _STARTS if rec.get(k))
    return costs, starts


def _test_of(label: str) -> tuple[str, str]:
    """`tests/x.py::t[a|b]|run` -> (`tests/x.py::t[a|b]`, `run`); a label of no test -> ("", "")."""
    # a static (process) label and a dynamic one may be joined by coverage.py as `STATIC|DYNAMIC`: the last
    # NODEID|PHASE pair wins
    for phase in ("run", "setup", "teardown"):
        suffix = f"|{phase}"
        if label.endswith(suffix):
            node = label[: -len(suffix)]
            if "|" in node and "::" in node.rsplit("|", 1)[-1]:
                node = node.rsplit("|", 1)[-1]
            return node, phase
    return "", ""


def analyse(cov_dir: Path, *, top: int, extra_drops: list[str]) -> int:
    by_ctx = _load_lines(cov_dir)
    costs, starts = _load_costs(cov_dir / "profile.jsonl")
    all_lines: set = set().union(*by_ctx.values()) if by_ctx else set()
    unlabelled: set = set()  # collection-time imports and the like: run whatever tests are kept
    run_lines: dict[str, set] = collections.defaultdict(set)  # lines a test's call phase ran
    fixture_lines: dict[str, set] = collections.defaultdict(set)  # per file: its tests' setup/teardown lines
    for label, lines in by_ctx.items():
        node, phase = _test_of(label)
        if not node:
            unlabelled |= lines
        elif phase == "run":
            run_lines[node] |= lines
        else:
            fixture_lines[node.split("::", 1)[0]] |= lines
            run_lines.setdefault(node, set())
    tests = sorted(run_lines, key=lambda n: -costs.get(n, 0.0))
    # which tests run each line
    holders: dict[tuple, set] = collections.defaultdict(set)
    for node, lines in run_lines.items():
        for ln in lines:
            holders[ln].add(node)
    file_holders: dict[tuple, set] = collections.defaultdict(set)
    for fname, lines in fixture_lines.items():
        for ln in lines:
            file_holders[ln].add(fname)
    kept = set(tests)
    kept_files = collections.Counter(n.split("::", 1)[0] for n in kept)

    def still_run(ln, without: str) -> bool:
        if ln in unlabelled:
            return True
        if any(h != without and h in kept for h in holders.get(ln, ())):
            return True
        wf = without.split("::", 1)[0]
        return any(kept_files[f] - (f == wf) > 0 for f in file_holders.get(ln, ()))

    def drop(node: str) -> None:
        kept.discard(node)
        kept_files[node.split("::", 1)[0]] -= 1

    dropped = []
    for node in tests:
        if all(still_run(ln, node) for ln in run_lines[node]):
            drop(node)
            dropped.append(node)
    forced_lost = []
    for sub in extra_drops:
        for node in [n for n in tests if sub in n and n in kept]:
            lost = sorted(ln for ln in run_lines[node] if not still_run(ln, node))
            drop(node)
            dropped.append(node)
            forced_lost += [(node, ln) for ln in lost]

    def best_replacement(node: str) -> tuple[str, float]:
        lines = run_lines[node] - unlabelled
        if not lines:
            return "(runs no line of its own in its call)", 1.0
        counts = collections.Counter(h for ln in lines for h in holders.get(ln, ()) if h in kept)
        if not counts:
            return "(unlabelled lines only)", 1.0
        best, n = counts.most_common(1)[0]
        return best, n / len(lines)

    print(f"{len(tests)} tests, {len(all_lines)} lines run; dropping {len(dropped)} tests "
          f"({sum(costs.get(n, 0.0) for n in dropped):.0f} s of {sum(costs.values()):.0f} s)\n")
    print(f"{'s':>7}  test  ->  the kept test running most of its lines (share)")
    for node in sorted(dropped, key=lambda n: -costs.get(n, 0.0)):
        rep, share = best_replacement(node)
        print(f"{costs.get(node, 0.0):7.1f}  {node}  [started: {starts.get(node) or 'nothing'}]\n"
              f"         -> {rep} ({share:.0%})")
    print(f"\nThe {top} costliest kept tests and the lines only they run:")
    for node in [n for n in tests if n in kept][:top]:
        own = sorted(ln for ln in run_lines[node] if not still_run(ln, node))
        eg = f"{own[0][0]}:{own[0][1]}" if own else ""
        print(f"{costs.get(node, 0.0):7.1f}  {len(own):5d}  {node}  {eg}")
    after = unlabelled | {ln for n in kept for ln in run_lines[n]} | {
        ln for f, lines in fixture_lines.items() if kept_files[f] > 0 for ln in lines}
    print(f"\nlines run: {len(all_lines)} before, {len(after)} after the drops")
    for node, ln in forced_lost:
        print(f"lost with {node}: {ln[0]}:{ln[1]}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("cov_dir", type=Path)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--drop", nargs="*", default=[])
    args = ap.parse_args(argv)
    return analyse(args.cov_dir, top=args.top, extra_drops=args.drop)


if __name__ == "__main__":
    sys.exit(main())
