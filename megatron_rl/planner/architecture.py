"""The planner's view of an architecture: parameters per rank (memory), per token (FLOPs), activation and KV bytes.

`arch_of(spec)` reads a `ModelSpec` (dense Llama/Qwen/Mistral, and the MoE models the trainer builds: Qwen3-MoE,
Mixtral); `deepseek_v3_arch(hf_config)` reads a DeepSeek-V3 config.json (planning only: the trainer cannot build it).

Mixture of experts:
  memory counts every parameter. Expert weights are sharded over expert parallelism (whole experts, E/ep per rank)
  and inside an expert over TP (megatron-core's default expert_tensor_parallel_size = TP); everything else (attention,
  router, shared experts, norms, embeddings) is split over TP/PP as in a dense model and replicated over DP. The
  distributed optimizer shards dense state over DP and expert state over the expert-data-parallel group (dp/ep).
  compute counts the active parameters: attention + router + shared experts + the top-k routed experts per token.
DeepSeek-V3 approximations (planning only): MLA is counted by its real weights (down-projections replicated over
  TP, as vLLM and megatron-core do) and its attention FLOPs per key (q.k over 192 dims, a.v over 128, per head); its KV
  cache is vLLM's compressed latent (512 + 64 rope dims per token and layer, the same on every TP rank); activations
  use q width = heads x 192 and kv width = heads x 160; the multi-token-prediction module (num_nextn_predict_layers,
  14B) is left out, as in the 671B the model card counts; the group-limited routing is costed like plain top-8.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Arch:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    vocab: int
    padded_vocab_multiple: int  # vocab rows are padded to a multiple of this x TP
    tied: bool
    attn: int  # attention weights per layer that TP splits (q, k, v, o projections and their biases)
    attn_rep: int  # attention weights per layer replicated over TP (q/k norms; MLA's down-projections and norms)
    score_width: int  # q.k and a.v widths summed over heads: forward attention FLOPs per token = score_width x context
    act_attn: int  # activation bytes per token of attention (q, k, v, o and their inputs), split over TP
    kv_bytes: int  # KV-cache bytes per token and layer (bf16)
    kv_splits: int  # at most this many generation-TP ranks split the KV cache (GQA: the KV heads; MLA latent: 1)
    ffn: int  # dense MLP width: every layer of a dense model, the first `dense_layers` layers of an MoE model
    dense_layers: int
    experts: int = 0  # routed experts per MoE layer (0: dense)
    topk: int = 0
    expert_ffn: int = 0
    shared_ffn: int = 0  # shared experts' width (DeepSeek: 1 x 2048), run by every token
    uneven_pp: bool = False  # pipeline stages may hold different layer counts (megatron's first/last-stage option)

    @property
    def moe(self) -> bool:
        return self.experts > 0

    def padded_vocab_for(self, tp: int) -> int:
        m = self.padded_vocab_multiple * tp
        return int(math.ceil(self.vocab / m) * m)

    def is_moe_layer(self, i: int) -> bool:
        return self.moe and i >= self.dense_layers


def arch_of(spec) -> Arch:
    """The planner's view of a ModelSpec (an `Arch` passes through)."""
    if isinstance(spec, Arch):
        return spec
    from megatron_rl.models.provider import VOCAB_PAD_MULTIPLE

    hd = spec.head_dim
    q, kv = spec.num_heads * hd, spec.num_kv_heads * hd
    qkv = q + 2 * kv
    moe = spec.moe
    return Arch(
        layers=spec.num_layers, hidden=spec.hidden_size, heads=spec.num_heads, kv_heads=spec.num_kv_heads,
        vocab=spec.vocab_size, padded_vocab_multiple=VOCAB_PAD_MULTIPLE, tied=spec.tied_embeddings,
        attn=spec.hidden_size * qkv + q * spec.hidden_size + (qkv if spec.qkv_bias else 0),
        attn_rep=2 * hd if spec.qk_norm else 0, score_width=2 * q, act_attn=4 * q + 4 * kv, kv_bytes=2 * kv * 2,
        kv_splits=spec.num_kv_heads, ffn=spec.ffn_hidden_size, dense_layers=0 if moe else spec.num_layers,
        experts=moe.num_experts if moe else 0, topk=moe.topk if moe else 0,
        expert_ffn=moe.ffn_hidden_size if moe else 0)


