"""Rank bodies for test_moe_train.py: the policy worker's training step on a tiny Qwen3-MoE at EP=2 (gloo), against
HF transformers + torch AdamW.

With every advantage 0 the policy loss has zero gradient, so whatever a step changes comes from the router's
load-balancing loss (policy.moe_aux_loss_coef). The reference recomputes that loss from HF's router logits with the
Switch Transformer formula (Fedus et al. 2021, normalised by top-k as megatron-core does): per layer and micro-batch
of T tokens, E * sum_e f_e * P_e with f_e = (tokens routed to e) / (T * k) and P_e = the mean softmax probability
of e; summed over layers, and the micro-batches weighted by their token share.
"""
from __future__ import annotations

import random

import torch

from megatron_rl.config.schema import OptimizerConfig, PolicyConfig
from megatron_rl.policy.interface import RolloutBatch
from megatron_rl.policy.loss_api import LossInputs
from tests.distributed.policy_bodies import _gather_obj

LR, EPS = 1e-3, 1e-4  # a large Adam eps keeps the update a smooth function of tiny gradients (policy_bodies.py)
SEQ, PROMPT, N = 12, 4, 4  # N sequences of SEQ tokens: one per micro-batch (the token budget), no padding


def pg_loss(inp: LossInputs):
    """An importance-weighted policy gradient loss (zero gradient when every advantage is 0)."""
    loss = (-inp.advantages * torch.exp(inp.logprobs - inp.old_logprobs)).sum() / inp.num_global_tokens
    return loss, {"loss": loss.detach()}


def masked_pg_loss(inp: LossInputs):
    """pg_loss over the tokens that count (inp.mask: a multi-turn trajectory's observation tokens do not)."""
    loss = (-inp.advantages * torch.exp(inp.logprobs - inp.old_logprobs) * inp.mask).sum() / inp.num_global_tokens
    return loss, {"loss": loss.detach()}


def zero_advantage_batch(vocab: int, seed: int = 0) -> RolloutBatch:
    rng = random.Random(seed)
    return RolloutBatch(input_ids=[[rng.randrange(vocab) for _ in range(SEQ)] for _ in range(N)],
                        prompt_lens=[PROMPT] * N, advantages=[0.0] * N)


def switch_loss(router_logits: torch.Tensor, topk: int) -> torch.Tensor:
    """Switch load-balancing loss of one layer's router logits [T, E] (module doc)."""
    t, e = router_logits.shape
    probs = torch.softmax(router_logits.float(), dim=-1)
    counts = torch.zeros(e).index_add_(0, probs.topk(topk, dim=-1).indices.flatten(), torch.ones(t * topk))
    return e * ((counts / (t * topk)) * probs.mean(0)).sum()


def hf_reference(model_dir: str, batch: RolloutBatch, coef: float, temperature: float = 1.0, masks=None):
    """(response logprobs at `temperature`, policy loss, gradient norm, HF weights after one AdamW step) of
    pg_loss + coef x the micro-batches' Switch losses weighted by their token share, with one sequence per
    micro-batch (what the callers' budgets give). The router sees each sequence's input positions: all tokens but
    the last, T_i of them. masks (bool per response token): only those tokens enter the policy loss and its
    normaliser; the router still sees every position."""
    from transformers import AutoModelForCausalLM

    from megatron_rl.models.hf_io import disk_state_dict

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    model.train()
    k = model.config.num_experts_per_tok
    masks = masks or [torch.ones(len(ids) - p, dtype=torch.bool) for ids, p in zip(batch.input_ids, batch.prompt_lens)]
    n_tokens, routed = int(sum(m.sum() for m in masks)), sum(len(ids) - 1 for ids in batch.input_ids)
    lps, loss_sum = [], 0.0
    for ids, p, a, m in zip(batch.input_ids, batch.prompt_lens, batch.advantages, masks):
        out = model(torch.tensor([ids[:-1]]), output_router_logits=True)
        lp = torch.log_softmax(out.logits[0].float() / temperature, -1).gather(-1, torch.tensor(ids[1:])[:, None])
        lp = lp[p - 1:, 0]
        lps.append(lp.detach())
        pg = -(a * torch.exp(lp - lp.detach()) * m).sum() / n_tokens
        aux = coef * (len(ids) - 1) / routed * sum(switch_loss(lg, k) for lg in out.router_logits)
        (pg + aux).backward()
        loss_sum += float(pg)
    norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
    torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999), eps=EPS, weight_decay=0.0).step()
    return lps, loss_sum, norm, disk_state_dict(model)  # per-expert tensors under their on-disk names, as exported


