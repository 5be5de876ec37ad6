"""Kernel tests run the Triton kernels on CPU tensors through the Triton interpreter.

TRITON_INTERPRET must be in the environment before triton is first imported, hence at import time of this
conftest (pytest imports it before the test modules). Spawned TP ranks inherit it through os.environ.
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")
