"""Rank bodies for test_models_qwen3_moe.py: Qwen3 dense, Qwen3-MoE and Mixtral vs HF transformers on gloo.

For each model and each parallel layout the launch allows, the body builds this rank's megatron model, loads the HF
weights under their on-disk names (per-expert tensors), compares the logits with HF's (fp32) and exports the weights
back with `iter_hf_tensors` (the refit/export path), which must give exactly the on-disk tensors and names.
"""
from __future__ import annotations

import torch

from tests.distributed.models_bodies import _gather_vocab, _max_diff, _positions, _tokens, pipeline_logits

KINDS = ("qwen3", "qwen3_moe", "mixtral")


def _import_transformers_first():
    # see models_bodies._import_transformers_first: transformers' modules must be imported before the CPU compat layer
    import importlib

    for name in ("generation.utils", "models.mixtral.modeling_mixtral", "models.qwen3.modeling_qwen3",
                 "models.qwen3_moe.modeling_qwen3_moe"):
        importlib.import_module("transformers." + name)


def _logits(model, ids, pp: int):
    """Full-vocab logits on the last stage (None elsewhere)."""
    from megatron.core import parallel_state as ps

    if pp > 1:
        logits = pipeline_logits(model, ids)
    else:
        model.eval()
        with torch.no_grad():
            logits = model(ids, _positions(), None)
    if logits is not None and ps.get_tensor_model_parallel_world_size() > 1:
        logits = _gather_vocab(logits)
    return logits


def layouts_vs_hf(rank: int, world_size: int, layouts: list[tuple[int, int, int]], kinds=KINDS):
    """{kind: {"tp1_pp1_ep1": {"logits": max |diff| or None off the last stage, "export_equal": bool,
    "export_names": [...], "expected_names": [...]}, ...}} for each (tp, pp, ep) layout of `world_size` ranks."""
    _import_transformers_first()
    from megatron.core import parallel_state as ps

    from megatron_rl.models.mapping import iter_hf_tensors, load_hf_into_model
    from megatron_rl.models.provider import build_model
    from megatron_rl.models.hf_io import disk_state_dict
    from megatron_rl.models.tiny import make_tiny_hf_model
    from megatron_rl.platform import install_megatron_cpu_compat

    install_megatron_cpu_compat()
    out = {}
    for kind in kinds:
        hf = make_tiny_hf_model(kind)
        cfg, state = hf.config.to_dict(), disk_state_dict(hf)
        vocab = cfg["vocab_size"]
        ids = _tokens(vocab)
        with torch.no_grad():
            ref = hf(ids).logits.float()
        tied = bool(cfg.get("tie_word_embeddings"))
        expected = sorted(k for k in state if not (tied and k == "lm_head.weight"))
        r = out[kind] = {}
        for tp, pp, ep in layouts:
            ps.destroy_model_parallel()
            ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                         expert_model_parallel_size=ep)
            if ep > 1 and kind == "qwen3":  # a dense model has no experts to shard: the model builder refuses it
                try:
                    build_model(cfg, init_weights=False)
                    r[f"tp{tp}_pp{pp}_ep{ep}"] = {"refused": None}
                except ValueError as e:
                    r[f"tp{tp}_pp{pp}_ep{ep}"] = {"refused": str(e)}
                continue
            m = build_model(cfg, init_weights=False)
            load_hf_into_model(m, state)
            logits = _logits(m, ids, pp)
            got = dict(iter_hf_tensors(m))
            r[f"tp{tp}_pp{pp}_ep{ep}"] = {
                "logits": None if logits is None else _max_diff(logits[..., :vocab], ref),
                "export_equal": all(torch.equal(t, state[n]) for n, t in got.items()),
                "export_names": sorted(got), "expected_names": expected, "pp_rank": ps.get_pipeline_model_parallel_rank(),
            }
    ps.destroy_model_parallel()
    return out