def aux_loss_step(rank: int, world_size: int, model_dir: str, coef: float):
    """One zero-advantage training step at EP=2 with policy.moe_aux_loss_coef=coef: on rank 0
    {"got": (gradient norm, HF-named weights after), "ref": the same from `hf_reference`}."""
    import json

    from megatron_rl.policy.megatron_worker import MegatronPolicyWorker

    vocab = json.load(open(f"{model_dir}/config.json"))["vocab_size"]
    batch = zero_advantage_batch(vocab)
    cfg = PolicyConfig(model=model_dir, ep=2, precision="fp32", moe_aux_loss_coef=coef, shared_prefix=False,
                       max_tokens_per_microbatch=SEQ,
                       optimizer=OptimizerConfig(lr=LR, weight_decay=0.0, clip_grad=1.0, adam_eps=EPS))
    w = MegatronPolicyWorker(rank, world_size, policy_cfg=cfg)
    w.setup()
    assert w.dp_size == 2 and len(w._micro_batches(batch)) == N // 2  # the weighting hf_reference assumes
    norm = [o for o in _gather_obj(w.train(batch, pg_loss)) if o][0]["metrics"]["grad_norm"]
    after = _gather_obj(w.hf_state_dict())
    if rank == 0:
        _, _, ref_norm, ref_state = hf_reference(model_dir, batch, coef)
        return {"got": (norm, {k: v for d in after if d for k, v in d.items()}), "ref": (ref_norm, ref_state)}
    return None


# The lengths [700, 400, 350] at a 700-token budget, scaled down: rows of 14, 8 and 7 input tokens at a
# budget of 14. Balanced over DP=2, rank 0 gets the 14 (one micro-batch), rank 1 the 8 and the 7, which do not fit
# one padded micro-batch (2 x 8 > 14): two. Every MoE layer of every micro-batch runs an all-to-all over the EP
# group (= the two DP ranks), so the ranks must run the same number of micro-batches.
UNEVEN_LENS, UNEVEN_PROMPTS, UNEVEN_ADV, UNEVEN_BUDGET = (15, 9, 8), (4, 3, 2), (0.7, -1.1, 0.4), 14
TEMP = 0.7


def uneven_batch(vocab: int, seed: int = 5, masked: bool = False) -> RolloutBatch:
    """masked: every third response token from the second on is an observation (loss mask False), as a multi-turn
    trajectory's tool results are."""
    rng = random.Random(seed)
    masks = [torch.arange(n - p) % 3 != 1 for n, p in zip(UNEVEN_LENS, UNEVEN_PROMPTS)] if masked else None
    return RolloutBatch(input_ids=[[rng.randrange(vocab) for _ in range(n)] for n in UNEVEN_LENS],
                        prompt_lens=list(UNEVEN_PROMPTS), advantages=list(UNEVEN_ADV), loss_mask=masks)


