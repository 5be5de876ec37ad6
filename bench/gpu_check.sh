#!/usr/bin/env bash
# bench/gpu_check.py on the lent GPU machine (no network there): install the carried wheels from .whl/ (how to make
# them: the docstring of bench/gpu_check.py) into /tmp/site, then run the check under a hard timeout so that one
# hung section cannot eat the session's device time. The JSON (written after every section) and the log go to $OUT.
#
#   bash bench/gpu_check.sh [gpu_check.py args...]      # e.g. --sections train offload
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
OUT="${OUT:-$PWD/gpu_check_out}"
mkdir -p "$OUT"
# .whl/ and .whl2/ as carried by this call, /tmp/carry/ as left by an earlier call (Ray's wheel comes in two parts)
if compgen -G ".whl*/*.whl*" >/dev/null || compgen -G "/tmp/carry/*.whl*" >/dev/null; then
  bash bench/carry_wheels.sh /tmp/site .whl .whl2 /tmp/carry || exit 1
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | tee "$OUT/nvidia_smi.txt"
# 480 s: the check must end within 8 minutes; its own --budget-s (450) skips sections that would start later
timeout -k 10 "${GPU_CHECK_TIMEOUT:-480}" python3 bench/gpu_check.py --out "$OUT/gpu_check.json" "$@" 2>&1 \
  | tee "$OUT/gpu_check.log"
rc=${PIPESTATUS[0]}
echo "[gpu_check.sh] exit $rc" >&2
exit "$rc"
