"""The engine's routing records as the trainer replays them (MoE routing replay, policy/routing_replay.py): one
[prompt + completion tokens, MoE layers, k] record per sample, -1 where no expert is known.

The engine records the tokens it ran (`GenerationResult.routed_experts` from `routing_start` on). A prompt token it
served from its prefix cache was not run for that sample, but its keys and values were computed by another request
of the same call whose sequence starts with the same tokens (a sibling of the group, or another prompt sharing the
few-shot preamble): that request's experts are the ones the cached state came from, so they fill the gap. What is
left unknown (a cache entry older than the call) is routed by the trainer itself.

A multi-turn trajectory is one sequence run as several requests, each turn's prompt the conversation so far: each
turn's record covers what that turn ran (its uncached prompt tail, the previous observation included, and its
completion), and the trajectory's record is their union, the first record of a position kept (the turn that sampled
a token ran it first).
"""
from __future__ import annotations

import torch


def sample_records(prompts: list[list[int]], token_ids: list[list[int]], starts: list[int],
                   routed: list) -> list[torch.Tensor]:
    """Per sample (prompt `prompts[k]` + completion `token_ids[k]`), its full-sequence record: the engine's
    `routed[k]` at positions `starts[k]`.., the prompt's cached positions from a request of the call that ran the
    same prefix, -1 elsewhere (int16)."""
    records = [sequence_record(len(p) + len(ids), [(start, rec)])
               for p, ids, start, rec in zip(prompts, token_ids, starts, routed)]
    fill_shared_prefixes([list(p) + list(ids) for p, ids in zip(prompts, token_ids)], records)
    return records


def sequence_record(length: int, segments: list) -> torch.Tensor:
    """The record of one `length`-token sequence from the engine's (start, experts [tokens, layers, k]) segments
    (one per request that ran part of it), in the order they ran: a position keeps the first segment's experts."""
    shape = next((tuple(torch.as_tensor(rec).shape[1:]) for _, rec in segments if len(rec)), None)
    if shape is None:  # no segment ran a token (every position served from the cache)
        shape = tuple(torch.as_tensor(segments[0][1]).shape[1:]) if segments else (0, 0)
    out = torch.full((length, *shape), -1, dtype=torch.int16)
    for start, rec in segments:
        rec = torch.as_tensor(rec).to(torch.int16)
        end = min(start + rec.shape[0], length)
        if end <= start:
            continue
        view = out[start:end]
        unset = (view < 0).all(-1).all(-1)
        view[unset] = rec[:end - start][unset]
    return out


def fill_shared_prefixes(seqs: list[list[int]], records: list[torch.Tensor]) -> None:
    """In place: each record's unknown positions from another sequence of the same call with the same tokens up to
    and including that position, where that one's record knows them."""
    keys = [_prefix_keys(s) for s in seqs]
    known: dict = {}  # (position, hash of the tokens up to it) -> the experts of the request that ran it
    for out, key in zip(records, keys):
        have = (out >= 0).all(-1).all(-1)
        for j in torch.nonzero(have).flatten().tolist():
            known.setdefault(key[j], out[j])
    for out, key in zip(records, keys):
        missing = (out < 0).all(-1).all(-1)
        for j in torch.nonzero(missing).flatten().tolist():
            donor = known.get(key[j])
            if donor is not None:
                out[j] = donor


def _prefix_keys(seq: list[int]) -> list[tuple[int, int]]:
    """(j, a hash chain over seq[: j + 1]) for each position: equal keys, equal prefixes (a 64-bit chain's
    collisions aside)."""
    keys, h = [], 0
    for j, t in enumerate(seq):
        h = hash((h, int(t)))
        keys.append((j, h))
    return keys


def recorded_fraction(records: list[torch.Tensor]) -> float:
    """Share of the positions the trainer feeds (all but each sequence's last token) that carry a record."""
    fed = sum(r.shape[0] - 1 for r in records)
    have = sum(int((r[:-1] >= 0).all(-1).all(-1).sum()) for r in records)
    return have / max(fed, 1)
