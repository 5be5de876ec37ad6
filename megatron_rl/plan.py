"""`megatron-rl plan`: choose TP/PP/DP (and the vLLM layout) for a model, a GPU count and a GRPO workload.

    megatron-rl plan --model NAME_OR_HF_CONFIG --gpus N [--gpu h100|h200|a100|gb200] [--seq-len L] [--colocated]

For every candidate layout it estimates memory per GPU and the time of one synchronous GRPO step, keeps what fits and
prints the fastest few with the constraint that binds. Planning is arithmetic only (well under a second).

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
  moves cross PCIe every step (25 GB/s assumed).
  reserve: 2.5 GiB + 5% per GPU for the CUDA context, NCCL buffers and allocator fragmentation.
Step time = generate + logprobs + train + refit + switch (colocated: those host <-> GPU moves):
  train 6 * params * tokens (8 with recompute) + causal attention FLOPs, at an assumed MFU, paced by the slowest
  pipeline stage (the last one also runs the output layer), slowed by the bubble (PP-1)/micro-batches and the
  distributed optimizer's gradient reduce-scatter and parameter all-gather;
  logprobs 2 * params * tokens per pass (previous policy; +1 with a KL reference);
  decode is HBM-bandwidth bound: every step reads the instance's weights and its live KV cache, with concurrency
  limited by the KV cache and vLLM's max_num_seqs; the step also lasts as long as its longest response (some GRPO
  samples always run to the limit), so the tail runs at small batch. Decode runs as CUDA graphs unless
  `--enforce-eager` (generation.enforce_eager; the default is the config's): eager, the CPU launches every layer's
  kernels one by one each step, and a step cannot be shorter than that.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from megatron_rl.config.schema import GenerationConfig
from megatron_rl.plan_presets import GPU, GPUS, MODELS, PLAN_ONLY

GiB = 2**30
MFU = 0.40  # achieved/peak bf16 for Megatron dense training and forward passes at h >= 4096 (RL packing included)
PREFILL_MFU = 0.50
DECODE_BW_EFF = 0.70  # fraction of HBM bandwidth a decode step reaches
DECODE_STEP_OVERHEAD_S = 3e-3  # scheduler + kernel launches per decode step (vLLM V1, CUDA graphs)
# eager decode: the CPU issues each layer's ~12 kernels (norms, GEMMs, rotary, attention, activation) through Python,
# ~15 us each; it runs ahead of the GPU, so it only costs time when the GPU work per step is shorter
EAGER_LAUNCH_S_PER_LAYER = 2e-4
MAX_NUM_SEQS = 1024  # vLLM's default concurrency cap on >= 70 GiB GPUs other than A100 (256 there)
PCIE_GB_S = 25.0
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
    mb_tokens: int | None = None  # tokens per training micro-batch (default: seq_len)
    optimizer_steps: int = 1  # optimizer steps per rollout batch
    logprob_passes: int = 1  # previous-policy logprobs; 2 with a KL reference model
    distributed_optimizer: bool = True
    enforce_eager: bool = GenerationConfig.enforce_eager  # vLLM decode without CUDA graphs; the config's default

    @property
    def mean_len(self) -> int:
        return self.avg_len or self.seq_len // 2

    @property
    def micro_tokens(self) -> int:
        return max(self.mb_tokens or self.seq_len, self.seq_len)


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
    memory_gib: dict = field(default_factory=dict)  # training-phase breakdown of the fullest stage
    train_peak_gib: float = 0.0
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


# ---------------------------------------------------------------------------------------------------------------
# architecture arithmetic
# ---------------------------------------------------------------------------------------------------------------

def _widths(spec) -> tuple[int, int]:
    return spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim


def layer_params(spec, tp: int = 1) -> int:
    """One decoder layer's parameters on a TP rank: split matrices /tp, norms replicated."""
    h, f = spec.hidden_size, spec.ffn_hidden_size
    q, kv = _widths(spec)
    qkv = q + 2 * kv
    split = h * qkv + q * h + 3 * h * f + (qkv if spec.qkv_bias else 0)
    return split // tp + 2 * h


