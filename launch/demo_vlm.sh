#!/usr/bin/env bash
# Set up (idempotent) and run the CPU vision-language demo (docs/vlm.md): the embedded SmolLM2-135M-Instruct with a
# new vision tower in SmolVLM's layout, GRPO on "which colour is the shape" (configs/vlm_cpu.yaml), 2 cores.
# Extra arguments are config overrides, e.g. `bash launch/demo_vlm.sh grpo.max_steps=5`.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/launch/setup_env.sh"
cd "$ROOT"
PY="$ROOT/.venv/bin/python"
# built once: the model (~0.6 GB, fp32) and the task's parquet files (the paths configs/vlm_cpu.yaml reads)
[ -f .cache/models/smolvlm-demo/model.safetensors ] || \
  "$PY" -c "from megatron_rl.models.tiny_vlm import write_vlm_from_lm; write_vlm_from_lm('.cache/models/smolvlm-demo')"
[ -f .cache/data/colours/val.parquet ] || "$PY" -m megatron_rl.data.synthetic_vision --out .cache/data/colours
exec "$ROOT/.venv/bin/megatron-rl" train configs/vlm_cpu.yaml "$@"
