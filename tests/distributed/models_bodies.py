"""Rank bodies for test_models_*.py (module-level so spawned ranks can import them).

One 2-process launch checks, for a tied Llama (llama3 RoPE scaling, explicit head_dim) and an untied Qwen2 (QKV bias,
GQA), both with vocab 250 (padded to 256): megatron logits equal HF transformers logits at TP=1, TP=2 and PP=2; the
padded vocab takes no softmax mass; iter_hf_tensors gives back the exact HF tensors at TP=2 and per PP stage; and a
checkpoint saved at TP=2 loads at TP=1 and at PP=2 with identical logits. Launches cost ~10 s each, hence one body.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from megatron_rl.platform import install_megatron_cpu_compat

SEQ, BATCH = 12, 2


def _import_transformers_first():
    # platform's CPU compat layer replaces torch.cuda.Stream with a function; transformers modules that annotate
    # `torch.cuda.Stream | None` then fail to import. Import them before installing the compat layer.
    import transformers.generation.utils  # noqa: F401
    from transformers.models.llama import modeling_llama  # noqa: F401
    from transformers.models.mistral import modeling_mistral  # noqa: F401
    from transformers.models.qwen2 import modeling_qwen2  # noqa: F401


def _init(tp: int, pp: int):
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    return ps


def _tokens(vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, vocab, (BATCH, SEQ), generator=g)


def _positions() -> torch.Tensor:
    return torch.arange(SEQ).unsqueeze(0).expand(BATCH, -1)


def _forward(model, ids) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(ids, _positions(), None)


def _gather_vocab(local: torch.Tensor) -> torch.Tensor:
    """Concatenate vocab-parallel logits of the TP group along the last dim."""
    from megatron.core import parallel_state as ps

    group = ps.get_tensor_model_parallel_group()
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def pipeline_logits(model, ids):
    """Forward through megatron's pipeline schedule; the last stage returns the logits, others None."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    box = {}

    def step(_data, m):
        out = m(ids, _positions(), None)

        def loss_fn(o):
            box["logits"] = o.detach().clone()
            return torch.zeros(()), {}

        return out, loss_fn

    model.eval()
    with torch.no_grad():
        get_forward_backward_func()(forward_step_func=step, data_iterator=iter([None]), model=[model],
                                    num_microbatches=1, seq_length=SEQ, micro_batch_size=BATCH, forward_only=True)
    return box.get("logits")


def _aux_global() -> torch.Tensor:
    return torch.arange(32.0).reshape(16, 2)


def _aux_tensor(data, *offsets):
    """Extra sharded state (what an optimizer would add): a tensor split over TP ranks when saved, whole when loaded."""
    from megatron.core.dist_checkpointing import ShardedTensor

    return ShardedTensor.from_rank_offsets("aux.w", data, *offsets, replica_id=0 if offsets else dist.get_rank())


def _tp_attrs(model) -> dict:
    return {n: (getattr(p, "tensor_model_parallel", False), getattr(p, "partition_dim", -1))
            for n, p in model.named_parameters()}


def _max_diff(a, b) -> float:
    return float((a.float() - b.float()).abs().max())


def _exact_export(model, hf_state, tied: bool) -> dict:
    """iter_hf_tensors of this rank vs the HF state: names it yields and whether each is bit-identical."""
    from megatron_rl.models.mapping import iter_hf_tensors

    got = dict(iter_hf_tensors(model))
    return {"names": sorted(got), "equal": all(torch.equal(t, hf_state[n]) for n, t in got.items()),
            "expected_total": sorted(k for k in hf_state if not (tied and k == "lm_head.weight"))}


