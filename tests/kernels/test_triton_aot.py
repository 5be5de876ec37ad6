"""Compiled (non-interpreted) Triton: ahead-of-time for sm_90 via ptxas on any machine; on a GPU when present."""
import json
import os
import subprocess
import sys

import pytest
import triton

PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")


@pytest.mark.skipif(not os.path.exists(PTXAS), reason="triton wheel without the NVIDIA backend's ptxas")
def test_kernels_compile_for_sm90_with_vectorised_loads():
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, "-m", "tests.kernels.aot_compile"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("AOT ")][0][4:])
    assert len(result) == 3 * 5
    for name, loads in result.items():
        # logits tiles are read 16 bytes per thread (8 bf16 / 4 fp32 lanes), not element by element
        assert "ld.global.v4.b32" in loads, (name, loads)


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA device")
def test_compiled_kernels_on_gpu_match_reference():
    env = dict(os.environ, TRITON_INTERPRET="0")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, "-m", "tests.kernels.gpu_check"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
