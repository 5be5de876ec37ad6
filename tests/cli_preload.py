"""Imported once by tests/cli_runner.py's fork server before it forks any `megatron-rl` command: what the driver of a
run imports on its way to starting Ray (measured with `python -X importtime -m megatron_rl train ...`: ~6 s of one
core on the 2-core CPU machines). Only imports, as in megatron_rl/distributed/launch_preload.py: the server never
computes, so no thread pool exists in it for a fork to break. A module that fails to import is left to the command.
"""
import importlib
import warnings

MODULES = ("megatron_rl.distributed.launch_preload", "transformers.models.auto.tokenization_auto",
           "transformers.models.auto.configuration_auto", "ray", "pyarrow", "megatron_rl.cli", "megatron_rl.build",
           "megatron_rl.config.preflight", "megatron_rl.algorithms.stages", "megatron_rl.algorithms.grpo")

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    for _name in MODULES:
        try:
            importlib.import_module(_name)
        except Exception:  # noqa: BLE001 - the command imports (and fails on) it itself
            pass
