"""Rank bodies for test_sft_dpo.py: one SFT step and one DPO step of the Megatron policy worker at DP=2, TP=2 and
PP=2 against independent references, packed (shared-prompt) DPO against unpacked, and the same SFT and DPO steps on
the FSDP2 worker at DP=2.

References: SFT is HF transformers' own masked cross-entropy (`labels` with -100 on a padded batch: the mean over the
batch's trained tokens); DPO is the formula of Rafailov et al. 2023 (conservative label smoothing, plus the RPO
NLL term) written here in plain torch on HF logits. Both then take one clipped torch.optim.AdamW step.
"""
from __future__ import annotations

import json
import random

import torch
import torch.nn.functional as F

from megatron_rl.config.schema import DPOConfig
from megatron_rl.policy.interface import RolloutBatch
from tests.distributed.policy_bodies import EPS, LR, _cfg, _gather_obj, _merge

DPO = DPOConfig(beta=0.5, label_smoothing=0.1, sft_loss_weight=0.3)


def sft_batch(vocab: int, n: int = 6, seed: int = 11) -> RolloutBatch:
    """Sequences whose responses have context tokens (mask False) between trained ones, as multi-turn chats do."""
    rng = random.Random(seed)
    ids, plens, masks = [], [], []
    for _ in range(n):
        p, r = rng.randint(2, 8), rng.randint(3, 12)
        ids.append([rng.randrange(vocab) for _ in range(p + r)])
        plens.append(p)
        masks.append(torch.tensor([j < 2 or rng.random() < 0.6 for j in range(r)], dtype=torch.bool))
    return RolloutBatch(ids, plens, loss_mask=masks)


def pair_batch(vocab: int, n_pairs: int = 4, seed: int = 12) -> RolloutBatch:
    rng = random.Random(seed)
    ids, plens, groups, roles = [], [], [], []
    for k in range(n_pairs):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(3, 9))]
        for role in (1.0, 0.0):
            ids.append(prompt + [rng.randrange(vocab) for _ in range(rng.randint(2, 10))])
            plens.append(len(prompt))
            groups.append(k)
            roles.append(role)
    return RolloutBatch(ids, plens, group_ids=groups, seq_roles=roles, keep_groups=True)


def _hf(model_dir: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    model.train()
    return model


def _response_logprobs(model, batch: RolloutBatch) -> list[torch.Tensor]:
    out = []
    for ids, p in zip(batch.input_ids, batch.prompt_lens):
        x = torch.tensor([ids])
        lp = torch.log_softmax(model(x).logits[0, :-1].float(), -1).gather(-1, x[0, 1:, None])[:, 0]
        out.append(lp[p - 1:])
    return out


def _adamw_step(model) -> tuple[float, dict]:
    grad_norm = torch.sqrt(sum((q.grad.double() ** 2).sum() for q in model.parameters() if q.grad is not None))
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999), eps=EPS, weight_decay=0.0).step()
    return float(grad_norm), {k: v.detach().clone() for k, v in model.state_dict().items()}


def hf_sft_reference(model_dir: str, batch: RolloutBatch):
    model = _hf(model_dir)
    s = max(len(x) for x in batch.input_ids)
    ids = torch.zeros((len(batch), s), dtype=torch.long)
    labels = torch.full((len(batch), s), -100, dtype=torch.long)
    attn = torch.zeros((len(batch), s), dtype=torch.long)
    for i, (x, p, m) in enumerate(zip(batch.input_ids, batch.prompt_lens, batch.loss_mask)):
        ids[i, :len(x)] = torch.tensor(x)
        attn[i, :len(x)] = 1
        resp = torch.tensor(x[p:])
        labels[i, p:len(x)] = torch.where(m, resp, torch.full_like(resp, -100))
    loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss  # HF: mean over the non -100 labels
    loss.backward()
    norm, state = _adamw_step(model)
    return float(loss), norm, state


def paper_dpo_loss(lp: list[torch.Tensor], ref: list[torch.Tensor], cfg: DPOConfig) -> torch.Tensor:
    """Mean over pairs (2k chosen, 2k + 1 rejected) of -(1-e) log sigma(beta h) - e log sigma(-beta h) + w NLL_w."""
    losses = []
    for w, l in zip(range(0, len(lp), 2), range(1, len(lp), 2)):
        h = (lp[w].sum() - ref[w].sum()) - (lp[l].sum() - ref[l].sum())
        e = cfg.label_smoothing
        dpo = -(1 - e) * F.logsigmoid(cfg.beta * h) - e * F.logsigmoid(-cfg.beta * h)
        losses.append(dpo + cfg.sft_loss_weight * -lp[w].mean())
    return torch.stack(losses).mean()


