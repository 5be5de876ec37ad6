#!/usr/bin/env bash
# Set up (idempotent) and run the CPU vision-language demo (docs/vlm.md): the embedded SmolLM2-135M-Instruct with a
# new vision tower in SmolVLM's layout; SFT on 64 image examples of "which colour is the shape"
# (configs/vlm_sft_cpu.yaml), then GRPO from its export (configs/vlm_cpu.yaml), 2 cores.
# Extra arguments are the GRPO stage's config overrides, e.g. `bash launch/demo_vlm.sh grpo.max_steps=5`;
# VLM_SFT=0 skips the SFT stage (GRPO from the model with its random vision tower).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/launch/setup_env.sh"
cd "$ROOT"
PY="$ROOT/.venv/bin/python"
MRL="$ROOT/.venv/bin/megatron-rl"
# built once: the model (~0.6 GB, fp32) and the task's files (the paths the two configs read)
[ -f .cache/models/smolvlm-demo/model.safetensors ] || \
  "$PY" -c "from megatron_rl.models.tiny_vlm import write_vlm_from_lm; write_vlm_from_lm('.cache/models/smolvlm-demo')"
[ -f .cache/data/colours/sft.jsonl ] || "$PY" -m megatron_rl.data.synthetic_vision --out .cache/data/colours
if [ "${VLM_SFT:-1}" = 0 ]; then
  exec "$MRL" train configs/vlm_cpu.yaml "$@"
fi
SFT=runs/vlm_sft_cpu
if [ ! -f "$SFT/hf/config.json" ]; then  # a finished SFT stage is reused
  "$MRL" sft configs/vlm_sft_cpu.yaml "output.dir=$SFT"
  "$MRL" convert megatron-to-hf --ckpt "$(find "$SFT/checkpoints" -maxdepth 1 -name "step_*" | sort -V | tail -1)" \
    --out "$SFT/hf"
fi
exec "$MRL" train configs/vlm_cpu.yaml "policy.model=$SFT/hf" "$@"
