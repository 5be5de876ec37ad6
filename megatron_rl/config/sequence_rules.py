"""Rules for splitting sequences over ranks: context parallelism on megatron (`policy.cp`, policy/context_parallel.py)
and Ulysses sequence parallelism on fsdp2 (`policy.sp`, policy/fsdp2_sp.py): what each combines with, checked by the
loader before any worker starts. Each refusal names the key to change (the heads' split needs the model:
`parallel_dims.check_policy_split`)."""
from __future__ import annotations

from megatron_rl.config.schema import Config


def validate_sequence_split(cfg: Config) -> None:
    """ValueError naming the key where policy.cp or policy.sp > 1 cannot run; with CP, packing auto becomes varlen
    (CP splits packed rows)."""
    p = cfg.policy
    if p.sp > 1:
        _validate_ulysses(cfg)
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


def _validate_ulysses(cfg: Config) -> None:
    p, sp = cfg.policy, cfg.policy.sp
    if p.backend != "fsdp2":
        raise ValueError(f"policy.sp={sp} (Ulysses) runs on policy.backend=fsdp2; megatron splits sequences with "
                         "policy.cp")
    if p.moe_aux_loss_coef > 0:
        raise ValueError(f"policy.moe_aux_loss_coef={p.moe_aux_loss_coef} with policy.sp={sp}: the load-balancing "
                         "loss is not split over SP ranks; set policy.moe_aux_loss_coef=0")
    d = getattr(cfg, "distillation", None)
    if d is not None and getattr(d, "topk", 0):
        raise ValueError(f"distillation.topk={d.topk} with policy.sp={sp}: top-k distillation does not run sequence-"
                         "parallel; use distillation.topk=0 (the sampled-token loss) or policy.sp=1")
