"""HF config.json → megatron-core `TransformerConfig` + `GPTModel` for the Llama family and its MoE variants.

Supported: Llama-2/3 (incl. llama3 RoPE scaling), SmolLM2, Mistral (optional sliding window), Qwen2/2.5 (QKV bias),
Qwen3 (per-head q/k RMSNorm → megatron's qk_layernorm), and the mixture-of-experts models Qwen3-MoE and Mixtral
(softmax top-k router, SwiGLU experts, no token dropping; experts sharded by global index over expert parallelism).
`ModelSpec` is the one summary of an architecture that the mapping, planner and policy worker read; `build_model`
makes the rank's `GPTModel` from it.

Vocabulary padding: the embedding and output layer are padded to a multiple of `128 * tp` rows (Megatron-LM's
convention) so that every TP rank holds an equal slice. The padded rows are zero on import, dropped on export, and
their logits are forced to a very negative finite value by a forward hook on `output_layer` (`_mask_padded_logits`
below), so they never take softmax mass: logprobs, cross-entropy and entropy over the padded vocabulary equal those
over the real one. A finite value (not -inf) keeps `p * logit` terms at 0 instead of NaN in entropy computations.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping

import torch

# architectures[0] → the model_type values we accept with it (a mismatch means a config we do not understand)
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": ("llama",),
    "MistralForCausalLM": ("mistral",),
    "Qwen2ForCausalLM": ("qwen2",),
    "Qwen3ForCausalLM": ("qwen3",),
    "Qwen3MoeForCausalLM": ("qwen3_moe",),
    "MixtralForCausalLM": ("mixtral",),
}
VOCAB_PAD_MULTIPLE = 128


class UnsupportedModelError(ValueError):
    """The HF config describes a model this provider cannot represent exactly."""


@dataclass(frozen=True)
class RopeSpec:
    theta: float = 10000.0
    type: str = "default"  # "default", "linear" or "llama3"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    rotary_percent: float = 1.0  # HF partial_rotary_factor


@dataclass(frozen=True)
class MoESpec:
    """The mixture-of-experts part of a model (every decoder layer is an MoE layer; no shared experts)."""
    num_experts: int
    topk: int
    ffn_hidden_size: int  # per expert
    norm_topk_prob: bool  # renormalise the top-k softmax probabilities to sum to 1 (Mixtral always does)
    aux_loss_coeff: float  # the HF config's router_aux_loss_coef (used only when the load-balancing loss is on)


@dataclass(frozen=True)
class ModelSpec:
    """Architecture summary of a decoder-only Llama-family model (everything sharding and memory math needs)."""

    architecture: str
    model_type: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tied_embeddings: bool
    qkv_bias: bool
    norm_eps: float
    rope: RopeSpec
    max_position_embeddings: int
    sliding_window: int | None = None
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on each query and key head, before RoPE
    moe: MoESpec | None = None  # None: a dense model
    dtype: str = "float32"  # the HF checkpoint's declared dtype
    tp: int = 1  # the TP size padded_vocab refers to
    hf_config: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def padded_vocab(self) -> int:
        return self.padded_vocab_for(self.tp)

    def padded_vocab_for(self, tp: int) -> int:
        m = VOCAB_PAD_MULTIPLE * tp
        return int(math.ceil(self.vocab_size / m) * m)

    def with_tp(self, tp: int) -> "ModelSpec":
        return replace(self, tp=tp)

    @property
    def queries_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def qkv_rows(self) -> int:
        return (self.num_heads + 2 * self.num_kv_heads) * self.head_dim

    def validate_parallel(self, tp: int, pp: int, ep: int = 1) -> None:
        """Raise if this model cannot be split into tp x pp x ep (the local layer spec needs whole heads/groups per
        rank; expert parallelism needs whole experts per rank, and experts shard their FFN over TP too)."""
        problems = []
        if ep > 1 and self.moe is None:
            problems.append(f"expert parallelism ep={ep} needs a mixture-of-experts model")
        if self.moe is not None:
            if self.moe.num_experts % ep:
                problems.append(f"num_experts={self.moe.num_experts} is not divisible by ep={ep}")
            if self.moe.ffn_hidden_size % tp:
                problems.append(f"expert ffn size {self.moe.ffn_hidden_size} is not divisible by tp={tp}")
        if self.num_heads % tp:
            problems.append(f"num_attention_heads={self.num_heads} is not divisible by tp={tp}")
        if self.num_kv_heads % tp:
            problems.append(f"num_key_value_heads={self.num_kv_heads} is not divisible by tp={tp}")
        if self.moe is None and self.ffn_hidden_size % tp:
            problems.append(f"intermediate_size={self.ffn_hidden_size} is not divisible by tp={tp}")
        if self.num_layers % pp:
            problems.append(f"num_hidden_layers={self.num_layers} is not divisible by pp={pp}")
        if problems:
            raise ValueError(f"{self.architecture} cannot be split tp={tp} pp={pp} ep={ep}: " + "; ".join(problems))

    def num_parameters(self, padded: bool = False) -> int:
        """Parameter count (the planner's memory model uses it); padded=True counts the padded vocab rows."""
        v = self.padded_vocab if padded else self.vocab_size
        h, f = self.hidden_size, self.ffn_hidden_size
        attn = h * self.qkv_rows + self.num_heads * self.head_dim * h + (self.qkv_rows if self.qkv_bias else 0)
        attn += 2 * self.head_dim if self.qk_norm else 0
        if self.moe is None:
            mlp = 3 * h * f
        else:  # router + experts
            mlp = self.moe.num_experts * (h + 3 * h * self.moe.ffn_hidden_size)
        layer = attn + mlp + 2 * h
        return self.num_layers * layer + v * h * (1 if self.tied_embeddings else 2) + h

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("hf_config")
        return d

    @property
    def num_active_parameters(self) -> int:
        """Parameters one token passes through (MoE: top-k experts of each layer); the dense count otherwise."""
        if self.moe is None:
            return self.num_parameters()
        idle = self.moe.num_experts - self.moe.topk
        return self.num_parameters() - self.num_layers * idle * 3 * self.hidden_size * self.moe.ffn_hidden_size


# ----------------------------------------------------------------------------------------------------------------
# HF config parsing
# ----------------------------------------------------------------------------------------------------------------

def load_hf_config(src: Any) -> tuple[dict, str]:
    """Return (config dict, label for error messages) from a dict, a transformers config, a folder or a config.json."""
    if isinstance(src, Mapping):
        return dict(src), "config.json (dict)"
    if hasattr(src, "to_dict") and not isinstance(src, (str, Path)):
        return src.to_dict(), "config.json (transformers config)"
    path = Path(src)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no HF config at {path}")
    try:
        return json.loads(path.read_text()), str(path)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e


def _rope_from_config(cfg: dict, label: str) -> RopeSpec:
    # transformers 5 keeps everything in `rope_parameters`; 4.x used top-level `rope_theta` plus `rope_scaling`.
    params = dict(cfg.get("rope_parameters") or {})
    legacy = cfg.get("rope_scaling") or {}
    for k, v in legacy.items():
        params.setdefault(k, v)
    if "full_attention" in params and isinstance(params["full_attention"], dict):  # per-layer-type form
        params = dict(params["full_attention"])
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rtype = params.get("rope_type", params.get("type", "default")) or "default"
    partial = float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)) or 1.0)
    if rtype == "default":
        return RopeSpec(theta=theta, rotary_percent=partial)
    if rtype == "linear":
        return RopeSpec(theta=theta, type="linear", factor=float(params["factor"]), rotary_percent=partial)
    if rtype == "llama3":
        return RopeSpec(
            theta=theta, type="llama3", factor=float(params["factor"]),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
            rotary_percent=partial,
        )
    raise UnsupportedModelError(
        f"{label}: rope scaling type {rtype!r} is not supported (supported: default, linear, llama3)")


