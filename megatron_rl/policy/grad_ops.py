"""Two optimizer-step details of the megatron worker that MoE models make non-trivial: clipping a chained optimizer
to the global gradient norm, and the per-step coefficient of the router's load-balancing loss."""
from __future__ import annotations


def clip_to_total_norm(optimizer, total_norm: float) -> None:
    """Clip to the global norm as megatron's ChainedOptimizer.step does: an MoE model's optimizer chains a dense
    and an expert one (whose `clip_grad_norm` refuses chains), each clipped by the norm over both."""
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    for o in getattr(optimizer, "chained_optimizers", [optimizer]):
        params = [] if getattr(o, "is_stub_optimizer", False) else o.get_parameters()
        if params:
            clip_grad_by_total_norm_fp32(params, o.config.clip_grad, total_norm,
                                         o.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8)


def moe_aux_loss_coeff(coef: float, mbs, n_tokens: int) -> float:
    """megatron's `moe_aux_loss_coeff` for policy.moe_aux_loss_coef = `coef` x the token-weighted mean of the
    micro-batches' Switch losses: megatron's router scales each one by its routed tokens T_mb and
    `finalize_model_grads` divides by our count D (response tokens), so its coeff = coef * D / sum T_mb (over
    micro-batches and data-parallel ranks)."""
    from megatron.core import parallel_state as ps

    from megatron_rl.distributed.collectives import all_reduce_scalars

    routed = all_reduce_scalars([sum(mb.tokens.numel() for mb in mbs)], ps.get_data_parallel_group())[0]
    return coef * n_tokens / routed
