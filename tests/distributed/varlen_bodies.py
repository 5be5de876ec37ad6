"""Rank bodies for test_varlen.py: varlen (THD) packing and cascade shared-prefix attention against the unpacked
HF + torch AdamW reference, at DP=2, TP=2 and PP=2.

One launch runs every layout on the tiny llama model (llama3-scaled RoPE, tied embeddings, GQA) with the batch of
`shared_prefix_bodies` (groups with length-1 completions, a group of one, two sequences claiming one group id with
different prompts): varlen alone, varlen + cascade, cascade with every segment padded to 4 tokens (megatron's
padded cu_seqlens: padding inside the row), and cascade with full activation recompute.

The `masked` layouts train the same batch with a loss mask (multi-turn observation tokens: context, never trained,
`RolloutBatch.loss_mask`) at DP=2, unpacked and varlen + cascade, against the reference that leaves those tokens out
of the loss and of its normaliser.
"""
from __future__ import annotations

import json
import random

import torch

from tests.distributed.policy_bodies import TEMP, _cfg, _gather_obj, _merge, hf_reference, pg_loss
from tests.distributed.shared_prefix_bodies import make_group_batch

BUDGET = 40  # several packed rows (micro-batches) per DP rank, most holding several units


def _run(rank, world_size, model_dir, batch, shared, recompute=False, multiple=None, packing="varlen", masked=False,
         **kw):
    from megatron.core import parallel_state as ps

    # imported here, not at module level: megatron's attention imports triton, which must not load in the pytest
    # process before tests/kernels/conftest.py sets TRITON_INTERPRET
    from megatron_rl.models.varlen_attention import CascadeSeqParams
    from megatron_rl.policy.megatron_worker import MegatronPolicyWorker

    cfg = _cfg(model_dir, budget=BUDGET, **kw)
    cfg.packing, cfg.shared_prefix, cfg.activation_recompute = packing, shared, recompute
    w = MegatronPolicyWorker(rank, world_size, policy_cfg=cfg)
    w.setup()
    if multiple is not None:
        w.segment_multiple = multiple  # what sequence parallelism at tp=4 would ask for
    mbs = w._micro_batches(batch)
    first = ps.get_tensor_model_parallel_rank() == 0 and ps.get_pipeline_model_parallel_rank() == 0
    layout = {  # per DP replica, counted once
        "rows": [tuple(mb.tokens.shape) for mb in mbs] if first else [],
        "cascade_rows": sum(isinstance(mb.packed, CascadeSeqParams) for mb in mbs) if first else 0,
        "padded": sum(mb.packed is not None and mb.packed.cu_seqlens_q_padded is not None for mb in mbs)
        if first else 0,
        "tokens": sum(mb.tokens.numel() for mb in mbs) if first else 0,
    }
    lp = _merge(_gather_obj(w.logprobs(batch, temperature=TEMP)))
    out = [o for o in _gather_obj(w.train(batch, pg_loss, temperature=TEMP)) if o]
    after = _gather_obj(w.hf_state_dict())
    gathered = _gather_obj(layout)
    return {
        "varlen": w.varlen, "shared": w.shared_prefix, "fused": any(_gather_obj(w._fused_head is not None)),
        "rows": [r for g in gathered for r in g["rows"]],
        "cascade_rows": sum(g["cascade_rows"] for g in gathered), "padded": sum(g["padded"] for g in gathered),
        "tokens": sum(g["tokens"] for g in gathered),
        "logprobs": [lp[i] for i in range(len(batch))],
        "metrics": out[0]["metrics"], "train_logprobs": _merge([o["logprobs"] for o in out]),
        "after": {k: v for d in after if d for k, v in d.items()} if rank == 0 else None,
    }


LAYOUTS = {
    "dp2_varlen": dict(shared=False), "tp2_varlen": dict(shared=False, tp=2), "pp2_varlen": dict(shared=False, pp=2),
    "dp2_cascade": dict(shared=True), "tp2_cascade": dict(shared=True, tp=2), "pp2_cascade": dict(shared=True, pp=2),
    "tp2_cascade_unfused": dict(shared=True, tp=2, fused=False),  # the lm_head's logits, then the logprob kernel
    "tp2_cascade_pad4": dict(shared=True, tp=2, multiple=4),
    "pp2_cascade_recompute": dict(shared=True, pp=2, recompute=True),
    "dp2_masked": dict(shared=False, packing="none", masked=True),
    "dp2_cascade_masked": dict(shared=True, masked=True),
}


def with_observations(batch, seed: int = 1):
    """The batch with a loss mask: in each response of 3+ tokens a stretch after the first token is an
    "observation" (mask False), as between the turns of a multi-turn trajectory; the first token is always trained."""
    rng = random.Random(seed)
    masks = []
    for ids, p in zip(batch.input_ids, batch.prompt_lens):
        m = torch.ones(len(ids) - p, dtype=torch.bool)
        if len(m) >= 3:
            a = rng.randint(1, len(m) - 2)
            m[a:rng.randint(a + 1, len(m) - 1)] = False
        masks.append(m)
    assert sum(int((~m).sum()) for m in masks) > 0
    batch.loss_mask = masks
    return batch


def varlen_vs_reference(rank: int, world_size: int, model_dir: str, names: list[str]):
    vocab = json.load(open(f"{model_dir}/config.json"))["vocab_size"]
    batch = make_group_batch(vocab)
    ref_lps, ref_loss, ref_norm, ref_state = hf_reference(model_dir, batch)
    res = {"ref_lps": ref_lps, "ref_loss": ref_loss, "ref_norm": ref_norm, "n": len(batch),
           "ref_state": ref_state if rank == 0 else None,
           "sequence_tokens": sum(len(ids) - 1 for ids in batch.input_ids)}
    if any(LAYOUTS[n].get("masked") for n in names):
        masked = with_observations(make_group_batch(vocab))
        lps, loss, norm, state = hf_reference(model_dir, masked)
        res["masked_ref"] = {"ref_lps": lps, "ref_loss": loss, "ref_norm": norm, "n": len(masked),
                             "ref_state": state if rank == 0 else None}
    for name in names:
        run_batch = masked if LAYOUTS[name].get("masked") else batch
        res[name] = _run(rank, world_size, model_dir, run_batch, **LAYOUTS[name])
    return res
