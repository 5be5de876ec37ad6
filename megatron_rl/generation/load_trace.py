"""Which received tensors reached a weight loader during one refit (runs inside vLLM's worker).

vLLM's `model.load_weights(weights)` maps each checkpoint name to a parameter and calls that parameter's
`weight_loader(param, loaded_weight, ...)`; a name it does not map is skipped without a word (most model loaders
`continue` past unknown names). While installed, `LoadTrace` wraps every parameter's loader for the duration of each
`load_weights` call and credits each call to the received tensor it was given: the one whose bytes contain
`loaded_weight`'s first element (loaders get the tensor itself or a view of it: narrow, transpose), else, for a
tensor the model converted first, the name the iterator yielded last.

Both reload paths are covered, because both call `model.load_weights`: the CPU resident reloader (plain parameters
with their own loaders) and vLLM's layerwise `reload_weights` (GPU, MoE), whose parameters carry an
`online_process_loader` that buffers the call for later. There the wrapper borrows that name and `__wrapped__`, so
vLLM's wrapper logic (`reload/layerwise.py`: it re-wraps any loader of another name, and unwraps by that name) sees
its own loader and calls the real one later, untraced; the buffering call is the one this trace counts.
"""
from __future__ import annotations

import bisect
import contextlib

import torch

_LAYERWISE = "online_process_loader"  # vLLM 0.32's name for its buffering loader (reload/layerwise.py)


class LoadTrace:
    """One per engine worker, reused by every refit (`reset` between them): the wrappers of parameters that persist
    from refit to refit (the CPU resident reloader's) are made once, which keeps the trace at a fraction of a
    millisecond per refit (bench/refit_bench.py)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self._wrappers: dict[int, tuple] = {}  # id(param) -> (param, its loader, that loader wrapped)
        self.reset()

    def reset(self) -> None:
        self.consumed: set[str] = set()
        self._current: str | None = None
        self._starts: list[int] = []  # sorted start addresses of the yielded tensors' bytes
        self._spans: list[tuple[int, int, str]] = []  # (start, end, name), same order

    def feed(self, weights):
        """Pass (name, tensor) pairs through, remembering where each tensor's bytes are."""
        for name, t in weights:
            self._current = name
            if t.numel() and t.device.type != "meta":
                start = t.data_ptr()
                end = start + t.numel() * t.element_size()
                # spans this tensor overlaps belong to tensors already freed (the collective transport frees each
                # bucket once loaded, and the next may land at the same addresses): forget them
                i = bisect.bisect_left(self._starts, end)
                j = i
                while j > 0 and self._spans[j - 1][1] > start:
                    j -= 1
                del self._starts[j:i], self._spans[j:i]
                self._starts.insert(j, start)
                self._spans.insert(j, (start, end, name))
            yield name, t
        self._current = None

    def _owner(self, loaded) -> str | None:
        if isinstance(loaded, torch.Tensor) and loaded.numel() and loaded.device.type != "meta":
            ptr = loaded.data_ptr()
            i = bisect.bisect(self._starts, ptr) - 1
            if i >= 0 and self._spans[i][0] <= ptr < self._spans[i][1]:
                return self._spans[i][2]
        return self._current

    def _wrap(self, inner):
        def traced(*args, **kwargs):
            loaded = args[1] if len(args) > 1 else kwargs.get("loaded_weight")
            owner = self._owner(loaded)
            if owner is not None:
                self.consumed.add(owner)
            return inner(*args, **kwargs)

        if getattr(inner, "__name__", "") == _LAYERWISE:
            traced.__name__, traced.__wrapped__ = _LAYERWISE, inner
        return traced

    @contextlib.contextmanager
    def installed(self):
        from vllm.model_executor.model_loader.weight_utils import default_weight_loader

        model = self.model
        own = model.__dict__.get("load_weights")  # an instance attribute (a test's injected fault) is kept
        original = model.load_weights

        def load_weights(weights):
            saved = [(p, _loader_of(p)) for p in model.parameters()]
            for p, loader in saved:
                known = self._wrappers.get(id(p))
                if known is None or known[0] is not p or known[1] is not loader:
                    known = self._wrappers[id(p)] = (p, loader, self._wrap(loader or default_weight_loader))
                p.weight_loader = known[2]
            try:
                return original(weights)
            finally:
                for p, loader in saved:
                    if loader is not None:
                        p.weight_loader = loader
                    else:
                        with contextlib.suppress(AttributeError):
                            del p.weight_loader

        model.load_weights = load_weights
        try:
            yield self
        finally:
            if own is not None:
                model.load_weights = own
            else:
                del model.load_weights


def _loader_of(p):
    """The parameter's own loader, or None (plain tensors may have none; vLLM's parameter classes keep theirs behind
    a property that raises once deleted)."""
    try:
        return getattr(p, "weight_loader", None)
    except Exception:  # noqa: BLE001 - vLLM raises a bare ValueError-like error for a deleted loader
        return None
