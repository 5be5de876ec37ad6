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


CLIP = 0.2


def ppo_policy_reference(model_dir: str, batch: RolloutBatch):
    """PPO's clipped surrogate (Schulman et al. 2017) with per-token advantages, written out on HF logprobs:
    -sum_t min(r_t A_t, clip(r_t, 1 - e, 1 + e) A_t) / tokens, r_t = pi(t) / pi_old(t)."""
    model = _hf(model_dir)
    lps = _response_logprobs(model, batch)
    n = sum(len(x) for x in lps)
    total = 0.0
    for lp, old, a in zip(lps, batch.old_logprobs, batch.fields["advantages"]):
        ratio = torch.exp(lp - old)
        total = total + torch.minimum(ratio * a, ratio.clamp(1 - CLIP, 1 + CLIP) * a).sum()
    loss = -total / n
    loss.backward()
    norm, state = _adamw_step(model)
    return float(loss), norm, state


def value_reference(model_dir: str, batch: RolloutBatch, score: torch.Tensor):
    """The critic's loss written out on transformers' sequence classifier (its `score` the worker's initial head):
    V_t is the score of the hidden state before token t; 0.5 max((V - R)^2, (V_old + clip(V - V_old) - R)^2) over
    the tokens."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=1, dtype=torch.float32,
                                                               attn_implementation="eager")
    with torch.no_grad():
        model.score.weight.copy_(score)
    model.model.embed_tokens.padding_idx = None  # every row trains, as megatron's (rm_bodies.py says why)
    model.train()
    total, n = 0.0, 0
    for ids, p, ret, old in zip(batch.input_ids, batch.prompt_lens, batch.fields["returns"], batch.fields["old_values"]):
        hidden = model.model(input_ids=torch.tensor([ids])).last_hidden_state[0]
        v = model.score(hidden[p - 1:len(ids) - 1])[:, 0]
        v_clip = old + (v - old).clamp(-CLIP, CLIP)
        total = total + (0.5 * torch.maximum((v - ret) ** 2, (v_clip - ret) ** 2)).sum()
        n += len(ids) - p
    loss = total / n
    loss.backward()
    norm, state = _adamw_step(model)
    return float(loss), norm, state


def ppo_batch(vocab: int, seed: int = 41) -> RolloutBatch:
    """`batch_with_fields`' sequences with PPO's fields: per-token advantages, returns, old values, and old logprobs
    perturbed so that some ratios leave the clip range."""
    b = batch_with_fields(vocab, seed=seed)
    rng = torch.Generator().manual_seed(seed)
    lens = b.response_lens()
    b.fields = {"advantages": b.fields["token_adv"],
                "returns": [torch.randn(n, generator=rng) for n in lens],
                "old_values": [0.1 * torch.randn(n, generator=rng) for n in lens]}
    return b


def ppo_layouts(rank: int, world_size: int, model_dir: str):
    """PPO's policy loss (megatron DP2, fsdp2 DP2) and the critic's value loss (megatron DP2 and TP2, fsdp2 DP2)."""
    from megatron_rl.algorithms.ppo_loss import PPOPolicyLossFn, ValueLossFn
    from megatron_rl.config.schema import LossConfig
    from megatron_rl.policy.fsdp2_worker import FSDP2PolicyWorker
    from megatron_rl.policy.megatron_worker import MegatronPolicyWorker

    vocab = json.load(open(f"{model_dir}/config.json"))["vocab_size"]
    batch = ppo_batch(vocab)
    with torch.no_grad():
        lps = _response_logprobs(_hf(model_dir), batch)
    g = torch.Generator().manual_seed(5)
    batch.old_logprobs = [lp + 0.3 * torch.randn(len(lp), generator=g) for lp in lps]
    res = {"policy_ref": ppo_policy_reference(model_dir, batch) if rank == 0 else None}
    policy_loss = PPOPolicyLossFn(LossConfig(normalizer="tokens", ratio_clip_low=CLIP, ratio_clip_high=CLIP))
    runs = [("policy", "dp2", {}), ("policy", "fsdp2_dp2", dict(backend="fsdp2")),
            ("value", "dp2", {}), ("value", "tp2", dict(tp=2)), ("value", "fsdp2_dp2", dict(backend="fsdp2"))]
    for kind, name, kw in runs:
        backend = kw.pop("backend", "megatron")
        cfg = _cfg(model_dir, fused=kind == "policy", **kw)
        cfg.backend, cfg.value_head = backend, kind == "value"
        w = (FSDP2PolicyWorker if backend == "fsdp2" else MegatronPolicyWorker)(rank, world_size, policy_cfg=cfg)
        w.setup()
        before = {k: v for d in _gather_obj(w.hf_state_dict()) if d for k, v in d.items()}
        fn = policy_loss if kind == "policy" else ValueLossFn(CLIP)
        trained = [o for o in _gather_obj(w.train(batch, fn, 1.0)) if o]
        after = {k: v for d in _gather_obj(w.hf_state_dict()) if d for k, v in d.items()}
        res[(kind, name)] = {"metrics": trained[0]["metrics"], "after": after if rank == 0 else None}
        if kind == "value" and name == "dp2" and rank == 0:
            res["value_ref"] = value_reference(model_dir, batch, before["score.weight"])
    return res


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
