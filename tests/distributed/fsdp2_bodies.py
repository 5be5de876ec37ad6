"""Rank bodies for test_fsdp2.py: the FSDP2 policy worker against the megatron worker (the same GRPO step) and HF.

One 2-process launch runs every check that needs the workers, in this order: the megatron step, the FSDP2 step (the
same batch and config, only `policy.backend` differs, and a micro-batch budget that splits the FSDP2 ranks' shares
unevenly, so filler micro-batches run), then the FSDP2 worker's lifecycle and an exact resume, a bf16 step, and a
grouped batch in each packed layout (`packed_layouts`), TP=2 on both backends (`tp_steps`), and the MoE router's
load-balancing loss on both backends (`moe_aux_steps`).
"""
from __future__ import annotations

import dataclasses
import json

import torch

from megatron_rl.lifecycle import LifecycleError
from megatron_rl.policy.loss_api import LossInputs
from tests.distributed.policy_bodies import TEMP, _cfg, _gather_obj, _merge, make_batch

WEIGHT_DECAY = 0.1  # nonzero: both backends must leave biases and norm weights undecayed (megatron's grouping)


def grpo_loss(inp: LossInputs):
    """A clipped GRPO surrogate with an entropy bonus, normalised by global tokens (the entropy's gradient flows
    through the kernel too)."""
    ratio = torch.exp(inp.logprobs - inp.old_logprobs)
    clipped = torch.clamp(ratio, 0.8, 1.2)
    per_tok = -torch.minimum(ratio * inp.advantages, clipped * inp.advantages) - 0.01 * inp.entropy
    loss = (per_tok * inp.mask).sum() / inp.num_global_tokens
    return loss, {"loss": loss.detach(), "tokens": inp.mask.sum() / inp.num_global_tokens,
                  "entropy": (inp.entropy.detach() * inp.mask).sum() / inp.num_global_tokens}


def cfg(model_dir, backend: str, budget: int = 4096):
    c = _cfg(model_dir, budget=budget)
    c.optimizer.weight_decay = WEIGHT_DECAY
    return dataclasses.replace(c, backend=backend)


def _all(d):
    """Every rank's {index: value} merged, as a batch-ordered list."""
    merged = _merge(_gather_obj(d))
    return [merged[i] for i in range(len(merged))]


