"""The policy rank's weights going out: HF-named export in buckets, and the refit senders (see weights/transport.py).

A mixin of both policy backends (which provide `rank`, `dp_rank`, `device`, `_require_resident` and `export_weights`;
the megatron one's `export_weights` below reads `gpt` and `spec`; `policy/fsdp2_worker.py` brings its own and
answers `_is_exporter` / `_pipeline` for a data-parallel-only layout).
Exporting is collective over the tensor-parallel group (shards are gathered, every TP rank gets the full tensors),
so every TP rank of a stage iterates the export. Who sends:
- in-band transports (shared memory, CUDA IPC; colocated engines): the ranks the driver names (`senders`), one per
  device that hosts an engine worker (`weights/routing.py`). An engine worker needs the whole model on its own device,
  so with PP > 1 a sender also receives the other stages' buckets over its pipeline-parallel group
  (`_all_stage_buckets`). `send_weights` returns the sender's handle; `release_refit` frees its buffers;
- the collective transport (disaggregated engines): each stage's exporting rank (TP rank 0 of DP replica 0) with
  `refit_endpoint` + `join_refit_group` once, then per refit `send_weights` (stages the buckets, returns the
  manifest) and `broadcast_refit` while the engines receive.
"""
from __future__ import annotations

import socket
from typing import Iterator

import torch

from megatron_rl.platform import get_platform


