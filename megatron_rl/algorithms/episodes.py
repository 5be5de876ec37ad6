"""The multi-turn counterpart of `rollout.sample_groups`: draw prompts, run G trajectories each against the
environment (`multiturn.run_trajectories`), and hand the GRPO step the same payloads, each sample carrying its loss
mask as a sixth field. The environment's reward replaces the reward section's verifier; group-relative advantages
are then over whole trajectories, exactly as over single completions.

Per-step metrics (summed here, averaged by the caller where named *_mean): turns_mean, tool_calls_mean, env_errors,
observation_tokens, env_s, and env/<name>: the environment's own step metrics, per trajectory on average.
"""
from __future__ import annotations

import dataclasses
import itertools
import time

import torch

from megatron_rl.algorithms.advantages import Sample, dynamic_sample
from megatron_rl.algorithms.multiturn import Limits, LocalEngines, RayEngines, run_trajectories
from megatron_rl.algorithms.routing_records import fill_shared_prefixes, sequence_record
from megatron_rl.algorithms.samples import episode_fields
from megatron_rl.config.schema import Config

_calls = itertools.count()  # trajectory keys stay unique over a run's draws (the pool refuses a live key)


def env_item(it) -> dict:
    """What an environment's reset(item) sees of a prompt: the question as the dataset gave it, the reference answer,
    and the row's other fields (reasoning-gym: task, task_params, entry)."""
    return {"question": it.problem if isinstance(it.problem, str) else it.prompt_text, "messages":
            it.problem if isinstance(it.problem, list) else None, "answer": it.answer, **(it.meta or {})}


def engines_of(generator, cfg: Config, poll_s: float = 0.2):
    """The engines to run turns on: a pool's engine actors, or one in-process engine."""
    g = cfg.generation
    sampling = dict(temperature=g.temperature, top_p=g.top_p, top_k=g.top_k, stop=cfg.environment.stop or None)
    gen = getattr(generator, "gen", generator)  # async_rollouts' seeded wrapper
    if hasattr(gen, "engines"):
        return RayEngines(gen.engines, sampling, poll_s)
    return LocalEngines([gen], sampling, poll_s)


def limits_of(cfg: Config) -> Limits:
    e = cfg.environment
    return Limits(max_turns=e.max_turns, max_tokens=e.max_tokens, max_new_tokens=cfg.generation.max_new_tokens)


def sample_episodes(cfg: Config, generator, stream, env_pool, tokenizer, version: int):
    """(SampledGroups of (item, samples) payloads, stats); a sample is (response ids, generator logprobs, response
    text, finish reason, None, loss mask)."""
    G = cfg.grpo.num_generations_per_prompt
    totals: dict = {"num_generated_tokens": 0, "num_prompt_tokens": 0, "num_samples": 0, "num_truncated": 0,
                    "reward_s": 0.0, "env_s": 0.0, "env_errors": 0, "observation_tokens": 0, "turns": 0,
                    "tool_calls": 0}
    env_sums: dict = {}

    def draw(n: int):
        items = stream.next_batch(n)
        trajs, st = run_trajectories(engines_of(generator, cfg), env_pool, tokenizer, items, n=G,
                                     limits=limits_of(cfg), key_prefix=f"c{next(_calls)}-", to_env_item=env_item,
                                     version=version)
        totals["env_s"] += st["env_s"]
        totals["env_errors"] += st["env_errors"]
        if "env_error_first" in st:
            totals.setdefault("env_error_first", st["env_error_first"])
        routing = _records(trajs)
        payloads, rewards = [], []
        for i, it in enumerate(items):
            group = trajs[i * G:(i + 1) * G]
            # the batch's prompt is what the group's trajectories share (one rendering of reset's messages; an
            # environment whose reset differs per trajectory shares less): any rest of a trajectory's own prompt
            # becomes context in its response, masked like an observation
            opened = [t.prompt_ids for t in group if t.prompt_ids]  # failed resets have no prompt
            shared = _common_prefix(opened) if opened else list(it.prompt_ids)
            samples = []
            for j, t in enumerate(group):
                head = t.prompt_ids[len(shared):] if t.prompt_ids else []
                resp = head + t.response_ids
                # an environment failure is no truncation (the DAPO overlong filter must not drop it as one)
                finish = "length" if t.finish == "length" else "stop"
                samples.append(Sample(resp, [0.0] * len(head) + t.gen_logprobs, tokenizer.decode(t.response_ids),
                                      finish, None, torch.tensor([False] * len(head) + t.mask, dtype=torch.bool),
                                      record=episode_fields(t, tokenizer), routing=routing[i * G + j]))
                for k, v in t.metrics.items():  # the environment's own step metrics, summed over the trajectory
                    env_sums[k] = env_sums.get(k, 0.0) + v
                totals["num_generated_tokens"] += sum(t.mask)
                totals["observation_tokens"] += t.observation_tokens
                totals["turns"] += t.turns
                totals["tool_calls"] += int(t.metrics.get("tool_calls", 0))
                totals["num_truncated"] += finish == "length"
            payloads.append((dataclasses.replace(it, prompt_ids=shared), samples))
            rewards.append([t.reward for t in group])
            totals["num_prompt_tokens"] += len(group[0].prompt_ids) if group and group[0].prompt_ids else 0
            totals["num_samples"] += len(group)
        return payloads, torch.tensor(rewards, dtype=torch.float32).view(len(items), G)

    t0 = time.perf_counter()
    groups = dynamic_sample(draw, cfg.grpo.num_prompts_per_step, cfg.grpo.advantage)
    n = max(totals["num_samples"], 1)
    totals.update(num_groups_dropped=groups.num_dropped, sampling_rounds=groups.rounds,
                  turns_mean=totals.pop("turns") / n, tool_calls_mean=totals.pop("tool_calls") / n,
                  rollout_s=time.perf_counter() - t0)
    # metrics.jsonl: env/<name> is the mean per trajectory of what its steps reported (a name of the environment's
    # own cannot collide with the loop's metrics)
    totals.update({f"env/{k}": v / n for k, v in sorted(env_sums.items())})
    return groups, totals


def _records(trajs: list) -> list:
    """MoE routing replay: each trajectory's record over its whole sequence (the batch's prompt + response is
    `t.ids`), its turns' segments joined and the call's shared prefixes filled from each other; all None unless
    every trajectory has its turns' records (a failed reset ran no turn: the batch is routed by the trainer)."""
    if not trajs or any(not t.routing or not t.ids for t in trajs):
        return [None] * len(trajs)
    records = [sequence_record(len(t.ids), t.routing) for t in trajs]
    fill_shared_prefixes([t.ids for t in trajs], records)
    return records


def _common_prefix(seqs: list[list[int]]) -> list[int]:
    n = min(len(s) for s in seqs)
    k = 0
    while k < n and all(s[k] == seqs[0][k] for s in seqs):
        k += 1
    if k == 0:
        raise ValueError("the environment's reset() gave a group's trajectories prompts that differ from their first "
                         "token on: a GRPO group needs a common context to compare its trajectories in")
    return list(seqs[0][:k])
