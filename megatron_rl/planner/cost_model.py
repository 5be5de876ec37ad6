"""The planner's model: memory per GPU and the time of one GRPO step for a given layout (pure arithmetic).

`megatron-rl plan` (megatron_rl/planner/search.py) searches layouts with it; this text is part of its `--help`.

Memory per GPU (training ranks; bf16 weights, Megatron mixed precision):
  weights 2 B/param + fp32 gradient buffer 4 B/param + Adam state (fp32 master, m, v) 12 B/param, the last sharded
  over DP by the distributed optimizer; parameters per rank follow megatron-core's sharding exactly (TP-split
  matrices, replicated norms, vocab padded to 128*TP, embedding on the first stage, output layer on the last, and a
  second copy of a tied embedding there when PP > 1).
  activations per token and layer (flash attention, SwiGLU): (4*q_width + 4*kv_width + 6*ffn)/TP + 8h bytes (the
  8h of norm inputs/outputs is replicated over TP: the policy worker runs without sequence parallelism); with full
  recompute only the layer input (2h) is kept, plus one layer's activations while it is recomputed. 1F1B keeps PP
  micro-batches in flight on the first stage: L layers' worth.
  logits: bf16 [tokens, V/TP] and their gradient. Our fused log-prob kernels never build the fp32 [tokens, V]
  softmax that an unfused cross-entropy would (that would add 8 B per logit).
  colocated: during training vLLM sleeps (weights to host, KV cache freed); during generation the trainer has moved
  its weights and optimizer state to the host (PolicyWorker.offload) and only its fp32 gradient buffer stays next
  to vLLM's weights (2 B/param / gen-TP); the KV cache gets what is left and must hold one --seq-len sequence. Both
  moves cross PCIe every step (25 GB/s assumed). Disaggregated: vLLM's GPUs hold only vLLM.
  reserve: 2.5 GiB + 5% per GPU for the CUDA context, NCCL buffers and allocator fragmentation.
  mixture of experts (megatron_rl/planner/architecture.py): memory counts all parameters, routed experts sharded over EP
  (expert parallelism, ep | experts and ep | dp, as in megatron-core) and their optimizer state over dp/ep; an MoE
  layer keeps its top-k expert activations and the dispatched token copies per token.
  context parallelism (policy.cp): each rank holds 1/CP of every packed row, so activations and logits per rank
  are divided by CP; megatron-core sees the CP ranks as data-parallel ones, so the distributed optimizer shards over
  DP x CP.
Phase times:
  train 6 * params * tokens (8 with recompute) + causal attention FLOPs, at an assumed MFU, paced by the slowest
  pipeline stage (the last one also runs the output layer), slowed by the bubble (PP-1)/micro-batches and the
  distributed optimizer's gradient reduce-scatter and parameter all-gather;
  MoE: params are the active ones (attention, router, shared experts, top-k experts); the routed experts' GEMMs
  (with their router and permutes) run at MOE_MFU, which reproduces Megatron-Bridge's published H100 pre-training
  rate of Qwen3-30B-A3B (5,275 tokens/s/GPU at EP 8, PP 2, FP8; the planner gives 5,370 in bf16, so it is optimistic
  for bf16); each MoE layer adds its token dispatch and combine (all-to-all of top-k x hidden bf16 per token, each
  way; NVLink inside a node, the network across) twice per forward and twice per backward, not overlapped with
  compute (megatron's default) and without DeepEP's per-node deduplication, so pessimistic where those are on;
  context parallelism: a replica's tokens are split over its CP ranks (the zig-zag chunks balance causal
  attention), and every layer all-gathers K and V over the CP group in the forward (again in a recompute) and sums
  their gradients back in the backward: (CP-1)/CP of the row's K/V bytes per layer and pass, not overlapped (NVLink
  when TP x CP GPUs share a node, else the network);
  logprobs 2 * params * tokens per forward-only pass: the "old" pass when the loop runs one (several optimizer steps
  per rollout, or async) and the KL reference's (grpo.logprob_passes(), the loop's own rule);
  decode is HBM-bandwidth bound: every step reads the instance's weights (MoE: the experts its batch picked) and
  its live KV cache (MLA: vLLM's compressed latent), plus two TP all-reduces per layer (vLLM's custom all-reduce
  inside a node, measured ~9 us + its bytes at ~0.11 of NVLink; across nodes NCCL's tree latency), with concurrency
  limited by the KV cache and vLLM's max_num_seqs; the step also lasts as long as its longest response (some GRPO
  samples always run to the limit), so the tail runs at small batch. Decode runs as CUDA graphs unless
  `--enforce-eager` (generation.enforce_eager; the default is the config's): eager, the CPU launches every layer's
  kernels one by one each step, and a step cannot be shorter than that.
  refit: vLLM's weights once per step, over NVLink (colocated, 50% of peak) or the network (disaggregated: the
  collective broadcast, 80%), plus 0.5 s of fixed cost; switch (colocated only): both sides' host <-> GPU moves.
Step time, by mode:
  colocated (cluster.colocated: true):        generate + logprobs + train + refit + switch
  disaggregated, synchronous (max_staleness 0): generate + logprobs + train + refit   (each side idles while the
                                                other works, but nothing moves to the host)
  async (grpo.max_staleness k >= 1, disaggregated only): max(generate, logprobs + train) + refit
    the engines generate step n+1's rollout while step n trains; the loop joins the sampler before each refit, so
    the refit itself is not overlapped. Any k >= 1 has this steady state (a larger k only absorbs step-to-step
    variation, which the planner does not model); the trained samples are up to k weight versions old.
  tokens/s/GPU = samples * mean length / step time / every GPU of the job (trainer + engines).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

from megatron_rl.config.schema import GenerationConfig, GRPOConfig
from megatron_rl.distributed.parallel_dims import (
    check_engine_split, check_expert_split, check_policy_split, device_layout,
)
from megatron_rl.planner.architecture import (  # noqa: F401  (re-exported: the planner's model is part of its API)
    act_bytes_per_token_layer, arch_of, decode_weight_bytes, expert_matmul_params, kv_bytes_per_token,
    layer_matmul_params, matmul_params, pp_problem, stage_layers, stage_param_split, vllm_weight_bytes,
)
from megatron_rl.planner import fixed_peaks
from megatron_rl.planner.presets import GPU

GiB = 2**30
MFU = 0.40  # achieved/peak bf16 for Megatron dense training and forward passes at h >= 4096 (RL packing included)
# routed-expert GEMMs with their router and permutes: Megatron-Bridge's H100 Qwen3-30B-A3B pre-training rate (module
# doc; tests/unit/test_plan_moe.py pins it). Small experts (768 wide) run far below the dense MFU. The calibration row
# is FP8 (25.11: 16 GPUs, PP 2, EP 8, 5,275 tokens/s/GPU): Megatron-Bridge publishes no H100 BF16 row for this model
# (performance summaries 25.09 to 26.02.01; its later FP8 rows range 5,113 to 9,058), so bf16 runs are estimated fast
MOE_MFU = 0.10
PREFILL_MFU = 0.50
DECODE_BW_EFF = 0.70  # fraction of HBM bandwidth a decode step reaches
DECODE_STEP_OVERHEAD_S = 3e-3  # scheduler + kernel launches per decode step (vLLM V1, CUDA graphs)
# eager decode: the CPU issues each layer's ~12 kernels (norms, GEMMs, rotary, attention, activation) through Python,
# ~15 us each; it runs ahead of the GPU, so it only costs time when the GPU work per step is shorter
EAGER_LAUNCH_S_PER_LAYER = 2e-4
MAX_NUM_SEQS = 1024  # vLLM's default concurrency cap on >= 70 GiB GPUs other than A100 (256 there)
PCIE_GB_S = 25.0
COLLECTIVE_EFF = 0.8  # achieved / link bandwidth of NCCL collectives (gradient reduce-scatter, MoE all-to-all, TP)
# vLLM's tensor-parallel all-reduce of one decode step (batch x hidden, bf16; tp_allreduce_s). Inside an NVLink domain
# vLLM runs its own custom all-reduce; measured on H100 at TP 2/4/8 (github.com/sgl-project/sglang/pull/2904, vLLM's
# kernel): 8.5-10 us up to 32 KB, and 27/40/45 us at 1 MB, where its ring-equivalent bytes 2(n-1)/n x size move at
# 50-60 GB/s, about 0.11 of NVLink's 450 (0.5 MB: 43-60 GB/s) -- decode's messages are far from NVLink's peak
AR_NVLINK_LATENCY_S = 9e-6
AR_NVLINK_EFF = 0.11
# across nodes vLLM falls back to NCCL, which picks tree + LL for small messages; NCCL's own tuning model
# (NVIDIA/nccl src/graph/tuning.cc, its baseLat/hwLat tables) prices that at 6.8 us + 2 x ((GPUs per node - 1) x
# 0.6 us per NVLink hop + log2(nodes) x 5.0 us per network hop): 35 us for TP 32 over 4 nodes. The bytes cross the
# network as a ring.
NCCL_TREE_LL_BASE_S = 6.8e-6
NCCL_LL_NVLINK_HOP_S = 0.6e-6
NCCL_LL_NET_HOP_S = 5.0e-6
TP_EFF = {1: 1.0, 2: 0.97, 4: 0.93, 8: 0.88}  # tensor-parallel communication inside NVLink
SEQUENCE_PARALLEL = False  # the policy worker does not turn it on: norm activations are replicated over TP


class Infeasible(ValueError):
    """No layout can run this request; the message says why."""


@dataclass(frozen=True)
class Workload:
    samples: int = 1024  # sequences per GRPO step (prompts x generations)
    seq_len: int = 8192  # longest prompt + response
    avg_len: int | None = None  # mean prompt + response tokens (default: seq_len / 2)
    prompt_len: int = 256
    # tokens one rank holds per training micro-batch (policy.max_tokens_per_microbatch; default: seq_len / cp)
    mb_tokens: int | None = None
    optimizer_steps: int = 1  # optimizer steps per rollout batch
    # forward-only passes per step; the default is what the loop runs with the default config (none: one optimizer
    # step reuses its first forward as the "old" logprobs, and there is no KL reference)
    logprob_passes: int = GRPOConfig().logprob_passes()
    distributed_optimizer: bool = True
    enforce_eager: bool = GenerationConfig.enforce_eager  # vLLM decode without CUDA graphs; the config's default
    # vLLM's cap on its share of a GPU (weights + KV cache), as a fraction of the device; None: whatever the
    # trainer leaves free (what the planner proposes and --write-config writes)
    gpu_memory_utilization: float | None = None

    @property
    def mean_len(self) -> int:
        return self.avg_len or self.seq_len // 2

    @property
    def micro_tokens(self) -> int:
        return max(self.mb_tokens or self.seq_len, self.seq_len)

    def rank_tokens(self, cp: int = 1) -> float:
        """Tokens a rank holds per micro-batch at context-parallel size cp: the budget, and at least its share of
        the longest row (a row split over cp ranks holds cp x the budget)."""
        return max(self.mb_tokens or 0, self.seq_len / cp)


@dataclass
class Plan:
    tp: int
    pp: int
    dp: int
    gen_tp: int
    train_gpus: int
    gen_gpus: int
    recompute: bool
    colocated: bool
    max_staleness: int = 0  # >= 1: async GRPO (generation overlaps training)
    ep: int = 1  # expert parallelism (MoE): carved out of dp, as in megatron-core
    cp: int = 1  # context parallelism: ranks splitting each packed row (adds ranks, like tp)
    memory_gib: dict = field(default_factory=dict)  # training-phase breakdown of the fullest stage
    train_peak_gib: float = 0.0
    fixed_peaks_gib: dict = field(default_factory=dict)  # peaks outside the phases (planner/fixed_peaks.py)
    gen_peak_gib: float = 0.0
    kv_gib: float = 0.0  # KV cache per GPU while generating
    kv_tokens: int = 0  # KV-cache capacity per vLLM instance
    concurrency: int = 0  # sequences decoded together per instance
    seqs_per_instance: int = 0
    times_s: dict = field(default_factory=dict)
    step_s: float = 0.0
    tokens_per_s_per_gpu: float = 0.0
    bound: str = ""
    eager_decode: bool = False  # the decode estimate is for vLLM without CUDA graphs (generation.enforce_eager)
    vllm_gib: float = 0.0  # one vLLM rank's weights + KV cache: what generation.gpu_memory_utilization must allow
    handover_gib: dict = field(default_factory=dict)  # colocated: GiB per GPU at each handover phase (handover_memory)

    @property
    def total_gpus(self) -> int:
        return self.train_gpus if self.colocated else self.train_gpus + self.gen_gpus

    @property
    def gen_instances(self) -> int:
        return self.gen_gpus // self.gen_tp


def step_time(times: dict, *, max_staleness: int) -> float:
    """One step from its phase times (see the module docstring): the sum, or with async GRPO the slower of the two
    sides plus the refit that neither side overlaps."""
    if max_staleness > 0:
        return max(times["generate"], times["logprobs"] + times["train"]) + times["refit"] + times["switch"]
    return sum(times.values())


# ---------------------------------------------------------------------------------------------------------------
# architecture arithmetic (megatron_rl/planner/architecture.py: dense and MoE parameter, activation and KV counts)
# ---------------------------------------------------------------------------------------------------------------

def stage_params(spec, tp: int = 1, pp: int = 1, ep: int = 1) -> list[int]:
    """Parameters held by one rank of each pipeline stage, as megatron-core allocates them (experts over EP)."""
    return [d + e for d, e in stage_param_split(arch_of(spec), tp, pp, ep)]


def fwd_flops_per_token(spec, avg_len: int) -> float:
    # 2 FLOPs per active weight, plus causal attention: QK^T and AV over avg_len/2 keys on average
    a = arch_of(spec)
    return 2.0 * matmul_params(a) + a.layers * a.score_width * avg_len


# ---------------------------------------------------------------------------------------------------------------
# memory
# ---------------------------------------------------------------------------------------------------------------

def usable_bytes(gpu: GPU) -> float:
    return gpu.memory_gib * GiB * 0.95 - 2.5 * GiB


def train_memory(spec, tp: int, pp: int, dp: int, recompute: bool, wl: Workload, ep: int = 1,
                 cp: int = 1) -> tuple[dict, float]:
    """(breakdown of the fullest stage in GiB, static bytes of that rank kept across phases)."""
    a = arch_of(spec)
    t = wl.rank_tokens(cp)  # this rank's share of each packed row
    logits = 4.0 * t * a.padded_vocab_for(tp) / tp  # bf16 logits + their gradient
    # full recompute keeps only each layer's input (split over TP only with sequence parallelism)
    kept_in = t * 2 * a.hidden / (tp if SEQUENCE_PARALLEL else 1)
    # the distributed optimizer shards over megatron's data-parallel ranks, which include the CP ranks; expert state
    # over the expert-data-parallel replicas
    dp, edp = dp * cp, dp * cp // ep
    best = None
    acts = _stage_act_bytes(a, tp, pp)
    for i, ((dense, expert), n, (act_sum, act_max)) in enumerate(
            zip(stage_param_split(a, tp, pp, ep), stage_layers(a, pp), acts)):
        opt = 12.0 * (dense / dp + expert / edp) if wl.distributed_optimizer else 12.0 * (dense + expert)
        # 1F1B: stage i has PP - i micro-batches in flight; recompute rebuilds one layer at a time in backward
        act = (pp - i) * (n * kept_in if recompute else t * act_sum) + (t * act_max if recompute else 0.0)
        parts = {"weights": 2.0 * (dense + expert), "grads": 4.0 * (dense + expert), "optimizer": opt,
                 "activations": act, "logits": logits if i == pp - 1 else 0.0}
        if best is None or sum(parts.values()) > sum(best.values()):
            best = parts
    static = best["weights"] + best["grads"] + best["optimizer"]
    return {k: v / GiB for k, v in best.items()}, static


@functools.lru_cache(maxsize=4096)  # as architecture.stage_param_split: the search asks for the same sums again
def _stage_act_bytes(a, tp: int, pp: int) -> tuple[tuple[float, float], ...]:
    """Per pipeline stage: (sum, max) over its layers of the activation bytes kept per token."""
    out, start = [], 0
    for n in stage_layers(a, pp):
        per_layer = [act_bytes_per_token_layer(a, j, tp, SEQUENCE_PARALLEL) for j in range(start, start + n)]
        start += n
        out.append((sum(per_layer), max(per_layer)))
    return tuple(out)


def handover_memory(mem: dict, vllm_w: float, model_w: float, colocated: bool) -> dict:
    """GiB per GPU at the colocated handover's phases (the runtime's order, algorithms/handover.py): train holds the
    trainer's whole state (`train_memory`'s breakdown) and nothing of vLLM's (level-2 sleep); the refit holds the
    trainer's weights only, vLLM's weights and the refit buffer (the whole model: CUDA IPC exports one flat copy per
    engine GPU); generate is vLLM's alone (`evaluate` adds its KV cache). Disaggregated: nothing is shared."""
    if not colocated:
        return {}
    return {"train": sum(mem.values()), "refit": mem["weights"] + (vllm_w + model_w) / GiB}