def _hf_logprobs(model_dir: str, batch) -> list[torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    out = []
    with torch.no_grad():
        for ids, p in zip(batch.input_ids, batch.prompt_lens):
            x = torch.tensor([ids])
            logp = torch.log_softmax(model(x).logits[0, :-1].float() / TEMP, -1)
            out.append(logp.gather(-1, x[0, 1:, None])[:, 0][p - 1:])
    return out


def _step(w, batch, scoring=TEMP) -> dict:
    """export before, logprobs and entropies, one step, export after: the fields both backends are compared on.
    `scoring`: the temperature, or a `TokenScoring` with the engine's top-k / top-p."""
    before = w.hf_state_dict()
    lp_ent = _all(w.logprobs(batch, temperature=scoring, with_entropy=True))
    res = [r for r in _gather_obj(w.train(batch, grpo_loss, temperature=scoring)) if r]
    train_lp = _merge([r["logprobs"] for r in res])
    after = w.hf_state_dict()
    ref = _all(w.reference_logprobs(batch, temperature=scoring))  # the initial weights, after the step
    return {"before": before, "logprobs": [l for l, _ in lp_ent], "entropy": [e for _, e in lp_ent],
            "metrics": res[0]["metrics"], "train_logprobs": [train_lp[i] for i in range(len(batch))],
            "after": after, "ref_logprobs": ref}


def moe_export(rank: int, world_size: int, moe_dir: str) -> dict | None:
    """An MoE model's export (the refit's tensors) before training, beside the files transformers saved: experts that
    transformers 5 fuses in memory must leave under their per-expert on-disk names, which vLLM loads."""
    from megatron_rl.models.hf_io import HFCheckpoint
    from megatron_rl.policy.fsdp2_worker import FSDP2PolicyWorker

    w = FSDP2PolicyWorker(rank, world_size, policy_cfg=cfg(moe_dir, "fsdp2"), max_steps=10)
    w.setup()
    exported = _merge(_gather_obj(w.hf_state_dict()))
    return {"exported": exported, "disk": dict(HFCheckpoint(moe_dir).items())} if rank == 0 else None


MOE_AUX_COEFS = (0.0, 0.1)


def moe_aux_steps(rank: int, world_size: int, moe_dir: str) -> dict:
    """The same GRPO step on the tiny Qwen3-MoE on both backends at DP=2, at each of MOE_AUX_COEFS
    (policy.moe_aux_loss_coef): {coef: {backend: metrics, HF-named weights after (rank 0), micro-batch shapes}}. The
    26-token budget gives several micro-batches, padded rows and a filler (the router sees padding on both)."""
    from megatron_rl.policy.fsdp2_worker import FSDP2PolicyWorker
    from megatron_rl.policy.megatron_worker import MegatronPolicyWorker

    batch = make_batch(json.load(open(f"{moe_dir}/config.json"))["vocab_size"])
    out = {}
    for coef in MOE_AUX_COEFS:
        for backend, worker in (("megatron", MegatronPolicyWorker), ("fsdp2", FSDP2PolicyWorker)):
            c = dataclasses.replace(cfg(moe_dir, backend, budget=26), moe_aux_loss_coef=coef)
            w = worker(rank, world_size, policy_cfg=c, max_steps=10)
            w.setup()
            shapes = _gather_obj([tuple(mb.tokens.shape) + (mb.filler,) for mb in w._micro_batches(batch)])
            res = [r for r in _gather_obj(w.train(batch, grpo_loss, temperature=TEMP)) if r]
            after = _merge(_gather_obj(w.hf_state_dict()))
            out.setdefault(coef, {})[backend] = {"metrics": res[0]["metrics"], "shapes": shapes,
                                                 "after": after if rank == 0 else None}
    return out


def backends_agree(rank: int, world_size: int, model_dir: str, ckpt_dir: str, llama_dir: str, moe_dir: str):
    from megatron_rl.models.hf_io import HFCheckpoint
    from megatron_rl.policy.fsdp2_worker import FSDP2PolicyWorker
    from megatron_rl.policy.megatron_worker import MegatronPolicyWorker

    vocab = json.load(open(f"{model_dir}/config.json"))["vocab_size"]
    batch = make_batch(vocab)
    out = {"hf_logprobs": _hf_logprobs(model_dir, batch),
           "hf_state": {k: v.clone() for k, v in HFCheckpoint(model_dir).items()} if rank == 0 else None}
    m = MegatronPolicyWorker(rank, world_size, policy_cfg=cfg(model_dir, "megatron"), max_steps=10)
    m.setup()
    out["megatron"] = _step(m, batch)
    # 26 tokens a micro-batch: 2 micro-batches on one rank, 3 on the other (a filler on the short one)
    w = FSDP2PolicyWorker(rank, world_size, policy_cfg=cfg(model_dir, "fsdp2", budget=26), max_steps=10)
    info = w.setup()
    out["info"] = info
    out["fsdp2"] = _step(w, batch)
    out["recompute"] = recompute_step(rank, world_size, model_dir, batch)
    mbs = w._micro_batches(batch)
    out["fillers"] = _gather_obj((len(mbs), sum(mb.filler for mb in mbs)))

    # lifecycle: offloaded, every read of the weights refuses; onload gives back the same numbers
    lp_before = _all(w.logprobs(batch, temperature=TEMP))
    out["resident_report"] = w.memory_report()
    out["offload_report"] = w.offload()
    refused = {}
    for name, call in (("logprobs", lambda: w.logprobs(batch)), ("train", lambda: w.train(batch, grpo_loss)),
                       ("export", lambda: next(iter(w.export_weights()))),
                       ("reference", lambda: w.reference_logprobs(batch))):
        try:
            call()
            refused[name] = False
        except LifecycleError:
            refused[name] = True
    out["refused"] = refused
    out["onload_report"] = w.onload()
    lp_after = _all(w.logprobs(batch, temperature=TEMP))
    out["onload_identical"] = all(torch.equal(a, b) for a, b in zip(lp_before, lp_after))

    # exact resume: a second step, save, a third step == a fresh worker that loads and takes the third step
    w.train(make_batch(vocab, seed=3), grpo_loss, temperature=TEMP)
    out["resume"] = _resume(rank, world_size, w, cfg(model_dir, "fsdp2", budget=26), make_batch(vocab, seed=2),
                            ckpt_dir, extra={"data_position": 8})
    out["ckpt_meta"] = out["resume"].pop("meta")
    out["bf16"] = bf16_step(rank, world_size, model_dir)
    out["packed"] = packed_layouts(rank, world_size, model_dir)
    out["tp"] = tp_steps(rank, world_size, {"qwen2": model_dir, "llama": llama_dir}, f"{ckpt_dir}-tp")
    out["moe"] = moe_export(rank, world_size, moe_dir)
    out["moe_aux"] = moe_aux_steps(rank, world_size, moe_dir)
    return out


def recompute_step(rank: int, world_size: int, model_dir: str, batch) -> dict:
    """The same step with `policy.activation_recompute`: each decoder layer's forward runs again in the backward
    (counted by a forward hook on the first layer's attention), and the step is the same."""
    from megatron_rl.policy.fsdp2_worker import FSDP2PolicyWorker, decoder_layers

    c = dataclasses.replace(cfg(model_dir, "fsdp2", budget=26), activation_recompute=True)
    w = FSDP2PolicyWorker(rank, world_size, policy_cfg=c, max_steps=10)
    w.setup()
    calls = []
    # the attention, not the MLP: non-reentrant recompute stops early, inside the last module that saved a tensor
    decoder_layers(w.model.lm)[0].self_attn.register_forward_hook(lambda *a: calls.append(1))
    res = _step(w, batch)
    n_train = len(calls)
    w.logprobs(batch, temperature=TEMP)
    n_fwd = len(calls) - n_train
    return {"metrics": res["metrics"], "after": res["after"], "attn_calls": (n_train, n_fwd)}


def bf16_step(rank: int, world_size: int, model_dir: str) -> dict:
    """test_policy's bf16 step (pg_loss, wd 0) on the FSDP2 backend in bf16 (FSDP mixed precision: bf16 compute,
    fp32 master weights and gradient reduction), beside the fp32 HF + AdamW reference."""
    from megatron_rl.policy.fsdp2_worker import FSDP2PolicyWorker
    from tests.distributed.policy_bodies import LR, hf_reference, pg_loss

    vocab = json.load(open(f"{model_dir}/config.json"))["vocab_size"]
    batch = make_batch(vocab)
    # test_policy's bf16 step size (10 x its fp32 comparison's): at lr 1e-3 the q_proj/k_proj updates of this model
    # are 1-4 bf16 spacings of their weights, and rounding the exported weights before and after alone takes the
    # exact fp32 step's q_proj update to cos 0.88-0.99 (test_bf16_step_near_the_fp32_reference)
    ref_lps, ref_loss, ref_norm, ref_state = hf_reference(model_dir, batch, lr=10 * LR)
    w = FSDP2PolicyWorker(rank, world_size, policy_cfg=dataclasses.replace(
        _cfg(model_dir, precision="bf16", lr=10 * LR), backend="fsdp2"))
    w.setup()
    before = w.hf_state_dict()
    lps = _all(w.logprobs(batch, temperature=TEMP))
    res = w.train(batch, pg_loss, temperature=TEMP)
    return {"logprobs": lps, "metrics": res["metrics"], "before": before, "after": w.hf_state_dict(),
            "ref_lps": ref_lps, "ref_loss": ref_loss, "ref_norm": ref_norm,
            "ref_state": ref_state if rank == 0 else None}


PACKED_LAYOUTS = {  # name: (policy.shared_prefix, policy.packing, policy.max_tokens_per_microbatch)
    "group_rows": (True, "none", 4096),  # a group per row, its block mask
    "varlen": (False, "varlen", 4096),  # one masked row per micro-batch, every sequence on its own
    "varlen_shared": (True, "varlen", 4096),  # one masked row of group units
    "varlen_shared_split": (True, "varlen", 40),  # several rows a rank, uneven counts: fillers
}


def packed_layouts(rank: int, world_size: int, model_dir: str) -> dict:
    """shared_prefix_bodies' grouped batch on the megatron backend unshared (the reference layout) and on the FSDP2
    backend in each of PACKED_LAYOUTS: the same logprobs, step and update wherever the rows put the sequences."""
    from megatron_rl.policy.fsdp2_worker import FSDP2PolicyWorker
    from megatron_rl.policy.megatron_worker import MegatronPolicyWorker
    from tests.distributed.shared_prefix_bodies import make_group_batch

    vocab = json.load(open(f"{model_dir}/config.json"))["vocab_size"]
    batch = make_group_batch(vocab)
    c = dataclasses.replace(cfg(model_dir, "megatron"), shared_prefix=False, packing="none")
    m = MegatronPolicyWorker(rank, world_size, policy_cfg=c, max_steps=10)
    m.setup()
    out = {"megatron": _step(m, batch), "n": len(batch)}
    for name, (shared, packing, budget) in PACKED_LAYOUTS.items():
        c = dataclasses.replace(cfg(model_dir, "fsdp2", budget=budget), shared_prefix=shared, packing=packing)
        w = FSDP2PolicyWorker(rank, world_size, policy_cfg=c, max_steps=10)
        w.setup()
        mbs = w._micro_batches(batch)
        shape = {"mbs": len(mbs), "fillers": sum(mb.filler for mb in mbs), "one_row": sum(mb.one_row for mb in mbs),
                 "rows": sum(mb.tokens.shape[0] for mb in mbs if not mb.filler),
                 "tokens": sum(mb.tokens.numel() for mb in mbs if not mb.filler),
                 "masked": sum(mb.attention_mask is not None for mb in mbs)}
        out[name] = {"shape": _gather_obj(shape), **_step(w, batch)}
    return out


TP_CASES = {  # name: (model, policy overrides of the FSDP2 worker); each against the megatron backend at TP=2
    "qwen2": ("qwen2", {}),  # untied lm_head, q/k/v biases (column-parallel biases)
    "qwen2_unfused": ("qwen2", {"fused_lm_head": False}),  # vocab-split logits; the hidden gradient summed over TP
    "llama_tied_varlen": ("llama", {"packing": "varlen"}),  # tied: the vocab-split embedding is the lm_head
    # the engine sampled under top-k / top-p: both backends score the filtered distribution (sampling_filter.py)
    "qwen2_top_k_top_p": ("qwen2", {}),
}
FILTERED = {"qwen2_top_k_top_p": (20, 0.8)}


def tp_steps(rank: int, world_size: int, model_dirs: dict, ckpt_dir: str) -> dict:
    """The same GRPO step at TP=2 (DP=1) on the megatron backend and on the FSDP2 backend (DTensor TP); then, on the
    first case, save -> step == load -> step."""
    from megatron_rl.policy.fsdp2_worker import FSDP2PolicyWorker
    from megatron_rl.policy.interface import TokenScoring
    from megatron_rl.policy.megatron_worker import MegatronPolicyWorker

    out, megatron = {}, {}
    for name, (model, over) in TP_CASES.items():
        model_dir = model_dirs[model]
        batch = make_batch(json.load(open(f"{model_dir}/config.json"))["vocab_size"])
        scoring = TokenScoring(TEMP, *FILTERED[name]) if name in FILTERED else TEMP
        if (model, scoring) not in megatron:
            m = MegatronPolicyWorker(rank, world_size, policy_cfg=dataclasses.replace(cfg(model_dir, "megatron"),
                                                                                      tp=2), max_steps=10)
            m.setup()
            megatron[model, scoring] = _step(m, batch, scoring)
        c = dataclasses.replace(cfg(model_dir, "fsdp2"), tp=2, **over)
        w = FSDP2PolicyWorker(rank, world_size, policy_cfg=c, max_steps=10)
        info = w.setup()
        local = {n: tuple(p.to_local().shape) for n, p in w.model.named_parameters()}
        out[name] = {"megatron": megatron[model, scoring], "fsdp2": _step(w, batch, scoring),
                     "info": _gather_obj(info), "local_shapes": local}
        if "resume" not in out:
            out["resume"] = _resume(rank, world_size, w, c, batch, ckpt_dir)
    return out


def _resume(rank, world_size, w, c, batch, ckpt_dir, extra=None) -> dict:
    """Save, one step on `batch` == a fresh worker of config `c` that loads and takes the same step."""
    from megatron_rl.policy.fsdp2_worker import FSDP2PolicyWorker

    w.save(ckpt_dir, extra=extra)
    m_a = w.train(batch, grpo_loss, temperature=TEMP)["metrics"]
    a = w.hf_state_dict()
    w2 = FSDP2PolicyWorker(rank, world_size, policy_cfg=c, max_steps=10)
    w2.setup()
    loaded = w2.load(ckpt_dir)
    m_b = w2.train(batch, grpo_loss, temperature=TEMP)["metrics"]
    b = w2.hf_state_dict()
    with open(f"{ckpt_dir}/metadata.json") as f:
        meta = json.load(f)
    return {"extra": loaded, "steps": (w.step, w2.step), "m_a": m_a, "m_b": m_b, "meta": meta,
            "same": None if rank else (set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)),
            "full_disk": _save_on_a_full_disk(w2, ckpt_dir)}


