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
        if p.backend != "fsdp2":
            raise ValueError(f"policy.sp={p.sp} (Ulysses) runs on policy.backend=fsdp2; megatron splits sequences "
                             "with policy.cp")
        _refuse_unsplit(cfg, "policy.sp", p.sp)
    if p.cp == 1:
        return
    if p.backend != "megatron":
        raise ValueError(f"policy.cp={p.cp} runs on policy.backend=megatron; the fsdp2 backend splits sequences with "
                         "policy.sp (Ulysses)")
    if p.packing == "none":
        raise ValueError(f"policy.cp={p.cp} splits packed rows: set policy.packing=varlen (or auto)")
    p.packing = "varlen"
    _refuse_unsplit(cfg, "policy.cp", p.cp)


def _refuse_unsplit(cfg: Config, key: str, n: int) -> None:
    """What neither split divides over its ranks: the MoE load-balancing loss (each rank's router would balance its
    own share of the tokens) and top-k distillation (the student's top-k logprobs are not gathered)."""
    if cfg.policy.moe_aux_loss_coef > 0:
        raise ValueError(f"policy.moe_aux_loss_coef={cfg.policy.moe_aux_loss_coef} with {key}={n}: the load-"
                         "balancing loss is not split over ranks; set policy.moe_aux_loss_coef=0")
    d = getattr(cfg, "distillation", None)
    if d is not None and getattr(d, "topk", 0):
        raise ValueError(f"distillation.topk={d.topk} with {key}={n}: top-k distillation does not run on split "
                         f"rows; use distillation.topk=0 (the sampled-token loss) or {key}=1")


def check_sequence_heads(cfg: Config, heads: int, kv: int) -> None:
    """Ulysses (policy.sp > 1): the model's heads split over TP x SP ranks (policy/fsdp2_sp.check_heads)."""
    if cfg.policy.sp > 1:
        from types import SimpleNamespace

        from megatron_rl.policy.fsdp2_sp import check_heads

        check_heads(SimpleNamespace(num_attention_heads=heads, num_key_value_heads=kv), cfg.policy.tp, cfg.policy.sp)
