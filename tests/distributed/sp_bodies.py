"""Rank bodies for test_ulysses.py: Ulysses sequence parallelism (policy.sp) on the FSDP2 backend against SP = 1 and
the unpacked HF + torch AdamW reference (the same reference as the megatron backend's CP test).

The batch is `shared_prefix_bodies`' (GRPO groups with length-1 and uneven completions, a group of one, two
sequences claiming one group id with different prompts). Layouts: one masked varlen row per micro-batch with the
groups' shared prompts (cascade as a block mask), the same split over several rows (a 40-token budget: uneven
micro-batch counts, fillers), dense group rows (one row per unit, [b, s] with b > 1) and the tiny Llama's grouped
key/value heads (4 query heads on 2); at world 4 also SP 2 x TP 2 and SP 2 x DP 2 (a 4-KV-head Llama), and KV heads
replicated where there are fewer than SP ranks (SP 4, and SP 2 x TP 2 on the 2-KV-head Llama).
"""
from __future__ import annotations

import dataclasses
import json

from tests.distributed.policy_bodies import TEMP, _cfg, _gather_obj, _merge, hf_reference, pg_loss
from tests.distributed.shared_prefix_bodies import make_group_batch


def _run(rank, world_size, model_dir, batch, sp=1, packing="varlen", shared=True, budget=4096, **kw):
    from megatron_rl.policy.fsdp2_worker import FSDP2PolicyWorker

    cfg = dataclasses.replace(_cfg(model_dir, budget=budget, **kw), backend="fsdp2", sp=sp, packing=packing,
                              shared_prefix=shared)
    w = FSDP2PolicyWorker(rank, world_size, policy_cfg=cfg)
    w.setup()
    mbs = w._micro_batches(batch)
    lp = _merge(_gather_obj(w.logprobs(batch, temperature=TEMP)))
    out = [o for o in _gather_obj(w.train(batch, pg_loss, temperature=TEMP)) if o["logprobs"]]
    after = _gather_obj(w.hf_state_dict())
    coords = {"sp_rank": w.sp.rank, "dp_rank": w.dp_rank, "dp_size": w.dp_size, "tp_rank": w.tp_rank,
              "rows": [tuple(mb.tokens.shape) for mb in mbs], "fillers": sum(mb.filler for mb in mbs),
              "impl": w.model.lm.config._attn_implementation}
    return {"coords": _gather_obj(coords), "senders": len(out), "logprobs": [lp[i] for i in range(len(batch))],
            "metrics": out[0]["metrics"], "train_logprobs": _merge([o["logprobs"] for o in out]),
            "after": {k: v for d in after if d for k, v in d.items()} if rank == 0 else None}


LAYOUTS = {  # name -> (world size, model ("gqa": 4 query heads on 2 KV heads; "mha": 4 on 4), worker options)
    "sp1_dp2": (2, "gqa", dict(sp=1)),
    "sp2": (2, "gqa", dict(sp=2)),
    "sp2_split": (2, "gqa", dict(sp=2, budget=40)),
    "sp2_dense": (2, "gqa", dict(sp=2, packing="none")),
    "sp2_tp2": (4, "mha", dict(sp=2, tp=2)),
    "sp2_dp2": (4, "mha", dict(sp=2, packing="none", budget=16)),  # rows of 2 x 16 tokens: a filler on one replica
    # fewer KV heads than SP ranks: each replicated onto the ranks whose query heads use it
    "sp4_gqa": (4, "gqa", dict(sp=4)),
    "sp2_tp2_gqa": (4, "gqa", dict(sp=2, tp=2)),  # one KV head per TP rank, two SP ranks
}


def sp_vs_reference(rank: int, world_size: int, model_dirs: dict, names: list[str]):
    res = {}
    for kind, model_dir in model_dirs.items():
        vocab = json.load(open(f"{model_dir}/config.json"))["vocab_size"]
        batch = make_group_batch(vocab)
        lps, loss, norm, state = hf_reference(model_dir, batch)
        res[kind] = {"ref_lps": lps, "ref_loss": loss, "ref_norm": norm, "n": len(batch),
                     "ref_state": state if rank == 0 else None}
        for name in names:
            size, model, kw = LAYOUTS[name]
            if model == kind:
                assert size == world_size, (name, world_size)
                res[name] = _run(rank, world_size, model_dir, batch, **kw)
    return res