def uneven_microbatches(rank: int, world_size: int, model_dir: str, coef: float):
    """Logprobs, one training step (policy loss and the router's load-balancing loss) and reference logprobs at EP=2
    on `uneven_batch`, whose plan gives the DP ranks 1 and 2 micro-batches, with padded rows and with varlen rows
    (each its own filler layout), and with varlen rows on the batch with observation tokens masked
    ("varlen_masked": multi-turn at EP). On rank 0: {mode: the worker's results, "ref" / "ref_masked":
    `hf_reference`'s, which knows nothing of micro-batches or padding}."""
    import json

    from megatron_rl.policy import packing
    from megatron_rl.policy.megatron_worker import MegatronPolicyWorker
    from tests.distributed.policy_bodies import _merge

    vocab = json.load(open(f"{model_dir}/config.json"))["vocab_size"]
    res = {}
    for mode in ("none", "varlen", "varlen_masked"):
        batch = uneven_batch(vocab, masked=mode == "varlen_masked")
        loss_fn = masked_pg_loss if batch.loss_mask else pg_loss
        cfg = PolicyConfig(model=model_dir, ep=2, precision="fp32", moe_aux_loss_coef=coef, shared_prefix=False,
                           packing=mode.split("_")[0], max_tokens_per_microbatch=UNEVEN_BUDGET,
                           optimizer=OptimizerConfig(lr=LR, weight_decay=0.0, clip_grad=1.0, adam_eps=EPS))
        w = MegatronPolicyWorker(rank, world_size, policy_cfg=cfg)
        w.setup()
        # the case of the issue: the token-budget plan alone gives the two ranks different micro-batch counts
        # (varlen's cost 8 + 7 > 14 too), each micro-batch one sequence (the weighting hf_reference assumes)
        own = [packing.plan_microbatches(batch, shared=False, varlen=w.varlen, max_tokens=UNEVEN_BUDGET, dp_size=2,
                                         dp_rank=r) for r in range(2)]
        assert w.varlen == mode.startswith("varlen"), mode
        assert [len(p) for p in own] == [1, 2] and all(len(u.members) == 1 for p in own for mb in p for u in mb), own
        lp = _merge(_gather_obj(w.logprobs(batch, temperature=TEMP)))
        out = [o for o in _gather_obj(w.train(batch, loss_fn, temperature=TEMP)) if o]
        after = _gather_obj(w.hf_state_dict())
        ref_lp = _merge(_gather_obj(w.reference_logprobs(batch, temperature=TEMP)))
        res[mode] = {"logprobs": [lp[i] for i in range(len(batch))],
                     "ref_logprobs": [ref_lp[i] for i in range(len(batch))],
                     "train_logprobs": _merge([o["logprobs"] for o in out]), "metrics": out[0]["metrics"],
                     "after": {k: v for d in after if d for k, v in d.items()}}
    if rank != 0:
        return None
    refs = {}
    for name, masked in (("ref", False), ("ref_masked", True)):
        b = uneven_batch(vocab, masked=masked)
        lps, loss, norm, state = hf_reference(model_dir, b, coef, temperature=TEMP, masks=b.loss_mask)
        refs[name] = {"logprobs": lps, "loss": loss, "grad_norm": norm, "after": state}
    return {**res, **refs}


def ep2_suite(rank: int, world_size: int, model_dir: str, coef: float):
    """One launch (process start-up and imports cost ~10 s) for test_moe_train.py's EP=2 checks."""
    return {"aux_loss": aux_loss_step(rank, world_size, model_dir, coef),
            "uneven": uneven_microbatches(rank, world_size, model_dir, coef)}



# Routing replay: a group of two sharing a 4-token prompt (one shared-prefix row) and a single sequence
# and three more sequences, so that a rank's micro-batch holds several padded rows (b > 1)
REPLAY_LENS, REPLAY_PROMPTS, REPLAY_GROUPS = (11, 9, 8, 10, 7, 9), (4, 4, 3, 5, 2, 4), (0, 0, 1, 2, 3, 4)


def replay_batch(vocab: int, num_experts: int, layers: int, k: int, seed: int = 9) -> RolloutBatch:
    """`uneven`-like sequences with a record of forced experts for each: random distinct experts per token and layer
    (so most differ from the router's own choice), none (-1) for the first token of each sequence and for the last
    (which the engine never runs), and the group's members recording the same experts for their shared prompt (the
    rollout fills a member's prefix-cached prompt from its group, generation/routing)."""
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    prompt = [rng.randrange(vocab) for _ in range(REPLAY_PROMPTS[0])]
    ids = [prompt + [rng.randrange(vocab) for _ in range(n - p)] if grp == 0 else
           [rng.randrange(vocab) for _ in range(n)] for n, p, grp in zip(REPLAY_LENS, REPLAY_PROMPTS, REPLAY_GROUPS)]
    routed = []
    for n in REPLAY_LENS:
        rec = torch.stack([torch.stack([torch.randperm(num_experts, generator=g)[:k] for _ in range(layers)])
                           for _ in range(n)]).to(torch.int16)
        rec[0], rec[-1] = -1, -1
        routed.append(rec)
    routed[1][:REPLAY_PROMPTS[0]] = routed[0][:REPLAY_PROMPTS[0]]
    return RolloutBatch(input_ids=ids, prompt_lens=list(REPLAY_PROMPTS), advantages=[0.5, -1.0, 0.3, 0.8, -0.2, 0.1],
                        group_ids=list(REPLAY_GROUPS), routed_experts=routed)


