"""Rank bodies for test_distill.py: the distillation teacher (policy/teacher_worker.py) and loss
(algorithms/distill_loss.py) on Megatron at TP=2, PP=2 and DP=2 against HF transformers and a plain-torch
reverse-KL reference written here, independent of megatron and of megatron_rl's loss code. The student runs on
either policy backend (`policy.backend`: megatron, or fsdp2 at DP=2 and DTensor TP=2); the teacher is megatron's."""
from __future__ import annotations

import dataclasses
import json

import torch

from megatron_rl.config.schema import PolicyConfig
from tests.distributed.policy_bodies import EPS, LR, TEMP, _cfg, _gather_obj, _merge, make_batch

KL_COEF, REWARD_WEIGHT = 0.8, 0.5  # both terms of the advantage are on, so each one's weight is checked
TEACHER_LAYOUTS = {"tp2": dict(tp=2), "pp2": dict(pp=2), "tp2_unfused": dict(tp=2, fused_lm_head=False)}
# student layouts: policy overrides (`backend` picks the worker class, as build.policy_worker_class does for a run)
STUDENT_LAYOUTS = {"dp2": dict(), "tp2": dict(tp=2),
                   "fsdp2_dp2": dict(backend="fsdp2"), "fsdp2_tp2": dict(backend="fsdp2", tp=2)}
TOPK = 5
TOPK_STUDENT_LAYOUTS = {**STUDENT_LAYOUTS, "tp2_unfused": dict(tp=2, fused=False),
                        "fsdp2_tp2_unfused": dict(backend="fsdp2", tp=2, fused=False)}


def _student(rank: int, world_size: int, student_dir: str, backend: str = "megatron", **kw):
    """A set-up policy worker of `backend` on the reference's config (fp32, AdamW, clip 1)."""
    from megatron_rl.build import policy_worker_class

    w = policy_worker_class(backend)(rank, world_size,
                                     policy_cfg=dataclasses.replace(_cfg(student_dir, **kw), backend=backend))
    w.setup()
    return w


def _student_step(w, batch, loss_fn) -> dict:
    """One distillation step: its metrics and the HF-named weights after it (rank 0)."""
    outs = [o for o in _gather_obj(w.train(batch, loss_fn, temperature=TEMP)) if o]
    after = _gather_obj(w.hf_state_dict())
    return {"metrics": outs[0]["metrics"],
            "after": {k: v for d in after if d for k, v in d.items()} if w.rank == 0 else None}


def hf_logprobs(model, batch) -> list[torch.Tensor]:
    """Response-token logprobs at TEMP from an HF model's full logits (differentiable when the model is)."""
    out = []
    for ids, p in zip(batch.input_ids, batch.prompt_lens):
        x = torch.tensor([ids])
        logits = model(x).logits[0, :-1].float() / TEMP
        out.append(torch.log_softmax(logits, -1).gather(-1, x[0, 1:, None])[:, 0][p - 1:])
    return out


def _hf(model_dir, state=None):
    from transformers import AutoConfig, AutoModelForCausalLM

    if state is None:
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=torch.float32,
                                             attn_implementation="eager")
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    if missing:
        model.tie_weights()
    return model


def reverse_kl_reference(student_dir: str, batch, teacher_lps: list[torch.Tensor]):
    """The plain-torch reference: the loss value (KL_COEF x the sampled-token reverse KL, the mean over tokens of
    log pi_S - log pi_T, minus the reward term), the reverse KL itself, and the loss's score-function gradient,
    from the surrogate sum_t (KL_COEF * stopgrad(log pi_S - log pi_T) - REWARD_WEIGHT * a) * log pi_S / N; then one AdamW step."""
    model = _hf(student_dir)
    model.train()
    total = sum(len(ids) - p for ids, p in zip(batch.input_ids, batch.prompt_lens))
    value, rkl = 0.0, 0.0
    for ls, lt, a in zip(hf_logprobs(model, batch), teacher_lps, batch.advantages):
        value += float((KL_COEF * (ls.detach() - lt) - REWARD_WEIGHT * a).sum()) / total
        rkl += float((ls.detach() - lt).sum()) / total
        ((KL_COEF * (ls.detach() - lt) - REWARD_WEIGHT * a) * ls).sum().div(total).backward()
    grad_norm = torch.sqrt(sum((q.grad.double() ** 2).sum() for q in model.parameters() if q.grad is not None))
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999), eps=EPS, weight_decay=0.0).step()
    return value, rkl, float(grad_norm), {k: v.detach().clone() for k, v in model.state_dict().items()}


