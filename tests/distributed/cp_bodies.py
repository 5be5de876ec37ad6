"""Rank bodies for test_context_parallel.py: context parallelism (policy.cp) against CP = 1 and the unpacked HF +
torch AdamW reference.

The batch is `shared_prefix_bodies`' (GRPO groups with length-1 and uneven completions, a group of one, two
sequences claiming one group id with different prompts), packed as varlen rows with cascade prefixes; a budget of
40 tokens gives several micro-batches per rank. Each layout runs one logprob pass and one training step, and reports
what its ranks held: the whole rows (`rows`: tokens per row) and each rank's share of them (`local`).
"""
from __future__ import annotations

import json

from tests.distributed.policy_bodies import TEMP, _cfg, _gather_obj, _merge, hf_reference, pg_loss
from tests.distributed.shared_prefix_bodies import make_group_batch

BUDGET = 40


def _run(rank, world_size, model_dir, batch, cp=1, shared=True, recompute=False, **kw):
    from megatron.core import parallel_state as ps

    from megatron_rl.policy import context_parallel
    from megatron_rl.policy.megatron_worker import MegatronPolicyWorker

    cfg = _cfg(model_dir, budget=BUDGET, **kw)
    cfg.cp, cfg.packing, cfg.shared_prefix, cfg.activation_recompute = cp, "varlen", shared, recompute
    w = MegatronPolicyWorker(rank, world_size, policy_cfg=cfg)
    w.setup()
    mbs = w._micro_batches(batch)
    rows, local = [], []
    for mb in mbs:
        rows.append(mb.tokens.shape[1])
        if cp > 1:
            share = context_parallel.split_row(mb.packed, mb.resp_mask, cp, w.cp.rank, w.cp.group)
            local.append((w.cp.rank, share.cols.tolist()))
    lp = _merge(_gather_obj(w.logprobs(batch, temperature=TEMP)))
    out = [o for o in _gather_obj(w.train(batch, pg_loss, temperature=TEMP)) if o]
    after = _gather_obj(w.hf_state_dict())
    coords = {"cp_rank": w.cp.rank, "dp_rank": w.dp_rank, "dp_size": w.dp_size,
              "tp": ps.get_tensor_model_parallel_rank(), "pp": ps.get_pipeline_model_parallel_rank()}
    return {
        "coords": _gather_obj(coords), "rows": _gather_obj(rows), "local": _gather_obj(local),
        "outputs": len(out), "logprobs": [lp[i] for i in range(len(batch))],
        "metrics": out[0]["metrics"], "train_logprobs": _merge([o["logprobs"] for o in out]),
        "after": {k: v for d in after if d for k, v in d.items()} if rank == 0 else None,
    }


LAYOUTS = {  # name -> (world size, worker options)
    "cp1_dp2": (2, dict(cp=1)),
    "cp2": (2, dict(cp=2)),
    "cp2_plain": (2, dict(cp=2, shared=False)),  # varlen rows without cascade prefixes
    "cp2_recompute": (2, dict(cp=2, recompute=True)),  # the backward re-runs each layer's all-gathers
    "cp2_tp2": (4, dict(cp=2, tp=2)),
    "cp2_pp2": (4, dict(cp=2, pp=2)),
    "cp2_dp2": (4, dict(cp=2)),
}


MOE = {"cp1_moe": dict(cp=1), "cp2_moe": dict(cp=2)}  # a tiny Qwen3-MoE (4 experts, top-2), EP = 1


def cp_vs_reference(rank: int, world_size: int, model_dir: str, names: list[str], moe_dir: str | None = None):
    vocab = json.load(open(f"{model_dir}/config.json"))["vocab_size"]
    batch = make_group_batch(vocab)
    ref_lps, ref_loss, ref_norm, ref_state = hf_reference(model_dir, batch)
    res = {"ref_lps": ref_lps, "ref_loss": ref_loss, "ref_norm": ref_norm, "n": len(batch),
           "ref_state": ref_state if rank == 0 else None}
    for name in names:
        size, kw = LAYOUTS[name]
        assert size == world_size, (name, world_size)
        res[name] = _run(rank, world_size, model_dir, batch, **kw)
    if moe_dir is not None:  # MoE layers at CP = 2 against CP = 1 (the same megatron code; HF parity of the model is
        # tests/distributed/test_models_qwen3_moe.py's)
        moe_vocab = json.load(open(f"{moe_dir}/config.json"))["vocab_size"]
        for name, kw in MOE.items():
            res[name] = _run(rank, world_size, moe_dir, make_group_batch(moe_vocab), **kw)
    return res
