"""Group-relative advantages and dynamic sampling (dropping/refilling groups that carry no learning signal).

A group is the G completions of one prompt; rewards come as a [num_groups, G] tensor. The advantage of a completion
is its reward minus a baseline computed from its own group, optionally divided by the group's standard deviation.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Optional, Sequence

import torch

from megatron_rl.config.schema import AdvantageConfig

Tensor = torch.Tensor


def sanitize_rewards(rewards: Tensor) -> tuple[Tensor, int]:
    """Replace non-finite rewards (NaN/inf, e.g. a crashed verifier) by 0 and return how many there were.

    One bad reward must not turn a whole group's advantages (and then the loss) into NaN; counting it keeps the
    problem visible in the metrics instead.
    """
    if not torch.is_tensor(rewards):
        rewards = torch.as_tensor(rewards, dtype=torch.float32)
    bad = ~torch.isfinite(rewards)
    return torch.where(bad, torch.zeros_like(rewards), rewards), int(bad.sum())


def group_advantages(rewards: Tensor, cfg: AdvantageConfig) -> tuple[Tensor, int]:
    """Advantages for rewards of shape [num_groups, G]; returns (advantages [num_groups, G], num_nonfinite_rewards).

    baseline "mean": r_i - mean(group). "leave_one_out": r_i - mean of the other G-1 rewards (an unbiased baseline
    that does not include the sample itself); a group of one has no others, so its advantage is 0.
    normalize_std: divide by the group's sample standard deviation (Bessel-corrected, as torch.std) + cfg.std_eps;
    with std_mode "leave_one_out" (NeMo-RL's convention, there paired with the leave-one-out baseline) by the
    population std of the other G-1 rewards + std_eps instead, and not at all where those others are all equal
    (their std is 0: dividing by eps would blow a lone success up to 1e6, which NeMo-RL skips as well).
    A group whose rewards are all equal gets exactly zero advantages — it carries no signal, and rounding in the
    mean must not leak a tiny nonzero value through the division by eps.
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [num_groups, G], got shape {tuple(rewards.shape)}")
    r, num_bad = sanitize_rewards(rewards)
    r = r.to(torch.float32) if not r.is_floating_point() else r
    g = r.shape[1]
    if g <= 1:
        return torch.zeros_like(r), num_bad
    total = r.sum(dim=1, keepdim=True)
    if cfg.baseline == "mean":
        adv = r - total / g
    elif cfg.baseline == "leave_one_out":
        adv = r - (total - r) / (g - 1)
    else:
        raise ValueError(f"unknown advantage baseline {cfg.baseline!r} (expected mean or leave_one_out)")
    if cfg.normalize_std:
        if cfg.std_mode == "group":
            adv = adv / (r.std(dim=1, keepdim=True) + cfg.std_eps)
        elif cfg.std_mode == "leave_one_out":
            std = _leave_one_out_std(r)
            adv = torch.where(std > 0, adv / (std + cfg.std_eps), adv)
        else:
            raise ValueError(f"unknown advantage std_mode {cfg.std_mode!r} (expected group or leave_one_out)")
    constant = (r.amax(dim=1) == r.amin(dim=1)).unsqueeze(1)
    return torch.where(constant, torch.zeros_like(adv), adv), num_bad


def _leave_one_out_std(r: Tensor) -> Tensor:
    """[num_groups, G]: for each sample, the population std (divide by G-1) of the other G-1 rewards of its group.

    Deviations are taken from the others' own mean (G x G per group; G is small), not as E[x^2] - E[x]^2, whose
    rounding would turn an exact 0 into ~1e-9; where the others are all equal the std is set to exactly 0.
    """
    g = r.shape[1]
    self_pos = torch.eye(g, dtype=torch.bool, device=r.device)  # [i, j]: j is sample i itself
    others = r.unsqueeze(1).expand(-1, g, -1)  # [group, i, j] = r[group, j]
    mean = ((r.sum(dim=1, keepdim=True) - r) / (g - 1)).unsqueeze(2)
    var = torch.where(self_pos, torch.zeros_like(others), (others - mean) ** 2).sum(dim=2) / (g - 1)
    inf = torch.full_like(others, math.inf)
    same = torch.where(self_pos, inf, others).amin(dim=2) == torch.where(self_pos, -inf, others).amax(dim=2)
    return torch.where(same, torch.zeros_like(var), var.sqrt())


def groups_with_signal(rewards: Tensor) -> Tensor:
    """Bool [num_groups]: True where the group's rewards are not all equal (after non-finite -> 0).

    All-equal groups have zero advantage everywhere, so they only dilute the batch (DAPO's dynamic sampling).
    """
    r, _ = sanitize_rewards(rewards)
    return r.amax(dim=1) != r.amin(dim=1)


class Sample(NamedTuple):
    """One completion of a group: a payload is (PromptItem, [Sample] * G). A tuple, so old rollout states (plain
    lists, `async_rollouts.rollout_from_state`) read back as Sample(*fields); what only samples.jsonl shows goes in
    `record`, not in a new field every consumer must know."""
    ids: list
    logprobs: list
    text: str
    finish: str  # "stop" | "length"
    answer: Any = None  # what the verifier extracted (samples.jsonl); None for multi-turn
    loss_mask: Any = None  # multi-turn: a bool tensor over the response, True on sampled tokens
    record: Optional[dict] = None  # more fields of its samples.jsonl line (multi-turn: turns, env_error)
    routing: Any = None  # MoE routing replay: the engine's experts per token (algorithms/routing_records.py)


@dataclass
class SampledGroups:
    """What dynamic sampling collected: kept groups' payloads and rewards, and how it got there."""
    payloads: list[Any]
    rewards: Tensor  # [len(payloads), G]
    rounds: int = 0  # draw calls made
    num_drawn: int = 0  # groups generated in total
    num_dropped: int = 0  # groups without signal that were discarded
    num_surplus: int = 0  # kept groups beyond the batch size, discarded to keep the batch shape fixed
    per_round_kept: list[int] = field(default_factory=list)


DrawFn = Callable[[int], tuple[Sequence[Any], Tensor]]


def dynamic_sample(draw: DrawFn, batch_size: int, cfg: AdvantageConfig) -> SampledGroups:
    """Collect up to `batch_size` groups using `draw(n) -> (payloads[n], rewards[n, G])`.

    `draw` generates and scores n new prompts (the caller's closure over the prompt stream, generator and reward
    function). Without cfg.dynamic_sampling, one draw is returned as is. With it, all-equal groups are dropped; with
    cfg.refill, further draws follow until `batch_size` groups are kept or cfg.max_refill_rounds extra draws were
    made. A refill draw asks for the missing count divided by the keep rate seen so far (never more than
    batch_size), so a hard task fills in fewer rounds without ever generating more than a normal step at once.
    The result may hold fewer than batch_size groups (even zero): the caller decides what to do with a short batch.
    """
    payloads, rewards = draw(batch_size)
    out = SampledGroups(payloads=[], rewards=torch.empty(0), rounds=1, num_drawn=len(payloads))
    if not cfg.dynamic_sampling:
        out.payloads, out.rewards = list(payloads), torch.as_tensor(rewards)
        out.per_round_kept.append(len(payloads))
        return out

    kept_payloads: list[Any] = []
    kept_rewards: list[Tensor] = []

    def absorb(p: Sequence[Any], r: Tensor) -> None:
        r = torch.as_tensor(r)
        keep = groups_with_signal(r)
        idx = keep.nonzero().flatten().tolist()
        kept_payloads.extend(p[i] for i in idx)
        kept_rewards.extend(r[i] for i in idx)
        out.num_dropped += len(p) - len(idx)
        out.per_round_kept.append(len(idx))

    absorb(payloads, rewards)
    width = torch.as_tensor(rewards).shape[1] if len(payloads) else 0
    if cfg.refill:
        while len(kept_payloads) < batch_size and out.rounds <= cfg.max_refill_rounds:
            missing = batch_size - len(kept_payloads)
            keep_rate = max(len(kept_payloads) / max(out.num_drawn, 1), 1.0 / batch_size)
            n = min(batch_size, math.ceil(missing / keep_rate))
            p, r = draw(n)
            out.rounds += 1
            out.num_drawn += len(p)
            if len(p):
                width = torch.as_tensor(r).shape[1]
            absorb(p, r)
    out.num_surplus = max(0, len(kept_payloads) - batch_size)
    out.payloads = kept_payloads[:batch_size]
    kept = kept_rewards[:batch_size]
    out.rewards = torch.stack(kept) if kept else torch.zeros(0, width)
    return out