def hf_topk(model, batch, k: int):
    """(ids, logprobs) [n, k] per sequence: torch.topk of the full log-softmax at TEMP at each response position."""
    ids, lps = [], []
    with torch.no_grad():
        for seq, p in zip(batch.input_ids, batch.prompt_lens):
            logits = model(torch.tensor([seq])).logits[0, :-1].float() / TEMP
            top = torch.log_softmax(logits, -1)[p - 1:].topk(k, -1)
            ids.append(top.indices)
            lps.append(top.values)
    return ids, lps


def _kl_with_tail(ls_k: torch.Tensor, lt_k: torch.Tensor) -> torch.Tensor:
    """Written from probabilities: sum over the k ids of pS log(pS / pT), plus the tail (1 - the k ids' mass) alike."""
    ps, pt = ls_k.exp(), lt_k.exp()
    tail_s, tail_t = 1 - ps.sum(-1), 1 - pt.sum(-1)
    return (ps * (ls_k - lt_k)).sum(-1) + tail_s * torch.log(tail_s / tail_t)


def topk_reference(student_dir: str, batch, t_ids, t_lps):
    """Top-k distillation's plain-torch reference: KL_COEF x the mean over positions of the top-k + tail reverse KL
    on the HF student's full log-softmax, plus the reward's policy gradient (REWARD_WEIGHT x a, ratio 1); grad norm
    and one AdamW step."""
    model = _hf(student_dir)
    model.train()
    total = sum(len(ids) - p for ids, p in zip(batch.input_ids, batch.prompt_lens))
    value = 0.0
    for seq, p, a, ids, lt in zip(batch.input_ids, batch.prompt_lens, batch.advantages, t_ids, t_lps):
        x = torch.tensor([seq])
        full = torch.log_softmax(model(x).logits[0, :-1].float() / TEMP, -1)[p - 1:]
        sampled = full.gather(-1, x[0, p:, None])[:, 0]
        loss = (KL_COEF * _kl_with_tail(full.gather(-1, ids), lt).sum()
                - REWARD_WEIGHT * a * torch.exp(sampled - sampled.detach()).sum()) / total
        loss.backward()
        value += float(loss)
    grad_norm = torch.sqrt(sum((q.grad.double() ** 2).sum() for q in model.parameters() if q.grad is not None))
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999), eps=EPS, weight_decay=0.0).step()
    return value, float(grad_norm), {k: v.detach().clone() for k, v in model.state_dict().items()}


def _teacher_lps(w, batch) -> list[torch.Tensor]:
    got = _merge(_gather_obj(w.logprobs(batch, temperature=TEMP)))
    return [got[i] for i in range(len(batch))]


