#!/usr/bin/env bash
# Line coverage of megatron_rl/ and kernels/ by the default tier (or any pytest selection), child processes included:
# Ray actors, run_distributed's gloo ranks, `megatron-rl` CLI runs and bench scripts are measured through coverage.py's
# subprocess patch (tests/tools/coverage.rc). Also writes the suite profile (tests/tools/suite_profile.py).
#
#   bash tests/tools/coverage_suite.sh [OUT_DIR] [pytest args...]     # OUT_DIR default: .cache/coverage
#   (no pytest args: the default tier in two workers, then the serial tests, as launch/run_tests.sh runs it)
#
# Every line is labelled with the test that ran it (tests/tools/cov_context.py); tests/tools/redundant_tests.py
# OUT_DIR lists, from those labels, the tests whose lines other tests run too.
# Prints the TOTAL line; OUT_DIR gets report.txt, coverage.json and profile.jsonl. Coverage slows the suite (the
# baseline took 67 min instead of ~45 on a 2-core AMD EPYC with AVX-512): it is a measurement, not what CI runs.
# Actors that Ray kills without a clean exit lose their last lines (generation/actor.py reads low for that reason);
# compare totals measured the same way.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
OUT="$(realpath -m "${1:-$ROOT/.cache/coverage}")"
shift || true
mkdir -p "$OUT"
rm -f "$OUT"/.coverage*
: > "$OUT/profile.jsonl"  # the profile plugin appends
cd "$ROOT"
export COVERAGE_DATA_DIR="$OUT"
# Ray workers as new interpreters, which coverage.py's subprocess patch follows (not forks of a preloaded server,
# tests/worker_fork_server.py)
export MRL_WORKER_FORK=0
COV=("$ROOT/.venv/bin/python" -m coverage run --rcfile=tests/tools/coverage.rc -m pytest -q -p tests.tools.suite_profile
     -p tests.tools.cov_context
     "--suite-profile=$OUT/profile.jsonl")
rc=0
if [ $# -gt 0 ]; then
  "${COV[@]}" "$@" || rc=$?
else  # the default tier as launch/run_tests.sh runs it: two xdist workers, then the serial tests alone
  "${COV[@]}" -n "${MRL_TEST_JOBS:-2}" --dist loadfile --no-loadscope-reorder -m "not slow and not serial" || rc=$?
  # the second run's own combine must not replace the first's data: keep it under a name `combine` picks up
  [ -f "$OUT/.coverage" ] && mv "$OUT/.coverage" "$OUT/.coverage.parallel-phase"
  "${COV[@]}" -m "not slow and serial" || rc=$?
fi
# the main process combines its children's files when it ends; combine again for any written after that
"$ROOT/.venv/bin/python" -m coverage combine --rcfile=tests/tools/coverage.rc -q --append 2>/dev/null || true
"$ROOT/.venv/bin/python" -m coverage report -i --rcfile=tests/tools/coverage.rc > "$OUT/report.txt" 2>/dev/null || true
"$ROOT/.venv/bin/python" -m coverage json -i --rcfile=tests/tools/coverage.rc -o "$OUT/coverage.json" 2>/dev/null || true
grep TOTAL "$OUT/report.txt" || true
exit $rc
