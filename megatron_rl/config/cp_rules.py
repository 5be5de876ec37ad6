"""Rules for context parallelism (`policy.cp`, policy/context_parallel.py): what it combines with, checked by the
loader before any worker starts. Each refusal names the key to change."""
from __future__ import annotations

from megatron_rl.config.schema import Config


def validate_context_parallel(cfg: Config) -> None:
    """ValueError naming the key where policy.cp > 1 cannot run; packing auto becomes varlen (CP splits packed
    rows)."""
    p = cfg.policy
    cp = p.cp
    if cp == 1:
        return
    if p.backend != "megatron":
        raise ValueError(f"policy.cp={cp} runs on policy.backend=megatron; the fsdp2 backend does not split "
                         "sequences yet")
    if p.packing == "none":
        raise ValueError(f"policy.cp={cp} splits packed rows: set policy.packing=varlen (or auto)")
    p.packing = "varlen"
    if p.moe_aux_loss_coef > 0:  # each rank's router would balance its own share of the tokens
        raise ValueError(f"policy.moe_aux_loss_coef={p.moe_aux_loss_coef} with policy.cp={cp}: the load-balancing "
                         "loss is not split over CP ranks; set policy.moe_aux_loss_coef=0")
    d = getattr(cfg, "distillation", None)
    if d is not None and getattr(d, "topk", 0):
        raise ValueError(f"distillation.topk={d.topk} with policy.cp={cp}: top-k distillation does not run "
                         "context-parallel; use distillation.topk=0 (the sampled-token loss) or policy.cp=1")
