"""Rank bodies for test_batch_fields.py: a loss that reads `RolloutBatch.fields` (a per-token tensor and a
per-sequence number, as PPO's token advantages and a per-sequence weight would be) trained by the Megatron worker at
DP=2 (one micro-batch, and several small ones) and TP=2, and by the FSDP2 worker at DP=2, against the same formula in
plain torch on HF logprobs with a torch AdamW step."""
from __future__ import annotations

import json
import random

import torch

from megatron_rl.policy.interface import RolloutBatch
from megatron_rl.policy.loss_api import LossInputs
from tests.distributed.policy_bodies import _cfg, _gather_obj
from tests.distributed.sft_dpo_bodies import _adamw_step, _hf, _response_logprobs


def batch_with_fields(vocab: int, n: int = 6, seed: int = 31) -> RolloutBatch:
    rng = random.Random(seed)
    ids, plens, adv, weight = [], [], [], []
    for _ in range(n):
        p, r = rng.randint(2, 8), rng.randint(3, 12)
        ids.append([rng.randrange(vocab) for _ in range(p + r)])
        plens.append(p)
        adv.append(torch.tensor([rng.uniform(-1, 1) for _ in range(r)]))  # per token
        weight.append(rng.uniform(0.5, 2.0))  # per sequence
    return RolloutBatch(ids, plens, fields={"token_adv": adv, "weight": weight})


def fields_loss(inp: LossInputs):
    """-sum over trained tokens of weight x token advantage x logprob, over the batch's tokens."""
    per_tok = -inp.fields["weight"] * inp.fields["token_adv"] * inp.logprobs * inp.mask
    loss = per_tok.sum() / inp.num_global_tokens
    return loss, {"loss": loss.detach()}


def reference(model_dir: str, batch: RolloutBatch):
    model = _hf(model_dir)
    lps = _response_logprobs(model, batch)
    n = sum(len(x) for x in lps)
    loss = -sum((w * a * lp).sum() for w, a, lp in zip(batch.fields["weight"], batch.fields["token_adv"], lps)) / n
    loss.backward()
    norm, state = _adamw_step(model)
    return float(loss), norm, state


def fields_layouts(rank: int, world_size: int, model_dir: str):
    from megatron_rl.policy.fsdp2_worker import FSDP2PolicyWorker
    from megatron_rl.policy.megatron_worker import MegatronPolicyWorker

    vocab = json.load(open(f"{model_dir}/config.json"))["vocab_size"]
    batch = batch_with_fields(vocab)
    res = {"ref": reference(model_dir, batch) if rank == 0 else None}
    for name, kw in (("dp2", {}), ("dp2_small_mb", dict(budget=24)), ("tp2", dict(tp=2)),
                     ("fsdp2_dp2", dict(backend="fsdp2"))):
        backend = kw.pop("backend", "megatron")
        cfg = _cfg(model_dir, **kw)
        cfg.backend = backend
        w = (FSDP2PolicyWorker if backend == "fsdp2" else MegatronPolicyWorker)(rank, world_size, policy_cfg=cfg)
        w.setup()
        mbs = len(w._micro_batches(batch))
        trained = [o for o in _gather_obj(w.train(batch, fields_loss, 1.0)) if o]
        after = {k: v for d in _gather_obj(w.hf_state_dict()) if d for k, v in d.items()}
        res[name] = {"metrics": trained[0]["metrics"], "micro_batches": mbs, "after": after if rank == 0 else None}
    return res
