"""Optimizer-step details of the policy workers: the learning-rate schedule (both backends), torch Adam's fused
kernel, and three that MoE models make
non-trivial (clipping a chained optimizer to the global gradient norm, the per-step coefficient of the router's
load-balancing loss, and switching that loss per micro-batch)."""
from __future__ import annotations

import torch


def torch_optimizers(optimizer) -> list[torch.optim.Optimizer]:
    """The torch optimizers inside a megatron optimizer: one, or one per member of a chain (an MoE model's dense and
    expert optimizers); members without one (a rank with no parameters of that kind) are left out."""
    members = getattr(optimizer, "chained_optimizers", [optimizer])
    return [o.optimizer for o in members if getattr(o, "optimizer", None) is not None]


def use_fused_torch_adam(optimizer) -> int:
    """Switch every torch Adam/AdamW inside a megatron optimizer to torch's fused kernel; returns how many.

    Without apex or transformer-engine (every CPU install, and GPU installs without them) megatron builds torch's
    AdamW with torch's default implementation: on CPU that is one small op after another per parameter. The fused
    kernel does the same update in one pass: a 135M-parameter step 0.42 -> 0.07 s on 2 cores (SmolLM2-135M shapes,
    fp32 state, 2026-12-01). Same state layout (exp_avg, exp_avg_sq, a float32 'step' on the parameter's device),
    so checkpoints stay interchangeable. apex/TE's FusedAdam is left alone."""
    n = 0
    for inner in torch_optimizers(optimizer):
        if type(inner) not in (torch.optim.Adam, torch.optim.AdamW) or inner.defaults.get("differentiable"):
            continue
        params = [p for g in inner.param_groups for p in g["params"]]
        if not params or any(p.dtype not in (torch.float32, torch.float64) for p in params):
            continue
        for group in (inner.defaults, *inner.param_groups):
            group["fused"], group["foreach"] = True, False
        n += 1
    return n


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


def with_aux_loss_coeff(config, coeff: float | None, forward):
    """`forward()` (a micro-batch's (output, ...)) with megatron's `moe_aux_loss_coeff` at `coeff`, in its forward
    and in its backward; None: the loss is off, nothing is set.

    The worker gives padding micro-batches (`batching.filler_row`) coefficient 0: megatron attaches the router's
    load-balancing loss with a gradient of its own, independent of the main loss, so a filler's would reach the
    update; at 0 the router attaches none. The coefficient is read where the router runs, which with activation
    recompute is again inside the micro-batch's backward, and the pipeline schedule may run that backward after
    later micro-batches' forwards: a hook on the output sets the micro-batch's own coefficient again when its
    backward begins (the output's gradient is the first one computed). Checked at PP=2 x EP=2 with recompute on
    gloo against HF (without the hook the gradient norm was off by 0.3 %)."""
    if coeff is None:
        return forward()
    config.moe_aux_loss_coeff = coeff
    out = forward()
    if out[0].requires_grad:
        out[0].register_hook(lambda _grad: setattr(config, "moe_aux_loss_coeff", coeff))
    return out


# How a warm-up of W steps starts. 1 (checkpoints written before 2026-12-05): from lr 0, so the first optimizer
# step trained at lr 0 and a 1-step warm-up was a wasted step. 2: step i < W trains at lr * (i + 1) / W, so every
# step moves the weights. Checkpoints record their rule; a resumed run keeps the one it started with.
SCHEDULE_RULE = 2


def build_scheduler(optimizer, o, s, max_steps: int, rule: int = SCHEDULE_RULE):
    """megatron's OptimizerParamScheduler for policy.optimizer `o` and policy.scheduler `s`, over any optimizer with
    torch-style `param_groups` (a megatron optimizer, or the FSDP2 worker's torch AdamW): both backends then follow
    one schedule, weight decay included (each group's `wd_mult` scales it: 0 for biases and norms). Plain Python on
    the param groups; its construction already sets step 0's lr. Step i trains at the lr of the scheduler's
    num_steps = i; the decay reaches min_lr at decay_steps (default max_steps), i.e. after the last step, so the last
    step's lr is above min_lr. `rule`: SCHEDULE_RULE's comment."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    decay_steps = max(1, s.decay_steps or max_steps)
    w = s.warmup_steps
    if rule == 1:
        init_lr, warmup = (0.0 if w else o.lr), w
    elif rule == 2:  # lr/W at num_steps 0, rising linearly to lr at W - 1
        init_lr, warmup = (o.lr / w if w else o.lr), max(w - 1, 0)
    else:
        raise ValueError(f"unknown schedule rule {rule} (a checkpoint from a newer megatron-rl?)")
    sched = OptimizerParamScheduler(
        optimizer, init_lr=init_lr, max_lr=o.lr, min_lr=o.min_lr,
        lr_warmup_steps=warmup, lr_decay_steps=max(decay_steps, warmup + 1),
        lr_decay_style=s.decay, start_wd=o.weight_decay, end_wd=o.weight_decay, wd_incr_steps=decay_steps,
        wd_incr_style="constant")
    sched.rule = rule
    return sched


def scheduler_state(scheduler) -> dict:
    """What a checkpoint keeps of the scheduler: megatron's state and the warm-up rule it follows."""
    return {**scheduler.state_dict(), "rule": scheduler.rule}


def restore_scheduler(scheduler, optimizer, o, s, max_steps: int, state: dict):
    """`scheduler` at a checkpoint's `state`; rebuilt under the checkpoint's own rule when it is not today's (no
    "rule": written before rules were recorded, i.e. rule 1), so a resumed run keeps its schedule."""
    rule = state.get("rule", 1)
    if rule != scheduler.rule:
        scheduler = build_scheduler(optimizer, o, s, max_steps, rule=rule)
    scheduler.load_state_dict(state)
    return scheduler
