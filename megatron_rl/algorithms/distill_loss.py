"""On-policy distillation's loss (docs/distillation.md): GRPO's loss with a per-token advantage from the teacher.

The student pi_S samples x_t; the frozen teacher pi_T scores it. The per-token reverse KL on the sampled tokens,
KL(pi_S || pi_T) estimated by log pi_S(x_t) - log pi_T(x_t), has the score-function gradient
E[(log pi_S(x_t) - log pi_T(x_t)) grad log pi_S(x_t)] (the term E[grad log pi_S] is 0). That is a policy gradient
with the per-token advantage

    A_t = kl_coef * (log pi_T(x_t) - log pi_old(x_t)) + reward_weight * A_group

where pi_old is the student that the trained logprobs are compared with (the training forward's own when on-policy,
the recomputed pre-update ones with several optimizer steps or async rollouts) and A_group the task reward's
group-relative advantage (0 weight: pure distillation, no group baseline needed). The advantage is detached, so the
loss is exactly `grpo_loss` on it: its importance correction (the generator's logprobs, max_staleness), importance
masks, normalisers, clipping, KL-to-reference and entropy terms apply unchanged, and the value at ratio 1 is
kl_coef * mean(log pi_S - log pi_T) (minus the reward term), the reverse-KL estimate itself.

Top-k (`distillation.topk` = k > 0): the teacher returns its k most likely ids at each position with their logprobs
(policy/topk.py), the student's logprobs of the same ids come from the training forward, and the loss is
kl_coef x the full-distribution reverse KL over those ids plus the rest of the vocabulary as one outcome
(`topk_reverse_kl`; exact at k = vocabulary size), differentiated directly instead of by the score function.

The teacher's logprobs come with the batch (`RolloutBatch.teacher_logprobs`, scored by policy/teacher_worker.py at
the sampling temperature, the distribution the student's logprobs describe).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from megatron_rl.algorithms.loss_fn import GRPOLossFn
from megatron_rl.config.schema import DistillationConfig, LossConfig
from megatron_rl.policy.loss_api import LossInputs


def distill_advantages(teacher_logprobs: torch.Tensor, student_logprobs: torch.Tensor, seq_advantages: torch.Tensor,
                       mask: torch.Tensor, *, kl_coef: float, reward_weight: float) -> torch.Tensor:
    """Per-token A_t of the module doc, detached, 0 where `mask` is 0 (padding or observation tokens may hold
    anything there, even NaN)."""
    keep = mask.reshape(-1).to(torch.bool)
    # at least fp32 (bf16 logprobs would round the small gaps away), fp64 kept where given
    dtype = torch.promote_types(torch.promote_types(teacher_logprobs.dtype, student_logprobs.dtype), torch.float32)
    gap = (teacher_logprobs.reshape(-1).to(dtype) - student_logprobs.reshape(-1).to(dtype)).detach()
    adv = kl_coef * gap
    if reward_weight:
        adv = adv + reward_weight * seq_advantages.reshape(-1).to(dtype).detach()
    return torch.where(keep, adv, torch.zeros_like(adv))


def topk_reverse_kl(student_topk: torch.Tensor, teacher_topk: torch.Tensor, eps: float = 1e-12) -> torch.Tensor:
    """Per position, KL(pi_S || pi_T) over the teacher's top-k ids plus one more outcome, "any other id" (the tail):
    both distributions keep their whole-vocabulary logprobs on the k ids and put the rest of their mass on the tail,
    so the student cannot lower the loss by moving mass off the k ids, and k = vocabulary size is the exact KL.
    [n, k] logprobs in, [n] out (differentiable in the student's)."""
    def with_tail(lp):
        tail = (-torch.expm1(torch.logsumexp(lp, dim=-1))).clamp(min=eps)  # 1 - mass on the k ids, >= eps
        return torch.cat([lp, torch.log(tail)[:, None]], dim=-1)

    s, t = with_tail(student_topk), with_tail(teacher_topk.detach())
    return (s.exp() * (s - t)).sum(-1)


class DistillLossFn:
    """The trainer's loss callable (shipped to the policy ranks like `GRPOLossFn`)."""

    def __init__(self, loss_cfg: LossConfig, distill: DistillationConfig, max_response_len: Optional[int] = None):
        self.grpo = GRPOLossFn(loss_cfg, max_response_len)
        self.kl_coef, self.reward_weight = float(distill.kl_coef), float(distill.reward_weight)

    def __call__(self, inp: LossInputs):
        if inp.student_topk_logprobs is not None:
            return self._topk(inp)
        if inp.teacher_logprobs is None:
            raise ValueError("the distillation loss needs the teacher's logprobs (RolloutBatch.teacher_logprobs)")
        student = inp.old_logprobs.detach()
        adv = distill_advantages(inp.teacher_logprobs, student, inp.advantages, inp.mask, kl_coef=self.kl_coef,
                                 reward_weight=self.reward_weight)
        loss, metrics = self.grpo(dataclasses.replace(inp, advantages=adv))
        with torch.no_grad():  # this micro-batch's share of the step's per-token mean, like every loss metric
            keep = inp.mask.reshape(-1).to(torch.bool)
            student_minus_teacher = student.reshape(-1).to(adv.dtype) - inp.teacher_logprobs.reshape(-1).to(adv.dtype)
            gap = torch.where(keep, student_minus_teacher, torch.zeros_like(adv))
            metrics["reverse_kl"] = gap.sum() / inp.num_global_tokens
        return loss, metrics

    def _topk(self, inp: LossInputs):
        """distillation.topk > 0: kl_coef x the top-k full-distribution reverse KL per position (a quantity of the
        whole distribution, like the entropy bonus: token-normalised, not importance-weighted), plus GRPO's loss on
        reward_weight x the group advantage (0 when reward_weight is 0)."""
        keep = inp.mask.reshape(-1).to(torch.bool)
        adv = torch.where(keep, self.reward_weight * inp.advantages.reshape(-1).float(),
                          torch.zeros_like(inp.advantages.reshape(-1).float()))
        loss, metrics = self.grpo(dataclasses.replace(inp, advantages=adv))
        kl = topk_reverse_kl(inp.student_topk_logprobs.float(), inp.teacher_topk_logprobs.float())
        kl = torch.where(keep, kl, torch.zeros_like(kl))
        share = kl.sum() / inp.num_global_tokens
        loss = loss + self.kl_coef * share
        metrics["loss"] = loss.detach()
        metrics["reverse_kl"] = share.detach()
        return loss, metrics
