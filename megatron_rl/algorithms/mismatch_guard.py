"""Run-time version of NeMo-RL's CI gates on generator/trainer agreement.

NeMo-RL's tests require, over a run, median `token_mult_prob_error` < 1.05 and max `gen_kl_error` < 5e-4: a larger
gap means the generator samples from a different distribution than the trainer optimises (wrong weights after a
refit, a precision or kernel mismatch), and the on-policy loss silently becomes off-policy. Here each step is checked
as it happens: every step must stay under both limits (for gen_kl_error that is exactly the max gate; for
token_mult_prob_error it is stricter than a median, which is why the default only warns).
"""
from __future__ import annotations

import sys
from typing import Mapping, TextIO

from megatron_rl.config.schema import GRPOConfig


class MismatchAbort(RuntimeError):
    """grpo.mismatch_guard=abort and a step's generator/trainer mismatch was over a limit."""


def check_mismatch(metrics: Mapping[str, float], cfg: GRPOConfig, step: int, *,
                   stream: TextIO | None = None) -> list[str]:
    """Compare one step's `mismatch_metrics` with the limits in `cfg`; return the violations (empty: all fine).

    warn: each violation is printed to stderr, naming the step. abort: raises MismatchAbort naming them. off: no
    check. A step without tokens (both metrics 0) passes.
    """
    if cfg.mismatch_guard == "off":
        return []
    limits = {"token_mult_prob_error": ("grpo.mismatch_max_token_mult_prob_error",
                                        cfg.mismatch_max_token_mult_prob_error),
              "gen_kl_error": ("grpo.mismatch_max_gen_kl_error", cfg.mismatch_max_gen_kl_error)}
    bad = []
    for name, (key, limit) in limits.items():
        value = metrics.get(name)
        # NaN fails the comparison below; treat it as a violation too: a non-finite mismatch is never fine
        if value is not None and not (value < limit or value == 0.0):
            bad.append(f"{name}={value:.6g} exceeds {key}={limit:g}")
    if not bad:
        return bad
    msg = (f"step {step}: generator/trainer mismatch: {'; '.join(bad)} (the generator is not sampling from the "
           "policy being trained: check the refit, precision and kernels)")
    if cfg.mismatch_guard == "abort":
        raise MismatchAbort(msg + " [grpo.mismatch_guard=abort]")
    print(f"[megatron-rl] warning: {msg}", file=stream or sys.stderr, flush=True)
    return bad