def export_and_logprobs(rank: int, world_size: int, hf_dir: str, layout: tuple[int, int, int],
                        sequences: list[tuple[list[int], list[int]]]):
    """The trainer side of a refit at (tp, pp=1, ep): this rank's model loaded from an HF folder; returns
    {"export": {name: tensor} (iter_hf_tensors, the refit payload) on rank 0, "logprobs": per (prompt, tokens) the
    log-probabilities the trainer gives `tokens` (temperature 1, full padded vocabulary)}."""
    _import_transformers_first()
    from megatron.core import parallel_state as ps

    from megatron_rl.models.hf_io import HFCheckpoint
    from megatron_rl.models.mapping import iter_hf_tensors, load_hf_into_model
    from megatron_rl.models.provider import build_model
    from megatron_rl.platform import install_megatron_cpu_compat

    install_megatron_cpu_compat()
    tp, pp, ep = layout
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 expert_model_parallel_size=ep)
    m = build_model(hf_dir, init_weights=False)
    load_hf_into_model(m, HFCheckpoint(hf_dir))
    export = dict(iter_hf_tensors(m))
    m.eval()
    logprobs = []
    for prompt, tokens in sequences:
        ids = torch.tensor([prompt + tokens])
        with torch.no_grad():
            logits = m(ids, torch.arange(ids.shape[1])[None], None)
        if tp > 1:
            logits = _gather_vocab(logits)
        lp = torch.log_softmax(logits[0, len(prompt) - 1:-1].float(), -1)
        logprobs.append(lp.gather(-1, torch.tensor(tokens)[:, None])[:, 0])
    ps.destroy_model_parallel()
    return {"export": export if rank == 0 else None, "logprobs": logprobs}


def ep2_uneven_tokens_and_grads(rank: int, world_size: int, kind: str):
    """EP=2 on 2 ranks, each rank with its own sequence of a different length (what data parallelism gives the
    dispatcher): this rank's logits vs HF on its own sequence, and after backward of the summed token NLL, the
    expert gradients this rank holds vs HF's gradient of the NLL summed over both ranks' sequences (an expert on
    rank r serves the tokens of every rank routed to it)."""
    _import_transformers_first()
    from megatron.core import parallel_state as ps

    from megatron_rl.models.mapping import expert_owner, load_hf_into_model
    from megatron_rl.models.provider import build_model
    from megatron_rl.models.hf_io import disk_state_dict
    from megatron_rl.models.tiny import make_tiny_hf_model
    from megatron_rl.platform import install_megatron_cpu_compat

    install_megatron_cpu_compat()
    hf = make_tiny_hf_model(kind)
    cfg, vocab = hf.config.to_dict(), hf.config.vocab_size
    g = torch.Generator().manual_seed(11)
    seqs = [torch.randint(0, vocab, (1, n), generator=g) for n in (13, 6)]

    def nll(logits, ids):
        lp = torch.log_softmax(logits[0, :-1, :vocab].float(), -1)
        return -lp.gather(-1, ids[0, 1:, None]).sum()

    hf.zero_grad()
    ref = []
    for ids in seqs:
        out = hf(ids).logits
        ref.append(out.detach().float())
        nll(out, ids).backward()
    hf_grads = {n: p.grad for n, p in hf.named_parameters() if p.grad is not None}
    hf_grads = disk_state_dict_of_grads(hf, hf_grads)

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(expert_model_parallel_size=2)
    m = build_model(cfg, init_weights=False)
    load_hf_into_model(m, disk_state_dict(hf))
    m.train()
    ids = seqs[rank]
    logits = m(ids, torch.arange(ids.shape[1])[None], None)
    out = {"logits": _max_diff(logits[..., :vocab].detach(), ref[rank])}
    nll(logits, ids).backward()
    spec, worst = m.megatron_rl_spec, 0.0
    from megatron_rl.models.mapping import HF_MOE_NAMES

    _, expert, (gate, up, down) = HF_MOE_NAMES[spec.model_type]
    for e in range(spec.moe.num_experts):
        owner, j = expert_owner(spec, e, 2)
        if owner != rank:
            continue
        for i, layer in enumerate(m.decoder.layers):
            local = layer.mlp.experts.local_experts[j]
            x = f"model.layers.{i}." + expert.replace("{e}", str(e))
            want_fc1 = torch.cat([hf_grads[x + gate + ".weight"], hf_grads[x + up + ".weight"]])
            worst = max(worst, _max_diff(local.linear_fc1.weight.grad, want_fc1),
                        _max_diff(local.linear_fc2.weight.grad, hf_grads[x + down + ".weight"]))
    out["expert_grad"] = worst
    out["grad_scale"] = max(float(v.abs().max()) for k, v in hf_grads.items() if ".experts." in k)
    ps.destroy_model_parallel()
    return out


def disk_state_dict_of_grads(hf, grads: dict) -> dict:
    """HF gradients under on-disk (per-expert) names: the same conversion as the weights."""
    from transformers.core_model_loading import revert_weight_conversion

    return revert_weight_conversion(hf, dict(grads))


def parity_suite(rank: int, world_size: int, layouts, uneven_kinds=("qwen3_moe",)):
    """One launch (process start-up and imports cost ~10 s each) for `layouts_vs_hf` and the uneven-EP check."""
    return {"layouts": layouts_vs_hf(rank, world_size, layouts),
            "uneven": {k: ep2_uneven_tokens_and_grads(rank, world_size, k) for k in uneven_kinds}}