def stage_params(spec, tp: int = 1, pp: int = 1) -> list[int]:
    """Parameters held by one rank of each pipeline stage, as megatron-core allocates them."""
    h = spec.hidden_size
    vocab = spec.padded_vocab_for(tp) * h // tp
    per_stage = spec.num_layers // pp * layer_params(spec, tp)
    stages = [per_stage] * pp
    stages[0] += vocab  # input embedding
    stages[-1] += h  # final norm
    if not spec.tied_embeddings or pp > 1:  # tied + PP>1: the last stage keeps its own copy of the embedding
        stages[-1] += vocab
    return stages


def matmul_params(spec) -> int:
    """Parameters that cost FLOPs per token: the layers and the output projection (the embedding is a lookup)."""
    return spec.num_layers * layer_params(spec) + spec.vocab_size * spec.hidden_size


def act_bytes_per_token_layer(spec, tp: int = 1) -> float:
    """Bytes one layer keeps per token for its backward on a TP rank (bf16, flash attention, SwiGLU)."""
    q, kv = _widths(spec)
    hidden = 8 * spec.hidden_size  # norm inputs and outputs: split over TP only with sequence parallelism
    return hidden / (tp if SEQUENCE_PARALLEL else 1) + (4 * q + 4 * kv + 6 * spec.ffn_hidden_size) / tp


def kv_bytes_per_token(spec) -> int:
    return 2 * spec.num_layers * _widths(spec)[1] * 2  # K and V, bf16


def vllm_weight_bytes(spec, gen_tp: int) -> float:
    """bf16 weights of one vLLM rank: layers split over gen-TP, embedding and (untied) output layer too."""
    vocab = spec.vocab_size * spec.hidden_size * (1 if spec.tied_embeddings else 2)
    return 2.0 * (spec.num_layers * layer_params(spec, gen_tp) + vocab / gen_tp + spec.hidden_size)


def fwd_flops_per_token(spec, avg_len: int) -> float:
    # 2 FLOPs per weight, plus causal attention: QK^T and AV over avg_len/2 keys on average
    return 2.0 * matmul_params(spec) + 2.0 * spec.num_layers * _widths(spec)[0] * avg_len


# ---------------------------------------------------------------------------------------------------------------
# memory
# ---------------------------------------------------------------------------------------------------------------

def usable_bytes(gpu: GPU) -> float:
    return gpu.memory_gib * GiB * 0.95 - 2.5 * GiB


def train_memory(spec, tp: int, pp: int, dp: int, recompute: bool, wl: Workload) -> tuple[dict, float]:
    """(breakdown of the fullest stage in GiB, static bytes of that rank kept across phases)."""
    t = wl.micro_tokens
    per_layer = t * act_bytes_per_token_layer(spec, tp)
    # full recompute keeps only each layer's input (split over TP only with sequence parallelism)
    kept = t * 2 * spec.hidden_size / (tp if SEQUENCE_PARALLEL else 1) if recompute else per_layer
    layers = spec.num_layers // pp
    logits = 4.0 * t * spec.padded_vocab_for(tp) / tp  # bf16 logits + their gradient
    best = None
    for i, n in enumerate(stage_params(spec, tp, pp)):
        opt = 12.0 * n / (dp if wl.distributed_optimizer else 1)
        # 1F1B: stage i has PP - i micro-batches in flight; recompute rebuilds one layer at a time in backward
        act = (pp - i) * layers * kept + (per_layer if recompute else 0.0)
        parts = {"weights": 2.0 * n, "grads": 4.0 * n, "optimizer": opt, "activations": act,
                 "logits": logits if i == pp - 1 else 0.0}
        if best is None or sum(parts.values()) > sum(best.values()):
            best = parts
    static = best["weights"] + best["grads"] + best["optimizer"]
    return {k: v / GiB for k, v in best.items()}, static


# ---------------------------------------------------------------------------------------------------------------
# time
# ---------------------------------------------------------------------------------------------------------------

def _mfu(spec, tp: int) -> float:
    # narrow models run smaller GEMMs at lower efficiency (a heuristic: 0.78x at h=1536, 1x from h=4096)
    return MFU * min(1.0, (spec.hidden_size / 4096) ** 0.25) * TP_EFF[tp]


