"""Verified refits' two halves without an engine (the real engine's check: test_generation.py
`test_verified_refit_names_a_skipped_or_altered_tensor`, both reload paths in `TestTied`):

- the fingerprint, against numpy reading the same bytes as little-endian int32 words at the documented runs; the
  flat-buffer gather (in-band senders, every receiver) equals the per-tensor one (collective sender);
- `check_refit` names a missing, altered or unloaded tensor and lets a tied alias go unloaded;
- `LoadTrace` credits loader calls to the received tensor (views of it too) and misses a skipped one.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_rl.generation.load_trace import LoadTrace
from megatron_rl.weights.fingerprint import (RUN, RUNS, bucket_bytes, check_refit, fingerprint_bucket,
                                             fingerprint_flat)
from megatron_rl.weights.manifest import RefitError, as_bytes, bucket_layout, typed_views


def _bucket():
    g = torch.Generator().manual_seed(0)
    return [("w", torch.randn(300, 70, generator=g)), ("b", torch.randn(5, generator=g).bfloat16()),
            ("ids", torch.arange(7, dtype=torch.uint8)), ("e", torch.randn(100_001, generator=g).bfloat16()),
            ("flag", torch.ones(3, dtype=torch.bool)), ("h", torch.randn(1024, generator=g))]


def _numpy_fingerprint(t: torch.Tensor) -> int:
    raw = t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    words = np.frombuffer(raw[:len(raw) // 4 * 4], dtype="<i4").astype(np.int64)
    n = words.size
    if n <= RUNS * RUN:
        return int(words.sum())
    step = n // RUNS
    return int(sum(words[r * step:r * step + RUN].sum() for r in range(RUNS)))


def _flat(bucket):
    specs, size = bucket_layout(bucket)
    flat = torch.zeros(size, dtype=torch.uint8)
    for s, (_, t) in zip(specs, bucket):
        flat[s.offset:s.offset + s.nbytes].copy_(as_bytes(t))
    return flat, specs, size


def test_fingerprint_matches_numpy_and_both_paths_agree():
    bucket = _bucket()
    expect = [_numpy_fingerprint(t) for _, t in bucket]
    flat, specs, size = _flat(bucket)
    assert fingerprint_bucket(bucket) == expect
    assert fingerprint_flat(flat, specs) == expect
    # a receiver has only the views: the flat buffer is found again from them
    assert fingerprint_flat(bucket_bytes(typed_views(flat, specs), specs, size), specs) == expect


def test_fingerprint_sees_a_changed_run_element():
    bucket = _bucket()
    before = fingerprint_bucket(bucket)
    w = bucket[3][1]  # 100,001 bf16 = 50,000 words: sampled in runs
    step = (w.numel() // 2) // RUNS
    w.view(-1)[2 * step * 5 + 3] += 1  # inside run 5
    after = fingerprint_bucket(bucket)
    assert after[3] != before[3] and after[:3] == before[:3] and after[4:] == before[4:]


def test_check_refit_names_what_went_wrong():
    sent = {"a": 1, "b": 2, "lm_head.weight": 3}
    ok = {"received": dict(sent), "consumed": ["a", "b"]}
    check_refit(sent, ok, optional_names={"lm_head.weight"})
    with pytest.raises(RefitError, match="engine worker 1: 1 tensor.*reached no weight loader .*: b"):
        check_refit(sent, {"received": dict(sent), "consumed": ["a"]}, {"lm_head.weight"}, "engine worker 1")
    with pytest.raises(RefitError, match="other values than were sent: a .*sent 1, received 7"):
        check_refit(sent, {"received": {**sent, "a": 7}, "consumed": ["a", "b"]}, {"lm_head.weight"})
    with pytest.raises(RefitError, match="never arrived: b"):
        check_refit(sent, {"received": {"a": 1, "lm_head.weight": 3}, "consumed": ["a"]}, {"lm_head.weight"})


class _Model(torch.nn.Module):
    """A vLLM-shaped model: fused q/k rows filled by a loader taking a shard id, a plain parameter with none (the
    default loader), and a `load_weights` that skips names it does not map and converts one tensor first."""

    def __init__(self):
        super().__init__()
        self.qk = torch.nn.Parameter(torch.zeros(4, 3))
        self.norm = torch.nn.Parameter(torch.zeros(3))
        self.scale = torch.nn.Parameter(torch.zeros(3))

        def qk_loader(param, loaded_weight, shard):
            param.data[2 * shard:2 * shard + 2].copy_(loaded_weight)

        self.qk.weight_loader = qk_loader

    def load_weights(self, weights):
        for name, t in weights:
            if name in ("q", "k"):
                self.qk.weight_loader(self.qk, t.narrow(0, 0, 2), 0 if name == "q" else 1)
            elif name == "norm":
                getattr(self.norm, "weight_loader", lambda p, w: p.data.copy_(w))(self.norm, t)
            elif name == "scale":  # converted before loading: no byte of the received tensor reaches the loader
                getattr(self.scale, "weight_loader", lambda p, w: p.data.copy_(w))(self.scale, t * 2)
            # anything else: skipped, as vLLM's loaders skip names they do not map


def test_load_trace_credits_loader_calls_and_misses_a_skipped_tensor():
    model = _Model()
    received = [("q", torch.ones(2, 3)), ("k", torch.full((3, 3), 2.0)), ("norm", torch.ones(3)),
                ("scale", torch.ones(3)), ("renamed.weight", torch.ones(3))]
    trace = LoadTrace(model)
    with trace.installed():
        model.load_weights(trace.feed(iter(received)))
    assert trace.consumed == {"q", "k", "norm", "scale"}
    assert torch.equal(model.qk.data, torch.tensor([[1.0] * 3] * 2 + [[2.0] * 3] * 2))
    # the loaders are the model's own again, and a parameter that had none has none
    assert "weight_loader" not in model.norm.__dict__ and model.qk.weight_loader.__name__ == "qk_loader"
    assert "load_weights" not in model.__dict__


def test_load_trace_credits_the_newest_tensor_at_reused_addresses():
    """The collective transport frees each bucket once it is loaded, and the next one may be allocated at the same
    addresses: a view of the new bucket's tensor is credited to it, not to a freed tensor that started there."""
    buf = torch.zeros(64)
    trace = LoadTrace(_Model())
    stream = trace.feed(iter([("old.a", buf[0:8]), ("old.b", buf[8:11]), ("new", buf[0:12])]))
    for _ in stream:
        pass
    assert trace._owner(buf[8:10]) == "new"  # inside the freed "old.b" too, which started later than "new"
    assert trace._owner(buf[0:2]) == "new" and trace._owner(buf[20:22]) is None
