"""The engine's routing records as the trainer replays them (MoE routing replay, policy/routing_replay.py): one
[prompt + completion tokens, MoE layers, k] record per sample, -1 where no expert is known.

The engine records the tokens it ran (`GenerationResult.routed_experts` from `routing_start` on). A prompt token it
served from its prefix cache was not run for that sample, but its keys and values were computed by another request
of the same call whose prompt starts with the same tokens (a sibling of the group, or another prompt sharing the
few-shot preamble): that request's experts are the ones the cached state came from, so they fill the gap. What is
left unknown (a cache entry older than the call) is routed by the trainer itself.
"""
from __future__ import annotations

import torch


def sample_records(prompts: list[list[int]], token_ids: list[list[int]], starts: list[int],
                   routed: list) -> list[torch.Tensor]:
    """Per sample (prompt `prompts[k]` + completion `token_ids[k]`), its full-sequence record: the engine's
    `routed[k]` at positions `starts[k]`.., the prompt's cached positions from a request of the call that ran the
    same prefix, -1 elsewhere (int16)."""
    records, keys = [], []
    for prompt, ids, start, rec in zip(prompts, token_ids, starts, routed):
        rec = torch.as_tensor(rec)
        out = torch.full((len(prompt) + len(ids), *rec.shape[1:]), -1, dtype=torch.int16)
        out[start:start + rec.shape[0]] = rec.to(torch.int16)
        records.append(out)
        keys.append(_prefix_keys(prompt))
    known: dict = {}  # (position, hash of the tokens up to it) -> the experts of the request that ran it
    for out, key, start in zip(records, keys, starts):
        for j in range(start, len(key)):
            known.setdefault(key[j], out[j])
    for out, key, start in zip(records, keys, starts):
        for j in range(min(start, len(key))):
            donor = known.get(key[j])
            if donor is not None:
                out[j] = donor
    return records


def _prefix_keys(prompt: list[int]) -> list[tuple[int, int]]:
    """(j, a hash chain over prompt[: j + 1]) for each prompt position: equal keys, equal prefixes (a 64-bit
    chain's collisions aside)."""
    keys, h = [], 0
    for j, t in enumerate(prompt):
        h = hash((h, t))
        keys.append((j, h))
    return keys


def recorded_fraction(records: list[torch.Tensor]) -> float:
    """Share of the positions the trainer feeds (all but each sequence's last token) that carry a record."""
    fed = sum(r.shape[0] - 1 for r in records)
    have = sum(int((r[:-1] >= 0).all(-1).all(-1).sum()) for r in records)
    return have / max(fed, 1)
