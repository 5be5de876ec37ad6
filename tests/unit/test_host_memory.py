"""The CPU handover's freed heap pages: kept for the next step while the machine has memory to spare, handed back to
the system when it does not (`Platform.release_cached_memory`)."""
import os
import subprocess
import sys

import pytest

from megatron_rl.platform import get_platform

# Runs in a fresh process with the worker environment (1 GiB mmap/trim thresholds), as a Ray worker would: allocate
# and touch 512 MiB, free it, release, and report the resident-set change of the release itself.
_CHILD = r"""
import sys, torch
import megatron_rl.platform as P

def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096

P.HOST_MEMORY_RESERVE = float(sys.argv[1])
x = torch.ones(128 << 20)  # 512 MiB, every page touched
del x
before = rss()
P.get_platform().release_cached_memory()
print(before - rss())
"""


def _released_bytes(reserve: float) -> int:
    env = {**os.environ, **get_platform().worker_env()}
    out = subprocess.run([sys.executable, "-c", _CHILD, str(reserve)], env=env, capture_output=True, text=True,
                         check=True)
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(get_platform().is_gpu, reason="host-heap policy of the CPU platform; GPU frees via empty_cache")
def test_freed_heap_is_kept_with_memory_to_spare_and_returned_when_short():
    assert _released_bytes(0.0) < 64 << 20  # never short: the pages stay for the next step (no re-faulting)
    assert _released_bytes(1.0) > 400 << 20  # always short: the 512 MiB go back to the system
