"""Rules for mixture-of-experts options that span the trainer and the engine (the loader checks them, `build` acts
on them)."""
from __future__ import annotations

from megatron_rl.config.schema import Config
from megatron_rl.platform import get_platform


def routing_replay_enabled(cfg: Config, num_experts: int | None) -> bool:
    """Whether the engine records its routing and the trainer replays it (`policy.moe_routing_replay`, resolved for
    a model with `num_experts` experts, None or 0 for a dense one). ValueError naming the key where `on` cannot be
    honoured."""
    mode = cfg.policy.moe_routing_replay
    if mode == "off":
        return False
    if not num_experts:
        if mode == "on":
            raise ValueError("policy.moe_routing_replay=on: the model has no experts (a dense model routes nothing)")
        return False
    # CUDA graphs replay kernels without running the Python hook that records the routing
    # (generation/routing_capture.py); vLLM's own record (V2 runner, enable_return_routed_experts) is not wired
    eager = not get_platform().is_gpu or cfg.generation.enforce_eager
    if not eager:
        if mode == "on":
            raise ValueError("policy.moe_routing_replay=on needs generation.enforce_eager=true on GPU (the engine "
                             "records its routing in eager mode only)")
        return False
    if cfg.policy.activation_recompute and cfg.policy.pp > 1:
        if mode == "on":
            raise ValueError("policy.moe_routing_replay=on with policy.activation_recompute=true needs policy.pp=1 "
                             "(a pipeline recomputes a micro-batch after the next one's forward set other experts)")
        return False
    return True