def hf_forced_logprobs(model_dir: str, batch: RolloutBatch, temperature: float) -> list[torch.Tensor]:
    """Response logprobs of HF transformers' Qwen3-MoE with each router's top-k replaced, per token where the
    sequence's record has one, by the recorded experts, their gate weights the router's softmax there (renormalised
    where the config says so): written from `Qwen3MoeTopKRouter.forward`, one sequence at a time."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    current: list = [None]

    def forced(layer: int, router, hidden):
        logits = torch.nn.functional.linear(hidden.reshape(-1, router.hidden_dim), router.weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        own = torch.topk(probs, router.top_k, dim=-1).indices
        target = current[0][:, layer].long()
        idx = torch.where((target >= 0).all(-1, keepdim=True), target, own)
        val = probs.gather(1, idx)
        if router.norm_topk_prob:
            val = val / val.sum(-1, keepdim=True)
        return logits, val.to(logits.dtype), idx

    for layer, block in enumerate(model.model.layers):
        block.mlp.gate.forward = lambda h, layer=layer, r=block.mlp.gate: forced(layer, r, h)
    out = []
    with torch.no_grad():
        for ids, p, rec in zip(batch.input_ids, batch.prompt_lens, batch.routed_experts):
            current[0] = rec[:len(ids) - 1]
            logits = model(torch.tensor([ids[:-1]])).logits[0].float()
            lp = torch.log_softmax(logits / temperature, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
            out.append(lp[p - 1:])
    return out


def routing_replay(rank: int, world_size: int, model_dir: str):
    """policy.moe_routing_replay on both backends (megatron at EP=2, fsdp2 at DP=2): `replay_batch`'s
    logprobs without its record, with it (logprobs, the training step's own, reference), with padded rows (a shared-
    prefix row with a mask) and varlen rows (megatron: cascade THD; fsdp2: one masked row), and with the option off;
    on rank 0 also HF's with and without the forced experts."""
    import dataclasses
    import json

    from megatron_rl.policy.fsdp2_worker import FSDP2PolicyWorker
    from megatron_rl.policy.megatron_worker import MegatronPolicyWorker
    from tests.distributed.policy_bodies import _merge

    hf = json.load(open(f"{model_dir}/config.json"))
    experts = hf.get("num_experts") or hf["num_local_experts"]  # transformers saves Qwen3-MoE's under the latter
    batch = replay_batch(hf["vocab_size"], experts, hf["num_hidden_layers"], hf["num_experts_per_tok"])
    plain = dataclasses.replace(batch, routed_experts=None)
    res = {}
    cases = [(backend, worker, ep, mode, option)
             for backend, worker, ep in (("megatron", MegatronPolicyWorker, 2), ("fsdp2", FSDP2PolicyWorker, 1))
             for mode, option in (("none", "auto"), ("varlen", "on"), ("none_off", "off"))]
    for backend, worker, ep, mode, option in cases:
        cfg = PolicyConfig(model=model_dir, backend=backend, ep=ep, precision="fp32", shared_prefix=True,
                           packing=mode.split("_")[0], moe_routing_replay=option,
                           max_tokens_per_microbatch=64,
                           optimizer=OptimizerConfig(lr=LR, weight_decay=0.0, clip_grad=1.0, adam_eps=EPS))
        w = worker(rank, world_size, policy_cfg=cfg)
        w.setup()
        got = {"plain": _merge(_gather_obj(w.logprobs(plain, temperature=TEMP))),
               "replay": _merge(_gather_obj(w.logprobs(batch, temperature=TEMP)))}
        if mode != "none_off":
            got["reference"] = _merge(_gather_obj(w.reference_logprobs(batch, temperature=TEMP)))
            out = [o for o in _gather_obj(w.train(batch, pg_loss, temperature=TEMP)) if o]
            got["train"] = _merge([o["logprobs"] for o in out])
            mbs = w._micro_batches(batch)
            got["ranks"] = _gather_obj({  # the group's two members in one row (the shared prompt fed once)
                "group_in_one_row": any(any({0, 1} <= set(row.tolist()) for row in mb.source) for mb in mbs),
                "most_rows": max(mb.tokens.shape[0] for mb in mbs)})
        res[backend, mode] = {k: v if k == "ranks" else [v[i] for i in range(len(batch))]
                              for k, v in got.items()}
        del w
    if rank != 0:
        return None
    res["hf_forced"] = hf_forced_logprobs(model_dir, batch, TEMP)
    res["hf_plain"] = hf_forced_logprobs(model_dir, dataclasses.replace(
        batch, routed_experts=[torch.full_like(r, -1) for r in batch.routed_experts]), TEMP)
    return res