# ---------------------------------------------------------------------------------------------------------------
# time
# ---------------------------------------------------------------------------------------------------------------

def _mfu(width: int, tp: int) -> float:
    # narrow GEMMs run at lower efficiency (a heuristic: 0.78x at width 1536, 1x from 4096). Dense layers: width =
    # hidden; routed experts: their narrow side, min(hidden, expert ffn)
    return MFU * min(1.0, (width / 4096) ** 0.25) * TP_EFF[tp]


def stage_fwd_flops(spec, pp: int, avg_len: int) -> tuple[tuple[float, float, int], ...]:
    """Per pipeline stage: (forward FLOPs per token outside the routed experts, inside them, MoE layers). The last
    stage also runs the output layer."""
    return _stage_fwd_flops(arch_of(spec), pp, avg_len)


@functools.lru_cache(maxsize=4096)  # as architecture.stage_param_split: the search asks for the same sums again
def _stage_fwd_flops(a, pp: int, avg_len: int) -> tuple[tuple[float, float, int], ...]:
    out, start = [], 0
    for n in stage_layers(a, pp):
        layers = range(start, start + n)
        start += n
        expert = sum(2.0 * expert_matmul_params(a, i) for i in layers)
        dense = sum(2.0 * (layer_matmul_params(a, i) - 2 * a.hidden) + a.score_width * avg_len for i in layers)
        out.append([dense - expert, expert, sum(1 for i in layers if a.is_moe_layer(i))])
    out[-1][0] += 2.0 * a.vocab * a.hidden
    return tuple(tuple(x) for x in out)


