"""The FSDP2 backend (policy.backend: fsdp2, megatron_rl/policy/fsdp2_worker.py) in the planner's model.

What the worker builds: `fully_shard` on every decoder layer and on a root unit (embeddings, final norm, lm_head),
all ranks one data-parallel mesh (no TP/PP/EP: the config loader refuses them); fp32 master weights, bf16 compute
through MixedPrecisionPolicy, gradients reduced in fp32; torch AdamW on the shards; every unit reshards after its
forward (reshard_after_forward=True, also on the root).

Memory per GPU:
  sharded state: fp32 params + fp32 grads + AdamW's two fp32 moments, 16 B/param / world (every rank holds 1/world
  of every tensor, so it shrinks with the world, unlike Megatron's DP-only layout without the distributed
  optimizer, which replicates it);
  gathered: unsharded compute-dtype copies of the units all-gathered at once: the root (its forward wraps the
  decoder, so it stays gathered through the forward and, re-gathered, through the backward) and two decoder
  layers (the one running and the one FSDP2 prefetches);
  unsharded grads: the root's and one layer's gradient in the compute dtype until their reduce-scatter;
  activations and logits: the Megatron model's (cost_model.train_memory) at TP 1, PP 1, no sequence parallelism,
  no recompute (the worker's policy.activation_recompute is not priced here yet);
  the KL reference (the initial weights' fp32 shards, 4 B/param / world) is in host memory, not on the GPU.
Time: the Megatron model's compute for TP 1 / PP 1 (cost_model.train_side_times: its MFU, and the mean length, so
  the padding of this backend's padded rows is not counted: a lower bound) and FSDP2's collectives on the
  planner's data-parallel link (cost_model.dp_link_bytes_s): per training micro-batch an all-gather of the params in
  forward and again in backward (compute dtype) and a reduce-scatter of the gradients (fp32); per forward-only
  logprob micro-batch one all-gather. FSDP2 overlaps them with compute (prefetch), so a phase takes the longer of
  the two.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from megatron_rl.planner.architecture import arch_of, dense_layer_params, expert_layer_params, total_params
from megatron_rl.planner.cost_model import (
    GiB, Workload, dp_link_bytes_s, train_memory, train_side_times, usable_bytes,
)
from megatron_rl.planner.presets import GPU

SHARDED_BYTES_PER_PARAM = 4 * 4  # fp32 param, fp32 grad, AdamW exp_avg and exp_avg_sq (fp32)
REDUCE_BYTES = 4  # MixedPrecisionPolicy(reduce_dtype=torch.float32)
PREFETCHED_LAYERS = 2  # the running layer and the next one being all-gathered


@dataclass
class Fsdp2Plan:
    world: int  # data-parallel ranks (= trainer GPUs)
    memory_gib: dict = field(default_factory=dict)  # per GPU, training phase
    peak_gib: float = 0.0
    usable_gib: float = 0.0
    host_reference_gib: float = 0.0  # per rank, in host memory
    times_s: dict = field(default_factory=dict)  # logprobs, train (each: max(compute, collectives))
    collectives_s: float = 0.0  # of the two phases, before overlap

    @property
    def fits(self) -> bool:
        return self.peak_gib <= self.usable_gib

    @property
    def train_side_s(self) -> float:
        return self.times_s["logprobs"] + self.times_s["train"]


def unit_params(spec) -> tuple[int, list[int]]:
    """(root unit's parameters, each decoder layer's) as the FSDP2 worker groups them; unpadded vocab, as HF holds it."""
    a = arch_of(spec)
    root = a.vocab * a.hidden * (1 if a.tied else 2) + a.hidden
    return root, [dense_layer_params(a, i) + expert_layer_params(a, i) for i in range(a.layers)]


def fsdp2_memory(spec, world: int, wl: Workload, compute_bytes: int = 2) -> dict:
    """Bytes per GPU by part (the module doc), and the host-resident reference under "host_reference"."""
    a = arch_of(spec)
    n = total_params(a)
    root, layers = unit_params(a)
    largest = sorted(layers, reverse=True)[:PREFETCHED_LAYERS]
    megatron, _ = train_memory(a, 1, 1, world, False, wl)  # activations/logits at TP 1 (GiB)
    return {"sharded": SHARDED_BYTES_PER_PARAM * n / world,
            "gathered": compute_bytes * (root + sum(largest)),
            "unsharded_grads": compute_bytes * (root + largest[0]),
            "activations": megatron["activations"] * GiB, "logits": megatron["logits"] * GiB,
            "host_reference": 4.0 * n / world}


def fsdp2_collective_bytes(spec, world: int, compute_bytes: int = 2) -> tuple[float, float]:
    """(bytes one rank moves per training micro-batch, per forward-only micro-batch): ring all-gathers and
    reduce-scatter move (world-1)/world of the tensor per rank."""
    n = total_params(arch_of(spec))
    share = n * (world - 1) / world
    return share * (2 * compute_bytes + REDUCE_BYTES), share * compute_bytes


def fsdp2_plan(spec, world: int, gpu: GPU, wl: Workload, compute_bytes: int = 2) -> Fsdp2Plan:
    a = arch_of(spec)
    mem = fsdp2_memory(a, world, wl, compute_bytes)
    host = mem.pop("host_reference")
    side = train_side_times(a, gpu, 1, 1, world, False, wl, collectives=False)
    train_mb, fwd_mb = fsdp2_collective_bytes(a, world, compute_bytes)
    rate = dp_link_bytes_s(gpu, world)
    micro = side["micro"] * wl.optimizer_steps  # micro-batches per rank per step
    coll_train = micro * train_mb / rate if world > 1 else 0.0
    coll_lp = wl.logprob_passes * micro * fwd_mb / rate if world > 1 else 0.0
    times = {"logprobs": max(side["logprobs"], coll_lp), "train": max(side["train"], coll_train)}
    return Fsdp2Plan(world=world, memory_gib={k: v / GiB for k, v in mem.items()},
                     peak_gib=sum(mem.values()) / GiB, usable_gib=usable_bytes(gpu) / GiB,
                     host_reference_gib=host / GiB, times_s=times, collectives_s=coll_train + coll_lp)
