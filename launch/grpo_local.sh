#!/usr/bin/env bash
# Single-node GRPO: a private Ray on this machine, then `megatron-rl train`.
#
#   launch/grpo_local.sh CONFIG.yaml [key.path=value ...]
#   e.g. launch/grpo_local.sh configs/demo_cpu.yaml grpo.max_steps=5
#
# Sets thread counts so the ranks on this machine do not oversubscribe its cores: OMP_NUM_THREADS/MKL_NUM_THREADS
# default to cores / ranks (ranks = DEVICES_PER_NODE, else the GPUs nvidia-smi lists, else 1; the CPU trainer and
# generator then set their own per-phase counts), and TOKENIZERS_PARALLELISM=false because the reward workers fork.
# DEVICES_PER_NODE, when set, is also passed as cluster.devices_per_node. MEGATRON_RL chooses the CLI (default: the
# repo's .venv when present, else megatron-rl on PATH). For several nodes use launch/slurm_grpo.sh.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
usage() { sed -n '2,11p' "${BASH_SOURCE[0]}"; }
if [[ $# -lt 1 ]]; then usage >&2; exit 2; fi
if [[ "$1" == -h || "$1" == --help ]]; then usage; exit 0; fi
CONFIG="$1"; shift

if [[ -x "$ROOT/.venv/bin/megatron-rl" ]]; then
  MEGATRON_RL="${MEGATRON_RL:-$ROOT/.venv/bin/megatron-rl}"
else
  MEGATRON_RL="${MEGATRON_RL:-megatron-rl}"
fi
ranks="${DEVICES_PER_NODE:-}"
if [[ -z "$ranks" ]] && command -v nvidia-smi >/dev/null 2>&1; then
  ranks="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)"
fi
[[ "${ranks:-0}" -ge 1 ]] || ranks=1
cores="$(nproc)"
threads=$((cores / ranks))
[[ "$threads" -ge 1 ]] || threads=1
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$threads}"
export MKL_NUM_THREADS="${MKL_NUM_THREADS:-$OMP_NUM_THREADS}"
export TOKENIZERS_PARALLELISM="${TOKENIZERS_PARALLELISM:-false}"
extra=()
if [[ -n "${DEVICES_PER_NODE:-}" ]]; then extra+=("cluster.devices_per_node=$DEVICES_PER_NODE"); fi
echo "grpo_local.sh: $cores cores, $ranks rank(s): OMP_NUM_THREADS=$OMP_NUM_THREADS"
# ours first: an explicit override (or a trailing --dry-run) from the command line comes after them
exec "$MEGATRON_RL" train "$CONFIG" ${extra[@]+"${extra[@]}"} "$@"
