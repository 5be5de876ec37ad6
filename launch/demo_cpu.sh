#!/usr/bin/env bash
# Set up (idempotent) and run the CPU GRPO demo: SmolLM2-135M-Instruct on reasoning-gym chain_sum, 2 cores.
# Extra arguments are config overrides, e.g. `bash launch/demo_cpu.sh grpo.max_steps=5`.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/launch/setup_env.sh"
cd "$ROOT"
exec "$ROOT/.venv/bin/megatron-rl" train configs/demo_cpu.yaml "$@"