def deepseek_v3_arch(cfg: dict) -> Arch:
    """DeepSeek-V3 (MLA, shared + routed experts, first k layers dense) from its config.json fields."""
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    ql, kvl = cfg["q_lora_rank"], cfg["kv_lora_rank"]
    nope, rope, v = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    qk = nope + rope
    return Arch(
        layers=cfg["num_hidden_layers"], hidden=h, heads=heads, kv_heads=cfg["num_key_value_heads"],
        vocab=cfg["vocab_size"], padded_vocab_multiple=128, tied=bool(cfg.get("tie_word_embeddings", False)),
        # q_b_proj, kv_b_proj (k_nope and v of every head) and o_proj split over TP
        attn=ql * heads * qk + kvl * heads * (nope + v) + heads * v * h,
        # q_a_proj + its norm, kv_a_proj_with_mqa (latent + shared rope key) + its norm
        attn_rep=h * ql + ql + h * (kvl + rope) + kvl,
        score_width=heads * (qk + v), act_attn=4 * heads * qk + 4 * heads * (qk + v) // 2,
        kv_bytes=(kvl + rope) * 2, kv_splits=1, ffn=cfg["intermediate_size"],
        dense_layers=cfg["first_k_dense_replace"], experts=cfg["n_routed_experts"], topk=cfg["num_experts_per_tok"],
        expert_ffn=cfg["moe_intermediate_size"], shared_ffn=cfg["n_shared_experts"] * cfg["moe_intermediate_size"],
        uneven_pp=True)


# ---------------------------------------------------------------------------------------------------------------
# parameters
# ---------------------------------------------------------------------------------------------------------------

def _router(a: Arch) -> int:
    return a.hidden * a.experts  # DeepSeek's e_score_correction_bias is a buffer (transformers, megatron), not a weight


def dense_layer_params(a: Arch, i: int, tp: int = 1) -> int:
    """Layer i's non-expert parameters on a TP rank: split matrices /tp; norms, q/k norms and the router replicated."""
    if a.is_moe_layer(i):
        mlp = 3 * a.hidden * a.shared_ffn // tp + _router(a)
    else:
        mlp = 3 * a.hidden * a.ffn // tp
    return a.attn // tp + a.attn_rep + 2 * a.hidden + mlp


def expert_layer_params(a: Arch, i: int, tp: int = 1, ep: int = 1) -> int:
    """Layer i's routed-expert parameters on one rank: experts / ep of them, each split over TP."""
    return a.experts // ep * (3 * a.hidden * a.expert_ffn // tp) if a.is_moe_layer(i) else 0


