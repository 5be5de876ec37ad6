"""One rank of the Megatron policy: model, DDP, optimizer and scheduler on megatron-core (TP x PP x DP).

Runs as a Ray actor (`RankWorker`) in a `WorkerGroup`, or directly in a gloo process in tests. Every rank of the
group receives the whole `RolloutBatch`; each computes the same micro-batch plan (`policy/packing.py`) and works
on its data-parallel share. Results come back from the last pipeline stage's TP-rank-0 ranks only (one per DP
replica) as {batch index: tensor}; `PolicyGroup` merges them into batch order.

Loss normalisation: the loss function already divides by global counts. megatron's per-token mode
(`calculate_per_token_loss`) stops the schedule from dividing by the number of micro-batches and DDP from averaging
over DP; `finalize_model_grads` then divides the gradient by the sum of the token counts the loss functions report.
We report D = the global token count exactly once (first micro-batch of DP rank 0) and return loss * D, so the
gradient is exactly that of the normalised loss, whatever the split.

Shared prefix (`policy.shared_prefix`): each GRPO group becomes one row, its prompt computed once
(`policy/packing.py` plans it, `policy/batching.py` lays it out); the model is patched to honour per-token positions and explicit masks
(`policy/model_hooks.py`). Outputs and loss inputs are per sequence as in the unshared layout.

Equal micro-batch counts: with experts at DP > 1 megatron's token dispatcher runs an all-to-all over the expert-
parallel group (DP ranks) in every MoE layer of every micro-batch, so the short ranks' plans end with empty
micro-batches (`policy/microbatch.py`) fed as a few pad tokens (`batching.filler_row`): forward and backward run the
same collectives, the loss 0 * logits sends exact zero gradients, no tokens are counted, no outputs kept, no
load-balancing loss attached (`grad_ops.with_aux_loss_coeff`). Dense models need none of it.

Varlen packing (`policy.packing: varlen`): each micro-batch is one packed THD row (PackedSeqParams, no padding
between sequences); with shared prefix a group's completions attend its prompt by cascade attention, no mask
(`models/varlen_attention.py`).
"""
from __future__ import annotations

import math

import torch

from megatron_rl.config.schema import PolicyConfig
from megatron_rl.distributed.worker_group import RankWorker
from megatron_rl.platform import get_platform
from megatron_rl.policy import batching, identity_collectives
from megatron_rl.policy.forward_pass import ForwardPass, build_loaded_model, init_rank
from megatron_rl.policy.grad_ops import (build_scheduler, clip_to_total_norm, moe_aux_loss_coeff, restore_scheduler,
                                        scheduler_state, torch_optimizers, use_fused_torch_adam, with_aux_loss_coeff)
from megatron_rl.policy.interface import RolloutBatch
from megatron_rl.models.lora import adapters_disabled, install_lora
from megatron_rl.policy.residency import Residency
from megatron_rl.policy.step_inputs import StepFields, once_per_group, reduced_metrics, sum_metrics
from megatron_rl.policy.weights_out import WeightsOut


# Optimizer-state layout in checkpoints. megatron 0.16 with torch's AdamW (no apex/TE) cannot round-trip its default
# ('fully_sharded_model_space': rejects its own flattened shards) nor 'fully_reshardable' (per-parameter 'step'
# missing on load); 'dp_reshardable' works. Model weights stay fully reshardable (any TP/PP); optimizer state
# resumes at the same TP/PP layout.
_OPT_CKPT_META = {"distrib_optim_sharding_type": "dp_reshardable"}



