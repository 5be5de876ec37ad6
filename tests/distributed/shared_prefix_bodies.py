"""Rank bodies for test_shared_prefix.py: group-shared prefix packing against the unshared layout and HF.

One launch runs every layout (DP=2, TP=2, PP=2, each packed and unpacked, plus a budget that forces one group back to
the unshared layout) on the tiny llama model (llama3-scaled RoPE, tied embeddings, GQA).
"""
from __future__ import annotations

import json
import random
from collections import Counter

import torch

from megatron_rl.policy.interface import RolloutBatch
from tests.distributed.policy_bodies import TEMP, _cfg, _gather_obj, _merge, hf_reference, pg_loss

# (prompt length, response lengths): length-1 completions (EOS right away), uneven lengths, a group of one
GROUPS = [(9, [1, 7, 4]), (6, [10, 1, 1, 9, 6]), (11, [5, 8]), (4, [6])]
FALLBACK_BUDGET = 24  # group 1 packs to 5 + 27 = 32 tokens > 24: fed unshared; the others (20, 23, 9) stay packed


def make_group_batch(vocab: int, seed: int = 0) -> RolloutBatch:
    """Groups interleaved in batch order (not contiguous), plus two sequences that claim one group id but have
    different prompts (must fall back to the unshared layout)."""
    rng = random.Random(seed)
    seqs = []
    for g, (p, resp) in enumerate(GROUPS):
        prompt = [rng.randrange(vocab) for _ in range(p)]
        seqs += [(g, prompt + [rng.randrange(vocab) for _ in range(r)], p) for r in resp]
    for _ in range(2):
        seqs.append((len(GROUPS), [rng.randrange(vocab) for _ in range(7 + 3)], 7))
    rng.shuffle(seqs)
    return RolloutBatch(input_ids=[s for _, s, _ in seqs], prompt_lens=[p for _, _, p in seqs],
                        advantages=[rng.uniform(-1, 1) for _ in seqs], group_ids=[g for g, _, _ in seqs])


def _run_layout(rank, world_size, model_dir, batch, shared, recompute=False, **kw):
    from megatron_rl.policy.megatron_worker import MegatronPolicyWorker

    cfg = _cfg(model_dir, **kw)
    cfg.shared_prefix = shared
    cfg.activation_recompute = recompute  # the backward re-runs the forward: masks and positions must follow
    w = MegatronPolicyWorker(rank, world_size, policy_cfg=cfg)
    w.setup()
    mbs = w._micro_batches(batch)
    # rows holding more than one sequence, i.e. packed groups
    packed_rows = sum(sum(1 for c in Counter(row for row, _ in mb.spans).values() if c > 1) for mb in mbs)
    # each DP replica's micro-batches, counted once (its TP/PP ranks hold the same plan)
    from megatron.core import parallel_state as ps

    first = ps.get_tensor_model_parallel_rank() == 0 and ps.get_pipeline_model_parallel_rank() == 0
    row_tokens = sum(mb.tokens.numel() for mb in mbs) if first else 0
    packed_rows = packed_rows if first else 0
    lp = _merge(_gather_obj(w.logprobs(batch, temperature=TEMP)))
    out = [o for o in _gather_obj(w.train(batch, pg_loss, temperature=TEMP)) if o]
    after = _gather_obj(w.hf_state_dict())
    return {
        "enabled": w.shared_prefix, "packed_rows": sum(_gather_obj(packed_rows)),
        "row_tokens": sum(_gather_obj(row_tokens)),
        "logprobs": [lp[i] for i in range(len(batch))],
        "metrics": out[0]["metrics"], "train_logprobs": _merge([o["logprobs"] for o in out]),
        "after": {k: v for d in after if d for k, v in d.items()} if rank == 0 else None,
    }


def shared_vs_unshared(rank: int, world_size: int, model_dir: str):
    vocab = json.load(open(f"{model_dir}/config.json"))["vocab_size"]
    batch = make_group_batch(vocab)
    ref_lps, ref_loss, ref_norm, ref_state = hf_reference(model_dir, batch)
    res = {"ref_lps": ref_lps, "ref_loss": ref_loss, "ref_norm": ref_norm, "n": len(batch),
           "ref_state": ref_state if rank == 0 else None}
    layouts = {"dp2": {}, "tp2": dict(tp=2), "pp2": dict(pp=2)}
    for name, kw in layouts.items():
        for shared in (True, False):
            res[(name, shared)] = _run_layout(rank, world_size, model_dir, batch, shared, **kw)
    res[("dp2_fallback", True)] = _run_layout(rank, world_size, model_dir, batch, True, budget=FALLBACK_BUDGET)
    res[("tp2_recompute", True)] = _run_layout(rank, world_size, model_dir, batch, True, recompute=True, tp=2)
    # plain causal rows under recompute: megatron re-runs their forward (its causal mask built on "cuda") inside
    # the backward, outside the CPU compat layer's function mode unless the layer covers it (platform.py)
    res[("tp2_recompute_plain", False)] = _run_layout(rank, world_size, model_dir, batch, False, recompute=True,
                                                      tp=2)
    return res
