"""The disaggregated refit holds a bucket at a time on both ends (issue 54, item 4): the sender described its buckets,
then sent them through one flat buffer; the engine loads each bucket before the next arrives. Before, the sender kept
a flat device copy of the whole stage from `send` to `release`, and the receiver allocated every bucket before
loading any: a second copy of the model on both devices.

Two gloo processes (sender = rank 0 of the refit group, engine worker = rank 1), real `collective.py` groups; the
bytes held by live tensors are sampled at every broadcast on each end (before the call: what is held while the bucket
is in flight), against the bytes each process held before the refit."""
from __future__ import annotations

import gc
from unittest import mock

import pytest
import torch

from megatron_rl.distributed.launch import free_port, run_distributed

DTYPES = (torch.float32, torch.bfloat16, torch.int64)


def _model() -> list[list[tuple[str, torch.Tensor]]]:
    """6 buckets of 3 tensors each (mixed dtypes, odd sizes), the same on both ranks."""
    g = torch.Generator().manual_seed(0)
    out = []
    for b in range(6):
        bucket = []
        for j, dt in enumerate(DTYPES):
            t = torch.randn(37 + 11 * b, 29 + j, generator=g) * 100
            bucket.append((f"layer{b}.w{j}", t.to(dt)))
        out.append(bucket)
    return out


def _held_bytes() -> int:
    """Bytes of every distinct storage a live Python tensor refers to (views count their whole buffer once)."""
    gc.collect()
    storages = {}
    for o in gc.get_objects():
        if isinstance(o, torch.Tensor) and not o.is_meta:
            s = o.untyped_storage()
            storages[s.data_ptr()] = s.nbytes()
    return sum(storages.values())


def refit_body(rank: int, world_size: int, port: int) -> dict:
    import torch.distributed as dist

    from megatron_rl.weights import collective as col
    from megatron_rl.weights.manifest import RefitHandle

    model = _model()
    cpu = torch.device("cpu")
    group = col.open_group("127.0.0.1", port, rank, 2)
    dest = {n: torch.zeros_like(t) for bucket in model for n, t in bucket}  # the engine's weights, loaded into
    box, samples, real = [None], [], col._broadcast
    baseline = _held_bytes()  # before `send`: what it keeps until the broadcast counts too
    if rank == 0:
        sender = col.CollectiveSender(group, 0, cpu)
        box = [sender.send(iter(model), version=3).to_dict()]
    dist.broadcast_object_list(box, src=0)  # the driver's hand-over of the manifest
    handle = RefitHandle.from_dict(box[0])

    def sampled(g, flat):
        samples.append(_held_bytes() - baseline)
        return real(g, flat)

    with mock.patch.object(col, "_broadcast", sampled):
        if rank == 0:
            sender.broadcast(iter(model))  # the export again (deterministic: the same tensors)
            sender.release()
        else:
            for bucket in col.CollectiveReceiver([group], cpu).receive(handle):
                for name, t in bucket:
                    dest[name].copy_(t)
                del bucket, t
    want = {n: t for bucket in model for n, t in bucket}
    return {"samples": samples, "bucket_bytes": [b.nbytes for b in handle.buckets],
            "loaded_equal": rank == 0 or all(torch.equal(dest[n], want[n]) for n in want)}


@pytest.fixture(scope="module")
def results():
    return run_distributed(refit_body, 2, args=(free_port(),), timeout=120)


@pytest.mark.parametrize("end", ["sender", "engine"])
def test_each_end_holds_at_most_two_buckets(results, end):
    r = results[0 if end == "sender" else 1]
    largest, total = max(r["bucket_bytes"]), sum(r["bucket_bytes"])
    assert len(r["samples"]) == len(r["bucket_bytes"]) == 6
    assert total > 3 * largest  # the bound below is well under the whole model
    assert max(r["samples"]) <= 2 * largest, (end, r["samples"], largest, total)


def test_engine_loads_the_sent_weights(results):
    assert results[1]["loaded_equal"] is True
