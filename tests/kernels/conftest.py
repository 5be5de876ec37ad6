"""Kernel tests run the Triton kernels on CPU tensors through the Triton interpreter.

TRITON_INTERPRET must be in the environment before triton is first imported, hence at import time of this
conftest (pytest imports it before the test modules). Spawned TP ranks inherit it through os.environ.
"""
import os
import sys

if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
    # too late: the kernels' @triton.jit functions were built for the compiler, and every interpreted launch would
    # fail with "Cannot call @triton.jit'd outside of the scope of a kernel"
    raise RuntimeError("triton was imported before tests/kernels/conftest.py could set TRITON_INTERPRET=1: a test "
                       "module collected earlier imports it at module level (megatron-core's attention and vLLM "
                       "do); import those inside the test functions, or set TRITON_INTERPRET=1 in the environment")
os.environ.setdefault("TRITON_INTERPRET", "1")