def stage_layers(a: Arch, pp: int) -> list[int]:
    """Layers per pipeline stage: uniform; for `uneven_pp` architectures megatron's num_layers_in_first/last_pipeline
    _stage split, middle stages ceil(L/pp) and the remainder shared by the first and last (the first taking more,
    since the last also runs the output layer): DeepSeek-V3's 61 over 16 stages are 3, 4 x 14, 2, NeMo-RL's split."""
    if pp == 1 or a.layers % pp == 0 or not a.uneven_pp:
        return [a.layers // pp] * pp
    mid = math.ceil(a.layers / pp)
    rest = a.layers - mid * (pp - 2)
    first = math.ceil(rest / 2)
    return [first] + [mid] * (pp - 2) + [rest - first]


def pp_problem(a: Arch, pp: int) -> str | None:
    """Why the planner cannot split this architecture's layers over pp stages (None: it can)."""
    if pp > a.layers:
        return f"pp={pp} exceeds num_hidden_layers={a.layers}"
    if a.uneven_pp:
        return None if min(stage_layers(a, pp)) >= 1 else f"pp={pp} leaves a pipeline stage without layers"
    return None if a.layers % pp == 0 else f"policy.pp={pp} does not divide num_hidden_layers={a.layers}"


# The search evaluates ~1,500 layouts per request, each summing over every layer: the per-layer sums below are
# memoised on the (frozen, hashable) Arch, which took `plan` for a 64-layer model at 4,096 GPUs from 0.7 s to 0.1 s.
@functools.lru_cache(maxsize=4096)
def stage_param_split(a: Arch, tp: int = 1, pp: int = 1, ep: int = 1) -> tuple[tuple[int, int], ...]:
    """(non-expert, expert) parameters held by one rank of each pipeline stage, as megatron-core allocates them."""
    vocab = a.padded_vocab_for(tp) * a.hidden // tp
    out, start = [], 0
    for n in stage_layers(a, pp):
        layers = range(start, start + n)
        out.append([sum(dense_layer_params(a, i, tp) for i in layers),
                    sum(expert_layer_params(a, i, tp, ep) for i in layers)])
        start += n
    out[0][0] += vocab  # input embedding
    out[-1][0] += a.hidden  # final norm
    if not a.tied or pp > 1:  # tied + PP>1: the last stage keeps its own copy of the embedding
        out[-1][0] += vocab
    return tuple((d, e) for d, e in out)


def total_params(a: Arch) -> int:
    """Every parameter of the model (unpadded vocab)."""
    body = sum(dense_layer_params(a, i) + expert_layer_params(a, i) for i in range(a.layers))
    return body + a.vocab * a.hidden * (1 if a.tied else 2) + a.hidden


def active_params(a: Arch) -> int:
    """Parameters one token passes through (unpadded vocab, embeddings included): the model card's "active"."""
    idle = sum(a.experts - a.topk for i in range(a.layers) if a.is_moe_layer(i))
    return total_params(a) - idle * 3 * a.hidden * a.expert_ffn


def layer_matmul_params(a: Arch, i: int) -> int:
    """Layer i's weights that cost 2 FLOPs per token forward: all of a dense layer, the top-k experts of an MoE one."""
    active_experts = a.topk * 3 * a.hidden * a.expert_ffn if a.is_moe_layer(i) else 0
    return dense_layer_params(a, i) + active_experts


def matmul_params(spec) -> int:
    """Parameters that cost FLOPs per token: the layers' active weights and the output projection (the embedding is a
    lookup)."""
    return _matmul_params(arch_of(spec))


@functools.lru_cache(maxsize=256)
def _matmul_params(a: Arch) -> int:
    return sum(layer_matmul_params(a, i) for i in range(a.layers)) + a.vocab * a.hidden


def expert_matmul_params(a: Arch, i: int) -> int:
    """The part of layer_matmul_params run as routed-expert GEMMs (behind the token dispatch)."""
    return a.topk * 3 * a.hidden * a.expert_ffn if a.is_moe_layer(i) else 0


# ---------------------------------------------------------------------------------------------------------------
# activations, KV cache
# ---------------------------------------------------------------------------------------------------------------

def act_bytes_per_token_layer(a: Arch, i: int, tp: int = 1, sequence_parallel: bool = False) -> float:
    """Bytes layer i keeps per token for its backward on a TP rank (bf16, flash attention, SwiGLU). An MoE layer
    keeps each of its top-k expert inputs and SwiGLU activations, and the dispatched copies of the token (2 x top-k
    x hidden, permuted and unpermuted)."""
    hidden = 8 * a.hidden / (tp if sequence_parallel else 1)  # norm inputs and outputs
    if a.is_moe_layer(i):
        mlp = 6 * (a.topk * a.expert_ffn + a.shared_ffn) / tp + 4 * a.topk * a.hidden
    else:
        mlp = 6 * a.ffn / tp
    return hidden + a.act_attn / tp + mlp


def kv_bytes_per_token(spec) -> int:
    a = arch_of(spec)
    return a.layers * a.kv_bytes


def vllm_weight_bytes(spec, gen_tp: int) -> float:
    """bf16 weights of one vLLM rank: every layer (all experts) split over gen-TP, embedding and output layer too."""
    return _vllm_weight_bytes(arch_of(spec), gen_tp)


@functools.lru_cache(maxsize=1024)
def _vllm_weight_bytes(a: Arch, gen_tp: int) -> float:
    body = sum(dense_layer_params(a, i, gen_tp) + expert_layer_params(a, i, gen_tp) for i in range(a.layers))
    vocab = a.vocab * a.hidden * (1 if a.tied else 2)
    return 2.0 * (body + vocab / gen_tp + a.hidden)


def decode_weight_bytes(a: Arch, gen_tp: int, tokens: int) -> float:
    """bf16 weights one vLLM rank reads per decode step of `tokens` sequences: the dense part, and of each MoE layer
    the experts at least one token picked, E x (1 - (1 - k/E)^tokens) expected under uniform routing."""
    dense, moe_layers = _decode_dense_params(a, gen_tp)
    touched = a.experts * (1 - (1 - a.topk / a.experts) ** tokens) if a.moe else 0.0
    return 2.0 * (dense + moe_layers * touched * 3 * a.hidden * a.expert_ffn / gen_tp)


@functools.lru_cache(maxsize=1024)
def _decode_dense_params(a: Arch, gen_tp: int) -> tuple[float, int]:
    """(non-expert weights of one vLLM rank, embedding row block included; the number of MoE layers)."""
    dense = sum(dense_layer_params(a, i, gen_tp) for i in range(a.layers)) + a.vocab * a.hidden / gen_tp
    return dense, sum(1 for i in range(a.layers) if a.is_moe_layer(i))