def model_spec(hf_config: Any, tp: int = 1) -> ModelSpec:
    """Parse an HF config (dict, transformers config, folder or config.json path) into a `ModelSpec`."""
    cfg, label = load_hf_config(hf_config)
    archs = cfg.get("architectures") or []
    arch = archs[0] if archs else None
    if arch and arch.endswith("ForSequenceClassification"):  # a reward model's export (models/value_head.py): the
        arch = arch.replace("ForSequenceClassification", "ForCausalLM")  # same decoder under another head
    model_type = cfg.get("model_type")
    if arch not in SUPPORTED_ARCHITECTURES or model_type not in SUPPORTED_ARCHITECTURES[arch]:
        raise UnsupportedModelError(
            f"{label}: unsupported model (architectures={archs!r}, model_type={model_type!r}); supported: "
            + ", ".join(f"{a} ({'/'.join(t)})" for a, t in SUPPORTED_ARCHITECTURES.items()))
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModelError(f"{label}: hidden_act={act!r} is not supported (only silu / SwiGLU)")
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    hidden = int(cfg["hidden_size"])
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    if heads % kv_heads:
        raise UnsupportedModelError(f"{label}: num_attention_heads={heads} not a multiple of num_key_value_heads={kv_heads}")

    qkv_bias = model_type == "qwen2"  # Qwen2 hard-codes bias on q/k/v and none elsewhere
    if model_type != "qwen2" and (cfg.get("attention_bias") or cfg.get("mlp_bias")):
        raise UnsupportedModelError(
            f"{label}: attention_bias/mlp_bias are not supported for {arch} (megatron cannot bias o_proj "
            "without biasing the MLP too)")
    if model_type.startswith("qwen"):
        if cfg.get("use_sliding_window"):
            # Qwen applies the window only above max_window_layers; megatron's window applies to all layers.
            raise UnsupportedModelError(f"{label}: {arch} with use_sliding_window=true is not supported")
        window = None
    else:
        window = cfg.get("sliding_window") if model_type in ("mistral", "mixtral") else None
        window = int(window) if window else None
    if cfg.get("layer_types") and any(t != "full_attention" for t in cfg["layer_types"]) and window is None:
        raise UnsupportedModelError(f"{label}: per-layer attention types {set(cfg['layer_types'])} are not supported")
    moe = _moe_from_config(cfg, model_type, label)

    dtype = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
    return ModelSpec(
        architecture=arch, model_type=model_type, num_layers=int(cfg["num_hidden_layers"]), hidden_size=hidden,
        ffn_hidden_size=int(cfg["intermediate_size"]), num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        vocab_size=int(cfg["vocab_size"]), tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=qkv_bias, norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), rope=_rope_from_config(cfg, label),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)), sliding_window=window,
        qk_norm=model_type in ("qwen3", "qwen3_moe"), moe=moe,
        dtype=str(dtype).replace("torch.", ""), tp=tp, hf_config=cfg,
    )