def dispatch_s_per_token_layer(spec, gpu: GPU, tp: int, ep: int) -> float:
    """One MoE layer's token dispatch + combine for one token, forward: two all-to-alls over the EP group, each
    sending top-k copies of the hidden state (bf16) to the ranks holding the chosen experts ((ep-1)/ep of them
    leave the rank), over NVLink inside a node and the network across nodes (the slower side sets the pace), plus
    the local permute/unpermute copies at HBM bandwidth."""
    a = arch_of(spec)
    if not a.moe:
        return 0.0
    copy = 2 * (a.topk + 1) * a.hidden * 2 / (gpu.hbm_tb_s * 1e12 * DECODE_BW_EFF)  # permute + unpermute, r+w
    if ep == 1:
        return copy
    sent = 2 * a.topk * a.hidden * 2.0  # dispatch and combine
    # megatron's expert layout is tp-ep-...: an EP group is tp*ep consecutive GPUs; domain // tp of its ranks share
    # a node
    local = max(1, min(ep, gpu.nvlink_domain // tp))
    intra = sent * (local - 1) / ep / (gpu.nvlink_gb_s * 1e9 * COLLECTIVE_EFF)
    inter = sent * (ep - local) / ep / (gpu.network_gb_s * 1e9 * COLLECTIVE_EFF)
    return max(intra, inter) + copy


def dp_link_bytes_s(gpu: GPU, gpus: int) -> float:
    """Achieved bytes/s of a data-parallel collective over `gpus` ranks: NVLink inside one domain, else the network."""
    return (gpu.nvlink_gb_s if gpus <= gpu.nvlink_domain else gpu.network_gb_s) * 1e9 * COLLECTIVE_EFF


def cp_gather_s_per_token(spec, gpu: GPU, tp: int, cp: int) -> float:
    """Seconds per token of a replica for one pass's K/V all-gathers over the CP group (every layer; module doc): each
    rank receives the other ranks' (cp-1)/cp of the row's K and V (bf16), split over its TP ranks by KV head."""
    if cp == 1:
        return 0.0
    a = arch_of(spec)
    per_token = a.layers * a.kv_bytes / min(tp, a.kv_splits) * (cp - 1) / cp
    return per_token / dp_link_bytes_s(gpu, tp * cp)


def train_side_times(spec, gpu: GPU, tp: int, pp: int, dp: int, recompute: bool, wl: Workload,
                     ep: int = 1, collectives: bool = True, cp: int = 1) -> dict:
    """Logprob and train seconds of one step; `collectives=False` leaves out the distributed optimizer's (the FSDP2
    backend, planner/fsdp2_cost.py, prices its own). `micro`: micro-batches per optimizer step of one replica."""
    a = arch_of(spec)
    group_tokens = math.ceil(wl.samples / dp) * wl.mean_len  # one DP replica's share; idle replicas wait
    dense_rate = tp * gpu.bf16_tflops * 1e12 * _mfu(a.hidden, tp)
    expert_rate = tp * gpu.bf16_tflops * 1e12 * MOE_MFU * TP_EFF[tp]
    a2a = dispatch_s_per_token_layer(a, gpu, tp, ep)
    # seconds per token of one forward on each stage; a pipeline runs at the pace of its slowest stage
    stages = [d / dense_rate + e / expert_rate + m * a2a for d, e, m in stage_fwd_flops(a, pp, wl.mean_len)]
    # CP ranks share a replica's tokens; each pass adds its K/V all-gathers (a stage holds layers/pp of them)
    gather = cp_gather_s_per_token(a, gpu, tp, cp) / pp
    stages = [s / cp for s in stages]
    fwd = max(stages)
    micro = max(1, math.ceil(group_tokens / wl.optimizer_steps / (wl.rank_tokens(cp) * cp)))
    bubble = 1.0 + (pp - 1) / micro
    # the gathers: forward, backward (gradients summed back), and the recompute's forward again
    train = group_tokens * (fwd * (4 if recompute else 3) + gather * (3 if recompute else 2)) * bubble
    if dp * cp > 1 and collectives:  # distributed optimizer: fp32 grad reduce-scatter + bf16 param all-gather, once
        dense, expert = max(stage_param_split(a, tp, pp, ep), key=sum)  # per optimizer step, over DP x CP
        mdp, edp = dp * cp, dp * cp // ep
        moved = 6.0 * (dense * (mdp - 1) / mdp + expert * (edp - 1) / edp)
        train += wl.optimizer_steps * moved / dp_link_bytes_s(gpu, tp * pp * mdp)
    logprobs = wl.logprob_passes * group_tokens * (fwd + gather) * bubble
    balance = sum(stages) / (pp * fwd)
    return {"logprobs": logprobs, "train": train, "bubble": bubble - 1.0, "balance": balance, "micro": micro}


def tp_allreduce_s(nbytes: float, n: int, gpu: GPU) -> float:
    """One all-reduce of `nbytes` over a vLLM engine's `n` tensor-parallel ranks: vLLM's custom all-reduce inside an
    NVLink domain, NCCL's tree/LL latency across nodes (constants and sources above), plus the ring's bytes."""
    if n == 1:
        return 0.0
    ring = 2 * (n - 1) / n * nbytes
    if n <= gpu.nvlink_domain:
        return AR_NVLINK_LATENCY_S + ring / (gpu.nvlink_gb_s * 1e9 * AR_NVLINK_EFF)
    nodes = math.ceil(n / gpu.nvlink_domain)
    hops = (n // nodes - 1) * NCCL_LL_NVLINK_HOP_S + math.ceil(math.log2(nodes)) * NCCL_LL_NET_HOP_S
    return NCCL_TREE_LL_BASE_S + 2 * hops + ring / (gpu.network_gb_s * 1e9 * COLLECTIVE_EFF)


def generation_time(spec, gpu: GPU, gen_tp: int, instances: int, kv_tokens: int, wl: Workload) -> dict:
    a = arch_of(spec)
    seqs = math.ceil(wl.samples / instances)
    cap = MAX_NUM_SEQS if gpu.memory_gib >= 70 and "A100" not in gpu.name else 256
    conc = max(1, min(seqs, cap, kv_tokens // max(wl.mean_len, 1)))
    kv_gpu = kv_bytes_per_token(a) / min(gen_tp, a.kv_splits)  # vLLM replicates KV heads past kv_heads
    bw = gpu.hbm_tb_s * 1e12 * DECODE_BW_EFF
    fwd = fwd_flops_per_token(a, wl.mean_len)
    launch = a.layers * EAGER_LAUNCH_S_PER_LAYER if wl.enforce_eager else 0.0  # a floor on the GPU work

    def tp_allreduce(batch: int) -> float:  # two per layer (attention, MLP) of the step's hidden states
        return 2 * a.layers * tp_allreduce_s(batch * a.hidden * 2.0, gen_tp, gpu)

    resp_mean = max(1, wl.mean_len - wl.prompt_len)
    resp_max = max(resp_mean, wl.seq_len - wl.prompt_len)
    live_ctx = wl.prompt_len + resp_mean / 2
    full_steps = math.ceil(seqs * resp_mean / conc)
    # an MoE step reads the experts its batch picked: nearly all of them at a full batch, top-k per layer in the tail
    t_full = max((decode_weight_bytes(a, gen_tp, conc) + conc * live_ctx * kv_gpu) / bw,
                 conc * fwd / (gen_tp * gpu.bf16_tflops * 1e12 * PREFILL_MFU), launch) \
        + DECODE_STEP_OVERHEAD_S + tp_allreduce(conc)
    tail_steps = max(0, resp_max - full_steps)
    tail_read = decode_weight_bytes(a, gen_tp, 1) + live_ctx * kv_gpu
    t_tail = max(tail_read / bw, launch) + DECODE_STEP_OVERHEAD_S + tp_allreduce(1)
    prefill = seqs * wl.prompt_len * fwd / (gen_tp * gpu.bf16_tflops * 1e12 * PREFILL_MFU)
    total = prefill + full_steps * t_full + tail_steps * t_tail
    return {"generate": total, "concurrency": conc, "seqs": seqs,
            "tail_share": tail_steps * t_tail / max(total, 1e-9), "launch_bound": launch > tail_read / bw}


# ---------------------------------------------------------------------------------------------------------------
# one layout
# ---------------------------------------------------------------------------------------------------------------

def _straddles(first: int, n: int, tp: int, domain: int) -> bool:
    """Whether TP groups of `tp` GPUs, laid out from GPU `first` over `n` GPUs, cross a multiple of `domain`. With
    `domain` a multiple of `tp` (true for TP 1/2/4/8 and domains of 8 or 72), groups aligned to `tp` never do, and
    misaligned ones do exactly when a domain boundary falls inside the range."""
    if first % tp == 0:
        return False
    return (first // domain + 1) * domain < first + n


def layout_problem(spec, *, tp: int, pp: int, dp: int, gen_tp: int, gen_gpus: int, colocated: bool,
                   max_staleness: int = 0, domain: int = 0, ep: int = 1, cp: int = 1) -> str | None:
    """Why the runtime would refuse this layout (the loader's and build()'s own rules), or why the planner does
    (TP across NVLink `domain`s, when given), or None."""
    if gen_gpus % gen_tp:
        return f"{gen_gpus} generation GPUs do not split into vLLM-TP={gen_tp} instances"
    train_gpus = tp * pp * cp * dp
    if domain and not colocated and _straddles(train_gpus, gen_gpus, gen_tp, domain):
        # the planner's own rule (the runtime would run it, slowly): engines take the GPUs after the trainer's
        return f"a vLLM-TP={gen_tp} engine would span two NVLink domains of {domain} GPUs"
    a = arch_of(spec)
    try:
        # plan-only architectures with an uneven layer split (megatron's first/last-stage option) skip the
        # runtime's uniform-split rule for the planner's own
        check_policy_split(tp=tp, pp=pp, heads=a.heads, kv_heads=a.kv_heads, layers=None if a.uneven_pp else a.layers,
                           ffn=a.ffn)
        check_expert_split(ep=ep, tp=tp, num_experts=a.experts or None)
        check_engine_split(tp=gen_tp, heads=a.heads, kv_heads=a.kv_heads)
        device_layout(devices=train_gpus if colocated else train_gpus + gen_gpus, tp=tp, pp=pp, dp=dp,
                      colocated=colocated, gen_tp=gen_tp, gen_dp=gen_gpus // gen_tp, max_staleness=max_staleness,
                      ep=ep, cp=cp)
    except ValueError as e:
        return str(e)
    return pp_problem(a, pp)


def evaluate(spec, gpu: GPU, wl: Workload, *, tp: int, pp: int, dp: int, gen_tp: int, gen_gpus: int,
             recompute: bool, colocated: bool, max_staleness: int = 0, ep: int = 1, cp: int = 1) -> Plan | str:
    """A Plan when the layout fits, else a string saying what does not fit (or which runtime rule refuses it)."""
    spec = arch_of(spec)  # once: every model function below takes the Arch as it is
    refused = layout_problem(spec, tp=tp, pp=pp, dp=dp, gen_tp=gen_tp, gen_gpus=gen_gpus, colocated=colocated,
                             max_staleness=max_staleness, domain=gpu.nvlink_domain, ep=ep, cp=cp)
    if refused:
        return f"refused: {refused}"
    train_gpus = tp * pp * cp * dp
    usable = usable_bytes(gpu)
    mem, static = train_memory(spec, tp, pp, dp, recompute, wl, ep, cp)
    train_peak = sum(mem.values()) * GiB
    if train_peak > usable:
        return f"training needs {train_peak / GiB:.1f} GiB per GPU (usable {usable / GiB:.1f})"
    vllm_w = vllm_weight_bytes(spec, gen_tp)
    # colocated: the trainer's whole state leaves the device while vLLM runs (weights and optimizer state to the
    # host, the gradient buffers released: policy/residency.py), so generation has the device to itself
    resident = 0.0
    # reported, not (yet) refused: the refit buffer holds the whole model until the engine has loaded it, which
    # large models do not fit beside the weights (docs/gpu.md, the memory plan); `search._report` says so
    handover = handover_memory(mem, vllm_w, vllm_weight_bytes(spec, 1), colocated) if colocated else {}
    free = usable - vllm_w - resident
    if wl.gpu_memory_utilization is not None:  # a fixed vLLM budget: the KV cache gets what the weights leave of it
        free = min(free, wl.gpu_memory_utilization * gpu.memory_gib * GiB - vllm_w)
    kv_gpu = kv_bytes_per_token(spec) / min(gen_tp, arch_of(spec).kv_splits)
    kv_tokens = int(max(free, 0) / kv_gpu)
    if kv_tokens < wl.seq_len:
        return (f"generation: {gen_tp}-GPU vLLM instances keep {vllm_w / GiB:.1f} GiB of weights"
                + (f" next to the trainer's {resident / GiB:.1f} GiB of gradients" if colocated else "")
                + f"; the KV cache holds {kv_tokens} tokens < one {wl.seq_len}-token sequence")
    gen = generation_time(spec, gpu, gen_tp, gen_gpus // gen_tp, kv_tokens, wl)
    side = train_side_times(spec, gpu, tp, pp, dp, recompute, wl, ep, cp=cp)
    if colocated:
        # each GPU's vLLM shard comes from the trainer ranks that hold one copy of the model (tp * pp * ep of them):
        # over NVLink when they share a node, else (a pipeline or EP group across nodes) over the network
        one_copy_local = tp * pp * ep <= gpu.nvlink_domain
        link = gpu.nvlink_gb_s * 1e9 * 0.5 if one_copy_local else gpu.network_gb_s * 1e9 * COLLECTIVE_EFF
        refit = vllm_w / link + 0.5
        # both sides' weights (and the trainer's optimizer state) go to the host and back every step
        moved = (static - resident) + vllm_w
        switch = 2 * moved / (PCIE_GB_S * 1e9)
    else:
        refit = vllm_w / (gpu.network_gb_s * 1e9 * COLLECTIVE_EFF) + 0.5
        switch = 0.0
    times = {"generate": gen["generate"], "logprobs": side["logprobs"], "train": side["train"], "refit": refit,
             "switch": switch}
    step = step_time(times, max_staleness=max_staleness)
    kv_bytes = kv_tokens * kv_gpu
    p = Plan(tp, pp, dp, gen_tp, train_gpus, gen_gpus, recompute, colocated, max_staleness=max_staleness, ep=ep, cp=cp,
             memory_gib=mem, train_peak_gib=train_peak / GiB, gen_peak_gib=(resident + vllm_w + kv_bytes) / GiB,
             kv_gib=kv_bytes / GiB, kv_tokens=kv_tokens, concurrency=gen["concurrency"], seqs_per_instance=gen["seqs"],
             times_s=times, step_s=step, eager_decode=wl.enforce_eager, vllm_gib=(vllm_w + kv_bytes) / GiB,
             handover_gib={**handover, "generate": (vllm_w + kv_bytes) / GiB} if colocated else {},
             fixed_peaks_gib={} if colocated else fixed_peaks.disaggregated_refit(static, vllm_w, kv_bytes))
    p.tokens_per_s_per_gpu = wl.samples * wl.mean_len / step / p.total_gpus
    p.bound = _bound(p, gen, side, usable)
    return p


def _bound(p: Plan, gen: dict, side: dict, usable: float) -> str:
    t = p.times_s
    if p.max_staleness > 0:  # the overlapped sides: the slower one sets the step
        phase = "generate" if t["generate"] >= t["logprobs"] + t["train"] else max(("logprobs", "train"),
                                                                                  key=t.__getitem__)
    else:
        phase = max(("generate", "logprobs", "train"), key=t.__getitem__)
    if phase == "generate":
        if gen["tail_share"] > 0.5:
            why = "decode tail (longest response)"
        elif p.concurrency < p.seqs_per_instance:
            why = f"decode, KV cache ({p.concurrency}/{p.seqs_per_instance} seqs at once)"
        else:
            why = "decode, HBM bandwidth"
        if gen["launch_bound"]:
            why += ", eager kernel launches"
    elif side["bubble"] > 0.15:
        why = f"{phase}, pipeline bubble {side['bubble']:.0%}"
    elif side["balance"] < 0.8:
        why = f"{phase}, last pipeline stage ({side['balance']:.0%} balanced)"
    else:
        why = f"{phase}, compute"
    if p.max_staleness > 0:
        hidden = min(t["generate"], t["logprobs"] + t["train"])
        why += f" (async hides {hidden:.0f} s)"
    if p.train_peak_gib * GiB > 0.9 * usable:
        why += f"; memory {p.train_peak_gib * GiB / usable:.0%}"
    return why
