"""The tiny random model the benches' --smoke modes run on (a helper module, not a bench).

A random Llama from `megatron_rl.models.tiny` with the embedded SmolLM2 tokenizer's vocabulary and special ids, so
chat templates, prompt tokenization and stop tokens behave as on the real model, at a few MB of weights.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def tiny_model(root: Path, seed: int = 3) -> Path:
    from transformers import AutoTokenizer

    from megatron_rl.models.tiny import write_tiny_hf_model
    from megatron_rl.paths import default_model_dir

    tok = AutoTokenizer.from_pretrained(default_model_dir())
    return write_tiny_hf_model(Path(root) / "tiny", "llama", seed=seed, tokenizer_from=default_model_dir(),
                               config_overrides={"vocab_size": len(tok), "eos_token_id": tok.eos_token_id,
                                                 "bos_token_id": tok.bos_token_id, "max_position_embeddings": 512})
