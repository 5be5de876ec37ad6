"""HF config → ModelSpec / TransformerConfig: architectures, RoPE variants, GQA, padding, clear errors."""
import json

import pytest
import torch

from megatron_rl.models.provider import (
    ModelSpec, UnsupportedModelError, llama3_inv_freq, model_spec, shape_spec, transformer_config,
)
from megatron_rl.models.tiny import make_tiny_hf_model, tiny_hf_config

SMOLLM2 = {  # the embedded default model's config.json (transformers 5 form)
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "head_dim": 64, "hidden_act": "silu",
    "hidden_size": 576, "intermediate_size": 1536, "max_position_embeddings": 8192, "num_attention_heads": 9,
    "num_hidden_layers": 30, "num_key_value_heads": 3, "rms_norm_eps": 1e-05, "tie_word_embeddings": True,
    "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"}, "vocab_size": 49152, "dtype": "float32",
}


def test_smollm2_spec():
    s = model_spec(SMOLLM2)
    assert (s.num_layers, s.hidden_size, s.num_heads, s.num_kv_heads, s.head_dim) == (30, 576, 9, 3, 64)
    assert s.tied_embeddings and not s.qkv_bias and s.rope.theta == 100000.0 and s.rope.type == "default"
    assert s.padded_vocab == 49152 and s.padded_vocab_for(3) == 49152  # already a multiple of 128*3
    assert s.num_parameters() == 134_515_008  # SmolLM2-135M
    s.validate_parallel(3, 2)
    with pytest.raises(ValueError, match="num_attention_heads=9 is not divisible by tp=2"):
        s.validate_parallel(2, 1)


def test_spec_reads_config_folder(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(SMOLLM2))
    assert model_spec(tmp_path) == model_spec(SMOLLM2)


def test_legacy_rope_theta_and_rope_scaling_keys():
    cfg = dict(SMOLLM2, rope_theta=500000.0,
               rope_scaling={"type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 8192})
    del cfg["rope_parameters"]
    r = model_spec(cfg).rope
    assert (r.type, r.theta, r.factor, r.original_max_position_embeddings) == ("llama3", 500000.0, 32.0, 8192)
    cfg["rope_scaling"] = {"rope_type": "linear", "factor": 2.0}
    assert model_spec(cfg).rope.type == "linear"


@pytest.mark.parametrize("rope_type", ["dynamic", "yarn", "longrope"])
def test_unsupported_rope_scaling_is_named(rope_type):
    cfg = dict(SMOLLM2, rope_parameters={"rope_type": rope_type, "rope_theta": 1e4, "factor": 2.0})
    with pytest.raises(UnsupportedModelError, match=f"config.json.*{rope_type}"):
        model_spec(cfg)


@pytest.mark.parametrize("arch,mtype", [("GPT2LMHeadModel", "gpt2"), ("DeepseekV3ForCausalLM", "deepseek_v3"),
                                        ("LlamaForCausalLM", "mistral")])
def test_unsupported_architecture_names_values(tmp_path, arch, mtype):
    (tmp_path / "config.json").write_text(json.dumps(dict(SMOLLM2, architectures=[arch], model_type=mtype)))
    with pytest.raises(UnsupportedModelError) as e:
        model_spec(tmp_path)
    msg = str(e.value)
    assert str(tmp_path / "config.json") in msg and arch in msg and mtype in msg


def test_unsupported_biases_and_qwen2_sliding_window():
    with pytest.raises(UnsupportedModelError, match="attention_bias"):
        model_spec(dict(SMOLLM2, attention_bias=True))
    with pytest.raises(UnsupportedModelError, match="use_sliding_window"):
        model_spec(dict(tiny_hf_config("qwen2"), use_sliding_window=True, sliding_window=16))


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
def test_num_parameters_matches_transformers(kind):
    hf = make_tiny_hf_model(kind)
    assert model_spec(hf.config).num_parameters() == sum(p.numel() for p in hf.parameters())


def test_shape_spec_of_a_family_megatron_cannot_build():
    """The FSDP2 backend's view of an unmapped model (OLMo-2): megatron's spec refuses it, the shape spec reads it,
    and counts transformers' own parameters except OLMo-2's q/k norms (the dense shape has none)."""
    cfg = tiny_hf_config("olmo2")
    with pytest.raises(UnsupportedModelError, match="Olmo2ForCausalLM"):
        model_spec(cfg)
    s = shape_spec(cfg)
    hf = make_tiny_hf_model("olmo2")
    assert (s.num_layers, s.hidden_size, s.num_heads, s.head_dim, s.vocab_size) == (2, 64, 2, 32, 250)
    qk_norms = sum(p.numel() for n, p in hf.named_parameters() if ".q_norm." in n or ".k_norm." in n)
    assert s.num_parameters() == sum(p.numel() for p in hf.parameters()) - qk_norms
    assert shape_spec(SMOLLM2) == model_spec(SMOLLM2)  # a family megatron builds keeps its exact spec
    with pytest.raises(UnsupportedModelError, match="no hidden_size"):
        shape_spec({k: v for k, v in cfg.items() if k != "hidden_size"})


def test_tiny_specs_cover_the_interesting_cases():
    llama, qwen, mistral = (model_spec(tiny_hf_config(k)) for k in ("llama", "qwen2", "mistral"))
    assert llama.tied_embeddings and llama.head_dim == 32 and llama.hidden_size // llama.num_heads != 32
    assert llama.rope.type == "llama3" and llama.padded_vocab == 256 and llama.padded_vocab_for(4) == 512
    assert qwen.qkv_bias and not qwen.tied_embeddings and qwen.queries_per_group == 2
    assert mistral.sliding_window == 5
    assert isinstance(ModelSpec.to_dict(qwen), dict) and "hf_config" not in qwen.to_dict()


def test_llama3_inv_freq_matches_transformers():
    hf = make_tiny_hf_model("llama")
    torch.testing.assert_close(llama3_inv_freq(model_spec(hf.config)), hf.model.rotary_emb.inv_freq,
                               rtol=1e-6, atol=0)


def test_transformer_config_fields():
    q = transformer_config(model_spec(tiny_hf_config("qwen2")), tp=2)
    assert (q.num_query_groups, q.kv_channels, q.add_qkv_bias, q.add_bias_linear) == (2, 32, True, False)
    assert q.gated_linear_unit and q.normalization == "RMSNorm" and q.layernorm_epsilon == 1e-6
    m = transformer_config(model_spec(tiny_hf_config("mistral")))
    assert tuple(m.window_size) == (4, 0)  # HF window 5 = the token itself + 4 before
    b = transformer_config(model_spec(tiny_hf_config("llama")), params_dtype=torch.bfloat16)
    assert b.bf16 and b.params_dtype == torch.bfloat16