def shape_spec(hf_config: Any, tp: int = 1) -> ModelSpec:
    """`model_spec`, or for a model it cannot represent (a family the mapping does not cover, or a feature of a known
    one it refuses) the shape read from the config's common keys: what `policy.backend: fsdp2` needs, which trains
    transformers' own model, so only the preflight's vocabulary and context checks, the planner's memory model and
    the FLOP counter read the spec. Such a spec counts the model as dense, with plain RoPE and no biases."""
    try:
        return model_spec(hf_config, tp)
    except UnsupportedModelError:
        pass
    from megatron_rl.models.vlm import text_config

    cfg, label = load_hf_config(hf_config)
    cfg = text_config(cfg)  # a vision-language model: its language model's shape (models/vlm.py)
    try:
        heads, hidden = int(cfg["num_attention_heads"]), int(cfg["hidden_size"])
        archs = cfg.get("architectures") or ["?"]
        return ModelSpec(
            architecture=archs[0], model_type=str(cfg.get("model_type")), num_layers=int(cfg["num_hidden_layers"]),
            hidden_size=hidden, ffn_hidden_size=int(cfg["intermediate_size"]), num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads), vocab_size=int(cfg["vocab_size"]),
            tied_embeddings=bool(cfg.get("tie_word_embeddings", False)), qkv_bias=False,
            norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), rope=RopeSpec(),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            dtype=str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32").replace("torch.", ""), tp=tp,
            hf_config=cfg)
    except KeyError as e:
        raise UnsupportedModelError(f"{label}: no {e.args[0]} (a decoder-only causal LM's config names it)") from None


