#!/usr/bin/env bash
# Set up (idempotent) and run the test suite: the README's test command, and what CI runs.
#   bash launch/run_tests.sh            # default suite (slow tests excluded)
#   bash launch/run_tests.sh -m slow    # opt-in slow checks (real SmolLM2-135M parity, soak)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/launch/setup_env.sh"
cd "$ROOT"
exec "$ROOT/.venv/bin/python" -m pytest -q -ra --durations=15 "$@"
