"""top-k/top-p logprobs with vLLM 0.32's V2 model runner, checked on CPU (issues 54 and 58).

On a GPU with Triton vLLM runs its V2 model runner, whose sampler (`vllm/v1/worker/gpu/sample/sampler.py`) has no
`topk_topp_sampler` module and returns the logprobs of the top-k/top-p-masked logits. The CPU engine runs the V1
runner, so the integration tests never see that sampler: here vLLM's own runner decision is evaluated for a GPU
host, and vLLM's real V2 `Sampler` is built on CPU. Only its Triton kernels (temperature, Gumbel draw) are replaced
by torch equivalents; the masking (`apply_top_k_top_p`, torch path) and the control flow are vLLM's. Both runners
return the filtered distribution's logprobs, which the trainer recomputes (policy/sampling_filter.py); until issue
58 a hook in the worker undid the filter on each runner instead, and the V2 hook was what a GPU review found crashing.
"""
from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")

VOCAB = 64
TEMPERATURE = 0.7


def test_vllm_picks_the_v2_runner_for_our_gpu_engine(monkeypatch):
    """The GPU engine's settings (tp=2 over Ray, no speculative decoding) are not on V2's unsupported list: with
    Triton present, as on every CUDA host, vLLM's decision is V2, so the V2 sampler is what the extension meets."""
    import vllm.config.vllm as vllm_config_module
    from vllm.config import ParallelConfig, VllmConfig

    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    config = VllmConfig(parallel_config=ParallelConfig(tensor_parallel_size=2, distributed_executor_backend="ray"))
    with mock.patch.object(vllm_config_module, "HAS_TRITON", True):  # HAS_TRITON is False only without a GPU driver
        assert config.use_v2_model_runner is True
    with mock.patch.object(vllm_config_module, "HAS_TRITON", False):  # this CPU machine: the V1 runner
        assert config.use_v2_model_runner is False


def _torch_apply_temperature(logits, expanded_idx_mapping, temperature):
    t = temperature[expanded_idx_mapping.long()]
    logits.div_(torch.where(t == 0, torch.ones_like(t), t).unsqueeze(1))


def _torch_gumbel_sample(logits, expanded_idx_mapping, temperature, seed, pos, apply_temperature, is_drafting,
                         use_fp64=False, **_):
    noise = -torch.log(-torch.log(torch.rand(logits.shape, generator=torch.Generator().manual_seed(3))))
    return (logits + noise).argmax(dim=-1)  # masked tokens are -inf, so never drawn


@pytest.fixture
def v2_sampler():
    """vLLM's V2 Sampler on CPU (pinned-memory buffers fall back to plain ones, as on a platform without UVA) with
    two requests: top-k 5 and top-p 0.5, both at T=0.7 and asking for the sampled token's logprob."""
    import vllm.v1.worker.gpu.buffer_utils as buffer_utils
    from vllm import SamplingParams
    from vllm.config import VllmConfig

    with mock.patch.object(buffer_utils, "is_uva_available", lambda: False):
        from vllm.v1.worker.gpu.sample.sampler import Sampler
        from vllm.v1.worker.gpu.states import RequestState

        req_states = RequestState(4, 64, 64, 0, VOCAB, torch.device("cpu"))
        sampler = Sampler(VllmConfig(), 4, VOCAB, torch.device("cpu"), req_states,
                          logprobs_mode="processed_logprobs")
        sampler.add_request(0, SamplingParams(temperature=TEMPERATURE, top_k=5, logprobs=0))
        sampler.add_request(1, SamplingParams(temperature=TEMPERATURE, top_p=0.5, logprobs=0))
        sampler.apply_staged_writes()
        yield sampler


def _run_sample(sampler, logits):
    """`Sampler.sample` as `Sampler.__call__` runs it for two requests of one token each; returns the drawn tokens
    and the tensor `__call__` turns into logprobs in processed_logprobs mode."""
    import vllm.v1.worker.gpu.sample.sampler as sampler_module
    import vllm.v1.worker.gpu.sample.states as states_module

    idx = torch.arange(2, dtype=torch.int32)
    with mock.patch.object(states_module, "apply_temperature", _torch_apply_temperature), \
            mock.patch.object(sampler_module, "gumbel_sample", _torch_gumbel_sample):
        return sampler.sample(logits.clone(), idx, idx, idx.numpy(), torch.zeros(2, dtype=torch.int64),
                              torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int32),
                              np.full(2, 8, dtype=np.int32), return_logprobs=True)


def test_v2_sampler_returns_the_filtered_distribution_the_trainer_recomputes(v2_sampler):
    """The logprobs the V2 runner returns are those of the filtered distribution (vLLM's renormalisation over the
    kept tokens), as on the V1 runner: what `policy/sampling_filter.py` reproduces. Checked against the plain-torch
    filtered softmax, and the trainer's filtered logprob of each sampled token equals the engine's (ratio 1)."""
    from vllm.v1.worker.gpu.sample.sampler import Sampler

    from megatron_rl.policy.sampling_filter import TokenScoring, log_kept
    from tests.unit.test_sampling_filter import reference_filtered_logprobs

    assert type(v2_sampler) is Sampler and not hasattr(v2_sampler, "topk_topp_sampler")
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(0)) * 3
    sampled, processed = _run_sample(v2_sampler, logits)
    engine = processed.log_softmax(-1)  # what `Sampler.__call__` returns in processed_logprobs mode
    assert torch.isinf(engine[0]).sum() == VOCAB - 5  # top-k 5 kept five
    rules = [(5, 1.0), (-1, 0.5)]
    for row, (top_k, top_p) in enumerate(rules):
        ref = reference_filtered_logprobs(logits[row:row + 1].double(), TEMPERATURE, top_k, top_p)[0]
        kept = torch.isfinite(ref)
        assert torch.equal(torch.isfinite(engine[row]), kept) and int(sampled[row]) in kept.nonzero()[:, 0].tolist()
        torch.testing.assert_close(engine[row][kept].double(), ref[kept], atol=1e-5, rtol=0)
        y = sampled[row:row + 1].long()
        trainer, _ = log_kept(logits[row:row + 1], None, y, TokenScoring(TEMPERATURE, top_k, top_p))
        assert abs(float(trainer - engine[row, y])) < 1e-5
