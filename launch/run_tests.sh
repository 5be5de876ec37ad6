#!/usr/bin/env bash
# Set up (idempotent) and run the test suite: the README's test command, and what CI runs. docs/testing.md has the
# tiers and their times.
#   bash launch/run_tests.sh                  # the default tier (slow tests excluded): what CI runs
#   bash launch/run_tests.sh --quick          # the inner loop: unit, kernels, one distributed launch, one GRPO run
#   bash launch/run_tests.sh --changed        # only the tests whose code a change touched (pytest-testmon)
#   bash launch/run_tests.sh --profile F.jsonl  # the default tier, timing every test and fixture and counting what
#                                               # each starts (tests/tools/suite_profile.py F.jsonl prints the table)
#   bash launch/run_tests.sh -m slow          # opt-in slow checks (real SmolLM2-135M parity, soak, ...)
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
       "tests/integration/test_grpo.py::test_metrics_contract_and_outputs" -m "not slow and not bench")
args=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --quick) args+=("${QUICK[@]}") ;;
    # testmon records which code each test ran (coverage of the pytest process, not of Ray actors or launched ranks:
    # those tests are picked by the driver-side code they call) in .testmondata, and the next --changed run selects
    # the tests that ran changed code; the first run on a clone runs everything once to fill it.
    # forceselect: testmon otherwise ignores its selection whenever -m is given, and pytest.ini always gives one
    --changed) args+=(--testmon-forceselect) ;;
    --profile) args+=(-p tests.tools.suite_profile "--suite-profile=$2"); shift ;;
    *) args+=("$1") ;;
  esac
  shift
done
exec "$ROOT/.venv/bin/python" -m pytest -q -ra --durations=20 "${args[@]}"