class MegatronPolicyWorker(ForwardPass, WeightsOut, Residency, RankWorker):
    def __init__(self, rank: int, world_size: int, log_path: str | None = None, threads: int | None = None,
                 env: dict | None = None, policy_cfg: PolicyConfig | None = None, max_steps: int = 1):
        super().__init__(rank, world_size, log_path, threads, env)
        self.cfg = policy_cfg or PolicyConfig()
        self.max_steps = max_steps
        self.step = 0
        self.consumed_samples = 0
        # colocated handover (policy/residency.py): what reads weights or optimizer state requires it resident
        self._init_residency()

    # ------------------------------------------------------------------------------------------------- set-up
    def setup(self) -> dict:
        from megatron.core import parallel_state as ps
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed import finalize_model_grads

        cfg = self.cfg
        self.device = init_rank(cfg, self._local_rank(self.rank))
        # per-token loss mode (module doc) at construction: MoE routers read it there. The load-balancing loss when
        # policy.moe_aux_loss_coef > 0 (its coefficient is set per step, `grad_ops.moe_aux_loss_coeff`)
        aux = dict(moe_router_load_balancing_type="aux_loss") if cfg.moe_aux_loss_coef > 0 else {}
        gpt, self.model_dir, hf_config, self.dtype = build_loaded_model(
            cfg, self.device, recompute_granularity="full" if cfg.activation_recompute else None,
            recompute_method="uniform" if cfg.activation_recompute else None,
            recompute_num_layers=1 if cfg.activation_recompute else None, calculate_per_token_loss=True, **aux)
        # policy.value_head: build_loaded_model gave it a value head (a reward model / critic, models/value_head.py)
        # adapters (models/lora.py) before DDP: it must see the frozen base to give it no gradient buffers
        self.lora = install_lora(gpt, cfg.lora, hf_config, cfg.seed) if cfg.lora is not None else None
        self._setup_forward(gpt)  # policy/forward_pass.py: the hooks and coordinates the teacher shares
        tcfg = gpt.config
        self.model = DistributedDataParallel(
            config=tcfg, module=gpt,
            ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                     use_distributed_optimizer=cfg.optimizer.distributed))
        tcfg.no_sync_func = self.model.no_sync
        identity_collectives.install()  # DP=1: no whole-model gradient/parameter copies per step
        tcfg.finalize_model_grads_func = finalize_model_grads
        self._build_optimizer()
        # Reference policy for KL: the initial weights, host-resident (no extra device memory while training);
        # with LoRA the base itself, adapters off (no copy)
        self.ref_weights = self._weights_copy()
        return {"rank": self.rank, "tp_rank": ps.get_tensor_model_parallel_rank(), "dp_rank": self.dp_rank,
                "pp_rank": ps.get_pipeline_model_parallel_rank(), "dp_size": self.dp_size,
                "num_params": sum(p.numel() for p in self.gpt.parameters()),
                "trainable_params": sum(p.numel() for p in self.gpt.parameters() if p.requires_grad)}

    def _weights_copy(self) -> dict[str, torch.Tensor] | None:
        # LoRA: the base is the reference. A value model (reward model, PPO's critic) has no KL term: no host copy
        if self.lora is not None or self.cfg.value_head:
            return None
        return {n: p.detach().to("cpu", copy=True) for n, p in self.gpt.named_parameters()}

    def _build_optimizer(self) -> None:
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        o, s = self.cfg.optimizer, self.cfg.scheduler
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay,
                            adam_beta1=o.adam_beta1, adam_beta2=o.adam_beta2, adam_eps=o.adam_eps,
                            clip_grad=o.clip_grad, bf16=self.dtype == torch.bfloat16,
                            fp16=self.dtype == torch.float16, params_dtype=self.dtype,
                            use_distributed_optimizer=o.distributed),
            [self.model])
        use_fused_torch_adam(self.optimizer)
        self.scheduler = build_scheduler(self.optimizer, o, s, self.max_steps)

    # ------------------------------------------------------------------------------- forward (forward_pass.py)
    @torch.no_grad()
    def _swap_weights(self, source: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        saved = {}
        for n, p in self.gpt.named_parameters():
            saved[n] = p.detach().to("cpu", copy=True)
            p.copy_(source[n].to(p.device, p.dtype))
        return saved

    def reference_logprobs(self, batch: RolloutBatch, temperature: float = 1.0):
        self._require_resident("compute reference logprobs")
        if self.lora is not None:
            with adapters_disabled(self.lora):
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
        """One optimizer step. Returns {"metrics", "logprobs" ({index: tensor}), "skipped"} on output ranks."""
        fields = StepFields(batch)  # policy/step_inputs.py: what the loss sees, the same on every backend
        self._require_resident("train")
        mbs = self._micro_batches(batch)
        n_tokens = fields.n_tokens
        first_dp = self.dp_rank == 0 and self.cp.rank == 0  # reports the token count once (module doc)
        own_lp: dict[int, torch.Tensor] = {}

        aux_coeff = None
        if self.cfg.moe_aux_loss_coef > 0:  # over the real micro-batches: fillers route no loss-bearing token
            aux_coeff = moe_aux_loss_coeff(self.cfg.moe_aux_loss_coef, [mb for mb in mbs if not mb.filler], n_tokens)

        def step(data_iter, model):
            raw = next(data_iter)
            coeff = 0.0 if aux_coeff is not None and raw.filler else aux_coeff  # a filler: no load-balancing loss
            logits, mb = with_aux_loss_coeff(self.gpt.config, coeff, lambda: self._forward(model, raw))

            def loss_func(logits):
                if mb.filler:  # an exact zero gradient through the whole model, no token counted, no metrics
                    return logits.sum() * 0.0, torch.zeros((), dtype=torch.int, device=logits.device), {}
                lp, ent = self._token_stats(logits, mb, temperature)
                flat_lp = batching.flat(lp, mb)
                for i, l in zip(mb.indices, batching.split_rows(lp.detach(), mb)):
                    own_lp[i] = l.float().cpu()
                inputs = fields.loss_inputs(
                    mb, flat_lp, batching.flat(ent, mb),
                    self._topk_inputs(logits, mb, fields, flat_lp, temperature))  # top-k distillation only
                loss, metrics = loss_fn(inputs)
                report = first_dp and raw is mbs[0]
                count = torch.tensor(n_tokens if report else 0, dtype=torch.int, device=flat_lp.device)
                reduced = reduced_metrics(loss, metrics, raw)
                return loss * n_tokens, count, reduced

            return logits, loss_func

        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        reduced_list = self._schedule(mbs, step, forward_only=False)
        metrics = self._sum_metrics(reduced_list)
        lr = float(self.optimizer.param_groups[0]["lr"])  # what this step trains at (the step ticks the scheduler)
        skipped, grad_norm = self._optimizer_step()
        self.consumed_samples += len(batch)
        metrics.update(grad_norm=grad_norm, lr=lr,
                       policy_peak_memory_gb=get_platform().peak_memory_bytes() / 2**30)
        if not self.is_output_rank:
            return None
        return {"metrics": metrics, "logprobs": own_lp, "skipped": skipped}

    def _sum_metrics(self, reduced_list) -> dict[str, float]:
        from megatron.core import parallel_state as ps

        reduce = ps.is_pipeline_last_stage() and ps.get_data_parallel_world_size() > 1  # CP ranks included
        return sum_metrics(once_per_group(reduced_list, self.cp.rank), ps.get_data_parallel_group() if reduce else None)

    def _optimizer_step(self) -> tuple[bool, float]:
        """Clip and step, unless the gradient is non-finite anywhere (the norm is global, so all ranks agree)."""
        opt = self.optimizer
        found_inf = opt.prepare_grads()
        norm = float(opt.get_grad_norm())
        if found_inf or not math.isfinite(norm):
            opt.zero_grad()
            self.model.zero_grad_buffer()
            return True, norm
        if opt.config.clip_grad > 0:
            clip_to_total_norm(self.optimizer, norm)
        opt.step_with_ready_grads()
        self.scheduler.step(increment=1)
        self.step += 1
        return False, norm

    def set_threads(self, n: int) -> None:
        from megatron_rl.platform import set_cpu_threads

        set_cpu_threads(n)

    # ------------------------------------------------------------------------------------------ checkpoints
    def save(self, path: str, extra: dict | None = None) -> str:
        from megatron_rl.models.checkpoint import save_checkpoint

        self._require_resident("save a checkpoint")
        if not self._has_optimizer_state():  # a save before the first update (e.g. only empty steps so far)
            self._materialize_optimizer_state()
        extra_state = {"scheduler": scheduler_state(self.scheduler), "step": self.step,
                       "consumed_samples": self.consumed_samples, "rng": get_platform().rng_state(),
                       "driver": extra or {}}
        opt_sd = self.optimizer.sharded_state_dict(self.gpt.sharded_state_dict(), metadata=_OPT_CKPT_META)
        # LoRA: the adapters and a pointer to the base (models/checkpoint.py)
        adapters = None if self.lora is None else {"lora": vars(self.cfg.lora), "base": str(self.model_dir)}
        try:
            return str(save_checkpoint(path, self.gpt, step=self.step, extra_state=extra_state,
                                       extra_sharded_state={"optimizer": opt_sd}, hf_dir=self.model_dir,
                                       adapters=adapters))
        finally:
            del opt_sd
            get_platform().trim_host_heap()  # the save's staging copies: freed, but not left resident

    def load(self, path: str) -> dict:
        from megatron_rl.models.checkpoint import load_checkpoint

        self._require_resident("load a checkpoint")
        self._materialize_optimizer_state()
        opt_sd = self.optimizer.sharded_state_dict(self.gpt.sharded_state_dict(), is_loading=True,
                                                   metadata=_OPT_CKPT_META)
        res = load_checkpoint(path, self.gpt, extra_sharded_state={"optimizer": opt_sd})
        with torch.no_grad():  # the loader copies into the (leaf, requires-grad) fp32 main params in place
            self.optimizer.load_state_dict(res["extra_sharded_state"]["optimizer"])
        self._restore_adam_steps(_saved_adam_step(res["extra_sharded_state"]["optimizer"]))
        use_fused_torch_adam(self.optimizer)  # the loaded param groups carry the saving run's implementation flags
        extra = res["extra_state"] or {}
        if "scheduler" in extra:
            self.scheduler = restore_scheduler(self.scheduler, self.optimizer, self.cfg.optimizer, self.cfg.scheduler,
                                               self.max_steps, extra["scheduler"])
        self.step = int(extra.get("step", res["metadata"].get("step", 0)))
        self.consumed_samples = int(extra.get("consumed_samples", 0))
        if "rng" in extra:
            get_platform().set_rng_state(extra["rng"])
        return extra.get("driver", {})

    def load_weights(self, path: str) -> None:
        """Model weights only (stage chains: the next stage starts from the previous stage's final weights with a
        fresh optimizer); they also become this stage's KL reference (with LoRA the base stays the reference)."""
        from megatron_rl.models.checkpoint import load_checkpoint

        self._require_resident("load weights")
        load_checkpoint(path, self.gpt)
        self.optimizer.reload_model_params()  # fp32 main params / distributed shards follow the loaded weights
        self.ref_weights = self._weights_copy()

    def _has_optimizer_state(self) -> bool:
        return any(len(o.state) for o in torch_optimizers(self.optimizer))

    def _materialize_optimizer_state(self) -> None:
        """A fresh torch Adam has no state (not even 'step') until its first step, and megatron's optimizer state
        dict requires it; take one step at lr 0 with zero gradients (weights unchanged), then let the load
        overwrite the state."""
        opt = self.optimizer
        saved = [g["lr"] for g in opt.param_groups]
        for g in opt.param_groups:
            g["lr"] = 0.0
        self.model.zero_grad_buffer()
        opt.zero_grad()
        opt.prepare_grads()
        opt.step_with_ready_grads()
        for g, lr in zip(opt.param_groups, saved):
            g["lr"] = lr

    def _restore_adam_steps(self, saved: float | None) -> None:
        """Give every torch-Adam state its own copy of the checkpoint's step count.

        Two megatron-core 0.16 loader problems with torch's Adam (no apex/TE): (1) every parameter's state gets the
        *same* 'step' tensor, which torch increments in place once per parameter, wrecking the bias correction;
        (2) with the distributed optimizer's `dp_reshardable` layout, the parameter-state loader copies the step of
        the *loading* optimizer (the lr-0 step of `_materialize_optimizer_state`: 1) over the checkpoint's, so the
        first update after a resume used the wrong bias correction (found by the async resume test: weights after
        the next step differed by ~1e-4 from the uninterrupted run's). The checkpoint's own step is in its param
        groups (`saved`)."""
        for inner in torch_optimizers(self.optimizer):
            for st in inner.state.values():
                if torch.is_tensor(st.get("step")):
                    st["step"] = torch.full_like(st["step"], saved) if saved is not None else st["step"].clone()


def _saved_adam_step(loaded) -> float | None:
    """The optimizer step count stored in a loaded megatron optimizer state dict (its param groups' 'step'); None
    when absent or inconsistent."""
    steps: set[float] = set()

    def walk(x):
        if isinstance(x, dict):
            for k, v in x.items():
                if k == "param_groups" and isinstance(v, list):
                    steps.update(float(g["step"]) for g in v if isinstance(g, dict) and g.get("step") is not None)
                else:
                    walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)

    walk(loaded)
    return steps.pop() if len(steps) == 1 else None