def stage_fwd_flops(spec, pp: int, avg_len: int) -> float:
    """Forward FLOPs per token of the slowest pipeline stage (the last one also runs the output layer)."""
    h = spec.hidden_size
    layer = 2.0 * (layer_params(spec) - 2 * h) + 2.0 * _widths(spec)[0] * avg_len
    return spec.num_layers // pp * layer + 2.0 * spec.vocab_size * h


def train_side_times(spec, gpu: GPU, tp: int, pp: int, dp: int, recompute: bool, wl: Workload) -> dict:
    group_tokens = math.ceil(wl.samples / dp) * wl.mean_len  # one DP replica's share; idle replicas wait
    # a pipeline runs at the pace of its slowest stage: uniform layer split, output layer on the last stage
    fwd = stage_fwd_flops(spec, pp, wl.mean_len)
    rate = tp * gpu.bf16_tflops * 1e12 * _mfu(spec, tp)
    micro = max(1, math.ceil(group_tokens / wl.optimizer_steps / wl.micro_tokens))
    bubble = 1.0 + (pp - 1) / micro
    train = group_tokens * fwd * (4 if recompute else 3) / rate * bubble
    if dp > 1:  # distributed optimizer: fp32 grad reduce-scatter + bf16 param all-gather, once per optimizer step
        n = max(stage_params(spec, tp, pp))
        bw = gpu.nvlink_gb_s if tp * pp * dp <= gpu.nvlink_domain else gpu.network_gb_s
        train += wl.optimizer_steps * 6.0 * n * (dp - 1) / dp / (bw * 1e9 * 0.8)
    logprobs = wl.logprob_passes * group_tokens * fwd / rate * bubble
    balance = fwd_flops_per_token(spec, wl.mean_len) / (pp * fwd)
    return {"logprobs": logprobs, "train": train, "bubble": bubble - 1.0, "balance": balance}


