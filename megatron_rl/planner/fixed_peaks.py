"""Memory peaks outside the training phases, per GPU: moments of start-up and of the refit whose size the runtime's
order fixes (issue 54's fixes; docs/gpu.md, "Fixed peaks"). Each is what the runtime holds on one GPU at that moment:

- disaggregated refit (weights/collective.py sends and loads one bucket at a time on both ends): a trainer GPU still
  holds its training state (weights, gradients, optimizer state: `cost_model.train_memory`'s static bytes; the
  activations are gone) plus one bucket's flat copy; an engine GPU holds vLLM's weights and KV cache plus one bucket.
- FSDP2 load (policy/fsdp2_load.py: the model built on `meta`, each unit filled from rank 0's host copy as it is
  sharded): the fp32 shards of the units already done (at the last unit, all of them: 4 B a parameter / world) plus
  the unit being filled, whole, in the checkpoint's dtype (bf16: 2 B a parameter / TP).
- distillation, colocated (build.py: the student's state leaves the device before the teacher sets up): the
  teacher's bf16 weights over its TP x PP alone at start-up; scoring adds its blockwise top-k buffers
  (policy/topk.py: [micro-batch tokens, VOCAB_BLOCK] fp32 logits and VOCAB_BLOCK rows of the head's weight in fp32;
  both sizes in buffers.py).

Predicted, not measured on a GPU: the CPU tests named in docs/gpu.md bound the same bytes on CPU.
"""
from __future__ import annotations

from megatron_rl.buffers import BUCKET_BYTES, VOCAB_BLOCK
from megatron_rl.planner.architecture import arch_of, dense_layer_params, expert_layer_params, total_params

GiB = 2**30
FSDP2_SHARD_BYTES = 4  # fp32 sharded parameters (policy/fsdp2_worker.py's MixedPrecisionPolicy)
CHECKPOINT_BYTES = 2  # bf16 checkpoints (HF's usual dtype)


def disaggregated_refit(static_bytes: float, vllm_w: float, kv_bytes: float) -> dict:
    """GiB on a trainer GPU and on an engine GPU while a refit streams (module doc)."""
    return {"refit_trainer": (static_bytes + BUCKET_BYTES) / GiB,
            "refit_engine": (vllm_w + kv_bytes + BUCKET_BYTES) / GiB}


def fsdp2_load(spec, world: int, tp: int = 1) -> float:
    """GiB per GPU at the FSDP2 load's last `fully_shard` (module doc): every shard plus the largest unit whole."""
    a = arch_of(spec)
    root = a.vocab * a.hidden * (1 if a.tied else 2) + a.hidden
    largest = max([root] + [dense_layer_params(a, i) + expert_layer_params(a, i) for i in range(a.layers)])
    return (FSDP2_SHARD_BYTES * total_params(a) / world + CHECKPOINT_BYTES * largest / tp) / GiB


def teacher(spec, tp: int, pp: int, micro_tokens: int, beside_gib: float = 0.0) -> dict:
    """GiB per GPU of a distillation teacher at its set-up (its weights, beside `beside_gib` of the student's: none
    when colocated, its training state when disaggregated) and while it scores (plus the blockwise top-k buffers of
    one micro-batch)."""
    a = arch_of(spec)
    weights = 2.0 * total_params(a) / (tp * pp)
    block = min(VOCAB_BLOCK, -(-a.vocab // tp))
    scoring = 4.0 * block * (micro_tokens + a.hidden)
    return {"teacher_startup": beside_gib + weights / GiB, "teacher_scoring": beside_gib + (weights + scoring) / GiB}
