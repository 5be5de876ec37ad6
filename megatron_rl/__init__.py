"""megatron-rl: GRPO post-training on megatron-core, vLLM and Ray.

The Python API (`megatron_rl/api.py`): `megatron_rl.train`, `.sft`, `.dpo`, `megatron_rl.load_config`, `megatron_rl.evaluate`.
They are imported on first use, so `import megatron_rl` loads nothing heavy (no torch, Ray or vLLM).
"""

__version__ = "0.1.0"  # the one place it is set: setup.py reads it from here, `megatron-rl --version` prints it
__all__ = ["train", "sft", "dpo", "rm", "load_config", "evaluate"]


def __getattr__(name: str):
    if name in __all__:
        from megatron_rl import api

        return getattr(api, name)
    raise AttributeError(f"module 'megatron_rl' has no attribute {name!r}")
