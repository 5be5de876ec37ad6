"""Rank bodies for test_policy.py: the Megatron policy worker at TP=2, PP=2, DP=2 against an HF + torch reference.

The reference is independent of megatron: HF transformers forward, a plain-torch loss, torch.optim.AdamW.
"""
from __future__ import annotations

import random

import torch

from megatron_rl.config.schema import PolicyConfig, OptimizerConfig
from megatron_rl.policy.interface import RolloutBatch
from megatron_rl.policy.loss_api import LossInputs

TEMP = 0.7
LR = 1e-3
# A large Adam eps keeps the update a smooth function of the gradient: with eps=1e-8 an element whose gradient is
# ~1e-9 (a barely used embedding row) moves by a large fraction of lr on rounding noise alone.
EPS = 1e-4


def pg_loss(inp: LossInputs):
    """A plain importance-weighted policy gradient loss, normalised by global tokens."""
    ratio = torch.exp(inp.logprobs - inp.old_logprobs)
    per_tok = -inp.advantages * ratio * inp.mask
    loss = per_tok.sum() / inp.num_global_tokens
    return loss, {"loss": loss.detach(), "tokens": inp.mask.sum() / inp.num_global_tokens}


def make_batch(vocab: int, n: int = 6, seed: int = 0) -> RolloutBatch:
    rng = random.Random(seed)
    ids, plens = [], []
    for _ in range(n):
        p = rng.randint(2, 9)
        r = rng.randint(1, 12)
        ids.append([rng.randrange(vocab) for _ in range(p + r)])
        plens.append(p)
    return RolloutBatch(input_ids=ids, prompt_lens=plens, advantages=[rng.uniform(-1, 1) for _ in range(n)])


def decays(name: str) -> bool:
    """Whether megatron-core decays this (HF-named) weight. Its rule (megatron/core/optimizer/__init__.py,
    get_standard_config_overrides, applied when get_megatron_optimizer gets no config_overrides, as the worker calls
    it): wd_mult 0 for every parameter of one dimension or named "*.bias", i.e. biases and norm weights; the
    matrices of the linear layers, the embedding and the output layer decay. Written here from names, not shapes,
    so that the reference does not restate the rule it checks."""
    return not (name.endswith(".bias") or "norm" in name)


