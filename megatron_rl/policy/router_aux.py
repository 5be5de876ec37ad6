"""The MoE router's load-balancing (Switch) loss on the FSDP2 backend (`policy.moe_aux_loss_coef` > 0), computed as
the megatron backend's router computes it (megatron-core's `aux_loss` with `grad_ops.moe_aux_loss_coeff`):

- per MoE layer and micro-batch, over the T positions the router saw (every position of the micro-batch's rows: a
  padded row's padding is routed on megatron too, since megatron-rl gives its router no padding mask), the Switch
  loss E * sum_e f_e * P_e with f_e = (tokens whose top-k holds e) / (T * k), P_e = the mean softmax probability of
  e; f counts are not differentiated;
- summed over the layers, and added to the micro-batch's policy loss with weight coef * T / (sum of T over every
  real micro-batch of every DP rank): megatron scales each layer's loss by T and its coefficient by
  coef * D / sum T, and `finalize_model_grads` divides by the response-token count D;
- filler micro-batches (`batching.filler_row`) add none: megatron gives them coefficient 0.

The router logits come from forward hooks on the modules transformers itself records as "router_logits"
(`_can_record_outputs`: Qwen3-MoE's and Mixtral's top-k router, output 0 = logits [tokens, experts]), so nothing of
the HF model is replaced. Only a forward inside `recording()` is kept: with activation recompute the layer's forward
runs again inside backward, and that second call must not record (its logits are the same tensors' recomputation).
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn


class RouterLogits:
    """Records each MoE layer's router logits during `recording()` forwards."""

    def __init__(self, lm: nn.Module):
        spec = getattr(lm, "_can_record_outputs", None) or {}
        rec = spec.get("router_logits")
        if rec is None:
            raise ValueError(f"policy.moe_aux_loss_coef > 0 needs a mixture-of-experts model whose router transformers "
                             f"records; {type(lm).__name__} has none")
        cls, self.index = rec.target_class, rec.index
        self.routers = [m for m in lm.modules() if isinstance(m, cls)]
        if not self.routers:
            raise ValueError(f"no {cls.__name__} module in {type(lm).__name__}")
        self.topk = int(lm.config.num_experts_per_tok)
        self._logits: list[torch.Tensor] | None = None
        for m in self.routers:
            m.register_forward_hook(self._hook)

    def _hook(self, _module, _inputs, output):
        if self._logits is not None:
            self._logits.append(output[self.index] if isinstance(output, tuple) else output)

    @contextmanager
    def recording(self):
        self._logits = []
        try:
            yield self._logits
        finally:
            self._logits = None


def switch_loss(logits: torch.Tensor, topk: int) -> torch.Tensor:
    """One layer's Switch load-balancing loss of router logits [T, E] (module doc), in fp32 as megatron's router."""
    t, e = logits.shape
    probs = torch.softmax(logits.float(), dim=-1)
    counts = torch.zeros(e, dtype=probs.dtype, device=probs.device)
    counts.index_add_(0, probs.detach().topk(topk, dim=-1).indices.flatten(),
                      torch.ones(t * topk, dtype=probs.dtype, device=probs.device))
    return e * (counts / (t * topk) * probs.mean(0)).sum()


def aux_loss(layer_logits: list[torch.Tensor], topk: int, weight: float) -> torch.Tensor:
    """`weight` x the Switch losses summed over the layers (megatron sums its layers' losses into the gradient)."""
    return weight * sum(switch_loss(lg, topk) for lg in layer_logits)