def parity_and_checkpoints(rank: int, world_size: int, workdir: str):
    _import_transformers_first()
    install_megatron_cpu_compat()
    from megatron_rl.models.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
    from megatron_rl.models.mapping import load_hf_into_model
    from megatron_rl.models.provider import build_model
    from megatron_rl.models.tiny import make_tiny_hf_model

    out = {}
    for kind in ("llama", "qwen2", "mistral"):
        hf = make_tiny_hf_model(kind)
        cfg, hf_state = hf.config.to_dict(), hf.state_dict()
        vocab = cfg["vocab_size"]
        ids = _tokens(vocab)
        with torch.no_grad():
            ref = hf(ids).logits.float()
        r = out[kind] = {}

        _init(1, 1)
        m = build_model(cfg)
        spec = m.megatron_rl_spec
        r["padded_vocab"] = spec.padded_vocab_for(2)
        load_hf_into_model(m, hf_state)
        r["tp1"] = _max_diff(_forward(m, ids)[..., :vocab], ref)
        if kind == "mistral":  # sliding window: TP=1 parity is what it needs; keep the launch short
            continue

        ps = _init(2, 1)
        m = build_model(cfg)
        load_hf_into_model(m, hf_state)
        full = _gather_vocab(_forward(m, ids))
        r["tp2"] = _max_diff(full[..., :vocab], ref)
        r["tp2_pad_max"] = float(full[..., vocab:].max())
        # log-softmax over the padded vocabulary equals HF's over the real one: padding takes no mass
        r["tp2_logprob"] = _max_diff(torch.log_softmax(full, -1)[..., :vocab], torch.log_softmax(ref, -1))
        r["tp2_export"] = _exact_export(m, hf_state, spec.tied_embeddings)
        r["tp_attrs_equal"] = _tp_attrs(m) == _tp_attrs(build_model(cfg, init_weights=False))
        ckpt = Path(workdir) / kind / "step_3"
        save_checkpoint(ckpt, m, step=3, extra_state={"note": kind, "counts": torch.arange(3)},
                        extra_sharded_state=lambda model_sd: {"aux": {"w": _aux_tensor(
                            _aux_global()[8 * ps.get_tensor_model_parallel_rank():][:8].clone(),
                            (0, ps.get_tensor_model_parallel_rank(), 2))}})
        tp2_logits = full

        ps = _init(1, 2)
        m = build_model(cfg)
        load_hf_into_model(m, hf_state)
        logits = pipeline_logits(m, ids)
        r[f"pp2_stage{ps.get_pipeline_model_parallel_rank()}_export"] = _exact_export(m, hf_state,
                                                                                      spec.tied_embeddings)
        if logits is not None:
            r["pp2"] = _max_diff(logits[..., :vocab], ref)
        m = build_model(cfg, seed=99)  # different random init: the load must overwrite everything
        load_checkpoint(ckpt, m)
        logits = pipeline_logits(m, ids)
        if logits is not None:
            r["ckpt_tp2_to_pp2"] = _max_diff(logits, tp2_logits)

        _init(1, 1)
        m = build_model(cfg, seed=99)
        loaded = load_checkpoint(ckpt, m, extra_sharded_state={"aux": {"w": _aux_tensor(torch.empty(16, 2))}})
        r["aux_equal"] = torch.equal(loaded["extra_sharded_state"]["aux"]["w"], _aux_global())
        r["ckpt_tp2_to_tp1"] = _max_diff(_forward(m, ids), tp2_logits)
        r["extra_state"] = loaded["extra_state"]
        r["step"] = loaded["metadata"]["step"]
        r["latest"] = str(latest_checkpoint(Path(workdir) / kind))
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    return out


def smollm2_parity(rank: int, world_size: int, model_dir: str):
    """Real SmolLM2-135M: TP=1 and PP=2 logits vs transformers (fp32)."""
    _import_transformers_first()
    install_megatron_cpu_compat()
    from transformers import AutoModelForCausalLM

    from megatron_rl.models.hf_io import HFCheckpoint
    from megatron_rl.models.mapping import load_hf_into_model
    from megatron_rl.models.provider import build_model

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = _tokens(hf.config.vocab_size)
    with torch.no_grad():
        ref = hf(ids).logits.float()
    del hf
    weights = HFCheckpoint(model_dir)
    out = {"ref_absmax": float(ref.abs().max())}
    _init(1, 1)
    m = build_model(model_dir, init_weights=False)
    load_hf_into_model(m, weights)
    out["tp1"] = _max_diff(_forward(m, ids), ref)
    del m
    ps = _init(1, 2)
    m = build_model(model_dir, init_weights=False)
    load_hf_into_model(m, weights)
    logits = pipeline_logits(m, ids)
    if logits is not None:
        out["pp2"] = _max_diff(logits, ref)
    ps.destroy_model_parallel()
    return out
