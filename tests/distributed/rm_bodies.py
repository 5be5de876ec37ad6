"""Rank bodies for test_rm.py: one reward-model step of the Megatron worker with a value head (policy.value_head) at
DP=2, TP=2 and PP=2, and DP=2 with varlen packing, and of the FSDP2 worker at DP=2 and TP=2, against an independent
reference: transformers'
...ForSequenceClassification (its `score` set to the worker's initial head) scoring each sequence at its last token,
TRL RewardTrainer's loss written here in plain torch, then one clipped torch.optim.AdamW step.
"""
from __future__ import annotations

import json
import random

import torch
import torch.nn.functional as F

from megatron_rl.data.supervised import PairExample
from tests.distributed.policy_bodies import _cfg, _gather_obj
from tests.distributed.sft_dpo_bodies import _adamw_step

CENTER = 0.01  # TRL's center_rewards_coefficient, on: its term is part of the checked gradient


def pairs(vocab: int, n_pairs: int = 4, seed: int = 21) -> list[PairExample]:
    """Random pairs over ids 1 .. vocab - 2, some responses ending with the pad id (vocab - 1) as a model that pads
    with its EOS ends them: transformers scores a row at its last non-pad token, and so must the trainer. One pad
    token sits mid-response too (a chat's turn end): it is scored past. 0 is the worker's appended score token
    (supervised_batches.rm_pair_batch)."""
    rng = random.Random(seed)
    pad = vocab - 1
    out = []
    for k in range(n_pairs):
        tok = lambda n: tuple(rng.randrange(1, vocab - 1) for _ in range(n))  # noqa: E731
        chosen = tok(rng.randint(2, 10)) + (pad,) * (k % 3)
        rejected = tok(2) + (pad,) + tok(rng.randint(1, 8)) + (pad,) * (k % 2)
        # TRL's per-pair margin on some lines (a line without one counts 0)
        out.append(PairExample(tok(rng.randint(3, 9)), chosen, rejected, k, rng.uniform(0.2, 1.0) if k % 2 else None))
    return out


def trl_reward_loss(chosen: torch.Tensor, rejected: torch.Tensor, center: float,
                    margin: torch.Tensor) -> torch.Tensor:
    """TRL RewardTrainer.compute_loss: -logsigmoid(r_c - r_r - margin).mean() + coef * mean((r_c + r_r) ** 2)."""
    return -F.logsigmoid(chosen - rejected - margin).mean() + center * torch.mean((chosen + rejected) ** 2)


def hf_rm_reference(model_dir: str, examples: list[PairExample], score: torch.Tensor):
    from transformers import AutoModelForSequenceClassification

    vocab = json.load(open(f"{model_dir}/config.json"))["vocab_size"]
    model = AutoModelForSequenceClassification.from_pretrained(
        model_dir, num_labels=1, pad_token_id=vocab - 1, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        model.score.weight.copy_(score)
    # transformers gives the pad token's embedding row padding_idx: no gradient, though the row is attended where it
    # ends a chat turn mid-response. megatron trains every row: compare the functions, not that quirk
    model.model.embed_tokens.padding_idx = None
    model.train()

    def reward(prompt, response):
        return model(input_ids=torch.tensor([list(prompt) + list(response)])).logits[0, 0]

    chosen = torch.stack([reward(e.prompt, e.chosen) for e in examples])
    rejected = torch.stack([reward(e.prompt, e.rejected) for e in examples])
    margin = torch.tensor([e.margin or 0.0 for e in examples])
    loss = trl_reward_loss(chosen, rejected, CENTER, margin)
    loss.backward()
    norm, state = _adamw_step(model)
    c, r = chosen.detach(), rejected.detach()
    metrics = {"loss": float(loss), "grad_norm": norm, "accuracy": float((c > r).float().mean()),
               "margin": float((c - r).mean()), "chosen_rewards": float(c.mean()),
               "rejected_rewards": float(r.mean())}
    return metrics, state, torch.cat([c, r])


def rm_layouts(rank: int, world_size: int, model_dir: str):
    from megatron_rl.algorithms.rm_loss import RMLossFn
    from megatron_rl.algorithms.supervised_batches import rm_pair_batch
    from megatron_rl.policy.fsdp2_worker import FSDP2PolicyWorker
    from megatron_rl.policy.megatron_worker import MegatronPolicyWorker

    vocab = json.load(open(f"{model_dir}/config.json"))["vocab_size"]
    examples = pairs(vocab)
    batch = rm_pair_batch(examples, pad_id=vocab - 1)
    res = {}
    for name, kw in (("dp2", {}), ("tp2", dict(tp=2)), ("pp2", dict(pp=2)), ("dp2_varlen", dict(packing="varlen")),
                     ("fsdp2_dp2", dict(backend="fsdp2")), ("fsdp2_tp2", dict(backend="fsdp2", tp=2))):
        extra = {k: kw.pop(k) for k in ("packing", "backend") if k in kw}
        cfg = _cfg(model_dir, fused=False, **kw)
        cfg.value_head = True
        for k, v in extra.items():
            setattr(cfg, k, v)
        worker = FSDP2PolicyWorker if cfg.backend == "fsdp2" else MegatronPolicyWorker
        w = worker(rank, world_size, policy_cfg=cfg)
        w.setup()
        before = {k: v for d in _gather_obj(w.hf_state_dict()) if d for k, v in d.items()}
        # the worker's per-token values before the step: each sequence's last one is its reward
        values = {k: v for d in _gather_obj(w.logprobs(batch)) if d for k, v in d.items()}
        trained = [o for o in _gather_obj(w.train(batch, RMLossFn(CENTER), 1.0)) if o]
        after = {k: v for d in _gather_obj(w.hf_state_dict()) if d for k, v in d.items()}
        out = {"metrics": trained[0]["metrics"], "varlen": w.varlen, "has_lm_head": "lm_head.weight" in after,
               "rewards": torch.stack([values[i][-1] for i in range(len(batch))])}
        if rank == 0:
            out["score_before"] = before["score.weight"]
            out["after"] = after
        res[name] = out
    if rank == 0:  # the reference from the first layout's initial head (every layout starts from the same one)
        res["ref"] = hf_rm_reference(model_dir, examples, res["dp2"]["score_before"])
    return res
