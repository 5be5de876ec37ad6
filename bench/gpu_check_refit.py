"""gpu_check's refit and placement sections: the colocated refit between processes, routed by device, and actor
placement under Ray with the device's real GPUs.

`ipc_refit`: the train section's worker exports the whole model through the platform's colocated transport (CUDA
IPC on GPU, shared memory on CPU) as a `RoutedUpdate` keyed by its device identity, the way the handover routes a
refit (`weights/routing.py`). Two receiver processes stand for two engine workers: each takes the handle of its own
device (`RoutedUpdate.for_device`), opens it (`transport.open_buckets`) and copies it like an engine's weight load;
both checksums must match the sender's. A third receiver is handed the same handle relabelled as another device's
and must refuse it. On one GPU every receiver shares the sender's device: the refusal is the per-device check.

`ray_placement`: Ray with this machine's GPUs, a placement group of one `{"GPU": 1}` bundle per GPU, a policy rank
and a colocated engine actor per bundle with the options `build()` gives them (`cluster.Placement`); each actor
reports its GPU's UUID through `platform.device_identity`, which must be the same for the two actors of a bundle and
differ between bundles. It needs Ray on the machine (the lent one has none unless its wheel travels with the check).
"""
from __future__ import annotations

import dataclasses
import os
import pickle
import queue
import time
import traceback

import torch


