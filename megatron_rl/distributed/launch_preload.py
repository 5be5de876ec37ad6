"""Imported once by `launch.run_distributed`'s fork server, before it forks any rank: the libraries every rank body
of this project imports first, so that each rank starts with them in memory instead of importing them again (~5 s of
one core per rank on a 2-core CPU machine). Only imports: the server never computes, so no thread pool (OpenMP,
gloo) exists in it to be broken by a fork.

A library that is not installed, or fails to import, is left for the rank to import (and fail on) itself: an
exception here would take the fork server down with it. megatron-core's "Transformer Engine and Apex are not
installed" warnings are the ranks' to print, not the server's (the server's stderr is the caller's).
"""
import importlib
import warnings

LIBRARIES = ("torch", "torch.distributed", "transformers", "transformers.models.llama.modeling_llama",
             "megatron.core", "megatron.core.models.gpt")

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    for _name in LIBRARIES:
        try:
            importlib.import_module(_name)
        except Exception:  # noqa: BLE001 - see the docstring
            pass