def hf_reference(model_dir: str, batch: RolloutBatch, lr: float = LR, weight_decay: float = 0.0):
    """Response logprobs at TEMP, then one AdamW step of pg_loss with old = current (detached). With a
    `batch.loss_mask`, only the kept tokens enter the loss and its normaliser (counted here from the masks). With
    `weight_decay`, torch's AdamW decays the weights `decays` names, in a group of their own; the rest in a group
    without decay."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    model.train()
    lps = []
    masks = batch.loss_mask or [torch.ones(len(ids) - p, dtype=torch.bool)
                                for ids, p in zip(batch.input_ids, batch.prompt_lens)]
    total = sum(int(m.sum()) for m in masks)
    loss_sum = 0.0
    for ids, p, a, m in zip(batch.input_ids, batch.prompt_lens, batch.advantages, masks):
        x = torch.tensor([ids])
        logits = model(x).logits[0, :-1].float() / TEMP
        lp = torch.log_softmax(logits, -1).gather(-1, x[0, 1:, None])[:, 0][p - 1:]
        lps.append(lp.detach())
        loss = -(a * torch.exp(lp[m] - lp[m].detach())).sum() / total
        loss.backward()
        loss_sum += float(loss)
    grad_norm = torch.sqrt(sum((q.grad.double() ** 2).sum() for q in model.parameters() if q.grad is not None))
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    named = list(model.named_parameters())
    groups = [{"params": [p for n, p in named if decays(n)], "weight_decay": weight_decay},
              {"params": [p for n, p in named if not decays(n)], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.999), eps=EPS)
    opt.step()
    return lps, loss_sum, float(grad_norm), {k: v.detach().clone() for k, v in model.state_dict().items()}


def _cfg(model_dir, tp=1, pp=1, budget=4096, distributed=True, precision="fp32", lr=LR, fused=True, wd=0.0):
    # fp32 unless asked: these layouts are compared with an fp32 HF reference to 1e-5 ("auto" is bf16 on a CPU with
    # bf16 instructions)
    return PolicyConfig(model=str(model_dir), tp=tp, pp=pp, max_tokens_per_microbatch=budget, precision=precision,
                        fused_lm_head=fused,
                        optimizer=OptimizerConfig(lr=lr, weight_decay=wd, clip_grad=1.0, adam_eps=EPS,
                                                  distributed=distributed))


def close_lists(got, want, atol):
    """Two lists of per-sequence tensors equal to `atol` (the message names the sequence)."""
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        torch.testing.assert_close(g, w, atol=atol, rtol=0, msg=lambda s: f"sequence {i}: {s}")


def _merge(results: list) -> dict:
    """Combine {index: value} dicts returned by the output ranks (None elsewhere)."""
    out = {}
    for r in results:
        if r:
            out.update(r)
    return out


def _gather_obj(obj):
    import torch.distributed as dist

    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


# the weight-decay layout's decay: lr * WD = 5e-4 of each decayed weight per step, far above the 1e-5 the weights are
# compared to, so a bias or norm decayed by mistake (or a matrix spared) shows
WD = 0.5


def layouts_match_reference(rank: int, world_size: int, model_dir: str, wd_model_dir: str):
    from megatron_rl.models.hf_io import HFCheckpoint
    from megatron_rl.policy.megatron_worker import MegatronPolicyWorker

    hf_state = {k: v.clone() for k, v in HFCheckpoint(model_dir).items()}
    import json

    vocab = json.load(open(f"{model_dir}/config.json"))["vocab_size"]
    batch = make_batch(vocab)
    ref_lps, ref_loss, ref_norm, ref_state = hf_reference(model_dir, batch)
    res = {"ref_lps": ref_lps, "ref_loss": ref_loss, "ref_norm": ref_norm, "ref_state": ref_state if rank == 0 else None}
    # weight decay on a model whose biases are not zero (HF initialises them to 0, where decay does nothing): the
    # same batch, compared with torch AdamW's two groups, at DP=2 (the distributed optimizer shards both groups) and
    # PP=2 (each stage builds its own groups)
    ref_lps_wd, ref_loss_wd, ref_norm_wd, ref_state_wd = hf_reference(wd_model_dir, batch, weight_decay=WD)
    _, _, _, ref_state_nowd = hf_reference(wd_model_dir, batch)
    res["wd_ref"] = {"ref_lps": ref_lps_wd, "ref_loss": ref_loss_wd, "ref_norm": ref_norm_wd,
                     "ref_state": ref_state_wd if rank == 0 else None,
                     "ref_state_nowd": ref_state_nowd if rank == 0 else None,
                     "before": {k: v.clone() for k, v in HFCheckpoint(wd_model_dir).items()} if rank == 0 else None}
    layouts = {"dp2": dict(), "tp2": dict(tp=2), "pp2": dict(pp=2), "dp2_small_mb": dict(budget=24),
               "tp2_plain_opt": dict(tp=2, distributed=False), "tp2_unfused": dict(tp=2, fused=False),
               "pp2_unfused": dict(pp=2, fused=False), "dp2_wd": dict(wd=WD), "pp2_wd": dict(pp=2, wd=WD)}
    for name, kw in layouts.items():
        w = MegatronPolicyWorker(rank, world_size,
                                 policy_cfg=_cfg(wd_model_dir if name.endswith("_wd") else model_dir, **kw))
        w.setup()
        exported = _gather_obj(w.hf_state_dict())
        lp = _merge(_gather_obj(w.logprobs(batch, temperature=TEMP)))
        # the lm_head ran on the response window only (its start is past column 0 for these prompts) on the last
        # stage, and exists nowhere else: the equalities with the HF reference below then cover the narrowed path
        from megatron.core import parallel_state as ps

        assert (w._logit_window is not None) == ps.is_pipeline_last_stage(), name
        assert w._logit_window is None or w._logit_window.start > 0, name
        # the fused head (no logits formed) on the last stage unless switched off: "*_unfused" cover the logits path
        assert (w._fused_head is not None) == (ps.is_pipeline_last_stage() and not name.endswith("_unfused")), name
        # the step below runs torch's fused AdamW kernel; the weights after it are compared with the default AdamW's
        from megatron_rl.policy.grad_ops import torch_optimizers

        assert all(g["fused"] for o in torch_optimizers(w.optimizer) for g in o.param_groups), name
        out = _gather_obj(w.train(batch, pg_loss, temperature=TEMP))
        after = _gather_obj(w.hf_state_dict())
        outs = [o for o in out if o]
        res[name] = {
            "export_before": {k: v for d in exported if d for k, v in d.items()},
            "logprobs": [lp[i] for i in range(len(batch))],
            "metrics": outs[0]["metrics"], "train_logprobs": _merge([o["logprobs"] for o in outs]),
            "after": {k: v for d in after if d for k, v in d.items()} if rank == 0 else None,
        }
        if name == "tp2":
            res[name]["hf_state"] = hf_state if rank == 0 else None
    return res


def save_load_resume(rank: int, world_size: int, model_dir: str, ckpt_dir: str):
    """steps 1-2, save, step 3 == fresh worker, load, step 3 (bit-identical weights), at TP=2. Two steps before the
    save: Adam's step count at the save (2) then differs from the loading optimizer's own (1), which megatron's
    dp_reshardable loader used to keep (the resumed update's bias correction was wrong)."""
    from megatron_rl.policy.megatron_worker import MegatronPolicyWorker
    import json

    vocab = json.load(open(f"{model_dir}/config.json"))["vocab_size"]
    b1, b2 = make_batch(vocab, seed=1), make_batch(vocab, seed=2)
    w = MegatronPolicyWorker(rank, world_size, policy_cfg=_cfg(model_dir, tp=2), max_steps=10)
    w.setup()
    w.train(b1, pg_loss)
    w.train(make_batch(vocab, seed=3), pg_loss)
    w.save(ckpt_dir, extra={"data_position": 8})
    m_a = w.train(b2, pg_loss)
    a = w.hf_state_dict()
    w2 = MegatronPolicyWorker(rank, world_size, policy_cfg=_cfg(model_dir, tp=2), max_steps=10)
    w2.setup()
    extra = w2.load(ckpt_dir)
    m_b = w2.train(b2, pg_loss)
    b = w2.hf_state_dict()
    return {"a": a, "b": b, "extra": extra, "m_a": m_a and m_a["metrics"], "m_b": m_b and m_b["metrics"],
            "steps": (w.step, w2.step)}


def onpolicy_reuse_equals_explicit_pass(rank: int, world_size: int, model_dir: str):
    """One step with old_logprobs=None (the training forward's own, detached) vs one with an explicit logprob pass."""
    import json

    from megatron_rl.policy.megatron_worker import MegatronPolicyWorker

    vocab = json.load(open(f"{model_dir}/config.json"))["vocab_size"]
    out = {}
    for name in ("reuse", "explicit"):
        batch = make_batch(vocab, seed=4)
        w = MegatronPolicyWorker(rank, world_size, policy_cfg=_cfg(model_dir, tp=2))
        w.setup()
        if name == "explicit":
            lp = _merge(_gather_obj(w.logprobs(batch, temperature=TEMP)))
            batch.old_logprobs = [lp[i] for i in range(len(batch))]
        res = _gather_obj(w.train(batch, pg_loss, temperature=TEMP))
        out[name] = {"metrics": [r for r in res if r][0]["metrics"], "after": w.hf_state_dict()}
    return out


def bf16_layouts_near_reference(rank: int, world_size: int, model_dir: str):
    """The same batch and step as `layouts_match_reference`, trained in bf16 (megatron mixed precision: bf16 compute,
    fp32 main weights, grads and Adam) at DP=2, TP=2 and PP=2; returned beside the fp32 HF reference."""
    import json

    from megatron_rl.policy.megatron_worker import MegatronPolicyWorker

    vocab = json.load(open(f"{model_dir}/config.json"))["vocab_size"]
    batch = make_batch(vocab)
    # a 10x larger step than the fp32 comparison's: the update must stand well above bf16's weight spacing
    # (|w| * 2^-8) for the moved weights to say anything about it
    ref_lps, ref_loss, ref_norm, ref_state = hf_reference(model_dir, batch, lr=10 * LR)
    res = {"ref_lps": ref_lps, "ref_loss": ref_loss, "ref_norm": ref_norm, "ref_state": ref_state if rank == 0 else None}
    for name, kw in {"dp2": dict(), "tp2": dict(tp=2), "pp2": dict(pp=2)}.items():
        w = MegatronPolicyWorker(rank, world_size, policy_cfg=_cfg(model_dir, precision="bf16", lr=10 * LR, **kw))
        w.setup()
        before = _gather_obj(w.hf_state_dict())
        lp = _merge(_gather_obj(w.logprobs(batch, temperature=TEMP)))
        out = [o for o in _gather_obj(w.train(batch, pg_loss, temperature=TEMP)) if o]
        after = _gather_obj(w.hf_state_dict())
        res[name] = {"logprobs": [lp[i] for i in range(len(batch))], "metrics": out[0]["metrics"],
                     "before": {k: v for d in before if d for k, v in d.items()} if rank == 0 else None,
                     "after": {k: v for d in after if d for k, v in d.items()} if rank == 0 else None}
    return res


def zero_advantage_part_same_update(rank: int, world_size: int, model_dir: str):
    """One step on a batch where half the sequences have advantage 0, fed whole vs only the part with gradient
    (`algorithms.trainable.trainable_part`, the whole batch's normalisers), at DP=2, for grpo (token mean) and
    gspo (sequence mean); an all-zero batch keeps one sequence per DP rank."""
    import json

    from megatron_rl.algorithms.loss_fn import GRPOLossFn
    from megatron_rl.algorithms.trainable import trainable_part
    from megatron_rl.config.schema import LossConfig
    from megatron_rl.policy.megatron_worker import MegatronPolicyWorker

    vocab = json.load(open(f"{model_dir}/config.json"))["vocab_size"]
    out = {}
    for variant in ("grpo", "gspo"):
        loss_fn = GRPOLossFn(LossConfig(variant=variant))
        for fed in ("whole", "part", "all_zero"):
            batch = make_batch(vocab, n=8, seed=5)
            batch.advantages = [a if i % 2 else 0.0 for i, a in enumerate(batch.advantages)]
            if fed == "all_zero":
                batch.advantages = [0.0] * len(batch)
            part = batch if fed == "whole" else trainable_part(batch, min_seqs=world_size)
            w = MegatronPolicyWorker(rank, world_size, policy_cfg=_cfg(model_dir))
            w.setup()
            before = w.hf_state_dict() if fed == "all_zero" else None
            res = _gather_obj(w.train(part, loss_fn, temperature=TEMP))
            out[(variant, fed)] = {"metrics": [r for r in res if r][0]["metrics"], "after": w.hf_state_dict(),
                                   "before": before, "num_fed": len(part)}
    return out


def _storages(tensors) -> dict[int, int]:
    """{storage address: allocated bytes} of the distinct, non-released storages under `tensors`."""
    out = {}
    for t in tensors:
        st = t.untyped_storage()
        if st.nbytes():
            out[st.data_ptr()] = st.nbytes()
    return out


def offload_without_distributed_optimizer(rank: int, world_size: int, model_dir: str):
    """bf16 at DP=2 with policy.optimizer.distributed false (DDP then keeps no parameter buffer: every bf16 weight is
    a tensor of its own). One step (so Adam has state), offload, onload, a second step; beside a worker that never
    offloads. Returns this rank's measurements: the trainer's tensors enumerated here (model weights, fp32 main
    weights, Adam state, gradients through each weight's main_grad) and their storages, before and after."""
    import json

    from megatron_rl.policy.grad_ops import torch_optimizers
    from megatron_rl.policy.megatron_worker import MegatronPolicyWorker

    vocab = json.load(open(f"{model_dir}/config.json"))["vocab_size"]
    b1, b2 = make_batch(vocab, seed=6), make_batch(vocab, seed=7)
    res = {}
    for name in ("never_offloaded", "offloaded"):
        w = MegatronPolicyWorker(rank, world_size, policy_cfg=_cfg(model_dir, distributed=False, precision="bf16"))
        w.setup()
        w.train(b1, pg_loss, temperature=TEMP)
        if name == "offloaded":
            weights = list(w.gpt.parameters())
            inner = torch_optimizers(w.optimizer)
            main = [p for o in inner for g in o.param_groups for p in g["params"]]
            adam = [v for o in inner for st in o.state.values() for v in st.values() if torch.is_tensor(v)]
            grads = [p.main_grad for p in weights]
            snap = [t.detach().clone() for t in weights + main + adam]
            kept = _storages(weights + main + adam)
            r = {"dtypes": sorted({str(p.dtype) for p in weights}),
                 "fp32_main": all(p.dtype == torch.float32 for p in main),
                 "distinct": len(_storages(weights)) == len(weights), "n_adam": len(adam),
                 "resident": sum(_storages(weights + main + adam + grads).values()), "kept": sum(kept.values()),
                 "report_before": w.memory_report()}
            r["report_offloaded"] = w.offload()
            r["still_allocated"] = [i for i, t in enumerate(weights + main + adam + grads)
                                    if t.untyped_storage().nbytes()]
            r["report_onloaded"] = w.onload()
            r["changed"] = [i for i, (t, s) in enumerate(zip(weights + main + adam, snap)) if not torch.equal(t, s)]
            res["checks"] = r
        out = w.train(b2, pg_loss, temperature=TEMP)
        res[name] = {"metrics": out and out["metrics"],
                     "after": {n: p.detach().clone() for n, p in w.gpt.named_parameters()}}
    return res


def bf16_suite(rank: int, world_size: int, model_dir: str):
    """One launch for the bf16 checks of test_policy.py."""
    return {**bf16_layouts_near_reference(rank, world_size, model_dir),
            "offload_plain_opt": offload_without_distributed_optimizer(rank, world_size, model_dir)}