def _result_of(proc, q, timeout: float):
    """The child's (ok, payload), or an error as soon as it dies without answering (a crash in CUDA, say)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            return q.get(timeout=2)
        except queue.Empty:
            if not proc.is_alive():
                return False, f"receiver exited with code {proc.exitcode} without a result"
    return False, f"receiver gave no result in {timeout:.0f} s"


def _receiver(update: dict, samples: list[str], q) -> None:
    """Second process (an engine worker): take this device's handle of the routed update, open the buckets, copy
    them into fresh tensors as an engine's weight load would, checksum what arrived. Results travel pickled (tensor
    data copied, no fd sharing); a refusal comes back as {"refused": message}."""
    try:
        from bench.gpu_check import _plat, checksum
        from megatron_rl.weights.manifest import RefitError
        from megatron_rl.weights.routing import RoutedUpdate
        from megatron_rl.weights.transport import open_buckets

        plat = _plat()
        dev = plat.device(0)
        if plat.is_gpu:
            torch.cuda.set_device(dev)
        mine = plat.device_identity(dev)
        t0 = time.perf_counter()
        try:
            handle = RoutedUpdate.from_dict(update).for_device(mine, f"receiver {os.getpid()}")
            dst = {t.name: torch.empty(t.shape, dtype=getattr(torch, t.dtype), device=dev)
                   for b in handle.buckets for t in b.tensors}
            plat.synchronize()
            t0 = time.perf_counter()
            buckets = open_buckets(handle, dev)
        except RefitError as e:
            q.put((True, pickle.dumps({"refused": str(e), "pid": os.getpid()})))
            return
        plat.synchronize()
        t1 = time.perf_counter()
        for name, view in (nv for b in buckets for nv in b):
            dst[name].copy_(view, non_blocking=True)
        plat.synchronize()
        out = {"map_s": t1 - t0, "load_s": time.perf_counter() - t1, "pid": os.getpid(), "device": mine,
               "checksums": {n: checksum(v) for b in buckets for n, v in b},
               "samples": {n: dst[n].cpu().clone() for n in samples}}
        del buckets, dst
        q.put((True, pickle.dumps(out)))
    except BaseException:
        q.put((False, traceback.format_exc()))


def _run_receivers(update: dict, samples: list[str], count: int) -> list[dict]:
    """`count` spawned receivers of the same update, all at once, results in order."""
    ctx = torch.multiprocessing.get_context("spawn")
    runs = []
    for _ in range(count):
        q = ctx.Queue()
        p = ctx.Process(target=_receiver, args=(update, samples, q), daemon=True)
        p.start()
        runs.append((p, q))
    out = []
    try:
        for p, q in runs:
            ok, payload = _result_of(p, q, timeout=300)
            if not ok:
                raise RuntimeError(f"receiver failed:\n{payload}")
            out.append(pickle.loads(payload))
    finally:
        for p, _ in runs:
            p.join(timeout=60)
    return out


def ipc_refit(check) -> dict:
    from bench.gpu_check import _plat, _time, _wall, checksum
    from megatron_rl.weights.routing import RoutedUpdate
    from megatron_rl.weights.transport import make_sender

    w, plat = check._need_worker(), _plat()
    buckets, export_s = _wall(lambda: list(w.export_weights(check.shapes["bucket_mb"] << 20)))
    by_name = {n: t for b in buckets for n, t in b}
    nbytes = sum(t.numel() * t.element_size() for t in by_name.values())
    sums = {n: checksum(t) for n, t in by_name.items()}
    # a few tensors compared whole on this side (small ones: they travel back pickled); checksums cover all
    small = [n for n, t in by_name.items() if t.numel() <= 1 << 24]
    samples = [small[0], small[len(small) // 2], small[-1]]
    sender = make_sender(plat.refit_transport_colocated)
    try:
        handle, send_s = _wall(lambda: sender.send(buckets, version=1))
        mine = w.device_id()
        engines = _run_receivers(RoutedUpdate(1, {mine: handle}).to_dict(), samples, 2)
        # the same buffers, labelled as exported on another device: a receiver here must refuse to open them
        other = "GPU-00000000-0000-0000-0000-000000000000" if plat.is_gpu else mine + "-other"
        foreign = _run_receivers(RoutedUpdate(1, {mine: dataclasses.replace(handle, device=other)}).to_dict(),
                                 samples, 1)[0]
    finally:
        sender.release()  # after the receivers have exited: their mappings of the buffers are gone
        sender.close()
    refused = [e["refused"] for e in engines if "refused" in e]
    if refused:
        raise AssertionError(f"an engine worker on the sender's device refused its update: {refused[0]}")
    mismatched = sorted({n for e in engines for n in by_name if e["checksums"].get(n) != sums[n]})
    samples_equal = all(torch.equal(by_name[n].cpu(), e["samples"][n]) for e in engines for n in samples)
    flat = torch.empty(nbytes, dtype=torch.uint8, device=plat.device())
    copy_s = _time(lambda: torch.empty_like(flat).copy_(flat), reps=5)
    map_s, load_s = max(e["map_s"] for e in engines), max(e["load_s"] for e in engines)
    refit_s = send_s + map_s + load_s
    out = {"transport": plat.refit_transport_colocated, "buckets": len(buckets), "tensors": len(by_name),
           "bytes": nbytes, "export_s": export_s, "send_s": send_s, "map_s": map_s, "load_s": load_s,
           "refit_s": refit_s, "refit_gbs": nbytes / refit_s / 1e9, "copy_s": copy_s,
           "copy_gbs": nbytes / copy_s / 1e9, "refit_vs_copy": copy_s / refit_s, "receivers": len(engines),
           "device": mine, "checksums_match": not mismatched, "samples_equal": samples_equal,
           "receiver_pids": [e["pid"] for e in engines], "foreign_device_refused": "refused" in foreign,
           "foreign_refusal": foreign.get("refused")}
    if mismatched or not samples_equal or "refused" not in foreign:
        raise AssertionError(f"refit bytes differ or a foreign device's update was taken: {mismatched[:5]} "
                             f"samples_equal={samples_equal} foreign={sorted(foreign)}")
    return out


class _Where:
    """A Ray actor that reports the device it was given, as the policy ranks and engines identify it."""

    def where(self) -> dict:
        import ray

        from megatron_rl.platform import get_platform

        plat = get_platform()
        return {"gpu_ids": [str(g) for g in ray.get_gpu_ids()], "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
                "device_id": plat.device_identity(plat.device(0)) if plat.is_gpu else None}


def ray_placement(check) -> dict:
    try:
        import ray
    except ImportError as e:  # a section that could not run fails (gpu_check.py's PREINSTALLED/CARRIED say why)
        raise RuntimeError(f"ray is not importable here ({e}): nothing was placed; Ray is not among the carried "
                           "wheels") from e
    from bench.gpu_check import _plat
    from megatron_rl.distributed.cluster import reserve
    from megatron_rl.distributed.parallel_dims import device_layout

    plat = _plat()
    gpus = torch.cuda.device_count() if plat.is_gpu else 2  # CPU dry run: two logical GPUs
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    t0 = time.perf_counter()
    ray.init(address="local", num_cpus=2, num_gpus=gpus, include_dashboard=False, object_store_memory=256 << 20,
             configure_logging=False, log_to_driver=False)
    try:
        layout = device_layout(devices=gpus, tp=1, pp=1, dp=None, colocated=True, gen_tp=1, gen_dp=None)
        placement = reserve(layout.bundles, timeout_s=60)
        actors = []
        for b in range(layout.bundles):  # a policy rank and its colocated engine on every bundle
            for _ in range(2):
                actors.append(ray.remote(_Where).options(**placement.actor_options(b, layout.share)).remote())
        seen = ray.get([a.where.remote() for a in actors], timeout=120)
    finally:
        ray.shutdown()
    pairs = [seen[i:i + 2] for i in range(0, len(seen), 2)]
    same = all(a["gpu_ids"] == b["gpu_ids"] and a["device_id"] == b["device_id"] for a, b in pairs)
    distinct = len({p[0]["gpu_ids"][0] if p[0]["gpu_ids"] else None for p in pairs}) == len(pairs)
    out = {"device_key": placement.device_key, "bundles": layout.bundles, "actors": seen,
           "pairs_share_device": same, "bundles_distinct": distinct, "place_s": time.perf_counter() - t0}
    if placement.device_key != "GPU" or not (same and distinct):
        raise AssertionError(f"placement wrong: {out}")
    return out


def handover_memory(check) -> dict:
    """The trainer's side of the colocated handover's memory plan, measured on the train section's worker: device
    bytes (torch's allocator on GPU; the trainer's storages on CPU) after a step, with only the weights left for the
    refit, while the transport holds the whole model (the refit's peak, the engine's weights not included: vLLM
    cannot run here), after the refit's buffers are released, and offloaded. Checks the order's promise: the refit
    peak is at most the weights plus one copy of them, far below the training state."""
    from bench.gpu_check import _plat
    from megatron_rl.weights.transport import make_sender

    w, plat = check._need_worker(), _plat()

    def used() -> int:
        if plat.is_gpu:
            plat.synchronize()
            return torch.cuda.memory_allocated()
        return w.memory_report()["device_bytes"]

    check._step()
    phases = {"train": used()}
    weights = w.memory_report()["weight_bytes"]
    w.offload_train_state()
    phases["refit_weights_only"] = used()
    sender = make_sender(plat.refit_transport_colocated)
    try:
        handle = sender.send(w.export_weights(check.shapes["bucket_mb"] << 20), version=1)
        # CPU: the shared-memory arena is host memory outside the trainer's storages; counted from the handle
        phases["refit_peak"] = used() + (0 if plat.is_gpu else handle.nbytes)
    finally:
        sender.release()
        sender.close()
    plat.release_cached_memory()
    phases["refit_released"] = used()
    w.offload()
    phases["offloaded"] = used()
    w.onload()
    out = {"phases_bytes": phases, "weight_bytes": weights, "refit_buffer_bytes": handle.nbytes,
           "refit_peak_over_weights": phases["refit_peak"] / weights, "train_over_weights": phases["train"] / weights}
    # the peak: the weights and one exported copy (allocator slack on GPU), and the training state never with them
    if not (phases["refit_peak"] <= 2.2 * weights and phases["refit_weights_only"] <= 1.1 * weights
            and phases["train"] > phases["refit_weights_only"] and phases["offloaded"] <= 0.01 * weights):
        raise AssertionError(f"handover memory out of plan: {out}")
    return out
