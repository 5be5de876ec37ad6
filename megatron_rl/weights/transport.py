"""Refit transports: move the policy's exported weights (HF names, full tensors) into a generation engine.

The policy's export yields buckets of `(hf_name, tensor)`. A *sender* turns them into a small, picklable
`RefitHandle` (the manifest: names, dtypes, shapes, byte offsets, sizes, checksums, plus where the bytes are); the
handle travels to the generator by any control channel (a direct call, a Ray actor call) and a *receiver* inside the
engine's worker turns it back into `(name, tensor)` buckets. The bytes never go through the control channel.

Which transport runs is the platform's decision (`get_platform().refit_transport_*`):
- ``shared_memory`` (CPU): each bucket is one flat file in /dev/shm, tensors 64-byte aligned; the manifest carries a
  CRC32 per bucket so a truncated or torn bucket is caught *before* any weight is touched.
- ``cuda_ipc`` (GPU, colocated): each bucket is one flat CUDA buffer shared through a CUDA IPC handle
  (`torch.multiprocessing.reductions.reduce_tensor`); the sender keeps the buffers alive until the update is done.
- ``nccl`` (GPU, disaggregated): the manifest goes ahead, then the sender broadcasts each flat bucket from rank 0 of
  a stateless NCCL group (vLLM's `StatelessProcessGroup` + `PyNcclCommunicator`) to every engine worker.
The two GPU transports are written against torch/vLLM 0.32 APIs but cannot be exercised on the CPU machines.
"""
from __future__ import annotations

import atexit
import os
import pickle
import uuid
import zlib
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field

import torch

Bucket = list[tuple[str, torch.Tensor]]

SHM_DIR = "/dev/shm"
SHM_PREFIX = "mrl-refit-"
_ALIGN = 64  # keeps every tensor view aligned for SIMD kernels and for `.view(dtype)`


class RefitError(RuntimeError):
    """A weight update was refused; the engine still holds the previous weights and version."""


@dataclass
class TensorSpec:
    name: str
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "bfloat16"
    shape: list[int]
    offset: int  # byte offset inside the bucket's flat buffer
    nbytes: int


@dataclass
class BucketSpec:
    tensors: list[TensorSpec]
    nbytes: int
    location: str | bytes | None = None  # shm: file path; cuda_ipc: pickled {gpu_uuid: rebuild args}; nccl: None
    checksum: int | None = None  # CRC32 of the whole flat buffer (shared memory only)


@dataclass
class RefitHandle:
    """What travels from the sender to the generator: small, picklable, and a plain dict via `to_dict`."""
    transport: str
    version: int
    buckets: list[BucketSpec] = field(default_factory=list)

    def names(self) -> list[str]:
        return [t.name for b in self.buckets for t in b.tensors]

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {t.name: tuple(t.shape) for b in self.buckets for t in b.tensors}

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "RefitHandle":
        if isinstance(d, RefitHandle):
            return d
        buckets = [BucketSpec(**{**b, "tensors": [TensorSpec(**t) for t in b["tensors"]]}) for b in d["buckets"]]
        return cls(d["transport"], int(d["version"]), buckets)

    def cleanup(self) -> None:
        """Remove this update's shared-memory files. Idempotent: receiver and sender may both call it."""
        if self.transport != "shared_memory":
            return
        for b in self.buckets:
            _unlink_quietly(b.location)


# ----------------------------------------------------------------------------------------------------------------
# Validation (runs before any weight is touched)
# ----------------------------------------------------------------------------------------------------------------

def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise RefitError(f"unknown dtype {name!r} in refit manifest")
    return dt


def _dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


def _brief(names) -> str:
    names = sorted(names)
    return ", ".join(names[:5]) + (f" (+{len(names) - 5} more)" if len(names) > 5 else "")


