#!/usr/bin/env bash
# Evaluate a Megatron checkpoint: export it to HF under torchrun, then pass@1 / pass@k with vLLM.
#
#   launch/torchrun_eval.sh --ckpt DIR [--tp N --pp M] [--dtype auto|bf16|fp32] [--keep-hf DIR] -- EVAL_ARGS...
#   e.g. launch/torchrun_eval.sh --ckpt runs/demo_cpu/checkpoints -- --config configs/demo_cpu.yaml --n 4
#
# --ckpt is a checkpoint directory (a run's checkpoints/step_N) or a root of them (the newest complete one is used).
# Step 1 runs launch/torchrun_convert.sh megatron-to-hf (tp*pp ranks on this node, CPU/gloo); step 2 runs
# `megatron-rl eval --model HF_DIR EVAL_ARGS...`. The HF folder is written under a temp dir (TMPDIR picks its
# filesystem: it holds a full copy of the weights) and removed at exit, unless --keep-hf says where to keep it.
# PYTHON / MEGATRON_RL choose the interpreter and CLI (default: the repo's .venv when present, else PATH).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(dirname "$HERE")"
usage() { sed -n '2,11p' "${BASH_SOURCE[0]}"; }

CKPT=""; TP=1; PP=1; DTYPE=auto; KEEP=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --ckpt) CKPT="${2:?--ckpt needs a value}"; shift 2 ;;
    --tp) TP="${2:?--tp needs a value}"; shift 2 ;;
    --pp) PP="${2:?--pp needs a value}"; shift 2 ;;
    --dtype) DTYPE="${2:?--dtype needs a value}"; shift 2 ;;
    --keep-hf) KEEP="${2:?--keep-hf needs a value}"; shift 2 ;;
    --) shift; break ;;
    *) echo "torchrun_eval.sh: unknown argument '$1' (evaluation arguments go after --)" >&2; usage >&2; exit 2 ;;
  esac
done
if [[ -z "$CKPT" ]]; then
  echo "torchrun_eval.sh: --ckpt is required" >&2; usage >&2; exit 2
fi
for a in "$@"; do
  if [[ "$a" == --model || "$a" == --model=* ]]; then
    echo "torchrun_eval.sh: --model is set to the exported checkpoint; do not pass it" >&2; exit 2
  fi
done

if [[ -x "$ROOT/.venv/bin/python" ]]; then
  export PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
  MEGATRON_RL="${MEGATRON_RL:-$ROOT/.venv/bin/megatron-rl}"
else
  export PYTHON="${PYTHON:-python3}"
  MEGATRON_RL="${MEGATRON_RL:-megatron-rl}"
fi

WORK="$(mktemp -d "${TMPDIR:-/tmp}/mrl-eval.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
HF="${KEEP:-$WORK/hf}"
echo "torchrun_eval.sh: exporting $CKPT -> $HF (tp=$TP pp=$PP)"
bash "$HERE/torchrun_convert.sh" megatron-to-hf --ckpt "$CKPT" --out "$HF" --tp "$TP" --pp "$PP" --dtype "$DTYPE"
echo "torchrun_eval.sh: evaluating $HF"
"$MEGATRON_RL" eval --model "$HF" "$@"