class WeightsOut:
    def _is_exporter(self) -> bool:
        from megatron.core import parallel_state as ps

        return ps.get_tensor_model_parallel_rank() == 0 and self.dp_rank == 0 and self.cp.rank == 0

    def _pipeline(self) -> tuple[int, int, object]:
        """(this rank's pipeline stage, stages, the pipeline group or None); a backend without pipeline
        parallelism (policy/fsdp2_worker.py) answers (0, 1, None)."""
        from megatron.core import parallel_state as ps

        pp = ps.get_pipeline_model_parallel_world_size()
        return ps.get_pipeline_model_parallel_rank(), pp, ps.get_pipeline_model_parallel_group() if pp > 1 else None

    def export_weights(self, bucket_bytes: int = 256 << 20, dtype: torch.dtype | None = None
                       ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """HF-named full tensors of this rank's pipeline stage, in buckets (collective over the TP group)."""
        from megatron_rl.models.mapping import iter_hf_tensors

        self._require_resident("export weights", weights_enough=True)
        bucket, size = [], 0
        # tensors stay on the device: the transport decides where bytes go (CUDA IPC shares device buffers, shared
        # memory copies to host); a host round trip here would cost two copies of the model per refit on GPU
        items = iter_hf_tensors(self.gpt, self.spec, dtype=dtype)
        if getattr(self, "lora", None):  # the engine serves the merged model: W + (alpha / r) B A (models/lora.py)
            from megatron_rl.models.lora import merged_hf_tensors

            items = merged_hf_tensors(self.lora, items)
        if getattr(self.gpt, "megatron_rl_value_model", False):  # a reward model / critic: score.weight, no lm_head
            from megatron_rl.models.value_head import value_model_hf_tensors

            items = value_model_hf_tensors(self.gpt, items)
        for name, t in items:
            bucket.append((name, t))
            size += t.numel() * t.element_size()
            if size >= bucket_bytes:
                yield bucket
                bucket, size = [], 0
        if bucket:
            yield bucket

    def device_id(self) -> str:
        """This rank's device identity (platform.device_identity): where its in-band refit buffers live."""
        return get_platform().device_identity(self.device)

    def send_weights(self, version: int, transport: str, bucket_bytes: int = 256 << 20,
                     senders: list[int] | None = None) -> dict | None:
        """Export through a refit transport. In-band with `senders` (global ranks): those ranks export the whole
        model and return their handle; collective (or in-band without senders): each stage's exporting rank returns
        its stage's handle (collective: the manifest of the stage's buckets, which `broadcast_refit` exports again and
        sends). Collective over TP (and over PP when a sender needs other stages): every rank must call it."""
        from megatron_rl.weights.collective import TRANSPORT as COLLECTIVE
        from megatron_rl.weights.transport import make_sender

        if senders is None or transport == COLLECTIVE:
            self._collective_bucket_bytes = bucket_bytes  # broadcast_refit's export: the same buckets
            exporter = self._is_exporter()
            buckets = self.export_weights(bucket_bytes)  # collective over TP: every TP rank must iterate it
        else:
            exporter = self.rank in senders
            buckets = self._all_stage_buckets(bucket_bytes, senders)
        if not exporter:
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

    def _all_stage_buckets(self, bucket_bytes: int, senders: list[int]) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Every stage's buckets on every rank of this rank's pipeline group, in stage order, when that group holds
        a sender; else this stage's own (the TP collective still needs this rank). Each stage's rank broadcasts
        its buckets in turn (a manifest object, then one flat buffer) over the pipeline group, NCCL on GPU and gloo
        on CPU; a bucket in transit costs one flat copy of it per rank, never the whole model."""
        import torch.distributed as dist

        from megatron_rl.weights.manifest import as_bytes, bucket_layout, typed_views

        me, pp, group = self._pipeline()
        ranks = dist.get_process_group_ranks(group) if group is not None else [self.rank]
        if pp == 1 or not set(ranks) & set(senders):
            yield from self.export_weights(bucket_bytes)
            return
        for stage, src in enumerate(ranks):  # the group's ranks are in stage order
            if stage == me:
                for bucket in self.export_weights(bucket_bytes):
                    specs, size = bucket_layout(bucket)
                    flat = torch.empty(size, dtype=torch.uint8, device=self.device)
                    for spec, (_, t) in zip(specs, bucket):
                        flat[spec.offset:spec.offset + spec.nbytes].copy_(as_bytes(t))
                    dist.broadcast_object_list([(specs, size)], src=src, group=group)
                    dist.broadcast(flat, src=src, group=group)
                    yield bucket
                dist.broadcast_object_list([None], src=src, group=group)  # end of this stage
                continue
            while True:
                meta = [None]
                dist.broadcast_object_list(meta, src=src, group=group)
                if meta[0] is None:
                    break
                specs, size = meta[0]
                flat = torch.empty(size, dtype=torch.uint8, device=self.device)
                dist.broadcast(flat, src=src, group=group)
                yield typed_views(flat, specs)

    # ---- collective transport (disaggregated engines)
    def refit_endpoint(self, host: str | None = None) -> dict | None:
        """Where this stage's refit group will meet (exporting ranks only): the store is hosted here, rank 0."""
        if not self._is_exporter():
            return None
        if host is None:  # multi-node: this node's address as Ray knows it
            import ray

            host = ray.util.get_node_ip_address()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("", 0))
            port = sock.getsockname()[1]
        return {"stage": self._pipeline()[0], "host": host, "port": port}

    def join_refit_group(self, endpoints: list[dict], world_size: int) -> None:
        """Exporting ranks open their stage's group as rank 0 (blocks until every engine worker has joined)."""
        from megatron_rl.weights.collective import CollectiveSender, open_group

        if not self._is_exporter():
            return
        stage = self._pipeline()[0]
        ep = endpoints[stage]
        self._collective = CollectiveSender(open_group(ep["host"], ep["port"], 0, world_size), stage, self.device)

    def broadcast_refit(self) -> int:
        """Export the stage again and send it, a bucket at a time, to every engine (they receive meanwhile): the
        buckets the last `send_weights` described. Collective over TP like the export: every rank calls it."""
        buckets = self.export_weights(self._collective_bucket_bytes)
        sender = getattr(self, "_collective", None)
        if sender is None:
            for _ in buckets:
                pass
            return 0
        return sender.broadcast(buckets)

    def release_refit(self) -> None:
        """The generator has loaded the last update: free what the transport kept for it (CUDA IPC and the
        the manifest of the collective transport's)."""
        for sender in (getattr(self, "_refit_sender", None), getattr(self, "_collective", None)):
            if sender is not None:
                sender.release()

    def close_refit(self) -> None:
        """Free the refit transport's resources (the shared-memory arena's files) before the worker is killed."""
        sender, self._refit_sender = getattr(self, "_refit_sender", None), None
        if sender is not None:
            sender.close()

    def save_adapter(self, out_dir: str) -> str | None:
        """The LoRA adapters as a PEFT folder (models/peft_folder.py) pointing at the base model; collective over
        all ranks (each stage's adapters go to global rank 0, which writes and returns the path)."""
        from megatron_rl.models.peft_folder import write_peft_files

        update = self.adapter_update()
        return None if update is None else str(write_peft_files(out_dir, update["tensors"], update["config"]))

    def adapter_update(self) -> dict | None:
        """The LoRA adapters as a PEFT folder's content, on global rank 0 (None elsewhere): {"tensors": PEFT-named
        full tensors on the CPU, "config": adapter_config.json's}. What `save_adapter` writes and what an
        adapter-only refit sends the engines (generation.lora_refit=adapter, generation/lora_serving.py).
        Collective over all ranks: each stage's adapters reach rank 0."""
        import torch.distributed as dist

        from megatron_rl.models.peft_folder import peft_config

        if getattr(self, "lora", None) is None:
            raise ValueError("save_adapter() / adapter_update() need policy.lora (this policy trains every weight)")
        self._require_resident("export the adapters", weights_enough=True)
        state = self._adapter_state()
        # to rank 0 only, the one that answers: an all-gather would give every rank a copy of every stage's adapters
        # (7B all-linear at rank 64: ~650 MB in fp32 per rank)
        parts = [None] * dist.get_world_size() if self.rank == 0 else None
        dist.gather_object(state if self._is_exporter() else None, parts, dst=0)
        if self.rank != 0:
            return None
        merged = {k: v for part in parts if part for k, v in part.items()}
        return {"tensors": merged, "config": peft_config(self.cfg.lora, self._adapter_target_names(),
                                                         str(self.model_dir))}

    def _adapter_state(self) -> dict[str, torch.Tensor]:
        """This stage's adapters, full, PEFT-named, on the CPU (collective over TP); the FSDP2 worker has its own."""
        from megatron_rl.models.lora import adapter_state

        return adapter_state(self.lora)

    def _adapter_target_names(self) -> list[str]:
        """adapter_config.json's target_modules."""
        return sorted({t.hf for _, ad in self.lora for t in ad.targets})

    def hf_state_dict(self) -> dict[str, torch.Tensor] | None:
        """All of this stage's HF tensors (tests and small models); output of the TP-rank-0, DP-rank-0 ranks."""
        tensors = {n: t.cpu() for bucket in self.export_weights() for n, t in bucket}
        return tensors if self._is_exporter() else None
