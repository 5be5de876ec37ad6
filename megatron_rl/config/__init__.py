"""Typed configuration: `load_config(path, overrides)` -> `Config` (see schema.py for every default)."""
from megatron_rl.config.loader import (
    ConfigError, apply_overrides, dump_yaml, from_dict, load_config, read_yaml_tree, resolve_model_dir, to_dict,
    validate,
)
from megatron_rl.config.schema import Config

__all__ = ["Config", "ConfigError", "apply_overrides", "dump_yaml", "from_dict", "load_config", "read_yaml_tree",
           "resolve_model_dir", "to_dict", "validate"]
