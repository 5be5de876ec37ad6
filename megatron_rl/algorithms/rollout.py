"""From prompts to a training batch: generate G samples per prompt, score them, compute group advantages.

Pure bookkeeping over the narrow interfaces (a generator proxy, a reward function, a tokenizer); no ranks or devices.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from megatron_rl.algorithms.advantages import Sample, dynamic_sample, group_advantages, sanitize_rewards
from megatron_rl.algorithms.routing_records import recorded_fraction, sample_records
from megatron_rl.config.schema import Config
from megatron_rl.generation.interface import engine_prompt
from megatron_rl.policy.interface import RolloutBatch
from megatron_rl.rewards.shaping import overlong_penalty


@dataclass
class Rollout:
    batch: RolloutBatch
    rewards: torch.Tensor  # [groups, G]
    completions: list[str]
    stats: dict = field(default_factory=dict)
    # each batch sequence's own reward (non-finite ones as 0, as the advantages see them): PPO's GAE starts from it
    seq_rewards: list[float] = field(default_factory=list)


def sample_groups(cfg: Config, generator, stream, reward_fn, tokenizer, version: int):
    """Draw prompts, generate, score. Returns (SampledGroups of (item, samples) payloads, reward stats)."""
    g = cfg.generation
    G = cfg.grpo.num_generations_per_prompt
    totals: dict = {"num_generated_tokens": 0, "num_prompt_tokens": 0, "num_samples": 0, "num_truncated": 0,
                    "reward_s": 0.0}

    def draw(n: int):
        items = stream.next_batch(n)
        res = generator.generate([engine_prompt(it) for it in items], n=G, temperature=g.temperature, top_p=g.top_p,
                                 top_k=g.top_k, max_tokens=g.max_new_tokens, stop=g.stop or None,
                                 expected_version=version)
        rewards, texts, answers = score_samples(cfg, reward_fn, tokenizer, [items[i] for i in res.prompt_indices],
                                                res.token_ids, res.finish_reasons, totals)
        totals["num_prompt_tokens"] += sum(len(it.prompt_ids) for it in items)  # prefilled once per prompt
        routing = [None] * len(res.token_ids)
        if res.routed_experts is not None:  # MoE routing replay (policy.moe_routing_replay)
            routing = sample_records([items[i].prompt_ids for i in res.prompt_indices], res.token_ids,
                                     res.routing_start, res.routed_experts)
        payloads = []
        for i, it in enumerate(items):
            idx = list(res.for_prompt(i))
            payloads.append((it, [Sample(res.token_ids[k], res.logprobs[k], texts[k], res.finish_reasons[k],
                                         answers[k], routing=routing[k]) for k in idx]))
        return payloads, torch.tensor(rewards, dtype=torch.float32).view(len(items), G)

    groups = dynamic_sample(draw, cfg.grpo.num_prompts_per_step, cfg.grpo.advantage)
    totals.update(num_groups_dropped=groups.num_dropped, sampling_rounds=groups.rounds)
    return groups, totals


def score_samples(cfg: Config, reward_fn, tokenizer, items: list, token_ids: list[list[int]], finish_reasons: list[str],
                  totals: dict) -> tuple[list[float], list[str], list]:
    """Score samples (one prompt item per sample): (rewards, texts, what the verifier read), with DAPO's overlong
    punishment applied; the counters go into `totals`."""
    texts = [tokenizer.decode(t) for t in token_ids]
    t0 = time.perf_counter()
    rewards, rstats = reward_fn.score(items, texts, token_ids=token_ids)
    totals["reward_s"] = totals.get("reward_s", 0.0) + time.perf_counter() - t0
    answers = rstats.get("answers") or [None] * len(texts)  # what the verifier read, for samples.jsonl
    max_new = cfg.generation.max_new_tokens
    if cfg.reward.overlong_buffer_len > 0:  # DAPO soft overlong punishment, before advantages see the rewards
        pens = [overlong_penalty(len(t), max_new, cfg.reward.overlong_buffer_len, cfg.reward.overlong_penalty)
                for t in token_ids]
        rewards = [r + p for r, p in zip(rewards, pens)]
        totals["num_overlong_penalized"] = totals.get("num_overlong_penalized", 0) + sum(p < 0 for p in pens)
    for k, v in rstats.items():
        if isinstance(v, (int, float)):
            totals[k] = totals.get(k, 0) + v
    totals["num_generated_tokens"] = totals.get("num_generated_tokens", 0) + sum(len(t) for t in token_ids)
    totals["num_samples"] = totals.get("num_samples", 0) + len(token_ids)
    totals["num_truncated"] = totals.get("num_truncated", 0) + sum(r == "length" for r in finish_reasons)
    return list(rewards), texts, answers


def build_rollout(cfg: Config, groups, stats: dict) -> Rollout:
    """Advantages per group, then one sequence per sample (prompt + response). Empty responses are dropped: they have
    no token to train and a zero-length sequence would divide by zero downstream. With grpo.overlong_filter (DAPO),
    truncated samples are dropped from the batch too, after the advantages: their rewards still shape the group's
    baseline, but a cut-off reasoning chain is neither reinforced nor punished."""
    # no group kept (dynamic sampling dropped all): nothing to normalise
    adv, num_bad = group_advantages(groups.rewards, cfg.grpo.advantage) if len(groups.payloads) else (None, 0)
    ids, plens, advs, gen_lps, gids, texts, masks, rews, routing = [], [], [], [], [], [], [], [], []
    vision: list[dict | None] = []  # each sequence's image inputs (a vision-language prompt's), else None
    clean = sanitize_rewards(groups.rewards)[0] if len(groups.payloads) else None
    for gi, (item, samples) in enumerate(groups.payloads):
        for j, sample in enumerate(samples):
            tok, lps, text, finish = sample[:4]
            s = Sample(*sample)  # multi-turn (episodes.py): observations are not trained; MoE: the engine's experts
            loss_mask, route = s.loss_mask, s.routing
            if len(tok) == 0:
                stats["num_empty_responses"] = stats.get("num_empty_responses", 0) + 1
                continue
            if loss_mask is not None and not bool(loss_mask.any()):  # nothing left to train (in-flight: too stale)
                stats["num_fully_masked"] = stats.get("num_fully_masked", 0) + 1
                continue
            if cfg.grpo.overlong_filter and finish == "length":
                stats["num_overlong_filtered"] = stats.get("num_overlong_filtered", 0) + 1
                continue
            ids.append(list(item.prompt_ids) + list(tok))
            plens.append(len(item.prompt_ids))
            advs.append(float(adv[gi, j]))
            rews.append(float(clean[gi, j]))
            gen_lps.append(torch.tensor(lps, dtype=torch.float32))
            gids.append(gi)
            texts.append(text)
            masks.append(loss_mask)
            routing.append(route)
            vision.append(getattr(item, "model_inputs", None))
    multiturn = any(m is not None for m in masks)
    batch = RolloutBatch(input_ids=ids, prompt_lens=plens, advantages=advs, gen_logprobs=gen_lps, group_ids=gids,
                         loss_mask=[m if m is not None else torch.ones(len(i) - p, dtype=torch.bool)
                                    for m, i, p in zip(masks, ids, plens)] if multiturn else None)
    batch.add_model_inputs(vision)  # the trainer's model inputs (policy/vision_inputs.py)
    if routing and all(r is not None for r in routing):  # the trainer replays the engine's experts
        batch.routed_experts = routing
        stats["routing_recorded_frac"] = recorded_fraction(routing)
    stats["num_nonfinite_rewards"] = num_bad
    return Rollout(batch=batch, rewards=groups.rewards, completions=texts, stats=stats, seq_rewards=rews)