def generation_time(spec, gpu: GPU, gen_tp: int, instances: int, kv_tokens: int, wl: Workload) -> dict:
    seqs = math.ceil(wl.samples / instances)
    cap = MAX_NUM_SEQS if gpu.memory_gib >= 70 and "A100" not in gpu.name else 256
    conc = max(1, min(seqs, cap, kv_tokens // max(wl.mean_len, 1)))
    weights = 2.0 * matmul_params(spec) / gen_tp  # bytes each GPU reads per decode step
    kv_gpu = kv_bytes_per_token(spec) / min(gen_tp, spec.num_kv_heads)  # vLLM replicates KV heads past kv_heads
    bw = gpu.hbm_tb_s * 1e12 * DECODE_BW_EFF
    fwd = fwd_flops_per_token(spec, wl.mean_len)
    overhead = DECODE_STEP_OVERHEAD_S + (2 * spec.num_layers * 8e-6 if gen_tp > 1 else 0.0)  # TP all-reduce latency
    launch = spec.num_layers * EAGER_LAUNCH_S_PER_LAYER if wl.enforce_eager else 0.0  # a floor on the GPU work
    resp_mean = max(1, wl.mean_len - wl.prompt_len)
    resp_max = max(resp_mean, wl.seq_len - wl.prompt_len)
    live_ctx = wl.prompt_len + resp_mean / 2
    full_steps = math.ceil(seqs * resp_mean / conc)
    t_full = max((weights + conc * live_ctx * kv_gpu) / bw,
                 conc * fwd / (gen_tp * gpu.bf16_tflops * 1e12 * PREFILL_MFU), launch) + overhead
    tail_steps = max(0, resp_max - full_steps)
    t_tail = max((weights + live_ctx * kv_gpu) / bw, launch) + overhead
    prefill = seqs * wl.prompt_len * fwd / (gen_tp * gpu.bf16_tflops * 1e12 * PREFILL_MFU)
    return {"generate": prefill + full_steps * t_full + tail_steps * t_tail, "concurrency": conc, "seqs": seqs,
            "tail_share": tail_steps * t_tail / max(prefill + full_steps * t_full + tail_steps * t_tail, 1e-9),
            "launch_bound": launch > (weights + live_ctx * kv_gpu) / bw}


# ---------------------------------------------------------------------------------------------------------------
# search
# ---------------------------------------------------------------------------------------------------------------

def _tp_options(spec, gpu: GPU, *, vllm: bool) -> list[int]:
    out = []
    for tp in (1, 2, 4, 8):
        if tp > gpu.nvlink_domain or spec.num_heads % tp:
            continue
        if vllm:  # vLLM splits KV heads or replicates them
            if spec.num_kv_heads % tp and tp % spec.num_kv_heads:
                continue
        elif spec.num_kv_heads % tp or spec.ffn_hidden_size % tp:  # megatron: num_query_groups % tp == 0
            continue
        out.append(tp)
    return out


def evaluate(spec, gpu: GPU, wl: Workload, *, tp: int, pp: int, dp: int, gen_tp: int, gen_gpus: int,
             recompute: bool, colocated: bool) -> Plan | str:
    """A Plan when the layout fits, else a string saying what does not fit."""
    train_gpus = tp * pp * dp
    usable = usable_bytes(gpu)
    mem, static = train_memory(spec, tp, pp, dp, recompute, wl)
    train_peak = sum(mem.values()) * GiB
    if train_peak > usable:
        return f"training needs {train_peak / GiB:.1f} GiB per GPU (usable {usable / GiB:.1f})"
    vllm_w = vllm_weight_bytes(spec, gen_tp)
    # colocated: PolicyWorker.offload moves weights and optimizer state to the host while vLLM runs; the fp32
    # gradient buffer stays
    resident = mem["grads"] * GiB if colocated else 0.0
    free = usable - vllm_w - resident
    kv_gpu = kv_bytes_per_token(spec) / min(gen_tp, spec.num_kv_heads)
    kv_tokens = int(max(free, 0) / kv_gpu)
    if kv_tokens < wl.seq_len:
        return (f"generation: {gen_tp}-GPU vLLM instances keep {vllm_w / GiB:.1f} GiB of weights"
                + (f" next to the trainer's {resident / GiB:.1f} GiB of gradients" if colocated else "")
                + f"; the KV cache holds {kv_tokens} tokens < one {wl.seq_len}-token sequence")
    gen = generation_time(spec, gpu, gen_tp, gen_gpus // gen_tp, kv_tokens, wl)
    side = train_side_times(spec, gpu, tp, pp, dp, recompute, wl)
    if colocated:
        refit = vllm_w / (gpu.nvlink_gb_s * 1e9 * 0.5) + 0.5
        # both sides' weights (and the trainer's optimizer state) go to the host and back every step
        moved = (static - resident) + vllm_w
        switch = 2 * moved / (PCIE_GB_S * 1e9)
    else:
        refit = vllm_w / (gpu.network_gb_s * 1e9 * 0.8) + 0.5
        switch = 0.0
    times = {"generate": gen["generate"], "logprobs": side["logprobs"], "train": side["train"], "refit": refit,
             "switch": switch}
    step = sum(times.values())
    total = train_gpus + (0 if colocated else gen_gpus)
    p = Plan(tp, pp, dp, gen_tp, train_gpus, gen_gpus, recompute, colocated, mem, train_peak / GiB,
             (resident + vllm_w + kv_tokens * kv_gpu) / GiB, kv_tokens * kv_gpu / GiB, kv_tokens, gen["concurrency"],
             gen["seqs"], times, step, wl.samples * wl.mean_len / step / total, eager_decode=wl.enforce_eager)
    p.bound = _bound(p, gen, side, usable)
    return p


def _bound(p: Plan, gen: dict, side: dict, usable: float) -> str:
    phase = max(("generate", "logprobs", "train"), key=lambda k: p.times_s[k])
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
    if p.train_peak_gib * GiB > 0.9 * usable:
        why += f"; memory {p.train_peak_gib * GiB / usable:.0%}"
    return why


def _fits(spec, gpus: int, gpu: GPU, wl: Workload, colocated: bool) -> bool:
    try:
        plan(spec, gpus, gpu, wl, colocated=colocated, top=1, _search_more=False)
        return True
    except Infeasible:
        return False


def plan(spec, gpus: int, gpu: GPU, wl: Workload, *, colocated: bool = True, top: int = 5,
         _search_more: bool = True) -> list[Plan]:
    """The `top` fastest layouts that fit, fastest first; raises Infeasible with the closest miss otherwise."""
    if gpus < 1:
        raise Infeasible("--gpus must be at least 1")
    if wl.seq_len <= wl.prompt_len or wl.mean_len > wl.seq_len or wl.mean_len <= wl.prompt_len:
        raise Infeasible(f"need prompt-len ({wl.prompt_len}) < avg-len ({wl.mean_len}) <= seq-len ({wl.seq_len})")
    splits = [(gpus, gpus)] if colocated else [(gpus - g, g) for g in sorted({gpus // 4, gpus // 2, 3 * gpus // 4})
                                               if 0 < g < gpus]
    if not splits:
        raise Infeasible("a disaggregated layout needs at least 2 GPUs (or use --colocated)")
    fits: list[Plan] = []
    misses: list[tuple[float, str]] = []
    pps = [p for p in range(1, spec.num_layers + 1) if spec.num_layers % p == 0]
    for train_gpus, gen_gpus in splits:
        for gen_tp in _tp_options(spec, gpu, vllm=True):
            if gen_gpus % gen_tp:
                continue
            for tp in _tp_options(spec, gpu, vllm=False):
                for pp in pps:
                    if train_gpus % (tp * pp):
                        continue
                    for recompute in (False, True):
                        r = evaluate(spec, gpu, wl, tp=tp, pp=pp, dp=train_gpus // (tp * pp), gen_tp=gen_tp,
                                     gen_gpus=gen_gpus, recompute=recompute, colocated=colocated)
                        if isinstance(r, Plan):
                            fits.append(r)
                        else:
                            where = f"tp={tp} pp={pp} dp={train_gpus // (tp * pp)} recompute={'on' if recompute else 'off'}"
                            if r.startswith("generation"):
                                where += f" vLLM-tp={gen_tp}"
                            misses.append((sum(train_memory(spec, tp, pp, train_gpus // (tp * pp), recompute,
                                                            wl)[0].values()), f"{where}: {r}"))
    if not fits:
        if not misses:
            raise Infeasible(f"no layout divides {gpus} GPUs for this model (TP must divide heads "
                             f"{spec.num_heads}, KV heads {spec.num_kv_heads} and ffn {spec.ffn_hidden_size})")
        msg = (f"does not fit on {gpus} x {gpu.name} ({gpu.memory_gib:.0f} GiB) at seq-len {wl.seq_len}; "
               f"closest: {min(misses)[1]}")
        if _search_more:
            more = next((n for n in (2 * gpus, 4 * gpus, 8 * gpus, 16 * gpus, 32 * gpus) if _fits(spec, n, gpu, wl,
                                                                                              colocated)), None)
            msg += f"; it fits from {more} GPUs" if more else "; it does not fit on 32x as many GPUs either"
        raise Infeasible(msg)
    fits.sort(key=lambda p: (p.step_s, p.train_peak_gib))
    return fits[:top]


# ---------------------------------------------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------------------------------------------

def resolve_model(name: str):
    """(label, ModelSpec, note) for a preset name or an HF config.json / model folder."""
    from megatron_rl.models.provider import ModelSpec, RopeSpec, model_spec

    key = name.lower()
    if key in MODELS:
        return key, model_spec(MODELS[key]), ""
    if key in PLAN_ONLY:
        fields = dict(PLAN_ONLY[key], norm_eps=1e-6, rope=RopeSpec(), dtype="bfloat16")
        return key, ModelSpec(**fields), f"{key}: planning only (the trainer does not build this architecture yet)"
    if Path(name).exists():
        return name, model_spec(name), ""
    raise Infeasible(f"unknown model {name!r}: give a path to an HF config.json (or its folder) or one of "
                     + ", ".join(sorted(MODELS) + sorted(PLAN_ONLY)))


def _table(plans: list[Plan]) -> str:
    head = ("#", "train TP/PP/DP", "recompute", "vLLM TP x n", "train GiB", "KV GiB", "seqs at once", "step s",
            "tok/s/GPU", "binding constraint")
    rows = [head]
    for i, p in enumerate(plans, 1):
        rows.append((str(i), f"{p.tp}/{p.pp}/{p.dp}", "on" if p.recompute else "off",
                     f"{p.gen_tp} x {p.gen_gpus // p.gen_tp}", f"{p.train_peak_gib:.1f}", f"{p.kv_gib:.1f}",
                     f"{p.concurrency}/{p.seqs_per_instance}", f"{p.step_s:.1f}", f"{p.tokens_per_s_per_gpu:,.0f}",
                     p.bound))
    widths = [max(len(r[c]) for r in rows) for c in range(len(head))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="megatron-rl plan", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="preset name or HF config.json / model folder")
    ap.add_argument("--gpus", type=int, required=True, help="GPUs in the job")
    ap.add_argument("--gpu", default="h100", choices=sorted(GPUS))
    ap.add_argument("--seq-len", type=int, default=8192, help="longest prompt + response (tokens)")
    ap.add_argument("--avg-len", type=int, default=None, help="mean prompt + response (default: seq-len / 2)")
    ap.add_argument("--prompt-len", type=int, default=256, help="mean prompt tokens")
    ap.add_argument("--samples", type=int, default=1024, help="sequences per step (prompts x generations)")
    ap.add_argument("--optimizer-steps", type=int, default=1, help="optimizer steps per rollout batch")
    ap.add_argument("--mb-tokens", type=int, default=None, help="tokens per training micro-batch (default seq-len)")
    ap.add_argument("--kl", action="store_true", help="a KL reference model: one more logprob pass")
    ap.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=GenerationConfig.enforce_eager,
                    help="vLLM decodes without CUDA graphs (generation.enforce_eager; default: %(default)s, as in "
                         "the config)")
    ap.add_argument("--colocated", action="store_true",
                    help="policy and vLLM share every GPU (default: split the GPUs between them)")
    ap.add_argument("--top", type=int, default=5)
    ap.add_argument("--json", action="store_true", help="print the plans as JSON")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    wl = Workload(samples=args.samples, seq_len=args.seq_len, avg_len=args.avg_len, prompt_len=args.prompt_len,
                  mb_tokens=args.mb_tokens, optimizer_steps=args.optimizer_steps,
                  logprob_passes=2 if args.kl else 1, enforce_eager=args.enforce_eager)
    gpu = GPUS[args.gpu]
    try:
        label, spec, note = resolve_model(args.model)
        plans = plan(spec, args.gpus, gpu, wl, colocated=args.colocated, top=args.top)
    except (Infeasible, ValueError, FileNotFoundError) as e:
        print(f"megatron-rl plan: refused: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps([asdict(p) for p in plans], indent=2))
        return 0
    mode = "colocated (policy + vLLM on every GPU)" if args.colocated else "disaggregated (GPUs split train | vLLM)"
    print(f"{label}: {spec.num_parameters() / 1e9:.2f}B parameters, {args.gpus} x {gpu.name}, {mode}")
    print(f"workload: {wl.samples} sequences/step, mean {wl.mean_len} tokens (prompt {wl.prompt_len}), "
          f"max {wl.seq_len}; {wl.logprob_passes} logprob pass(es); {wl.optimizer_steps} optimizer step(s)")
    launch_ms = spec.num_layers * EAGER_LAUNCH_S_PER_LAYER * 1e3
    decode = (f"eager (generation.enforce_eager: at least {launch_ms:.1f} ms of kernel launches per decode step)"
              if wl.enforce_eager else "CUDA graphs (generation.enforce_eager false)")
    print(f"decode: {decode}")
    if note:
        print(note)
    print(_table(plans))
    best = plans[0]
    print("best, memory of the fullest GPU (GiB): " + " + ".join(f"{k} {v:.1f}" for k, v in best.memory_gib.items())
          + f" = {best.train_peak_gib:.1f} of {usable_bytes(gpu) / GiB:.1f} usable")
    print("best, step time (s): " + " + ".join(f"{k} {v:.1f}" for k, v in best.times_s.items())
          + f" = {best.step_s:.1f}")
    if not args.colocated:
        print(f"  train on {best.train_gpus} GPUs, generate on {best.gen_gpus}")
    print("estimates: MFU 0.40, decode at 70% of HBM bandwidth; see `megatron-rl plan --help` for the model")
    return 0


if __name__ == "__main__":
    sys.exit(main())
