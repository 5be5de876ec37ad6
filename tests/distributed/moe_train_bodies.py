"""Rank bodies for test_moe_train.py: the policy worker's training step on a tiny Qwen3-MoE at EP=2 (gloo), against
HF transformers + torch AdamW.

With every advantage 0 the policy loss has zero gradient, so whatever a step changes comes from the router's
load-balancing loss (policy.moe_aux_loss_coef). The reference recomputes that loss from HF's router logits with the
Switch Transformer formula (Fedus et al. 2021, normalised by top-k as megatron-core does): per layer and micro-batch
of T tokens, E * sum_e f_e * P_e with f_e = (tokens routed to e) / (T * k) and P_e = the mean softmax probability
of e; summed over layers, and the micro-batches weighted by their token share.
"""
from __future__ import annotations

import random

import torch

from megatron_rl.config.schema import OptimizerConfig, PolicyConfig
from megatron_rl.policy.interface import RolloutBatch
from megatron_rl.policy.loss_api import LossInputs
from tests.distributed.policy_bodies import _gather_obj

LR, EPS = 1e-3, 1e-4  # a large Adam eps keeps the update a smooth function of tiny gradients (policy_bodies.py)
SEQ, PROMPT, N = 12, 4, 4  # N sequences of SEQ tokens: one per micro-batch (the token budget), no padding


def pg_loss(inp: LossInputs):
    """An importance-weighted policy gradient loss (zero gradient when every advantage is 0)."""
    loss = (-inp.advantages * torch.exp(inp.logprobs - inp.old_logprobs)).sum() / inp.num_global_tokens
    return loss, {"loss": loss.detach()}


def zero_advantage_batch(vocab: int, seed: int = 0) -> RolloutBatch:
    rng = random.Random(seed)
    return RolloutBatch(input_ids=[[rng.randrange(vocab) for _ in range(SEQ)] for _ in range(N)],
                        prompt_lens=[PROMPT] * N, advantages=[0.0] * N)


def switch_loss(router_logits: torch.Tensor, topk: int) -> torch.Tensor:
    """Switch load-balancing loss of one layer's router logits [T, E] (module doc)."""
    t, e = router_logits.shape
    probs = torch.softmax(router_logits.float(), dim=-1)
    counts = torch.zeros(e).index_add_(0, probs.topk(topk, dim=-1).indices.flatten(), torch.ones(t * topk))
    return e * ((counts / (t * topk)) * probs.mean(0)).sum()


def hf_reference(model_dir: str, batch: RolloutBatch, coef: float) -> tuple[float, dict]:
    """(gradient norm, HF weights after one AdamW step) of coef x the micro-batches' (here: the sequences', of equal
    length) mean Switch loss. The router sees each sequence's input positions: all tokens but the last."""
    from transformers import AutoModelForCausalLM

    from megatron_rl.models.tiny import disk_state_dict

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    model.train()
    k = model.config.num_experts_per_tok
    for ids in batch.input_ids:
        out = model(torch.tensor([ids[:-1]]), output_router_logits=True)
        (coef * sum(switch_loss(lg, k) for lg in out.router_logits) / len(batch)).backward()
    norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
    torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999), eps=EPS, weight_decay=0.0).step()
    return norm, disk_state_dict(model)  # per-expert tensors under their on-disk names, as megatron exports them


def aux_loss_step(rank: int, world_size: int, model_dir: str, coef: float):
    """One zero-advantage training step at EP=2 with policy.moe_aux_loss_coef=coef: on rank 0
    {"got": (gradient norm, HF-named weights after), "ref": the same from `hf_reference`}."""
    import json

    from megatron_rl.policy.megatron_worker import MegatronPolicyWorker

    vocab = json.load(open(f"{model_dir}/config.json"))["vocab_size"]
    batch = zero_advantage_batch(vocab)
    cfg = PolicyConfig(model=model_dir, ep=2, precision="fp32", moe_aux_loss_coef=coef, shared_prefix=False,
                       max_tokens_per_microbatch=SEQ,
                       optimizer=OptimizerConfig(lr=LR, weight_decay=0.0, clip_grad=1.0, adam_eps=EPS))
    w = MegatronPolicyWorker(rank, world_size, policy_cfg=cfg)
    w.setup()
    assert w.dp_size == 2 and len(w._micro_batches(batch)) == N // 2  # the weighting hf_reference assumes
    norm = [o for o in _gather_obj(w.train(batch, pg_loss)) if o][0]["metrics"]["grad_norm"]
    after = _gather_obj(w.hf_state_dict())
    if rank == 0:
        return {"got": (norm, {k: v for d in after if d for k, v in d.items()}),
                "ref": hf_reference(model_dir, batch, coef)}
    return None
