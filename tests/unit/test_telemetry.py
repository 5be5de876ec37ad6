"""GPU telemetry through nvidia-ml-py (`platform.device_telemetry`): per-device keys on a GPU host, none on CPU.

On CPU hosts (CI) nvidia-ml-py is installed but finds no NVIDIA driver: the readings must be empty, without raising,
so a training record carries no `gpu*` key rather than zeros. On a GPU host the same test checks the keys per device.
"""
from __future__ import annotations

import pytest

from megatron_rl.platform import device_telemetry, get_platform, nvml_readings, visible_devices


def test_telemetry_keys_per_device_on_gpu_and_absent_on_cpu():
    got = device_telemetry()
    if not get_platform().is_gpu:
        assert got == {}
        return
    import torch

    n = torch.cuda.device_count()
    for i in range(n):
        assert 0.0 <= got[f"gpu{i}_util"] <= 100.0
        total = torch.cuda.get_device_properties(i).total_memory / 2**30
        assert 0.0 < got[f"gpu{i}_mem_used_gb"] <= total
    assert not any(k.startswith(f"gpu{n}_") for k in got)  # only the devices this process may use


def test_nvml_without_a_driver_reads_nothing_and_says_why():
    if get_platform().is_gpu:
        pytest.skip("a GPU host has a driver: the test above covers it")
    assert nvml_readings() == {}  # nvidia-ml-py imported, nvmlInit failed: no exception escapes
    why = visible_devices()
    assert isinstance(why, str) and ("no NVIDIA driver" in why or "not installed" in why), why
