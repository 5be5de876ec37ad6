"""Verified refits: what the sender sent against what reached the engine's weight loaders, tensor by tensor.

A refit can go wrong without any error: a transport hands over the wrong bytes (a stale buffer, a bad offset), or the
engine's `load_weights` skips a tensor whose name it does not map (vLLM's model loaders `continue` past names they do
not know, and a renamed layer does exactly that). Then the engine samples from weights the trainer never had, and
only the mismatch metrics hint at it. So every update carries, per tensor, a fingerprint computed by the sender where
the tensor lives (`fingerprint_bucket`, stored in the handle's `BucketSpec.fingerprints`); each engine worker
computes the same on what it received and records which received tensors a weight loader consumed
(`generation/load_trace.py`); the generator compares the two (`check_refit`) and refuses the update naming the
tensor and the worker.

The fingerprint is the int64 sum of a tensor's bytes read as 4-byte integers, over 16 evenly spaced runs of 64 words
(the whole tensor when smaller): exact, so it compares with `==` on any device and in any summation order. Runs, not
every byte: a full pass over SmolLM2-135M costs 11 ms per end on a 2-core EPYC, ~10 % of its 0.12 s refit. In-band
senders and every receiver take all of a bucket's fingerprints from its flat buffer in one gather (`fingerprint_flat`),
since per-tensor torch calls alone cost ~3 ms per end for its 273 tensors; the collective sender, which describes its
buckets before it lays them out, reads each tensor's runs at the same word offsets (`fingerprint_bucket`). A skipped
tensor is caught by the loader trace whatever its values; a wrong, stale or shifted tensor changes its runs.
"""
from __future__ import annotations

import functools

import torch

RUNS, RUN = 16, 64


def _runs(nwords: int) -> torch.Tensor:
    """Word offsets sampled from a tensor of `nwords` 4-byte words, relative to its first word."""
    if nwords <= RUNS * RUN:
        return torch.arange(nwords)
    return (torch.arange(RUNS)[:, None] * (nwords // RUNS) + torch.arange(RUN)).reshape(-1)


def fingerprint_bucket(bucket) -> list[int]:
    """The fingerprint of each tensor of `bucket` (a list of (name, tensor)), on the tensors' own device."""
    from megatron_rl.weights.manifest import as_bytes

    sums = []
    for _, t in bucket:
        raw = as_bytes(t)
        words = raw[:raw.numel() // 4 * 4].view(torch.int32)
        sums.append(words[_runs(words.numel()).to(words.device)].sum(dtype=torch.int64))
    return torch.stack(sums).cpu().tolist() if sums else []


@functools.lru_cache(maxsize=256)
def _gather_plan(layout: tuple[tuple[int, int], ...], device: str):
    """For a bucket layout ((offset, nbytes), ...): the word indices of the tensors with all RUNS x RUN words sampled
    (summed as rows of one gather) and of the smaller ones (summed by segment), with their positions."""
    big, small, small_seg, big_pos, small_pos = [], [], [], [], []
    for k, (offset, nbytes) in enumerate(layout):
        idx = _runs(nbytes // 4) + offset // 4  # offsets are 64-byte aligned
        if idx.numel() == RUNS * RUN:
            big.append(idx)
            big_pos.append(k)
        else:
            small_seg.append(torch.full((idx.numel(),), len(small_pos)))
            small.append(idx)
            small_pos.append(k)
    cat = lambda xs: torch.cat(xs).to(device) if xs else torch.zeros(0, dtype=torch.long, device=device)  # noqa: E731
    return cat(big), big_pos, cat(small), cat(small_seg), small_pos


def fingerprint_flat(data: torch.Tensor, specs) -> list[int]:
    """The fingerprints of the tensors `specs` (manifest.TensorSpec) laid out in `data`, a bucket's uint8 bytes."""
    if not specs:
        return []
    big, big_pos, small, small_seg, small_pos = _gather_plan(tuple((s.offset, s.nbytes) for s in specs),
                                                             str(data.device))
    words = data[:data.numel() // 4 * 4].view(torch.int32)
    out = [0] * len(specs)
    if big_pos:
        for k, v in zip(big_pos, words[big].view(len(big_pos), -1).sum(1, dtype=torch.int64).tolist()):
            out[k] = v
    if small_pos:
        sums = torch.zeros(len(small_pos), dtype=torch.int64, device=data.device)
        for k, v in zip(small_pos, sums.index_add_(0, small_seg, words[small].long()).tolist()):
            out[k] = v
    return out


def bucket_bytes(bucket, specs, nbytes: int) -> torch.Tensor:
    """The flat uint8 buffer a received bucket's views (`manifest.typed_views`) were cut from."""
    first = bucket[0][1]
    storage = first.untyped_storage()
    start = first.data_ptr() - specs[0].offset - storage.data_ptr()
    return torch.empty(0, dtype=torch.uint8, device=first.device).set_(storage, start, (nbytes,), (1,))


def sent_fingerprints(buckets) -> dict[str, int] | None:
    """name -> fingerprint from a handle's bucket specs; None when the sender attached none."""
    out = {}
    for b in buckets:
        if b.fingerprints is None:
            return None
        out.update({t.name: fp for t, fp in zip(b.tensors, b.fingerprints)})
    return out


def check_refit(sent: dict[str, int], report: dict, optional_names=(), where: str = "engine") -> None:
    """Raise `RefitError` naming the first tensors that did not arrive as sent or that no weight loader took.

    `report` (one engine worker's, `generation/worker_extension.py`): `received` (name -> fingerprint of what
    arrived) and `consumed` (names a weight loader was called with). `optional_names` may go unconsumed (a tied
    model's lm_head, which vLLM's loaders skip on purpose)."""
    from megatron_rl.weights.manifest import RefitError

    received, consumed = report["received"], set(report["consumed"])
    missing = [n for n in sent if n not in received]
    differ = [n for n, fp in sent.items() if n in received and received[n] != fp]
    skipped = [n for n in sent if n in received and n not in consumed and n not in set(optional_names)]
    problems = []
    if missing:
        problems.append(f"{len(missing)} tensor(s) never arrived: {', '.join(missing[:3])}")
    if differ:
        n = differ[0]
        problems.append(f"{len(differ)} tensor(s) arrived with other values than were sent: {', '.join(differ[:3])}"
                        f" (fingerprint sent {sent[n]}, received {received[n]})")
    if skipped:
        problems.append(f"{len(skipped)} tensor(s) reached no weight loader (the engine kept its old values): "
                        f"{', '.join(skipped[:3])}")
    if problems:
        raise RefitError(f"refit verification failed on {where}: " + "; ".join(problems)
                         + "; its weights are undefined until the next successful refit")
