#!/usr/bin/env bash
# Set up (idempotent) and run the test suite: the README's test command, and what CI runs.
#   bash launch/run_tests.sh            # default suite (slow tests excluded)
#   bash launch/run_tests.sh -m slow    # opt-in slow checks (real SmolLM2-135M parity, soak)
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
exec "$ROOT/.venv/bin/python" -m pytest -q -ra --durations=15 "$@"
