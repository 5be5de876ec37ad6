"""The FSDP2 backend (policy.backend: fsdp2, megatron_rl/policy/fsdp2_worker.py) in the planner's model.

What the worker builds: `fully_shard` on every decoder layer and on a root unit (embeddings, final norm, lm_head)
over the data-parallel mesh dimension, and with `policy.tp` > 1 DTensor tensor parallelism first (policy/fsdp2_tp.py:
Megatron's split of the projections and the vocabulary; a dp x tp mesh; no PP/EP: the config loader refuses them);
fp32 master weights, bf16 compute through MixedPrecisionPolicy, gradients reduced in fp32; torch AdamW on the shards;
every unit reshards after its forward (reshard_after_forward=True, also on the root). `best_fsdp2_plan` picks the TP
size (within one NVLink domain, dividing the heads, KV heads and vocabulary) with the shortest training side that
fits.

Memory per GPU:
  sharded state: fp32 params + fp32 grads + AdamW's two fp32 moments, 16 B/param / world (every rank holds 1/world
  of every tensor — 1/dp of its TP slice — so it shrinks with the world, unlike Megatron's DP-only layout without
  the distributed optimizer, which replicates it; the norms TP replicates are not counted);
  gathered: unsharded compute-dtype copies of the units all-gathered over dp at once (their TP slices): the root
  (its forward wraps the decoder, so it stays gathered through the forward and, re-gathered, through the backward)
  and two decoder layers (the one running and the one FSDP2 prefetches);
  unsharded grads: the root's and one layer's gradient in the compute dtype until their reduce-scatter;
  activations and logits: the Megatron model's (cost_model.train_memory) at this TP, PP 1, no sequence
  parallelism, no recompute (the worker's policy.activation_recompute is not priced here yet);
  the KL reference (the initial weights' fp32 shards, 4 B/param / world) is in host memory, not on the GPU.
Time: the Megatron model's compute for this TP / PP 1 (cost_model.train_side_times: its MFU, TP's efficiency, and
  the mean length, so the padding of this backend's padded rows is not counted: a lower bound) and FSDP2's
  collectives on the planner's data-parallel link (cost_model.dp_link_bytes_s): per training micro-batch an
  all-gather of the params' TP slice in forward and again in backward (compute dtype) and a reduce-scatter of the
  gradients (fp32); per forward-only logprob micro-batch one all-gather. FSDP2 overlaps them with compute (prefetch), so a phase takes the longer of
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
    world: int  # trainer GPUs: dp x tp
    tp: int = 1
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


def fsdp2_memory(spec, world: int, wl: Workload, compute_bytes: int = 2, tp: int = 1) -> dict:
    """Bytes per GPU by part (the module doc), and the host-resident reference under "host_reference"."""
    a = arch_of(spec)
    n = total_params(a)
    root, layers = unit_params(a)
    largest = sorted(layers, reverse=True)[:PREFETCHED_LAYERS]
    megatron, _ = train_memory(a, tp, 1, world // tp, False, wl)  # activations/logits at this TP (GiB)
    return {"sharded": SHARDED_BYTES_PER_PARAM * n / world,
            "gathered": compute_bytes * (root + sum(largest)) / tp,
            "unsharded_grads": compute_bytes * (root + largest[0]) / tp,
            "activations": megatron["activations"] * GiB, "logits": megatron["logits"] * GiB,
            "host_reference": 4.0 * n / world}


def fsdp2_collective_bytes(spec, world: int, compute_bytes: int = 2, tp: int = 1) -> tuple[float, float]:
    """(bytes one rank moves per training micro-batch, per forward-only micro-batch): ring all-gathers and
    reduce-scatter over the dp ranks move (dp-1)/dp of the rank's TP slice."""
    n = total_params(arch_of(spec))
    dp = world // tp
    share = n / tp * (dp - 1) / dp
    return share * (2 * compute_bytes + REDUCE_BYTES), share * compute_bytes


def fsdp2_plan(spec, world: int, gpu: GPU, wl: Workload, compute_bytes: int = 2, tp: int = 1) -> Fsdp2Plan:
    a = arch_of(spec)
    if world % tp:
        raise ValueError(f"TP {tp} does not divide {world} GPUs")
    dp = world // tp
    mem = fsdp2_memory(a, world, wl, compute_bytes, tp)
    host = mem.pop("host_reference")
    side = train_side_times(a, gpu, tp, 1, dp, False, wl, collectives=False)
    train_mb, fwd_mb = fsdp2_collective_bytes(a, world, compute_bytes, tp)
    rate = dp_link_bytes_s(gpu, world)
    micro = side["micro"] * wl.optimizer_steps  # micro-batches per rank per step
    coll_train = micro * train_mb / rate if dp > 1 else 0.0
    coll_lp = wl.logprob_passes * micro * fwd_mb / rate if dp > 1 else 0.0
    times = {"logprobs": max(side["logprobs"], coll_lp), "train": max(side["train"], coll_train)}
    return Fsdp2Plan(world=world, tp=tp, memory_gib={k: v / GiB for k, v in mem.items()},
                     peak_gib=sum(mem.values()) / GiB, usable_gib=usable_bytes(gpu) / GiB,
                     host_reference_gib=host / GiB, times_s=times, collectives_s=coll_train + coll_lp)


def tp_sizes(spec, world: int, gpu: GPU) -> list[int]:
    """The TP sizes the FSDP2 worker takes here (policy/fsdp2_tp.check_tp: heads, KV heads and the unpadded
    vocabulary divisible) within one NVLink domain."""
    a = arch_of(spec)
    return [t for t in (1, 2, 4, 8) if t <= gpu.nvlink_domain and world % t == 0
            and a.heads % t == 0 and a.kv_heads % t == 0 and a.vocab % t == 0]


def best_fsdp2_plan(spec, world: int, gpu: GPU, wl: Workload, compute_bytes: int = 2) -> Fsdp2Plan:
    """The fitting plan with the shortest training side over `tp_sizes`; if none fits, the smallest peak."""
    plans = [fsdp2_plan(spec, world, gpu, wl, compute_bytes, t) for t in tp_sizes(spec, world, gpu)]
    fitting = [p for p in plans if p.fits]
    return min(fitting, key=lambda p: p.train_side_s) if fitting else min(plans, key=lambda p: p.peak_gib)
