"""top-k/top-p logprobs with vLLM 0.32's V2 model runner, checked on CPU (issue 54, item 1).

On a GPU with Triton vLLM runs its V2 model runner, whose sampler (`vllm/v1/worker/gpu/sample/sampler.py`) has no
`topk_topp_sampler` module and returns the logprobs of the top-k/top-p-masked logits. The CPU engine runs the V1
runner, so the integration tests never see that sampler: here vLLM's own runner decision is evaluated for a GPU
host, and vLLM's real V2 `Sampler` is built on CPU. Only its Triton kernels (temperature, Gumbel draw) are replaced
by torch equivalents; the masking (`apply_top_k_top_p`, torch path) and the control flow are vLLM's.
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


def test_extension_hooks_the_v2_sampler_and_returns_untruncated_logprobs(v2_sampler):
    from vllm.v1.worker.gpu.sample.sampler import Sampler

    from megatron_rl.generation.worker_extension import RefitWorkerExtension, _install_untruncated_logprobs

    assert type(v2_sampler) is Sampler and not hasattr(v2_sampler, "topk_topp_sampler")
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(0)) * 3
    reference = torch.log_softmax(logits / TEMPERATURE, dim=-1)  # what the trainer recomputes
    top5 = set(logits[0].topk(5).indices.tolist())

    # vLLM as is: the logprobs it would return are renormalised over the kept tokens (the defect the hook undoes)
    _, masked = _run_sample(v2_sampler, logits)
    assert torch.isinf(masked[0]).sum() == VOCAB - 5
    assert not torch.allclose(masked.log_softmax(-1)[0, list(top5)], reference[0, list(top5)])

    # the extension's setup, run as vLLM's worker runs it (self.model_runner.sampler is the V2 Sampler)
    worker = RefitWorkerExtension.__new__(RefitWorkerExtension)
    worker.model_runner = type("Runner", (), {"sampler": v2_sampler})()
    worker.device = torch.device("cpu")
    assert worker.mrl_setup()["untruncated_logprobs"] is True
    assert _install_untruncated_logprobs(v2_sampler) is True  # idempotent

    sampled, processed = _run_sample(v2_sampler, logits)
    torch.testing.assert_close(processed.log_softmax(-1), reference)
    assert int(sampled[0]) in top5  # sampling itself is still filtered
    kept_p = reference[1].exp().sort(descending=True)
    nucleus = set(kept_p.indices[: int((kept_p.values.cumsum(0) < 0.5).sum()) + 1].tolist())
    assert int(sampled[1]) in nucleus


def test_v2_hook_refuses_a_sampler_returning_its_sampling_mask(v2_sampler):
    """vLLM builds the sampling mask from the masked logits: the hook would corrupt it, so filtering is refused."""
    from megatron_rl.generation.worker_extension import _install_untruncated_logprobs

    v2_sampler.return_sampling_mask = True
    assert _install_untruncated_logprobs(v2_sampler) is False