def _moe_from_config(cfg: dict, model_type: str, label: str) -> MoESpec | None:
    """The MoE fields of a Qwen3-MoE or Mixtral config (None for dense models); layouts we cannot mirror are named."""
    if model_type not in ("qwen3_moe", "mixtral"):
        return None
    # Qwen3MoeConfig calls it num_experts, and saves it as num_local_experts (Mixtral's spelling): accept both
    n = cfg.get("num_experts") or cfg.get("num_local_experts")
    if not n:
        raise UnsupportedModelError(f"{label}: {model_type} config names no expert count (num_experts / "
                                    "num_local_experts)")
    if model_type == "qwen3_moe":
        if cfg.get("mlp_only_layers") or int(cfg.get("decoder_sparse_step") or 1) != 1:
            raise UnsupportedModelError(
                f"{label}: mixed dense/MoE layers (mlp_only_layers={cfg.get('mlp_only_layers')}, "
                f"decoder_sparse_step={cfg.get('decoder_sparse_step')}) are not supported; every layer must be MoE")
        ffn, norm_topk = int(cfg["moe_intermediate_size"]), bool(cfg.get("norm_topk_prob", False))
    else:  # Mixtral: the expert width is intermediate_size, and the top-k probabilities are always renormalised
        ffn, norm_topk = int(cfg["intermediate_size"]), True
    if cfg.get("router_jitter_noise"):
        raise UnsupportedModelError(f"{label}: router_jitter_noise={cfg['router_jitter_noise']} is not supported "
                                    "(the generator has no jitter, so training with it would be off-policy)")
    return MoESpec(num_experts=int(n), topk=int(cfg.get("num_experts_per_tok") or 2), ffn_hidden_size=ffn,
                   norm_topk_prob=norm_topk, aux_loss_coeff=float(cfg.get("router_aux_loss_coef") or 0.0))


# ----------------------------------------------------------------------------------------------------------------
# megatron-core config and model
# ----------------------------------------------------------------------------------------------------------------

def transformer_config(spec: ModelSpec, *, tp: int = 1, pp: int = 1, ep: int = 1,
                       params_dtype: torch.dtype = torch.float32, use_cpu_initialization: bool | None = None,
                       init_weights: bool = True, **overrides):
    """megatron-core TransformerConfig equivalent to the HF model; `overrides` go straight to TransformerConfig
    (e.g. moe_router_load_balancing_type="aux_loss" turns the router's load-balancing loss on, at the HF config's
    router_aux_loss_coef unless moe_aux_loss_coeff is given too)."""
    from megatron.core.transformer import TransformerConfig

    from megatron_rl.platform import get_platform

    spec.validate_parallel(tp, pp, ep)
    if use_cpu_initialization is None:
        use_cpu_initialization = not get_platform().is_gpu
    kwargs = dict(
        num_layers=spec.num_layers, hidden_size=spec.hidden_size, ffn_hidden_size=spec.ffn_hidden_size,
        num_attention_heads=spec.num_heads, num_query_groups=spec.num_kv_heads, kv_channels=spec.head_dim,
        normalization="RMSNorm", layernorm_epsilon=spec.norm_eps,
        gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        add_bias_linear=False, add_qkv_bias=spec.qkv_bias,
        hidden_dropout=0.0, attention_dropout=0.0,  # HF models here are trained/post-trained without dropout
        params_dtype=params_dtype, pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16, fp16=params_dtype == torch.float16,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        use_cpu_initialization=use_cpu_initialization, perform_initialization=init_weights,
        # HF computes the softmax scale from head_dim; megatron's default 1/sqrt(kv_channels) is the same.
        attention_softmax_in_fp32=True,
    )
    if spec.sliding_window is not None:
        # HF lets query i see keys j with i - j < window; megatron's window_size=(left, right) allows i - j <= left.
        kwargs["window_size"] = (spec.sliding_window - 1, 0)
    if spec.qk_norm:
        kwargs["qk_layernorm"] = True  # per-head RMSNorm over head_dim (kv_channels), eps = layernorm_epsilon
    if spec.moe is not None:
        kwargs.update(_moe_config(spec.moe, ep))
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def _moe_config(moe: MoESpec, ep: int) -> dict:
    """TransformerConfig fields of an HF softmax-top-k MoE block.

    Routing: HF takes softmax over all experts, then the top k, renormalised when norm_topk_prob. megatron's default
    (topk on the logits, then softmax over those k) is that renormalised form; moe_router_pre_softmax=True (softmax
    over all, then top k, no renormalisation) is the other. The router runs in fp32 as HF's does. No token dropping
    (capacity factor None), as HF. The load-balancing loss is off by default: it is not part of the RL objective
    (the policy loss) and would move the router away from the policy being optimised; turn it on by override.
    """
    from megatron_rl.platform import get_platform

    return dict(
        num_moe_experts=moe.num_experts, moe_router_topk=moe.topk, moe_ffn_hidden_size=moe.ffn_hidden_size,
        moe_router_pre_softmax=not moe.norm_topk_prob, moe_router_score_function="softmax",
        moe_router_dtype="fp32", moe_expert_capacity_factor=None, moe_grouped_gemm=False,
        moe_router_load_balancing_type="none", moe_aux_loss_coeff=moe.aux_loss_coeff,
        moe_token_dispatcher_type=get_platform().moe_token_dispatcher,
        expert_model_parallel_size=ep,
    )


