"""Per-phase FLOP/s: the matmul parameter count against a hand count of the model's linear layers (and the trained
HF model's own parameter count), and the rate arithmetic against a hand computation."""
import json

import pytest

from megatron_rl.algorithms.throughput import matmul_params_of, phase_flops_per_s


def _write(tmp_path, **over):
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 160,
           "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000,
           "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
           "torch_dtype": "float32"}
    cfg.update(over)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return str(tmp_path)


def test_matmul_params_count_every_linear_and_the_lm_head(tmp_path):
    d = _write(tmp_path)
    h, f, L, v, hd = 64, 160, 3, 1000, 16
    q, kv = 4 * hd, 2 * hd
    by_hand = L * (h * q + 2 * h * kv + q * h + 3 * h * f + 2 * h) + v * h  # norms: 2h per layer, a rounding error
    assert matmul_params_of(d) == by_hand
    # cross-check with transformers' own count: all parameters = matmul params + the final norm (h), tied embedding
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(d))
    assert sum(p.numel() for p in model.parameters()) == by_hand + h


def test_phase_rates_by_hand():
    rec = {"time_train_s": 2.0, "time_logprobs_s": 0.5, "time_generate_s": 4.0, "num_generated_tokens": 300,
           "num_prompt_tokens": 100}
    out = phase_flops_per_s(1_000_000, rec, tokens_fed=1000, logprob_passes=1)
    assert out["train_flops_per_s"] == pytest.approx(6e6 * 1000 / 2.0)
    assert out["logprobs_flops_per_s"] == pytest.approx(2e6 * 1000 / 0.5)
    assert out["generate_flops_per_s"] == pytest.approx(2e6 * 400 / 4.0)
    # a phase that did not run is absent, not a zero or a division by zero
    out = phase_flops_per_s(1_000_000, {**rec, "time_logprobs_s": 0.0}, tokens_fed=1000, logprob_passes=0)
    assert "logprobs_flops_per_s" not in out
