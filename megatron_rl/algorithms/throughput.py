"""Achieved FLOP/s per phase of a GRPO step, from token counts and the model's shape.

FLOPs are counted as the matmuls' 2 * (matmul params) per token forward, 6 per token trained (forward + backward),
where matmul params are every linear layer plus the lm_head (`planner.architecture.matmul_params`; the same count the
planner uses). Attention score FLOPs are left out: at the demo's lengths they are under 2 % of the total, and a count
that only grows with them would flatter long-context runs. Tokens are what each phase computed:
- train: positions fed to the trainer (packed rows, padding included), per optimizer step. The lm_head is counted
  on every position although the trainer runs it on the response window only (`policy/model_hooks.py`): for the
  CPU demo's short responses behind long shared prompts that overstates the rate by up to ~20 % (SmolLM2's lm_head
  is 21 % of its matmul params); `bench/phase_limits.py` turns the window off, so its counts are exact;
- logprobs: the same positions per forward-only pass (old logprobs, KL reference);
- generate: tokens sampled plus prompt tokens prefilled once per prompt (prefix caching shares them over a group).
`bench/phase_limits.py` puts these rates next to this machine's matmul peak.
"""
from __future__ import annotations

from functools import lru_cache


@lru_cache(maxsize=8)
def matmul_params_of(model_dir: str) -> int:
    from megatron_rl.models.provider import shape_spec
    from megatron_rl.planner.architecture import matmul_params

    return matmul_params(shape_spec(model_dir))  # any family: the FSDP2 backend trains models the mapping lacks


def phase_flops_per_s(n_matmul: int, rec: dict, *, tokens_fed: float, logprob_passes: int) -> dict[str, float]:
    """Per-phase FLOP/s for one step's record (its time_*_s keys and token counts); phases that did not run (or ran
    too briefly to time) are left out."""
    out = {}
    gen_tokens = rec.get("num_generated_tokens", 0) + rec.get("num_prompt_tokens", 0)
    for key, flops, seconds in (
            ("train_flops_per_s", 6 * n_matmul * tokens_fed, rec.get("time_train_s", 0.0)),
            ("logprobs_flops_per_s", 2 * n_matmul * tokens_fed * logprob_passes, rec.get("time_logprobs_s", 0.0)),
            ("generate_flops_per_s", 2 * n_matmul * gen_tokens, rec.get("time_generate_s", 0.0))):
        if flops > 0 and seconds > 1e-3:
            out[key] = flops / seconds
    return out
