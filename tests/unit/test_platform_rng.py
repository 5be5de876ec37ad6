"""Checkpointed RNG state: what `Platform.rng_state()` saves, `set_rng_state()` continues exactly."""
import torch

from megatron_rl.platform import get_platform


def test_rng_state_round_trip_continues_the_same_stream():
    plat = get_platform()
    torch.manual_seed(123)
    torch.rand(5)
    state = plat.rng_state()
    want = torch.rand(8)
    torch.rand(100)  # move on, as training would
    plat.set_rng_state(state)
    assert torch.equal(torch.rand(8), want)
    assert ("cuda" in state) == plat.is_gpu  # the CUDA stream is kept exactly when there is one


def test_checkpoints_with_only_the_cpu_state_still_load():
    plat = get_platform()
    torch.manual_seed(7)
    old_style = torch.get_rng_state()  # what checkpoints held before the CUDA/tracker states were added
    want = torch.rand(4)
    plat.set_rng_state(old_style)
    assert torch.equal(torch.rand(4), want)
