"""The refit manifest: what travels from a weight sender to a generator, whatever carries the bytes.

The policy's export yields buckets of `(hf_name, tensor)`. A sender (one per transport: `shared_memory.py`,
`cuda_ipc.py`, `collective.py`) lays each bucket out as one flat byte buffer and describes it in a small, picklable
`RefitHandle` (names, dtypes, shapes, byte offsets, sizes, plus where the bytes are); the handle travels by any control
channel, and the receiver turns it back into `(name, tensor)` views. `validate_manifest` checks a handle against the
model before any byte is read, so a bad update is refused with the engine's weights untouched.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

Bucket = list[tuple[str, torch.Tensor]]

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
    fingerprints: list[int] | None = None  # per tensor, the sender's (weights/fingerprint.py)


@dataclass
class RefitHandle:
    """What travels from the sender to the generator: small, picklable, and a plain dict via `to_dict`."""
    transport: str
    version: int
    buckets: list[BucketSpec] = field(default_factory=list)
    device: str | None = None  # in-band transports: identity of the device the buffers are on (routing.py)

    def names(self) -> list[str]:
        return [t.name for b in self.buckets for t in b.tensors]

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {t.name: tuple(t.shape) for b in self.buckets for t in b.tensors}

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)

    def to_dict(self) -> dict:
        """Plain values only (it crosses process boundaries). Built by hand: `dataclasses.asdict` deep-copies every
        field and took 7 ms per refit for SmolLM2-135M's 272 tensors, more than the refit check it carries."""
        return {"transport": self.transport, "version": self.version, "device": self.device,
                "buckets": [{"tensors": [{"name": t.name, "dtype": t.dtype, "shape": list(t.shape), "offset": t.offset,
                                          "nbytes": t.nbytes} for t in b.tensors],
                             "nbytes": b.nbytes, "location": b.location,
                             "fingerprints": None if b.fingerprints is None else list(b.fingerprints)}
                            for b in self.buckets]}

    @classmethod
    def from_dict(cls, d: dict) -> "RefitHandle":
        if isinstance(d, RefitHandle):
            return d
        buckets = [BucketSpec(**{**b, "tensors": [TensorSpec(**t) for t in b["tensors"]]}) for b in d["buckets"]]
        return cls(d["transport"], int(d["version"]), buckets, d.get("device"))


# ----------------------------------------------------------------------------------------------------------------
# Validation (runs before any weight is touched)
# ----------------------------------------------------------------------------------------------------------------

def dtype_of(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise RefitError(f"unknown dtype {name!r} in refit manifest")
    return dt


def dtype_name(dt: torch.dtype) -> str:
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
            if t.nbytes != numel * dtype_of(t.dtype).itemsize or t.offset < 0 or t.offset + t.nbytes > b.nbytes:
                raise RefitError(f"refit v{handle.version}: manifest entry for {t.name} is inconsistent "
                                 f"(shape {t.shape}, {t.dtype}, {t.nbytes} bytes at {t.offset} of {b.nbytes})")
            if expected_shapes and t.name in expected_shapes and tuple(t.shape) != tuple(expected_shapes[t.name]):
                raise RefitError(f"refit v{handle.version}: {t.name} has shape {tuple(t.shape)}, "
                                 f"the model expects {tuple(expected_shapes[t.name])}")


def bucket_layout(bucket: Bucket) -> tuple[list[TensorSpec], int]:
    specs, off = [], 0
    for name, t in bucket:
        nbytes = t.numel() * t.element_size()
        specs.append(TensorSpec(name, dtype_name(t.dtype), list(t.shape), off, nbytes))
        off += (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
    return specs, max(off, 1)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous()
    return t.reshape(-1).view(torch.uint8)


def typed_views(flat: torch.Tensor, specs: list[TensorSpec]) -> Bucket:
    """Typed, shaped views into a flat uint8 buffer: no copies."""
    return [(s.name, flat[s.offset:s.offset + s.nbytes].view(dtype_of(s.dtype)).view(s.shape)) for s in specs]
