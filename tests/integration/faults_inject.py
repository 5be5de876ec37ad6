"""Faults injected from the outside of the code under test (no hook in the product code):

- `flaky_score`: a verifier for `RewardFn(scorer=...)` that hangs on some completions, raises on others and scores
  the rest 1.0 — chosen by a hash of the completion, so it is deterministic for a given run. It runs inside the
  reward pool's worker processes (imported there by name): keep this module's imports light.
- `pseudo_score`: a deterministic pseudo-reward in [0, 1] of the completion text (a random tiny model never solves
  arithmetic; this gives GRPO a gradient). Used by bench/soak.py.
- `PoisonedLoss`: wraps the GRPO loss shipped to the policy ranks and makes the loss (`where="loss"`) or only the
  gradients (`where="grad"`, the loss stays finite) NaN. Ray pickles it to the workers; the test registers this
  module for pickling by value, so the workers need not import `tests`.
"""
from __future__ import annotations

import time
import zlib


def _bucket(completion: str, mod: int) -> int:
    return zlib.crc32(completion.encode("utf-8", "replace")) % mod


def flaky_score(payload):
    k = _bucket(payload["completion"], 5)
    if k == 0:
        time.sleep(600)  # a verifier that hangs: the pool's timeout must end it
    if k == 1:
        raise RuntimeError("verifier bug (injected)")
    return {"score": 1.0, "format_ok": False}


def flaky_expected(completion: str) -> str:
    """What flaky_score does with a completion: "timeout", "error" or "ok"."""
    return {0: "timeout", 1: "error"}.get(_bucket(completion, 5), "ok")


def pseudo_score(payload):
    return {"score": _bucket(payload["completion"], 7) / 6, "format_ok": False}


class PoisonedLoss:
    def __init__(self, inner, where: str):
        assert where in ("loss", "grad")
        self.inner, self.where = inner, where

    def __call__(self, inp):
        import torch

        class _NanGrad(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                return x.clone()

            @staticmethod
            def backward(ctx, g):
                return g * float("nan")

        loss, metrics = self.inner(inp)
        if self.where == "loss":  # as a real NaN loss would: its reported value is NaN too
            loss = loss * float("nan")
            return loss, {**metrics, "loss": loss.detach()}
        return _NanGrad.apply(loss), metrics


def run_with_pseudo_reward(cfg, monkeypatch) -> list[dict]:
    """`build.run(cfg)` in this process with `pseudo_score` as the reward (a random tiny model never answers right,
    so no group would learn from the real verifier); the run's metrics records."""
    import json
    import signal
    from pathlib import Path

    import megatron_rl.rewards.reward_fn as rf
    from megatron_rl import build

    real = rf.RewardFn
    monkeypatch.setattr(rf, "RewardFn", lambda cfg_r, kind: real(cfg_r, kind, scorer=pseudo_score))
    handler = signal.getsignal(signal.SIGTERM)  # build.run installs its own
    try:
        assert build.run(cfg) == 0
    finally:
        signal.signal(signal.SIGTERM, handler)
        monkeypatch.setattr(rf, "RewardFn", real)
    text = (Path(cfg.output.dir) / "metrics.jsonl").read_text()
    return [json.loads(x) for x in text.splitlines() if x.strip()]
