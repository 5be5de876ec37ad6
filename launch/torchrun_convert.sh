#!/usr/bin/env bash
# Run the HF <-> Megatron conversion under torchrun instead of locally spawned processes.
#
#   launch/torchrun_convert.sh hf-to-megatron --hf DIR --out DIR --tp 2 --pp 2
#   launch/torchrun_convert.sh megatron-to-hf --ckpt DIR --out DIR --tp 2 --pp 2 [--dtype bf16]
#
# It starts tp*pp ranks on this node (torchrun --standalone); each rank converts its own shard on the CPU (gloo), so
# memory per process is ~1/(tp*pp) of the model. For several nodes, call torchrun yourself with the same module and
# arguments (--nnodes/--rdzv-endpoint); --out must be on a filesystem all nodes share.
set -euo pipefail
if [[ $# -lt 1 ]]; then
  sed -n '2,9p' "$0"; exit 2
fi
TP=1; PP=1; prev=""
for a in "$@"; do
  case "$prev" in --tp) TP="$a" ;; --pp) PP="$a" ;; esac
  case "$a" in --tp=*) TP="${a#--tp=}" ;; --pp=*) PP="${a#--pp=}" ;; esac
  prev="$a"
done
PYTHON="${PYTHON:-python}"
exec "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$((TP * PP))" \
  -m megatron_rl.weights.convert "$@"