def validate_manifest(handle: RefitHandle, expected_names: Iterable[str] | None = None,
                      expected_shapes: dict[str, tuple[int, ...]] | None = None,
                      optional_names: Iterable[str] = ()) -> None:
    """Check the manifest alone (no bytes read): complete name set, no duplicates, shapes, and a layout where every
    tensor lies inside its bucket. Raises `RefitError` naming what is wrong."""
    names = handle.names()
    dupes = {n for n, c in Counter(names).items() if c > 1}
    if dupes:
        raise RefitError(f"refit v{handle.version}: duplicate tensors {_brief(dupes)}")
    if expected_names is not None:
        expected, got, optional = set(expected_names), set(names), set(optional_names)
        missing, unexpected = expected - got, got - expected - optional
        if missing or unexpected:
            raise RefitError(f"refit v{handle.version} does not match the model: "
                             f"missing {len(missing)} [{_brief(missing)}], unexpected {len(unexpected)} "
                             f"[{_brief(unexpected)}]; the engine keeps its previous weights")
    for b in handle.buckets:
        for t in b.tensors:
            numel = 1
            for s in t.shape:
                numel *= int(s)
            if t.nbytes != numel * _dtype(t.dtype).itemsize or t.offset < 0 or t.offset + t.nbytes > b.nbytes:
                raise RefitError(f"refit v{handle.version}: manifest entry for {t.name} is inconsistent "
                                 f"(shape {t.shape}, {t.dtype}, {t.nbytes} bytes at {t.offset} of {b.nbytes})")
            if expected_shapes and t.name in expected_shapes and tuple(t.shape) != tuple(expected_shapes[t.name]):
                raise RefitError(f"refit v{handle.version}: {t.name} has shape {tuple(t.shape)}, "
                                 f"the model expects {tuple(expected_shapes[t.name])}")


