"""Named models and GPUs for `megatron-rl plan`.

MODELS are the real architectures as HF config.json fields, so a preset goes through the same parser
(`megatron_rl.models.provider.model_spec`) as a downloaded config. `PLAN_ONLY` holds architectures the trainer cannot
build but whose shapes the planner can still reason about (their config.json fields, read by
megatron_rl/planner/architecture.py).

GPUS: memory the driver reports, dense bf16 peak, HBM bandwidth, NVLink bandwidth per GPU (one direction), the size of
the NVLink domain (tensor parallelism stays inside it), GPUs per host, and inter-node bandwidth per GPU.
"""
from __future__ import annotations

from dataclasses import dataclass


def _llama(layers, hidden, ffn, heads, kv_heads, vocab=128256, tied=False, max_pos=131072):
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": layers,
        "hidden_size": hidden, "intermediate_size": ffn, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "vocab_size": vocab, "tie_word_embeddings": tied,
        "max_position_embeddings": max_pos, "rms_norm_eps": 1e-5, "hidden_act": "silu", "torch_dtype": "bfloat16",
        "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
    }


def _qwen2(layers, hidden, ffn, heads, kv_heads, vocab, tied, max_pos, theta):
    return {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "num_hidden_layers": layers,
        "hidden_size": hidden, "intermediate_size": ffn, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "vocab_size": vocab, "tie_word_embeddings": tied,
        "max_position_embeddings": max_pos, "rms_norm_eps": 1e-6, "hidden_act": "silu", "torch_dtype": "bfloat16",
        "rope_theta": theta, "use_sliding_window": False,
    }


def _qwen3(layers, hidden, ffn, heads, kv_heads, **moe):
    cfg = {
        "architectures": ["Qwen3MoeForCausalLM" if moe else "Qwen3ForCausalLM"], "model_type":
        "qwen3_moe" if moe else "qwen3", "num_hidden_layers": layers, "hidden_size": hidden,
        "intermediate_size": ffn, "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": 128,
        "vocab_size": 151936, "tie_word_embeddings": False, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
        "hidden_act": "silu", "torch_dtype": "bfloat16", "rope_theta": 1_000_000.0, "use_sliding_window": False,
        "attention_bias": False,
    }
    return dict(cfg, **moe)


MODELS: dict[str, dict] = {
    # Qwen/Qwen2.5-1.5B(-Instruct): 1,543,714,304 parameters, tied embeddings
    "qwen2.5-1.5b": _qwen2(28, 1536, 8960, 12, 2, 151936, True, 32768, 1_000_000.0),
    # deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B: the same body with an untied output layer (1,777,088,000)
    "r1-distill-qwen-1.5b": _qwen2(28, 1536, 8960, 12, 2, 151936, False, 131072, 10000.0),
    # meta-llama/Llama-3.1-8B(-Instruct): 8,030,261,248
    "llama3.1-8b": _llama(32, 4096, 14336, 32, 8),
    # Qwen/Qwen2.5-32B(-Instruct): 32,763,876,352
    "qwen2.5-32b": _qwen2(64, 5120, 27648, 40, 8, 152064, False, 32768, 1_000_000.0),
    # meta-llama/Llama-3.1-70B(-Instruct): 70,553,706,496
    "llama3.1-70b": _llama(80, 8192, 28672, 64, 8),
    # Qwen/Qwen3-32B: head_dim 128 with 64 heads (q width 8192 > hidden 5120), per-head q/k RMSNorm
    "qwen3-32b": _qwen3(64, 5120, 25600, 64, 8),
    # Qwen/Qwen3-30B-A3B: 48 MoE layers of 128 experts (width 768), top 8, renormalised; 30,532,122,624 parameters,
    # 3,353,032,704 active (the model card's 30.5B / 3.3B)
    "qwen3-30b-a3b": _qwen3(48, 2048, 6144, 32, 4, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                            norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                            router_aux_loss_coef=0.001),
}

# Architectures the trainer cannot build, as their config.json fields; the planner reads them itself
# (megatron_rl/planner/architecture.py says what it approximates).
PLAN_ONLY: dict[str, dict] = {
    # deepseek-ai/DeepSeek-V3: MLA attention, 3 dense layers then 58 MoE layers of 1 shared + 256 routed experts
    # (width 2048), top 8; 671.0B parameters without the multi-token-prediction module, 37.6B active
    "deepseek-v3": {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "num_hidden_layers": 61,
        "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_attention_heads": 128,
        "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256, "num_experts_per_tok": 8,
        "first_k_dense_replace": 3, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64, "v_head_dim": 128, "vocab_size": 129280, "tie_word_embeddings": False,
        "num_nextn_predict_layers": 1, "max_position_embeddings": 163840,
    },
}


@dataclass(frozen=True)
class GPU:
    name: str
    memory_gib: float  # what the driver reports as total
    bf16_tflops: float  # dense
    hbm_tb_s: float
    nvlink_gb_s: float  # per GPU, one direction
    nvlink_domain: int  # GPUs reachable over NVLink
    gpus_per_host: int
    network_gb_s: float  # inter-node, per GPU


GPUS: dict[str, GPU] = {
    "a100": GPU("A100-SXM 80GB", 80.0, 312.0, 2.04, 300.0, 8, 8, 25.0),
    "h100": GPU("H100-SXM 80GB", 79.6, 989.0, 3.35, 450.0, 8, 8, 50.0),
    "h200": GPU("H200-SXM 141GB", 139.8, 989.0, 4.8, 450.0, 8, 8, 50.0),
    # GB200 NVL72: 4 GPUs per host but one 72-GPU NVLink domain
    "gb200": GPU("GB200 (NVL72)", 184.0, 2500.0, 8.0, 900.0, 72, 4, 50.0),
}