def distill_suite(rank: int, world_size: int, student_dir: str, teacher_dir: str, ckpt_dir: str) -> dict:
    from megatron_rl.algorithms.distill_loss import DistillLossFn
    from megatron_rl.config.schema import DistillationConfig, LossConfig
    from megatron_rl.lifecycle import OFFLOADED, RESIDENT, LifecycleError
    from megatron_rl.policy.teacher_worker import TeacherWorker

    vocab = json.load(open(f"{student_dir}/config.json"))["vocab_size"]
    batch = make_batch(vocab, seed=5)
    with torch.no_grad():
        ref_teacher = [t.detach() for t in hf_logprobs(_hf(teacher_dir), batch)]
    res: dict = {"ref_teacher": ref_teacher}

    # the teacher at each layout: its logprobs, frozen, and its turn on the device (offload -> refused -> onload)
    for name, kw in TEACHER_LAYOUTS.items():
        w = TeacherWorker(rank, world_size, teacher_cfg=PolicyConfig(model=teacher_dir, precision="fp32", **kw))
        w.setup()
        r = {"logprobs": _teacher_lps(w, batch), "frozen": not any(p.requires_grad for p in w.gpt.parameters()),
             "has_optimizer": hasattr(w, "optimizer")}
        if name == "tp2":
            off = w.offload()
            try:
                w.logprobs(batch, temperature=TEMP)
                r["refused"] = None
            except LifecycleError as e:
                r["refused"] = str(e)
            on = w.onload()
            r.update(offloaded=(off["state"], off["device_bytes"], off["host_bytes"]),
                     onloaded=(on["state"], on["device_bytes"]), states=(OFFLOADED, RESIDENT),
                     after_onload=_teacher_lps(w, batch))
        res[f"teacher_{name}"] = r
        del w

    # top-k: the teacher's k most likely ids and logprobs at TP=2 (fused and unfused head) vs HF's torch.topk
    t_ids, t_lps = hf_topk(_hf(teacher_dir), batch, TOPK)
    res["ref_topk"] = (t_ids, t_lps)
    for name in ("tp2", "tp2_unfused"):
        w = TeacherWorker(rank, world_size, teacher_cfg=PolicyConfig(model=teacher_dir, precision="fp32",
                                                                     **TEACHER_LAYOUTS[name]))
        w.setup()
        got = _merge(_gather_obj(w.topk_logprobs(batch, TOPK, temperature=TEMP)))
        res[f"topk_{name}"] = [got[i] for i in range(len(batch))]
        del w

    # the student's top-k distillation step on the HF teacher's top-k vs the plain-torch reference
    batch.teacher_topk_ids, batch.teacher_topk_logprobs = t_ids, t_lps
    value, norm, state = topk_reference(student_dir, batch, t_ids, t_lps)
    res["ref_topk_step"] = {"loss": value, "grad_norm": norm, "state": state if rank == 0 else None}
    loss_fn = DistillLossFn(LossConfig(), DistillationConfig(teacher="hf", kl_coef=KL_COEF,
                                                             reward_weight=REWARD_WEIGHT, topk=TOPK))
    for name, kw in TOPK_STUDENT_LAYOUTS.items():
        w = _student(rank, world_size, student_dir, **kw)
        res[f"topk_student_{name}"] = _student_step(w, batch, loss_fn)
        del w
    batch.teacher_topk_ids = batch.teacher_topk_logprobs = None

    # the student's distillation step on the HF teacher's logprobs vs the plain-torch reference
    batch.teacher_logprobs = ref_teacher
    value, rkl, norm, state = reverse_kl_reference(student_dir, batch, ref_teacher)
    res["ref"] = {"loss": value, "reverse_kl": rkl, "grad_norm": norm, "state": state if rank == 0 else None}
    loss_fn = DistillLossFn(LossConfig(), DistillationConfig(teacher="hf", kl_coef=KL_COEF,
                                                             reward_weight=REWARD_WEIGHT))
    for name, kw in STUDENT_LAYOUTS.items():
        w = _student(rank, world_size, student_dir, **kw)
        res[f"student_{name}"] = _student_step(w, batch, loss_fn)
        if name == "tp2":  # a megatron-rl checkpoint of the trained student, distilled from below
            w.save(ckpt_dir)
        del w

    # a teacher from that checkpoint, resharded to PP=2: its logprobs are HF's on the checkpoint's weights
    from megatron_rl.config.distillation import teacher_hf_dir

    w = TeacherWorker(rank, world_size, teacher_cfg=PolicyConfig(model=str(teacher_hf_dir(ckpt_dir)),
                                                                 precision="fp32", pp=2), checkpoint=ckpt_dir)
    w.setup()
    res["ckpt_teacher"] = _teacher_lps(w, batch)
    trained = res["student_tp2"]["after"]
    if rank == 0:
        with torch.no_grad():
            res["ckpt_ref"] = [t.detach() for t in hf_logprobs(_hf(student_dir, trained), batch)]
    return res
