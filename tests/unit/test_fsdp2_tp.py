"""policy/fsdp2_tp.check_tp: a model the Megatron-style split would get wrong is refused before any weight moves,
naming the model and what is wrong (the split itself is compared with megatron's TP in test_fsdp2.py)."""
import pytest
from megatron_rl.models.tiny import make_tiny_hf_model
from megatron_rl.policy.fsdp2_tp import check_tp
from megatron_rl.policy.fsdp2_worker import decoder_layers


def refusal(lm, tp=2) -> str:
    with pytest.raises(ValueError) as e:
        check_tp(lm, decoder_layers(lm), tp)
    return str(e.value)


def test_heads_not_divisible():
    assert "Gemma2ForCausalLM's num_key_value_heads=1 is not divisible" in refusal(make_tiny_hf_model("gemma2"))


def test_a_norm_over_all_heads():
    msg = refusal(make_tiny_hf_model("olmo2"))
    assert "Olmo2ForCausalLM's self_attn.q_norm normalises across all heads (64 features)" in msg


def test_fused_projections():
    msg = refusal(make_tiny_hf_model("phi3"))
    assert "Phi3ForCausalLM's decoder layer has no self_attn.q_proj" in msg and "mlp.gate_proj" in msg


@pytest.mark.parametrize("kind", ["qwen2", "llama", "qwen3"])
def test_split_models_pass(kind):
    lm = make_tiny_hf_model(kind)
    check_tp(lm, decoder_layers(lm), 2)  # Qwen3's q/k norms are per head: fine
    with pytest.raises(ValueError, match="num_attention_heads=4 is not divisible"):
        check_tp(lm, decoder_layers(lm), 3)
