"""The policy rank's weights going out: HF-named export in buckets, and the refit senders (see weights/transport.py).

A mixin of `MegatronPolicyWorker` (which provides `gpt`, `spec`, `dp_rank`, `device` and `_require_resident`).
Exporting is collective over the tensor-parallel group (shards are gathered), so every TP rank of a stage iterates
the export; the stage's exporting rank (TP rank 0 of DP replica 0) is the one that sends:
- in-band transports (shared memory, CUDA IPC): `send_weights` returns the handle; `release_refit` frees buffers;
- the collective transport (disaggregated engines): `refit_endpoint` + `join_refit_group` once, then per refit
  `send_weights` (stages the buckets, returns the manifest) and `broadcast_refit` while the engines receive.
"""
from __future__ import annotations

import socket
from typing import Iterator

import torch


class WeightsOut:
    def _is_exporter(self) -> bool:
        from megatron.core import parallel_state as ps

        return ps.get_tensor_model_parallel_rank() == 0 and self.dp_rank == 0

    def export_weights(self, bucket_bytes: int = 256 << 20, dtype: torch.dtype | None = None
                       ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """HF-named full tensors of this rank's pipeline stage, in buckets (collective over the TP group)."""
        from megatron_rl.models.mapping import iter_hf_tensors

        self._require_resident("export weights")
        bucket, size = [], 0
        # tensors stay on the device: the transport decides where bytes go (CUDA IPC shares device buffers, shared
        # memory copies to host); a host round trip here would cost two copies of the model per refit on GPU
        for name, t in iter_hf_tensors(self.gpt, self.spec, dtype=dtype):
            bucket.append((name, t))
            size += t.numel() * t.element_size()
            if size >= bucket_bytes:
                yield bucket
                bucket, size = [], 0
        if bucket:
            yield bucket

    def send_weights(self, version: int, transport: str, bucket_bytes: int = 256 << 20) -> dict | None:
        """Export through a refit transport; each stage's exporting rank returns its handle (collective: the
        manifest of the staged buckets, sent by `broadcast_refit`)."""
        from megatron_rl.weights.collective import TRANSPORT as COLLECTIVE
        from megatron_rl.weights.transport import make_sender

        buckets = self.export_weights(bucket_bytes)  # collective over TP: every TP rank must iterate it
        if not self._is_exporter():
            for _ in buckets:
                pass
            return None
        if transport == COLLECTIVE:
            sender = getattr(self, "_collective", None)
            if sender is None:
                raise RuntimeError("collective refit before join_refit_group()")
        else:
            sender = getattr(self, "_refit_sender", None)
            if sender is None or getattr(self, "_refit_transport", None) != transport:
                if sender is not None:
                    sender.close()
                # kept for the worker's life: the shared-memory arena is rewritten in place by every refit
                sender, self._refit_transport = make_sender(transport), transport
                self._refit_sender = sender
        sender.release()  # normally done already by release_refit(); a no-op then
        return sender.send(buckets, version).to_dict()

    # ---- collective transport (disaggregated engines)
    def refit_endpoint(self, host: str | None = None) -> dict | None:
        """Where this stage's refit group will meet (exporting ranks only): the store is hosted here, rank 0."""
        from megatron.core import parallel_state as ps

        if not self._is_exporter():
            return None
        if host is None:  # multi-node: this node's address as Ray knows it
            import ray

            host = ray.util.get_node_ip_address()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("", 0))
            port = sock.getsockname()[1]
        return {"stage": ps.get_pipeline_model_parallel_rank(), "host": host, "port": port}

    def join_refit_group(self, endpoints: list[dict], world_size: int) -> None:
        """Exporting ranks open their stage's group as rank 0 (blocks until every engine worker has joined)."""
        from megatron.core import parallel_state as ps

        from megatron_rl.weights.collective import CollectiveSender, open_group

        if not self._is_exporter():
            return
        stage = ps.get_pipeline_model_parallel_rank()
        ep = endpoints[stage]
        self._collective = CollectiveSender(open_group(ep["host"], ep["port"], 0, world_size), stage, self.device)

    def broadcast_refit(self) -> int:
        """Send the buckets staged by the last `send_weights` to every engine (they receive meanwhile)."""
        sender = getattr(self, "_collective", None)
        return sender.broadcast() if sender is not None else 0

    def release_refit(self) -> None:
        """The generator has loaded the last update: free what the transport kept for it (CUDA IPC and the
        collective transport: a flat device copy of the stage's weights, which must not stay allocated)."""
        for sender in (getattr(self, "_refit_sender", None), getattr(self, "_collective", None)):
            if sender is not None:
                sender.release()

    def close_refit(self) -> None:
        """Free the refit transport's resources (the shared-memory arena's files) before the worker is killed."""
        sender, self._refit_sender = getattr(self, "_refit_sender", None), None
        if sender is not None:
            sender.close()

    def hf_state_dict(self) -> dict[str, torch.Tensor] | None:
        """All of this stage's HF tensors (tests and small models); output of the TP-rank-0, DP-rank-0 ranks."""
        tensors = {n: t.cpu() for bucket in self.export_weights() for n, t in bucket}
        return tensors if self._is_exporter() else None
