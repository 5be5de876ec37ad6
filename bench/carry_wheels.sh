#!/usr/bin/env bash
# Install the wheels carried to the lent GPU machine (no network there) into TARGET: every *.whl in the given
# folders, and wheels carried in parts, joined first. One device call carries at most 64 MiB, and Ray's wheel alone is
# 79 MB (ray 2.60.0, cp312): it is split (`split -b 60M W.whl W.whl.part-`) and its parts carried in two calls
# (bench/gpu_check.py's docstring has the commands). Missing folders are ignored; no wheel at all installs nothing.
#
#   bash bench/carry_wheels.sh TARGET DIR...          # e.g. /tmp/site .whl .whl2 /tmp/carry
set -euo pipefail
target="$1"
shift
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
for d in "$@"; do
  [[ -d "$d" ]] || continue
  for f in "$d"/*.whl "$d"/*.whl.part-*; do
    if [[ -e "$f" ]]; then cp "$f" "$work/"; fi
  done
done
for first in "$work"/*.whl.part-aa; do
  [[ -e "$first" ]] || continue
  whl="${first%.part-aa}"
  cat "$whl".part-* > "$whl"  # the glob sorts the parts: aa, ab, ...
  rm -f "$whl".part-*
done
if ! compgen -G "$work/*.whl" >/dev/null; then
  echo "[carry_wheels] no wheels in: $*" >&2
  exit 0
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$target" "$work"/*.whl
names=()
for w in "$work"/*.whl; do names+=("$(basename "$w")"); done
echo "[carry_wheels] installed into $target: ${names[*]}" >&2
