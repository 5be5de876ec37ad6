"""One rank of the FSDP2 policy (`policy.backend: fsdp2`): the Hugging Face model itself, sharded over the data-
parallel ranks with torch's `fully_shard` (DTensor), behind the same PolicyWorker interface as the megatron backend.

Same as the megatron worker, by sharing its backend-free parts: the micro-batch plan and its rows (`packing.py`,
`batching.py`), what the loss sees and how metrics add up (`step_inputs.py`), the logprob/entropy kernels (`kernels/`,
the lm_head fused into them unless `policy.fused_lm_head: false`, on the response window only), the lr schedule
(`grad_ops.build_scheduler`), the lifecycle states (`residency.py`) and the refit senders (`weights_out.py`).
Differences that are the backend's:

- Sharding: `fully_shard` per decoder layer, then on a root module that owns the HF model (embeddings, final norm,
  lm_head). That root's forward runs the decoder *and* the kernel, so the lm_head weight is the unsharded tensor
  while the kernel reads it, and its gradient takes FSDP's reduce-scatter like any other. Every module reshards
  after forward, so no stale unsharded copy survives a weight swap (the KL reference) or an offload.
- Tensor parallelism (`policy.tp` > 1): DTensor's Megatron-style split of the projections and the vocabulary before
  `fully_shard`, on a dp x tp mesh (`policy/fsdp2_tp.py`); the scorer feeds the lm_head's vocab slice to the TP-aware
  kernel. One rank per TP group returns logprobs and exports.
- Gradient reduction: FSDP averages over DP by default; the loss functions already divide by the *global* counts,
  so the shards' gradients must be summed (divide factor 1), as megatron's per-token mode does.
- Every forward all-gathers over DP, so every rank runs the same number of micro-batches: the plan pads the short
  ranks with filler rows (`microbatch.plan(equal_counts=True)`, zero loss), as megatron does for experts.
- Activation recompute (`policy.activation_recompute`): transformers' per-layer gradient checkpointing, non-
  reentrant, inside each layer's FSDP unit, so the recompute runs while that layer's weights are gathered.
- Shared-prefix and varlen rows reach the HF attention as an explicit mask (`models/hf_masks.py`), since its sdpa and
  eager attention take no cu_seqlens: a group row carries its block mask (`policy.shared_prefix`, as megatron's
  `packing: none` rows do), and `packing: varlen` packs a micro-batch into one unpadded row (`batching.masked_row`)
  whose mask also separates the units. Positions restart per sequence (HF's rotary reads position_ids). The mask
  costs [t, t] per row, so `packing: auto` stays `none` here (the config loader; docs/fsdp2.md).
- The MoE router's load-balancing loss (`policy.moe_aux_loss_coef` > 0): megatron's, recomputed from the router
  logits that hooks on HF's routers record (`policy/router_aux.py`) and added to each real micro-batch's backward.
- Optimizer: torch AdamW over the DTensor shards with megatron's parameter groups (no weight decay on biases and
  1-D weights), the global gradient norm over DTensors, clipping as megatron clips.
- Checkpoints: torch.distributed.checkpoint in megatron-rl's checkpoint directory format (`fsdp2_checkpoint.py`).
- Distillation: the sampled-token mode is a batch field; top-k has the root's forward also return the student's
  logprobs at the teacher's ids (`topk.logprobs_at`, over the TP group) while the lm_head is unsharded.
- Ulysses sequence parallelism (`policy.sp`): each row over SP ranks, all-to-all around attention (`fsdp2_sp.py`).
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from megatron_rl.config.loader import resolve_model_dir
from megatron_rl.config.schema import PolicyConfig
from megatron_rl.distributed.worker_group import RankWorker
from megatron_rl.models.checkpoint import FSDP2_PREFIX
from megatron_rl.models.hf_layers import decoder_layers
from megatron_rl.models.hf_masks import hf_attention_mask, layer_mask_kinds
from megatron_rl.models.vlm import is_vision_language
from megatron_rl.platform import get_platform
from megatron_rl.policy import batching, fsdp2_load, fsdp2_lora, fsdp2_sp, packing, vision_inputs
from megatron_rl.policy.forward_pass import join_process_group
from megatron_rl.policy.fsdp2_scorer import Scorer
from megatron_rl.policy.fsdp2_tp import check_tp, grad_norm, parallelize
from megatron_rl.policy.grad_ops import build_scheduler, restore_scheduler, scheduler_state
from megatron_rl.policy.interface import RolloutBatch
from megatron_rl.policy.residency import Residency
from megatron_rl.policy.router_aux import RouterLogits, aux_loss
from megatron_rl.policy.routing_replay import HFRoutingReplay, attach
from megatron_rl.policy.step_inputs import StepFields, once_per_group, reduced_metrics, sum_metrics
from megatron_rl.policy.weights_out import WeightsOut

ROOT = FSDP2_PREFIX  # the HF model is `Scorer.lm`: parameter names minus this prefix are the HF names


class FSDP2PolicyWorker(WeightsOut, Residency, RankWorker):
    def __init__(self, rank: int, world_size: int, log_path: str | None = None, threads: int | None = None,
                 env: dict | None = None, policy_cfg: PolicyConfig | None = None, max_steps: int = 1):
        super().__init__(rank, world_size, log_path, threads, env)
        self.cfg = policy_cfg or PolicyConfig()
        self.max_steps = max_steps
        self.step = 0
        self.consumed_samples = 0
        self._init_residency()

    # ------------------------------------------------------------------------------------------------- set-up
    def setup(self) -> dict:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
        from transformers import AutoConfig

        cfg, plat = self.cfg, get_platform()
        self.device = join_process_group(self._local_rank(self.rank))
        world, self.tp_size = dist.get_world_size(), cfg.tp
        if world % self.tp_size:
            raise ValueError(f"policy.tp={self.tp_size} does not divide the {world} policy ranks")
        self.mesh = init_device_mesh(plat.device_type, (world // self.tp_size, self.tp_size),
                                     mesh_dim_names=("dp", "tp"))
        self.dp_group = self.mesh.get_group("dp")  # FSDP's: the data-parallel replicas' ranks and their SP ranks
        self.sp = fsdp2_sp.init_sp(cfg.sp, self.mesh)  # Ulysses (policy/fsdp2_sp.py); size 1: none
        self.dp_size, self.dp_rank = self.sp.dp_size, self.sp.dp_rank
        self.tp_rank = self.mesh.get_local_rank("tp")
        self.model_dir = resolve_model_dir(cfg.model)
        self.dtype = plat.resolve_dtype(cfg.precision)
        torch.manual_seed(cfg.seed)
        # fp32 master weights always; bf16 is FSDP's compute dtype (gradients reduced in fp32)
        # sdpa (transformers' default) has no attention-score soft-capping: a capped model (Gemma-2) would train a
        # different function than the one vLLM serves; eager applies the cap
        capped = getattr(AutoConfig.from_pretrained(self.model_dir), "attn_logit_softcapping", None)
        attn = {"attn_implementation": "eager"} if capped else {}
        # built on `meta`, split and sharded there, then each rank fills its own shards (policy/fsdp2_load.py): no
        # rank ever holds the whole model on the device, nor in fp32 on the host
        lm = fsdp2_load.skeleton(self.model_dir, **attn)
        lm.config.use_cache = False
        # transformers builds the embedding with padding_idx = config.pad_token_id, whose row then never gets a
        # gradient; SmolLM2's pad is <|im_end|>, a token of every chat prompt, which megatron (and vLLM) treat as any
        # token: trained the same on both backends (on the CLI's SFT batch the step-1 gradient norms were 13.26 here
        # and 114.7 on megatron before this; a random tiny model's zeroed pad row makes it that large)
        lm.get_input_embeddings().padding_idx = None
        self.hf_config = lm.config
        self.vision = is_vision_language(lm.config.to_dict())  # image inputs to its forward (vision_inputs.py)
        self.vocab_size = lm.get_output_embeddings().weight.shape[0]
        self.max_positions = int(getattr(lm.config.get_text_config(), "max_position_embeddings", 1 << 30))
        self.varlen = cfg.packing == "varlen"  # auto is none on this backend (config loader)
        self.mask_kinds = layer_mask_kinds(lm.config) if cfg.shared_prefix or self.varlen or cfg.sp > 1 else None
        # hooks before FSDP wraps the layers (they stay on the router modules); None: no load-balancing loss
        self.router = RouterLogits(lm) if cfg.moe_aux_loss_coef > 0 else None
        self._replay = HFRoutingReplay.install(lm, cfg.moe_routing_replay)  # MoE routing replay, or None
        if cfg.activation_recompute:  # each decoder layer's activations recomputed in its backward (HF's own hook,
            # which keeps the parameter names: a wrapper module would rename every tensor the export and DCP write)
            lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if self.sp.size > 1:  # attention over the whole row for 1/SP of the heads (policy/fsdp2_sp.py)
            fsdp2_sp.install(lm, decoder_layers(lm), self.sp.group, "eager" if capped else "sdpa", self.tp_size)
        mp = MixedPrecisionPolicy(param_dtype=self.dtype, reduce_dtype=torch.float32) \
            if self.dtype != torch.float32 else MixedPrecisionPolicy()
        tp_group = None
        if self.tp_size > 1:  # DTensor TP on the projections and the vocabulary first, then FSDP over dp
            check_tp(lm, decoder_layers(lm), self.tp_size)
            parallelize(lm, decoder_layers(lm), self.mesh["tp"])
            tp_group = self.mesh.get_group("tp")
        self._disk_as_is: set[str] = set()  # tensors whose in-memory name is their on-disk name (`_disk_tensors`)
        # LoRA adapters after TP (they follow its split), before FSDP (which then gives the frozen base no gradient)
        self.lora = None if cfg.lora is None else \
            fsdp2_lora.install(lm, decoder_layers(lm), cfg.lora, cfg.seed, self.mesh["tp"] if self.tp_size > 1 else None)
        kw = dict(mesh=self.mesh["dp"], mp_policy=mp, reshard_after_forward=True)
        for layer in decoder_layers(lm):
            fully_shard(layer, **kw)
        computed = {} if self.lora is None else fsdp2_lora.initial_values(self.lora, cfg.seed)
        score = None
        if cfg.value_head:  # a reward model / critic: a fresh head as the megatron backend's, the lm_head frozen
            from megatron_rl.models.value_head import HF_SCORE, ValueHead

            init = ValueHead(lm.config.hidden_size, seed=cfg.seed,
                             std=getattr(lm.config, "initializer_range", 0.02)).score
            with torch.device("meta"):
                score = nn.Linear(lm.config.hidden_size, 1, bias=False)
            computed[HF_SCORE] = init.weight.detach()
            if not self._tied(lm):  # a tied lm_head is the input embedding, which trains
                lm.get_output_embeddings().requires_grad_(False)
        self.model = fully_shard(Scorer(lm, cfg.fused_lm_head, tp_group, score, self.vision), **kw)
        for m in self.model.modules():  # the loss is globally normalised: sum the shards' gradients (module doc)
            if isinstance(m, FSDPModule):
                m.set_gradient_divide_factor(1.0)
                m.set_force_sum_reduction_for_comms(True)  # a plain SUM: gloo has no PREMUL_SUM
        fsdp2_load.load_shards(self.model, ROOT, self.model_dir, self.device, computed, **attn)
        self._build_optimizer()
        # the KL reference: the initial weights (this rank's shards), host-resident, as the megatron worker keeps them;
        # with LoRA the base itself, adapters off (no copy)
        self.ref_weights = self._weights_copy()
        return {"rank": self.rank, "tp_rank": self.tp_rank, "dp_rank": self.dp_rank, "pp_rank": 0,
                "dp_size": self.dp_size,
                "num_params": sum(p.numel() for p in self.model.parameters()),  # DTensors: the global sizes
                "trainable_params": sum(p.numel() for p in self.model.parameters() if p.requires_grad),
                "backend": "fsdp2"}

    @staticmethod
    def _tied(lm: nn.Module) -> bool:
        return lm.get_output_embeddings().weight is lm.get_input_embeddings().weight

    def _build_optimizer(self) -> None:
        o, s = self.cfg.optimizer, self.cfg.scheduler
        decay, no_decay = [], []
        for name, p in self.model.named_parameters():  # megatron's default grouping: no decay on biases, 1-D weights
            if not p.requires_grad:  # a LoRA run's frozen base
                continue
            (no_decay if name.endswith(".bias") or p.dim() == 1 else decay).append(p)
        groups = [{"params": ps, "wd_mult": m, "lr_mult": 1.0} for ps, m in ((decay, 1.0), (no_decay, 0.0)) if ps]
        # foreach groups tensors into one kernel, which DTensors on different meshes (dp, dp x tp) cannot share
        self.optimizer = torch.optim.AdamW(groups, lr=o.lr, betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps,
                                           weight_decay=o.weight_decay, foreach=self.tp_size == 1)
        self.scheduler = build_scheduler(self.optimizer, o, s, self.max_steps)

    def _local(self, p: torch.Tensor) -> torch.Tensor:
        return p.to_local() if hasattr(p, "to_local") else p

    def _weights_copy(self) -> dict[str, torch.Tensor] | None:
        # LoRA: the base is the reference. A value model (reward model, PPO's critic) has no KL term: no host copy
        if self.lora is not None or self.cfg.value_head:
            return None
        return {n: self._local(p).detach().to("cpu", copy=True) for n, p in self.model.named_parameters()}

    def set_threads(self, n: int) -> None:
        from megatron_rl.platform import set_cpu_threads

        set_cpu_threads(n)

    # ------------------------------------------------------------------------------------------------ forward
    def _micro_batches(self, batch: RolloutBatch) -> list[batching.MicroBatchRows]:
        batching.check_batch(batch, self.vocab_size, self.max_positions)
        if len(batch) < self.dp_size:
            raise ValueError(f"batch of {len(batch)} sequences cannot feed {self.dp_size} data-parallel ranks")
        # a VLM's rows are one sequence each, with its images (policy/vision_inputs.py): no shared prefix
        plan = packing.plan_split_rows(batch, shared=self.cfg.shared_prefix and not self.vision, varlen=self.varlen,
                                       multiple=1, max_tokens=self.cfg.max_tokens_per_microbatch, ranks=self.sp.size,
                                       key="policy.sp", dp_size=self.dp_size, dp_rank=self.dp_rank,
                                       equal_counts=self.dp_size > 1)
        mbs = [batching.rows(batch, units, varlen=self.varlen, thd=False) for units in plan]
        if self.vision:
            vision_inputs.attach(batch, mbs)
        return attach(batch, mbs, self._replay)

    def _score(self, mb: batching.MicroBatchRows, temperature: float, fields: StepFields | None = None):
        """(logprobs, entropy, the mb narrowed to the response window, extra LossInputs): the extras are top-k
        distillation's teacher and student logprobs at the teacher's ids when `fields`' batch carries them, else {}."""
        if self.sp.size > 1:  # this rank's chunk of the rows, the responses gathered (no top-k: the loader refuses)
            return fsdp2_sp.score(self, mb, temperature)
        start, view = batching.response_window(mb)
        dev = self.device
        window = start if isinstance(start, int) else start.to(dev)
        positions = mb.position_ids.to(dev)
        mask = None if mb.attention_mask is None else \
            hf_attention_mask(mb.attention_mask.to(dev), positions, self.mask_kinds, self.dtype)
        teacher = None if fields is None or mb.filler else fields.teacher_topk(view, dev)
        topk = None if teacher is None else (view.resp_mask.to(dev), teacher[0])
        if self._replay is not None:
            self._replay.set(mb.routing)
        vision = None if not self.vision else {k: v.to(dev) for k, v in (mb.model_inputs or {}).items()}
        out = self.model(mb.tokens.to(dev), positions, window, view.targets.to(dev), temperature, mask, topk, vision)
        if teacher is None:
            return *out, view, {}
        lp, ent, student = out
        return lp, ent, view, {"teacher_topk_logprobs": teacher[1], "student_topk_logprobs": student}

    @torch.no_grad()
    def logprobs(self, batch: RolloutBatch, temperature: float = 1.0, with_entropy: bool = False):
        """{batch index: response-token logprobs} (and entropies) of this DP rank's share."""
        self._require_resident("compute logprobs")
        out: dict[int, Any] = {}
        self.model.eval()
        try:
            for mb in self._micro_batches(batch):
                lp, ent, view, _ = self._score(mb, temperature)
                for i, l, e in zip(view.indices, batching.split_rows(lp, view), batching.split_rows(ent, view)):
                    out[i] = (l.float().cpu(), e.float().cpu()) if with_entropy else l.float().cpu()
        finally:
            self.model.train()
        return out if self._is_sender() else {}  # a TP (or SP) group's ranks hold the same values: one sends them

    def logprobs_and_entropy(self, batch: RolloutBatch, temperature: float = 1.0):
        return self.logprobs(batch, temperature, with_entropy=True)

    @torch.no_grad()
    def _swap_weights(self, source: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        saved = {}
        for n, p in self.model.named_parameters():
            local = self._local(p)
            saved[n] = local.detach().to("cpu", copy=True)
            local.copy_(source[n].to(local.device, local.dtype))
        return saved

    def reference_logprobs(self, batch: RolloutBatch, temperature: float = 1.0):
        self._require_resident("compute reference logprobs")
        if self.lora is not None:
            with fsdp2_lora.disabled(self.lora):
                return self.logprobs(batch, temperature)
        if self.ref_weights is None:
            raise RuntimeError("a value model (policy.value_head: a reward model or PPO's critic) keeps no KL reference")
        current = self._swap_weights(self.ref_weights)
        try:
            return self.logprobs(batch, temperature)
        finally:
            self._swap_weights(current)

    # ------------------------------------------------------------------------------------------------ train
    def train(self, batch: RolloutBatch, loss_fn, temperature: float = 1.0) -> dict:
        """One optimizer step. Returns {"metrics", "logprobs" ({index: tensor}), "skipped"} on every rank (each with
        its DP share's logprobs; the metrics are the whole batch's)."""
        fields = StepFields(batch)
        self._require_resident("train")
        self.model.train()  # from_pretrained leaves eval mode; HF's recompute hook runs in training mode only
        mbs = self._micro_batches(batch)
        own_lp: dict[int, torch.Tensor] = {}
        reduced = []
        self.optimizer.zero_grad(set_to_none=True)
        routed = None
        if self.router is not None:  # the routed positions of every real micro-batch over DP (router_aux.py's weight)
            from megatron_rl.distributed.collectives import all_reduce_scalars

            routed = all_reduce_scalars([sum(mb.tokens.numel() for mb in mbs if not mb.filler)],
                                        self.dp_group if self.dp_size > 1 else None)[0]
        for mb in mbs:
            if self.router is None:
                lp, ent, view, extra = self._score(mb, temperature, fields)
            else:
                with self.router.recording() as router_logits:
                    lp, ent, view, extra = self._score(mb, temperature, fields)
            if mb.filler:  # the same collectives as a real micro-batch, an exact zero gradient, nothing counted
                ((lp.sum() + ent.sum()) * 0.0).backward()
                continue
            flat_lp = batching.flat(lp, view)
            for i, l in zip(view.indices, batching.split_rows(lp.detach(), view)):
                own_lp[i] = l.float().cpu()
            loss, metrics = loss_fn(fields.loss_inputs(view, flat_lp, batching.flat(ent, view), extra))
            if routed is not None:  # the policy loss stays the metric; the aux term joins its backward only
                coef = self.cfg.moe_aux_loss_coef * mb.tokens.numel() / routed
                (loss + aux_loss(router_logits, self.router.topk, coef)).backward()
            else:
                loss.backward()
            reduced.append(reduced_metrics(loss, metrics, mb))
        group = self.dp_group if dist.get_world_size(self.dp_group) > 1 else None  # SP ranks included
        metrics = sum_metrics(once_per_group(reduced, self.sp.rank), group)
        lr = float(self.optimizer.param_groups[0]["lr"])  # what this step trains at (the step ticks the scheduler)
        skipped, grad_norm = self._optimizer_step()
        self.consumed_samples += len(batch)
        metrics.update(grad_norm=grad_norm, lr=lr,
                       policy_peak_memory_gb=get_platform().peak_memory_bytes() / 2**30)
        return {"metrics": metrics, "logprobs": own_lp if self._is_sender() else {}, "skipped": skipped}

    def _optimizer_step(self) -> tuple[bool, float]:
        """Clip and step unless the global gradient norm is non-finite (all ranks agree: the norm is global)."""
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        norm = grad_norm(grads, self.tp_size)
        if not math.isfinite(norm):
            self.optimizer.zero_grad(set_to_none=True)
            return True, norm
        clip = self.cfg.optimizer.clip_grad
        if clip > 0 and clip / (norm + 1e-6) < 1.0:  # megatron's rule: scale by clip / (norm + 1e-6) when below 1
            for g in grads:
                g.mul_(clip / (norm + 1e-6))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)  # nothing of the step stays allocated until the next one
        self.scheduler.step(increment=1)
        self.step += 1
        return False, norm

    # ------------------------------------------------------------------------------------------------ export
    def _is_sender(self) -> bool:
        return self.tp_rank == 0 and self.sp.rank == 0

    def _is_exporter(self) -> bool:
        return self.dp_rank == 0 and self._is_sender()

    def _pipeline(self) -> tuple[int, int, object]:
        return 0, 1, None

    def export_weights(self, bucket_bytes: int = 256 << 20, dtype: torch.dtype | None = None):
        """Full tensors under their on-disk HF names (what vLLM's loader and save_pretrained's files use) in buckets,
        gathered from the shards (collective over DP: every rank iterates); with LoRA the merged weights,
        W + (alpha / r) B A (the adapters gathered first, on every rank)."""
        from megatron_rl.models.lora import merged

        self._require_resident("export weights", weights_enough=True)
        dtype = dtype or self.dtype
        items = self._full_weights()
        if self.lora is not None:
            items = merged(items, fsdp2_lora.merges(self.lora, fsdp2_lora.adapter_state(self.model, ROOT,
                                                                                        on_host=False)))
        bucket, size = [], 0
        for name, w, local in items:
            for disk_name, t in self._disk_tensors(name, w.detach()):
                t = t.to(dtype)
                # a one-rank gather is the shard itself (and a split expert a view of it): a snapshot, so a consumer
                # keeping it (hf_state_dict, a bucket in flight) never sees a later step
                if t.untyped_storage().data_ptr() == local.untyped_storage().data_ptr():
                    t = t.clone()
                bucket.append((disk_name, t))
                size += t.numel() * t.element_size()
            if size >= bucket_bytes:
                yield bucket
                bucket, size = [], 0
        if bucket:
            yield bucket

    def _disk_tensors(self, name: str, full: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """One in-memory tensor under its on-disk names: transformers 5 fuses an MoE layer's experts into one
        [experts, ...] tensor in memory (`mlp.experts.gate_up_proj`) and splits it per expert when saving
        (`mlp.experts.0.gate_proj.weight`, the names vLLM loads); every other tensor keeps its name."""
        from transformers.core_model_loading import revert_weight_conversion

        if name in self._disk_as_is:  # the conversion costs ~1 ms a tensor even when it changes nothing
            return [(name, full)]
        out = list(revert_weight_conversion(self.model.lm, {name: full}).items())
        if len(out) == 1 and out[0][0] == name and out[0][1] is full:
            self._disk_as_is.add(name)  # every refit after the first skips it
        return out

    def _full_weights(self):
        """(HF name, full tensor, this rank's shard) of every model weight but the adapters (and a value model's
        lm_head: a ...ForSequenceClassification has none)."""
        for name, p in self.model.named_parameters():
            if self.cfg.value_head and not self._tied(self.model.lm) and \
                    p is self.model.lm.get_output_embeddings().weight:
                continue
            if fsdp2_lora.ADAPTER_KEY not in name:
                full = p.full_tensor() if hasattr(p, "full_tensor") else p
                yield (name[len(ROOT):] if name.startswith(ROOT) else name), full, self._local(p)

    # LoRA's PEFT-named adapters for `WeightsOut.adapter_update` (save_adapter, the adapter-only refit)
    def _adapter_state(self) -> dict[str, torch.Tensor]:
        return fsdp2_lora.adapter_state(self.model, ROOT)

    def _adapter_target_names(self) -> list[str]:
        return fsdp2_lora.target_names(self.lora)

    # ------------------------------------------------------------------------------------------ checkpoints
    def save(self, path: str, extra: dict | None = None) -> str:
        from megatron_rl.policy.fsdp2_checkpoint import save_fsdp2_checkpoint

        self._require_resident("save a checkpoint")
        extra_state = {"scheduler": scheduler_state(self.scheduler), "step": self.step,
                       "consumed_samples": self.consumed_samples, "rng": get_platform().rng_state(),
                       "driver": extra or {}}
        try:
            return str(save_fsdp2_checkpoint(path, self.model, self.optimizer, step=self.step,
                                             extra_state=extra_state, hf_dir=self.model_dir,
                                             dtype=self.dtype, dp=self.dp_size, tp=self.tp_size,
                                             adapters=None if self.lora is None else
                                             {"lora": vars(self.cfg.lora), "base": str(self.model_dir)},
                                             value_head=self.cfg.value_head))
        finally:
            get_platform().trim_host_heap()

    def load(self, path: str) -> dict:
        from megatron_rl.policy.fsdp2_checkpoint import load_fsdp2_checkpoint

        self._require_resident("load a checkpoint")
        extra = load_fsdp2_checkpoint(path, self.model, self.optimizer) or {}
        if "scheduler" in extra:
            self.scheduler = restore_scheduler(self.scheduler, self.optimizer, self.cfg.optimizer, self.cfg.scheduler,
                                               self.max_steps, extra["scheduler"])
        self.step = int(extra.get("step", 0))
        self.consumed_samples = int(extra.get("consumed_samples", 0))
        if "rng" in extra:
            get_platform().set_rng_state(extra["rng"])
        return extra.get("driver", {})

    def load_weights(self, path: str) -> None:
        """Model weights only (stage chains), which also become the KL reference (the megatron worker's rule)."""
        from megatron_rl.policy.fsdp2_checkpoint import load_fsdp2_checkpoint

        self._require_resident("load weights")
        load_fsdp2_checkpoint(path, self.model, None)
        self.ref_weights = self._weights_copy()

    # ----------------------------------------------------------------------- residency (policy/residency.py)
    def _weight_tensors(self) -> list[torch.Tensor]:
        """This rank's shards (FSDP's unsharded copies exist only inside a forward or backward)."""
        return [self._local(p) for p in self.model.parameters()]

    def _train_state(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(Adam state kept, gradients dropped): a step leaves no gradient (set to None), this is for safety."""
        keep = [self._local(v) for st in self.optimizer.state.values() for v in st.values() if torch.is_tensor(v)]
        drop = [self._local(p.grad) for p in self.model.parameters() if p.grad is not None]
        return keep, drop