def _layout(bucket: Bucket) -> tuple[list[TensorSpec], int]:
    specs, off = [], 0
    for name, t in bucket:
        nbytes = t.numel() * t.element_size()
        specs.append(TensorSpec(name, _dtype_name(t.dtype), list(t.shape), off, nbytes))
        off += (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
    return specs, max(off, 1)


def _byte_view(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous()
    return t.reshape(-1).view(torch.uint8)


def _views(flat: torch.Tensor, specs: list[TensorSpec]) -> Bucket:
    """Typed, shaped views into a flat uint8 buffer: no copies."""
    return [(s.name, flat[s.offset:s.offset + s.nbytes].view(_dtype(s.dtype)).view(s.shape)) for s in specs]


# ----------------------------------------------------------------------------------------------------------------
# Shared memory (CPU)
# ----------------------------------------------------------------------------------------------------------------

_LIVE_FILES: set[str] = set()  # written by this process and not yet removed: removed at exit so crashes leak nothing


def _unlink_quietly(path) -> None:
    if isinstance(path, str):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        _LIVE_FILES.discard(path)


@atexit.register
def _remove_live_files() -> None:
    for p in list(_LIVE_FILES):
        _unlink_quietly(p)


def send_shared_memory(buckets: Iterable[Bucket], version: int, shm_dir: str = SHM_DIR) -> RefitHandle:
    """Write each bucket into one /dev/shm file (streaming: a bucket can be freed as soon as it is written).

    Written with `os.pwrite` from each tensor's own memory: the kernel copies into the tmpfs pages in one pass and
    allocates them as it goes, which measured faster than faulting in a fresh mapping and copying with torch (whose
    multi-threaded copy also suffers badly when the cores are shared). The CRC32 is taken over the same source bytes
    while they are hot in cache. On any failure the files written so far are removed.
    """
    handle = RefitHandle("shared_memory", int(version))
    tag = f"{SHM_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}-v{int(version)}"
    try:
        for k, bucket in enumerate(buckets):
            specs, size = _layout(bucket)
            path = os.path.join(shm_dir, f"{tag}-{k}.bin")
            _LIVE_FILES.add(path)
            handle.buckets.append(BucketSpec(specs, size, path))
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.ftruncate(fd, size)  # alignment gaps stay holes (read as zeros)
                crc = 0
                for spec, (_, t) in zip(specs, bucket):
                    src = memoryview(_byte_view(t.cpu()).numpy())
                    done = 0
                    while done < spec.nbytes:  # pwrite may write less than asked
                        done += os.pwrite(fd, src[done:], spec.offset + done)
                    crc = zlib.crc32(src, crc)
            finally:
                os.close(fd)
            handle.buckets[-1].checksum = crc
    except BaseException:
        handle.cleanup()
        raise
    return handle


def map_shared_memory(handle: RefitHandle) -> list[Bucket]:
    """Map every bucket of `handle` and verify sizes and checksums of all of them before returning any tensor.

    The tensors are copy-on-write views of the files (MAP_PRIVATE): reading them costs no copy, and a consumer that
    writes into them cannot corrupt the sender's data. Unlinking the files afterwards is safe while views live.
    """
    import mmap

    out = []
    for k, b in enumerate(handle.buckets):
        crc_span = 0
        try:
            fd = os.open(b.location, os.O_RDONLY)
        except (FileNotFoundError, TypeError) as e:
            raise RefitError(f"refit v{handle.version}: bucket {k} ({b.location}) is missing") from e
        try:
            size = os.fstat(fd).st_size
            if size != b.nbytes:
                raise RefitError(f"refit v{handle.version}: bucket {k} ({b.location}) is truncated or overlong: "
                                 f"{size} bytes on disk, {b.nbytes} in the manifest")
            mm = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        flat = torch.frombuffer(mm, dtype=torch.uint8)
        # CRC over exactly the bytes the sender hashed (the tensors, not the alignment padding)
        for s in b.tensors:
            crc_span = zlib.crc32(memoryview(flat[s.offset:s.offset + s.nbytes].numpy()), crc_span)
        if b.checksum is not None and crc_span != b.checksum:
            raise RefitError(f"refit v{handle.version}: bucket {k} ({b.location}) fails its checksum "
                             f"(torn or overwritten)")
        out.append(_views(flat, b.tensors))
    return out


# ----------------------------------------------------------------------------------------------------------------
# CUDA IPC (GPU, colocated) — written for real, not runnable on CPU machines
# ----------------------------------------------------------------------------------------------------------------

class CudaIpcSender:
    """Packs each bucket into one flat CUDA buffer and exports an IPC handle for it.

    The buffers must outlive the receiver's use: keep this object until `receive_weights` returned, then `close()`
    (which also lets the CUDA driver reclaim the exported memory via `torch.cuda.ipc_collect`).
    """

    def __init__(self):
        self._keepalive: list[torch.Tensor] = []

    def send(self, buckets: Iterable[Bucket], version: int) -> RefitHandle:
        from torch.multiprocessing.reductions import reduce_tensor

        handle = RefitHandle("cuda_ipc", int(version))
        device = torch.cuda.current_device()
        uuid_ = str(torch.cuda.get_device_properties(device).uuid)
        for bucket in buckets:
            specs, size = _layout(bucket)
            flat = torch.empty(size, dtype=torch.uint8, device=device)
            for spec, (_, t) in zip(specs, bucket):
                flat[spec.offset:spec.offset + spec.nbytes].copy_(_byte_view(t.to(device, non_blocking=True)))
            self._keepalive.append(flat)
            _rebuild, args = reduce_tensor(flat)
            # pickled here so the handle stays plain bytes for msgpack-based RPC (vLLM multiprocess executors)
            handle.buckets.append(BucketSpec(specs, size, pickle.dumps({uuid_: args})))
        torch.cuda.synchronize(device)  # the receiver reads on another stream/process: data must be complete
        return handle

    def close(self) -> None:
        self._keepalive.clear()
        torch.cuda.ipc_collect()


def map_cuda_ipc(handle: RefitHandle, device: torch.device) -> list[Bucket]:
    """Open the sender's buffers in this (engine worker) process; checks each buffer's size against the manifest."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    my_uuid = str(torch.cuda.get_device_properties(device).uuid)
    out = []
    for k, b in enumerate(handle.buckets):
        per_gpu = pickle.loads(b.location)
        if my_uuid not in per_gpu:
            raise RefitError(f"refit v{handle.version}: bucket {k} was exported from GPU(s) {list(per_gpu)}, "
                             f"not from this worker's GPU {my_uuid} (colocated CUDA IPC needs the same device)")
        args = list(per_gpu[my_uuid])
        args[6] = device.index  # reduce_tensor's device slot: the receiver's ordinal for the same physical GPU
        flat = rebuild_cuda_tensor(*args)
        if flat.numel() != b.nbytes:
            raise RefitError(f"refit v{handle.version}: bucket {k} has {flat.numel()} bytes, manifest {b.nbytes}")
        out.append(_views(flat, b.tensors))
    return out


# ----------------------------------------------------------------------------------------------------------------
# NCCL broadcast (GPU, disaggregated) — written for real, not runnable on CPU machines
# ----------------------------------------------------------------------------------------------------------------

def describe_buckets(bucket_meta: Iterable[list[tuple[str, torch.dtype, tuple[int, ...]]]], version: int,
                     transport: str = "nccl") -> RefitHandle:
    """Build the manifest from metadata only (names, dtypes, shapes), so it can go ahead of the broadcast."""
    handle = RefitHandle(transport, int(version))
    for meta in bucket_meta:
        fake = [(n, torch.empty(shape, dtype=dt, device="meta")) for n, dt, shape in meta]
        specs, size = _layout(fake)
        handle.buckets.append(BucketSpec(specs, size))
    return handle


def _nccl_group(host: str, port: int, rank: int, world_size: int, device: torch.device):
    from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
    from vllm.distributed.utils import StatelessProcessGroup

    # A stateless group does not touch torch.distributed's default group, which Megatron and vLLM each own.
    pg = StatelessProcessGroup.create(host=host, port=port, rank=rank, world_size=world_size)
    return PyNcclCommunicator(pg, device=device)


class NcclSender:
    """Rank 0 of the refit group (the policy's exporting rank). Engine workers join as ranks 1..world_size-1."""

    def __init__(self, host: str, port: int, world_size: int, device: torch.device | None = None):
        self.device = device or torch.device("cuda", torch.cuda.current_device())
        self.comm = _nccl_group(host, port, 0, world_size, self.device)

    def send(self, handle: RefitHandle, buckets: Iterable[Bucket]) -> None:
        """Broadcast the buckets in manifest order; `handle` must come from `describe_buckets` on the same metadata
        and must already have been given to the receivers (they validate it, then post matching receives)."""
        for k, (spec, bucket) in enumerate(zip(handle.buckets, buckets, strict=True)):
            if [n for n, _ in bucket] != [t.name for t in spec.tensors]:
                raise RefitError(f"NCCL refit: bucket {k} does not match the announced manifest")
            flat = torch.empty(spec.nbytes, dtype=torch.uint8, device=self.device)
            for t_spec, (_, t) in zip(spec.tensors, bucket):
                flat[t_spec.offset:t_spec.offset + t_spec.nbytes].copy_(_byte_view(t.to(self.device)))
            self.comm.broadcast(flat, src=0)
        torch.cuda.synchronize(self.device)


class NcclReceiver:
    def __init__(self, host: str, port: int, rank: int, world_size: int, device: torch.device):
        self.device = device
        self.comm = _nccl_group(host, port, rank, world_size, device)

    def receive(self, handle: RefitHandle) -> Iterator[Bucket]:
        """Yield each bucket as it arrives (one bucket of receive buffer at a time)."""
        for b in handle.buckets:
            flat = torch.empty(b.nbytes, dtype=torch.uint8, device=self.device)
            self.comm.broadcast(flat, src=0)
            yield _views(flat, b.tensors)


def open_buckets(handle: RefitHandle, device: torch.device, nccl: NcclReceiver | None = None):
    """Receiver entry point: the buckets of `handle` as `(name, tensor)` lists, validated as far as the transport
    allows before the first tensor is handed out (shared memory: all sizes and checksums; CUDA IPC: all sizes;
    NCCL: the manifest only — the data arrives while loading)."""
    if handle.transport == "shared_memory":
        return map_shared_memory(handle)
    if handle.transport == "cuda_ipc":
        return map_cuda_ipc(handle, device)
    if handle.transport == "nccl":
        if nccl is None:
            raise RefitError("NCCL refit requested but this worker has not joined a refit group (init_nccl_group)")
        return nccl.receive(handle)
    raise RefitError(f"unknown refit transport {handle.transport!r}")


def send(buckets: Iterable[Bucket], version: int, transport: str) -> tuple[RefitHandle, object | None]:
    """Sender entry point for the in-band transports: returns the handle and an object to keep alive until the
    receiver is done (`CudaIpcSender`, closed by the caller) or None. NCCL needs its group: use `NcclSender`."""
    if transport == "shared_memory":
        return send_shared_memory(buckets, version), None
    if transport == "cuda_ipc":
        sender = CudaIpcSender()
        return sender.send(buckets, version), sender
    raise ValueError(f"transport {transport!r} cannot be used in-band; NCCL refits go through NcclSender")