def llama3_inv_freq(spec: ModelSpec) -> torch.Tensor:
    """RoPE inverse frequencies with Llama-3 frequency-dependent scaling, for the given (not hard-coded) parameters."""
    r = spec.rope
    dim = int(spec.head_dim * r.rotary_percent)
    inv = 1.0 / (r.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    wavelen = 2 * math.pi / inv
    low_wl = r.original_max_position_embeddings / r.low_freq_factor  # longer than this: fully scaled
    high_wl = r.original_max_position_embeddings / r.high_freq_factor  # shorter than this: untouched
    scaled = torch.where(wavelen > low_wl, inv / r.factor, inv)
    smooth = (r.original_max_position_embeddings / wavelen - r.low_freq_factor) / (r.high_freq_factor - r.low_freq_factor)
    blended = (1 - smooth) * scaled / r.factor + smooth * scaled
    medium = (wavelen >= high_wl) & (wavelen <= low_wl)
    return torch.where(medium, blended, scaled)


def layer_spec_for(kind: str = "auto", spec: ModelSpec | None = None):
    """The transformer-engine layer spec when TE is available (or asked for), megatron's local spec otherwise.
    `spec` adds the model's q/k norm and MoE block (experts as a SequentialMLP of per-expert linears: no grouped
    GEMM, so each expert's weights are their own tensors, as on the HF side)."""
    from megatron.core.models.gpt import gpt_layer_specs as specs

    from megatron_rl.platform import get_platform

    qk = bool(spec and spec.qk_norm)
    experts = spec.moe.num_experts if spec is not None and spec.moe is not None else None
    if kind == "auto":
        kind = "te" if get_platform().has_transformer_engine else "local"
    if kind == "te":
        return specs.get_gpt_layer_with_transformer_engine_spec(num_experts=experts, moe_grouped_gemm=False,
                                                                qk_layernorm=qk), "te"
    if kind == "local":
        return specs.get_gpt_layer_local_spec(num_experts=experts, moe_grouped_gemm=False, qk_layernorm=qk,
                                              normalization="RMSNorm"), "local"
    raise ValueError(f"layer spec must be 'auto', 'te' or 'local', not {kind!r}")


def _mask_padded_logits(vocab_size: int, vocab_start: int, local_vocab: int):
    """Forward hook for output_layer: logits of padded vocab rows (index >= vocab_size) → very negative."""
    first_pad = max(0, vocab_size - vocab_start)  # local column where padding starts

    def hook(module, _inputs, output):
        if getattr(module, "megatron_rl_returned_hidden", False):
            # the fused head (policy/model_hooks.install_fused_head) returned hidden states, not logits; its
            # logprob kernel is given only this shard's real vocabulary rows instead
            return output
        logits = output[0] if isinstance(output, tuple) else output
        # in place is autograd-safe: the linear's backward needs its inputs, not its output; masked entries get 0 grad
        logits[..., first_pad:].fill_(torch.finfo(logits.dtype).min)
        return output

    return hook if first_pad < local_vocab else None


def _tag_tensor_parallel_weights(model) -> None:
    """Mark TP-sharded weights the way megatron's initialisers would.

    megatron-core 0.16 sets `tensor_model_parallel` / `partition_dim` on weights only inside its init functions, so a
    model built with perform_initialization=False has untagged weights, and grad-norm/clipping would then count
    them as replicated. Tagging here makes init_weights=False safe for training too.
    """
    from megatron.core import tensor_parallel as tpl

    for module in model.modules():
        if isinstance(module, (tpl.ColumnParallelLinear, tpl.VocabParallelEmbedding)):
            dim = 0
        elif isinstance(module, tpl.RowParallelLinear):
            dim = 1
        else:
            continue
        w = getattr(module, "weight", None)
        if w is not None and not hasattr(w, "tensor_model_parallel"):
            tpl.set_tensor_model_parallel_attributes(w, is_parallel=True, dim=dim, stride=1)


def build_model(hf_config: Any, *, tp: int | None = None, pp: int | None = None,
                params_dtype: torch.dtype = torch.float32, pre_process: bool | None = None,
                post_process: bool | None = None, seed: int = 1234, init_weights: bool = True,
                layer_spec: str = "auto", parallel_output: bool = True, **config_overrides):
    """Build this rank's GPTModel for an HF config. tp/pp and the stage flags default to megatron's parallel_state,
    which must be initialised. The model carries `model.megatron_rl_spec` (a ModelSpec) and `.megatron_rl_layer_spec`.

    init_weights=False skips random initialisation (weights are loaded right after); TP attributes are still set.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_rl.platform import install_megatron_cpu_compat

    install_megatron_cpu_compat()
    tp = ps.get_tensor_model_parallel_world_size() if tp is None else tp
    pp = ps.get_pipeline_model_parallel_world_size() if pp is None else pp
    pre_process = ps.is_pipeline_first_stage() if pre_process is None else pre_process
    post_process = ps.is_pipeline_last_stage() if post_process is None else post_process
    ep = ps.get_expert_model_parallel_world_size() if ps.model_parallel_is_initialized() else 1
    spec = model_spec(hf_config, tp=tp)
    config = transformer_config(spec, tp=tp, pp=pp, ep=ep, params_dtype=params_dtype, init_weights=init_weights,
                                **config_overrides)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    layer, kind = layer_spec_for(layer_spec, spec)
    from megatron_rl.models.varlen_attention import with_varlen_core_attention

    layer = with_varlen_core_attention(layer)  # packed (THD) rows, incl. cascade shared prefix; else unchanged
    rope = spec.rope
    model = GPTModel(
        config=config, transformer_layer_spec=layer, vocab_size=spec.padded_vocab,
        max_sequence_length=spec.max_position_embeddings, pre_process=pre_process, post_process=post_process,
        parallel_output=parallel_output, share_embeddings_and_output_weights=spec.tied_embeddings,
        position_embedding_type="rope", rotary_percent=rope.rotary_percent, rotary_base=rope.theta,
        seq_len_interpolation_factor=rope.factor if rope.type == "linear" else None,
    )
    if not init_weights:
        _tag_tensor_parallel_weights(model)
    if rope.type == "llama3":
        # megatron's built-in llama3 scaling hard-codes low/high freq factors and the original context length;
        # install the frequencies computed from this config instead (before any forward caches them).
        model.rotary_pos_emb.inv_freq = llama3_inv_freq(spec).to(model.rotary_pos_emb.inv_freq.device)
    if post_process and spec.padded_vocab != spec.vocab_size:
        rank = ps.get_tensor_model_parallel_rank() if tp > 1 else 0
        local = spec.padded_vocab // tp if parallel_output else spec.padded_vocab
        start = rank * local if parallel_output else 0
        hook = _mask_padded_logits(spec.vocab_size, start, local)
        if hook is not None:
            model.output_layer.register_forward_hook(hook)
    model.megatron_rl_spec = spec
    model.megatron_rl_layer_spec = kind
    return model