def hf_dpo_reference(model_dir: str, batch: RolloutBatch, ref: list[torch.Tensor]):
    model = _hf(model_dir)
    lp = _response_logprobs(model, batch)
    loss = paper_dpo_loss(lp, ref, DPO)
    loss.backward()
    norm, state = _adamw_step(model)
    return float(loss), norm, state, [x.detach() for x in lp]


def sft_dpo_layouts(rank: int, world_size: int, model_dir: str, other_dir: str):
    """The references once, then each layout's worker: SFT at dp2/tp2/pp2 and dp2 varlen in small micro-batches;
    DPO (reference logprobs from another model, so h != 0) at dp2/tp2/pp2 packed, dp2 in small micro-batches, dp2
    unpacked (no shared prefix), and dp2 varlen (cascade attention)."""
    from megatron_rl.algorithms.supervised_loss import DPOLossFn, SFTLossFn
    from megatron_rl.policy.fsdp2_worker import FSDP2PolicyWorker
    from megatron_rl.policy.megatron_worker import MegatronPolicyWorker

    vocab = json.load(open(f"{model_dir}/config.json"))["vocab_size"]
    sb, pb = sft_batch(vocab), pair_batch(vocab)
    with torch.no_grad():
        init_lps = _response_logprobs(_hf(model_dir), pb)
        pb.ref_logprobs = _response_logprobs(_hf(other_dir), pb)
    res = {"sft_ref": hf_sft_reference(model_dir, sb), "dpo_ref": hf_dpo_reference(model_dir, pb, pb.ref_logprobs),
           "init_lps": init_lps, "dpo_ref_in": pb.ref_logprobs}
    if rank != 0:
        res["sft_ref"] = res["sft_ref"][:2]
        res["dpo_ref"] = res["dpo_ref"][:2]
    runs = [("sft", "dp2", {}), ("sft", "tp2", dict(tp=2)), ("sft", "pp2", dict(pp=2)),
            # whole examples packed into several token-budget varlen micro-batches (pairs: whole pairs)
            ("sft", "dp2_varlen_small_mb", dict(budget=24, packing="varlen")), ("dpo", "dp2_small_mb", dict(budget=32)),
            ("dpo", "dp2", {}), ("dpo", "tp2", dict(tp=2)), ("dpo", "pp2", dict(pp=2)),
            ("dpo", "dp2_unpacked", dict(shared_prefix=False)), ("dpo", "dp2_varlen", dict(packing="varlen")),
            # the same steps on the FSDP2 backend (HF model sharded over dp): the same references, and megatron's dp2
            ("sft", "fsdp2_dp2", dict(backend="fsdp2")), ("dpo", "fsdp2_dp2", dict(backend="fsdp2"))]
    for algo, name, kw in runs:
        extra = {k: kw.pop(k) for k in ("shared_prefix", "packing", "backend") if k in kw}
        cfg = _cfg(model_dir, **kw)
        for k, v in extra.items():
            setattr(cfg, k, v)
        worker = FSDP2PolicyWorker if cfg.backend == "fsdp2" else MegatronPolicyWorker
        w = worker(rank, world_size, policy_cfg=cfg)
        w.setup()
        out = {"shared_prefix": getattr(w, "shared_prefix", cfg.shared_prefix), "varlen": w.varlen,
               "micro_batches": len(w._micro_batches(sb if algo == "sft" else pb))}
        if algo == "dpo":
            # the worker's own reference pass (the frozen initial weights) is the HF model's logprobs
            ref = _merge(_gather_obj(w.reference_logprobs(pb)))
            out["worker_ref"] = [ref[i] for i in range(len(pb))]
        batch, fn = (sb, SFTLossFn("tokens")) if algo == "sft" else (pb, DPOLossFn(DPO))
        trained = [o for o in _gather_obj(w.train(batch, fn, 1.0)) if o]
        after = _gather_obj(w.hf_state_dict())
        out.update(metrics=trained[0]["metrics"],
                   after={k: v for d in after if d for k, v in d.items()} if rank == 0 else None)
        res[(algo, name)] = out
    return res
