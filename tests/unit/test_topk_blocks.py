"""The teacher's top-k scoring (`policy/topk.vocab_topk`) works a block of vocabulary columns at a time (issue 54,
item 7): the same ids and logprobs as a full fp64 `log_softmax` + `topk` over the whole vocabulary, and no tensor
larger than a block of logits or a block of the head's weight in fp32 is ever made (every op's output counted with
a TorchDispatchMode, on CPU as it would be on the device). TP > 1 (the normaliser and top-k reduced over the group)
against HF: tests/distributed/test_distill.py::test_teacher_logprobs_equal_hf."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_rl.policy.topk import VOCAB_BLOCK, vocab_topk


def reference(logits: torch.Tensor, k: int, temperature: float):
    lp = torch.log_softmax(logits.double() / temperature, -1)
    v, i = lp.topk(k, -1)
    return i, v


class _Largest(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("fused", [True, False], ids=["fused_head", "logits"])
@pytest.mark.parametrize("block", [7, 64, VOCAB_BLOCK])
def test_blocks_equal_the_whole_vocabulary(fused, block):
    g = torch.Generator().manual_seed(0)
    n, h, vocab, k, temperature = 6, 16, 50, 5, 0.7
    x = torch.randn(n, h, generator=g)
    w = torch.randn(vocab, h, generator=g) * 2
    logits = x @ w.t()
    head = SimpleNamespace(weight=w, vocab_start=0) if fused else None
    ids, lps = vocab_topk(x if fused else logits, head, k, temperature, block=block)
    ref_ids, ref_lps = reference(logits, k, temperature)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(lps.double(), ref_lps, rtol=0, atol=1e-5)


def test_no_tensor_holds_the_whole_vocabulary():
    """A 20,000-id vocabulary, 8 positions, a bf16 head of width 16: the whole fp32 logits (160,000 values) and the
    fp32 copy of the weight (320,000) are each larger than the bound, a block of either (8 x 8,192 or 8,192 x 16)."""
    g = torch.Generator().manual_seed(1)
    n, h, vocab, k = 8, 16, 20_000, 4
    x = torch.randn(n, h, generator=g).bfloat16()
    w = torch.randn(vocab, h, generator=g).bfloat16()
    head = SimpleNamespace(weight=w, vocab_start=0)
    with _Largest() as seen:
        ids, lps = vocab_topk(x, head, k, 1.0)
    assert seen.largest <= VOCAB_BLOCK * max(n, h) < n * vocab, seen.largest
    ref_ids, ref_lps = reference(x.float() @ w.float().t(), k, 1.0)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(lps.double(), ref_lps, rtol=0, atol=1e-4)
