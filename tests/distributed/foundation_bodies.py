"""Rank bodies for test_foundation.py (module-level so spawned ranks can import them).

A tiny megatron-core GPTModel is built at TP=1/PP=1 and again at TP=2 or PP=2 in the same 2-process launch. With
`use_cpu_initialization=True` megatron initialises each full ("master") weight from the same seed and slices out the
rank's shard, so TP=2 holds exactly the TP=1 weights. For PP the stages create only their own layers, so the PP=2
model gets the PP=1 weights copied by layer index.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from megatron_rl.platform import install_megatron_cpu_compat

VOCAB, SEQ, BATCH, LAYERS = 128, 16, 2, 4


def _build(tp: int, pp: int, seed: int = 1234):
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    cfg = TransformerConfig(
        num_layers=LAYERS, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128,
        use_cpu_initialization=True, normalization="RMSNorm", gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.float32,
        pipeline_dtype=torch.float32, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
    )
    model = GPTModel(
        config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"), vocab_size=VOCAB,
        max_sequence_length=SEQ, pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=False, position_embedding_type="rope",
    )
    return model


def _data():
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _forward_backward(model, pp: int):
    """One forward+backward through megatron's schedule; returns (per-token losses or None, grad norm^2 local)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    inputs, labels = _data()
    pos = torch.arange(SEQ).unsqueeze(0).expand(BATCH, -1)
    captured = {}

    def step(data_iter, m):
        out = m(inputs, pos, None, labels=labels)

        def loss_fn(output):
            captured["losses"] = output.detach().clone()
            return output.sum() / output.numel(), {}

        return out, loss_fn

    fb = get_forward_backward_func()
    fb(forward_step_func=step, data_iterator=iter([None]), model=[model], num_microbatches=1, seq_length=SEQ,
       micro_batch_size=BATCH, forward_only=False)
    sq = sum(float((p.grad.double() ** 2).sum()) for p in model.parameters() if p.grad is not None)
    return captured.get("losses"), sq


def tp_and_pp_equivalence(rank: int, world_size: int):
    install_megatron_cpu_compat()
    from megatron.core import parallel_state as ps

    out = {}
    # Reference: TP=1, PP=1 (each rank holds the whole model).
    ref = _build(1, 1)
    for p in ref.parameters():
        p.grad = None
    ref_losses, ref_sq = _forward_backward(ref, 1)
    out["ref_losses"] = ref_losses
    out["ref_grad_norm"] = ref_sq ** 0.5
    ref_state = {k: v.detach().clone() for k, v in ref.state_dict().items() if v is not None and torch.is_tensor(v)}

    # TP=2: same seed gives the same master weights, sliced.
    tp_model = _build(2, 1)
    tp_losses, tp_sq = _forward_backward(tp_model, 1)
    # TP-sharded parameters contribute their shard; replicated ones (norms) are counted once (rank 0).
    sq = torch.zeros(1, dtype=torch.float64)
    for p in tp_model.parameters():
        if p.grad is None:
            continue
        part = (p.grad.double() ** 2).sum()
        if getattr(p, "tensor_model_parallel", False) or ps.get_tensor_model_parallel_rank() == 0:
            sq += part
    dist.all_reduce(sq, group=ps.get_tensor_model_parallel_group())
    out["tp_losses"] = tp_losses
    out["tp_grad_norm"] = float(sq) ** 0.5

    # PP=2: copy the reference weights by global layer index into each stage.
    pp_model = _build(1, 2)
    stage = ps.get_pipeline_model_parallel_rank()
    offset = stage * (LAYERS // 2)
    new_state = {}
    for k, v in pp_model.state_dict().items():
        if not torch.is_tensor(v):
            continue
        src = k
        if k.startswith("decoder.layers."):
            parts = k.split(".")
            parts[2] = str(int(parts[2]) + offset)
            src = ".".join(parts)
        new_state[k] = ref_state[src]
    pp_model.load_state_dict(new_state, strict=False)
    pp_losses, pp_sq = _forward_backward(pp_model, 2)
    sq = torch.tensor([pp_sq], dtype=torch.float64)
    dist.all_reduce(sq, group=ps.get_pipeline_model_parallel_group())
    out["pp_losses"] = pp_losses  # only the last stage has them
    out["pp_grad_norm"] = float(sq) ** 0.5
    out["pp_stage"] = stage
    ps.destroy_model_parallel()
    return out


def fail_on_rank_one(rank: int, world_size: int):
    if rank == 1:
        raise ValueError("deliberate failure on rank 1")
    return rank


def process_facts(rank: int, world_size: int, key: str):
    """What a rank sees of its start: its parent, the caller's variable KEY, the working directory, whether the fork
    server's preloaded libraries are already imported, and a module-level mark a previous rank would have left."""
    import sys

    seen = getattr(sys.modules[__name__], "_MARK", None)
    sys.modules[__name__]._MARK = rank  # a later launch must not see this: each rank is a fresh address space
    return {"ppid": os.getppid(), "env": os.environ.get(key), "cwd": os.getcwd(), "mark": seen,
            "megatron_preloaded": "megatron.core" in sys.modules, "threads": torch.get_num_threads()}
