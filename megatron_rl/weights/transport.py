"""Refit transports: move the policy's exported weights (HF names, full tensors) into a generation engine.

The policy's export yields buckets of `(hf_name, tensor)`. A *sender* turns them into a small, picklable
`RefitHandle` (the manifest: names, dtypes, shapes, byte offsets, sizes, plus where the bytes are); the
handle travels to the generator by any control channel (a direct call, a Ray actor call) and a *receiver* inside the
engine's worker turns it back into `(name, tensor)` buckets. The bytes never go through the control channel.

Which transport runs is the platform's decision (`get_platform().refit_transport_*`):
- ``shared_memory`` (CPU): each bucket is one flat file in /dev/shm, tensors 64-byte aligned, in an arena that
  persists across updates (`SharedMemorySender`); a version stamp pair in each file's header catches a truncated,
  torn or rewritten bucket before any weight is touched.
- ``cuda_ipc`` (GPU, colocated): each bucket is one flat CUDA buffer shared through a CUDA IPC handle
  (`torch.multiprocessing.reductions.reduce_tensor`); the sender keeps the buffers alive until the update is done.
- ``nccl`` (GPU, disaggregated): the manifest goes ahead, then the sender broadcasts each flat bucket from rank 0 of
  a stateless NCCL group (vLLM's `StatelessProcessGroup` + `PyNcclCommunicator`) to every engine worker.
The two GPU transports are written against torch/vLLM 0.32 APIs but cannot be exercised on the CPU machines.
"""
from __future__ import annotations

import atexit
import contextlib
import mmap
import os
import pickle
import struct
import uuid
import warnings
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

_HEADER = 64  # bytes before each bucket's data: magic, version whose write began, version whose write completed
_MAGIC = b"MRLREFT1"
_STAMPS = struct.Struct("<8sqq")
_LIVE_FILES: set[str] = set()  # created by this process and not yet removed: removed at exit so crashes leak nothing


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


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie holds no mapping any more
    except (OSError, IndexError):
        return False


def remove_orphaned_files(shm_dir: str = SHM_DIR) -> list[str]:
    """Remove refit files whose writer (the pid in `mrl-refit-<pid>-...`) is dead: an arena outlives its updates,
    so a writer killed with SIGKILL (no atexit) leaves one behind. Run by every new sender and by the driver at
    shutdown, after its workers are gone."""
    removed = []
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return removed
    for name in names:
        if not name.startswith(SHM_PREFIX):
            continue
        try:
            pid = int(name[len(SHM_PREFIX):].split("-", 1)[0])
        except ValueError:
            continue
        if pid != os.getpid() and not _pid_alive(pid):
            path = os.path.join(shm_dir, name)
            _unlink_quietly(path)
            removed.append(path)
    return removed