def _save_on_a_full_disk(w, ckpt_dir) -> dict:
    """A save over the complete checkpoint at `ckpt_dir` whose shard writer fails with ENOSPC after rank 0 wrote part
    of a shard (the fsdp2 row of test_faults.py's disk-full case, which runs with -m slow): the error reaches the
    caller, the partial `.tmp-` folder is removed and the previous checkpoint still verifies."""
    from pathlib import Path

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from megatron_rl.models.checkpoint import verify_checkpoint

    real = dcp.save

    def full_disk(state, checkpoint_id):
        if dist.get_rank() == 0:
            Path(checkpoint_id).mkdir(parents=True, exist_ok=True)
            (Path(checkpoint_id) / "__0_0.distcp").write_bytes(b"part of a shard")
        dist.barrier()  # both ranks fail after the partial write, as a full disk fails every writer
        raise OSError(28, "No space left on device")

    dcp.save = full_disk
    try:
        w.save(ckpt_dir)
        error = None
    except OSError as e:
        error = str(e)
    finally:
        dcp.save = real
    dist.barrier()
    left = sorted(p.name for p in Path(ckpt_dir).parent.iterdir() if ".tmp-" in p.name)
    return {"error": error, "partial_left": left, "previous_step": verify_checkpoint(ckpt_dir)["step"]}
