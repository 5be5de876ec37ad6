#!/usr/bin/env bash
# Set up (idempotent) and run the test suite: the README's test command, and what CI runs. docs/testing.md has the
# tiers and their times.
#   bash launch/run_tests.sh                  # the default tier (slow tests excluded): what CI runs
#   bash launch/run_tests.sh --quick          # the inner loop: unit, kernels, one distributed launch, one GRPO run
#   bash launch/run_tests.sh --changed        # only the tests whose code a change touched (pytest-testmon)
#   bash launch/run_tests.sh --profile F.jsonl  # the default tier, timing every test and fixture and counting what
#                                               # each starts (tests/tools/suite_profile.py F.jsonl prints the table)
#   bash launch/run_tests.sh -m slow          # opt-in slow checks (real SmolLM2-135M parity, soak, ...)
#   bash launch/run_tests.sh --serial         # one test at a time (default: two pytest-xdist workers, then the
#                                             # `serial` tests alone; MRL_TEST_JOBS=N sets the workers)
# Other arguments go to pytest as they are (a file, -k EXPR, -x, ...).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/launch/setup_env.sh"

# System tools some tests need: a real local Slurm (slurm-wlm + munge) for tests/integration/test_slurm_launch.py and
# the shell linter (Debian's shellcheck) for launch/*.sh. Installed through apt only when this runs as root (CI, a
# fresh machine); without them those tests skip and say why. The tests start their own daemons in a temp dir: nothing
# is enabled or started here (on a machine with systemd, apt itself may start the packages' services; the tests do
# not use them).
have() { command -v "$1" >/dev/null 2>&1 || [[ -x "/usr/sbin/$1" ]]; }
missing=()
{ have slurmctld && have slurmd && have sbatch && have srun; } || missing+=(slurm-wlm)
have munged || missing+=(munge)
have shellcheck || missing+=(shellcheck)
if [[ ${#missing[@]} -gt 0 ]]; then
  if [[ "$(id -u)" == 0 ]] && command -v apt-get >/dev/null 2>&1; then
    echo "[run_tests] installing ${missing[*]} (apt-get)"
    if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
             "${missing[@]}" >/dev/null; }; then
      echo "[run_tests] warning: apt-get could not install ${missing[*]}; the tests that need them will skip" >&2
    fi
  else
    echo "[run_tests] ${missing[*]} not installed and not root: the tests that need them will skip" >&2
  fi
fi

cd "$ROOT"
# The quick tier: everything under tests/unit and tests/kernels except the bench smokes (each a set of subprocesses
# starting Ray and engines), the collective harness's own checks, and one end-to-end GRPO run through the CLI. The
# default tier runs all of it too.
QUICK=(tests/unit tests/kernels tests/distributed/test_foundation.py
       "tests/integration/test_grpo.py::test_metrics_contract_and_outputs")
QUICK_MARK="not slow and not bench"
# Two processes at a time (pytest-xdist, whole files per worker so module-scoped runs are shared): a test mostly
# waits on one core for its start-ups (imports, Ray, engines), so two of them take ~0.65x the time of one after the
# other (two tiny `megatron-rl train` runs: 35 s together, 27 s alone; docs/testing.md). Tests marked `serial` (they
# count leaked files and processes machine-wide, or kill processes on a timer) run afterwards, alone.
JOBS="${MRL_TEST_JOBS:-2}"
MARK="not slow"  # pytest.ini's default; a -m given here replaces it, as it would for pytest
PROFILE=""
args=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --quick) args+=("${QUICK[@]}"); MARK="$QUICK_MARK" ;;
    # testmon records which code each test ran (coverage of the pytest process, not of Ray actors or launched ranks:
    # those tests are picked by the driver-side code they call) in .testmondata, and the next --changed run selects
    # the tests that ran changed code; the first run on a clone runs everything once to fill it.
    # forceselect: testmon otherwise ignores its selection whenever -m is given, and pytest.ini always gives one.
    # One process: testmon records per process and does not merge xdist workers' data.
    --changed) args+=(--testmon-forceselect); JOBS=1 ;;
    --serial) JOBS=1 ;;
    --profile) PROFILE="$2"; shift ;;
    -m) MARK="$2"; shift ;;
    *) args+=("$1") ;;
  esac
  shift
done
# every run is profiled (cheap): the closing table of the 20 slowest tests covers both phases
if [[ -z "$PROFILE" ]]; then
  PROFILE="$(mktemp -t mrl-suite-XXXXXX.jsonl)"
  trap 'rm -f "$PROFILE"' EXIT
fi
: > "$PROFILE"
PYTEST=("$ROOT/.venv/bin/python" -m pytest -q -ra -p tests.tools.suite_profile "--suite-profile=$PROFILE")
ok() { [[ $1 == 0 || $1 == 5 ]]; }  # 5: the phase selected no test
if [[ "$JOBS" == 1 ]]; then
  rc=0; "${PYTEST[@]}" -m "$MARK" "${args[@]}" || rc=$?
  ok $rc && rc=0
else
  rc1=0; "${PYTEST[@]}" -n "$JOBS" --dist loadfile --no-loadscope-reorder -m "($MARK) and not serial" "${args[@]}" || rc1=$?
  echo "[run_tests] the serial tests, alone:"
  rc2=0; "${PYTEST[@]}" -m "($MARK) and serial" "${args[@]}" || rc2=$?
  rc=0
  ok $rc1 || rc=$rc1
  ok $rc2 || rc=$rc2
  [[ $rc1 == 5 && $rc2 == 5 ]] && rc=5
fi
echo
"$ROOT/.venv/bin/python" "$ROOT/tests/tools/suite_profile.py" "$PROFILE" --slowest 20 || true
exit $rc