class _ArenaFile:
    """One bucket's file in /dev/shm, mapped shared and kept mapped: rewriting it is a copy into warm pages."""

    def __init__(self, path: str, specs: list[TensorSpec], size: int):
        self.path, self.specs, self.size = path, specs, size
        _LIVE_FILES.add(path)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, _HEADER + size)  # alignment gaps stay holes (read as zeros)
            st = os.fstat(fd)
            self.mm = mmap.mmap(fd, _HEADER + size, flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)
        self.identity = (st.st_dev, st.st_ino)
        _STAMPS.pack_into(self.mm, 0, _MAGIC, -1, -1)
        self.data = torch.frombuffer(self.mm, dtype=torch.uint8)[_HEADER:]

    def intact(self) -> bool:
        """False when someone removed or resized the file: writing through the mapping would then fault (SIGBUS)."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return False
        return (st.st_dev, st.st_ino) == self.identity and st.st_size == _HEADER + self.size

    def write(self, bucket: Bucket, version: int) -> None:
        _STAMPS.pack_into(self.mm, 0, _MAGIC, version, _read_stamps(self.mm)[1])
        for spec, (_, t) in zip(self.specs, bucket):
            self.data[spec.offset:spec.offset + spec.nbytes].copy_(_byte_view(t.cpu()))
        _STAMPS.pack_into(self.mm, 0, _MAGIC, version, version)

    def close(self) -> None:
        self.data = None
        with contextlib.suppress(BufferError):  # a view still alive elsewhere keeps the mapping until it dies
            self.mm.close()
        _unlink_quietly(self.path)


def _read_stamps(mm) -> tuple[int, int]:
    magic, begun, done = _STAMPS.unpack_from(mm, 0)
    if magic != _MAGIC:
        raise RefitError("not a refit bucket (bad magic)")
    return begun, done


class SharedMemorySender:
    """Writes each refit into a persistent arena: one /dev/shm file per bucket, created on the first refit (or when
    a bucket's layout changes) and rewritten in place after that; `close()` (or process exit) removes the files.

    Why persistent: creating, faulting in, checksumming and unlinking fresh tmpfs files for every update cost
    ~0.5 s per 0.5 GB on this machine, against 0.03 s to copy the same bytes into pages that are already mapped.

    Integrity without a checksum: each file's header holds the version whose write began and the version whose write
    completed (a seqlock). The receiver takes a bucket only when both equal the handle's version, checked before any
    weight is touched and again after loading, which catches a writer that died mid-bucket, a stale or replayed
    handle, and a bucket rewritten while it was read. A truncated or replaced file fails the size check.
    """

    def __init__(self, shm_dir: str = SHM_DIR):
        self.shm_dir = shm_dir
        remove_orphaned_files(shm_dir)
        self._tag = f"{SHM_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._files: list[_ArenaFile] = []
        self._generation = 0  # part of new file names, so a replaced bucket never reuses a path a receiver mapped

    def send(self, buckets: Iterable[Bucket], version: int) -> RefitHandle:
        handle = RefitHandle("shared_memory", int(version))
        count = 0
        for k, bucket in enumerate(buckets):
            specs, size = _layout(bucket)
            f = self._arena_file(k, specs, size)
            f.write(bucket, int(version))
            handle.buckets.append(BucketSpec(specs, size, f.path))
            count = k + 1
        for f in self._files[count:]:
            f.close()
        del self._files[count:]
        return handle

    def _arena_file(self, k: int, specs: list[TensorSpec], size: int) -> _ArenaFile:
        if k < len(self._files):
            f = self._files[k]
            if f.specs == specs and f.intact():
                return f
            f.close()
        self._generation += 1
        f = _ArenaFile(os.path.join(self.shm_dir, f"{self._tag}-{k}-g{self._generation}.bin"), specs, size)
        if k < len(self._files):
            self._files[k] = f
        else:
            self._files.append(f)
        return f

    @property
    def paths(self) -> list[str]:
        return [f.path for f in self._files]

    def release(self) -> None:
        """The receiver is done with this update (nothing to free: the arena is reused by the next one)."""

    def close(self) -> None:
        for f in self._files:
            f.close()
        self._files.clear()


# Receiver side: the mappings of the last update's files, reused while the file is the same (device, inode, size)
_MAPPED: dict[str, tuple[tuple[int, int, int], mmap.mmap, torch.Tensor]] = {}


def _map_readonly(path: str, k: int, b: BucketSpec, version: int):
    try:
        fd = os.open(path, os.O_RDONLY)
    except (FileNotFoundError, TypeError) as e:
        raise RefitError(f"refit v{version}: bucket {k} ({path}) is missing") from e
    try:
        st = os.fstat(fd)
        if st.st_size != _HEADER + b.nbytes:
            raise RefitError(f"refit v{version}: bucket {k} ({path}) is truncated or overlong: "
                             f"{st.st_size} bytes on disk, {_HEADER + b.nbytes} in the manifest")
        key = (st.st_dev, st.st_ino, st.st_size)
        cached = _MAPPED.get(path)
        if cached is not None and cached[0] == key:
            return cached
        mm = mmap.mmap(fd, st.st_size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    with warnings.catch_warnings():  # read-only by design: the engine's loaders only read (copy out of) these views
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        flat = torch.frombuffer(mm, dtype=torch.uint8)
    return key, mm, flat


def _check_stamps(mm, k: int, b: BucketSpec, version: int, when: str) -> None:
    try:
        begun, done = _read_stamps(mm)
    except RefitError as e:
        raise RefitError(f"refit v{version}: bucket {k} ({b.location}): {e}") from None
    if begun != version or done != version:
        what = (f"was rewritten by version {begun}" if begun != version else
                f"is torn: its writer began version {version} and did not finish")
        raise RefitError(f"refit v{version}: bucket {k} ({b.location}) {what} ({when})")


def map_shared_memory(handle: RefitHandle) -> list[Bucket]:
    """Views of every bucket of `handle`, after checking the sizes and stamps of all of them (no copies)."""
    out, mapped = [], {}
    for k, b in enumerate(handle.buckets):
        key, mm, flat = _map_readonly(b.location, k, b, handle.version)
        mapped[b.location] = (key, mm, flat)
        _check_stamps(mm, k, b, handle.version, "before loading")
        out.append(_views(flat[_HEADER:], b.tensors))
    _MAPPED.clear()  # mappings of files no longer in use close once their last view is gone
    _MAPPED.update(mapped)
    return out


def verify_shared_memory_unchanged(handle: RefitHandle) -> None:
    """After loading: every bucket still holds the handle's version (nobody rewrote it mid-read)."""
    for k, b in enumerate(handle.buckets):
        cached = _MAPPED.get(b.location)
        if cached is None:
            raise RefitError(f"refit v{handle.version}: bucket {k} ({b.location}) was not mapped by this process")
        _check_stamps(cached[1], k, b, handle.version, "after loading")


# ----------------------------------------------------------------------------------------------------------------
# CUDA IPC (GPU, colocated) — written for real, not runnable on CPU machines
# ----------------------------------------------------------------------------------------------------------------

class CudaIpcSender:
    """Packs each bucket into one flat CUDA buffer and exports an IPC handle for it.

    The buffers must outlive the receiver's use: keep them until `receive_weights` returned, then `release()` (which
    also lets the CUDA driver reclaim the exported memory via `torch.cuda.ipc_collect`).
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

    def release(self) -> None:
        self._keepalive.clear()
        torch.cuda.ipc_collect()

    def close(self) -> None:
        self.release()


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
    allows before the first tensor is handed out (shared memory: all sizes and stamps; CUDA IPC: all sizes;
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


def make_sender(transport: str) -> SharedMemorySender | CudaIpcSender:
    """Sender for the in-band transports. Keep it for the process's life: `send(buckets, version)` per update,
    `release()` once the receiver has loaded it, `close()` at the end. NCCL needs its group: use `NcclSender`."""
    if transport == "shared_memory":
        return SharedMemorySender()
    if transport == "cuda_ipc":
        return CudaIpcSender()
    raise ValueError(f"transport {transport!r} cannot be used in-band; NCCL refits go through NcclSender")


def verify_after_load(handle: RefitHandle) -> None:
    """Receiver, after loading: raise `RefitError` if the bytes changed while they were read (shared memory);
    the other transports hand over buffers nobody rewrites during a load."""
    if handle.transport == "shared_memory":
        verify_shared_memory_unchanged(handle)
