"""What every Megatron rank that scores tokens shares: the rank's set-up (process groups, the model built from an HF
folder, its weights loaded) and the forward pass (micro-batch plan, shared-prefix / varlen layouts, the response
window of the lm_head, the logprob kernels). The trainable policy (`megatron_worker.MegatronPolicyWorker`) and the
frozen distillation teacher (`teacher_worker.TeacherWorker`) are both built from it, so a teacher's logprobs come
from exactly the code the policy's (and its KL reference's) do.

A class using `ForwardPass` provides `cfg` (a PolicyConfig), `model` (what the schedule runs: megatron DDP or the
bare GPTModel) and `_require_resident` (policy/residency.py); `_setup_forward(gpt)` sets the rest.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_rl.config.loader import resolve_model_dir
from megatron_rl.config.schema import PolicyConfig
from megatron_rl.platform import get_platform, install_megatron_cpu_compat
from megatron_rl.policy import batching, context_parallel, packing
from megatron_rl.policy.interface import RolloutBatch


def init_rank(cfg: PolicyConfig, local_rank: int) -> torch.device:
    """This process's device, torch.distributed and megatron's model-parallel groups for cfg's split."""
    from megatron.core import parallel_state as ps

    install_megatron_cpu_compat()
    device = join_process_group(local_rank)
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=cfg.tp, pipeline_model_parallel_size=cfg.pp,
                                 expert_model_parallel_size=cfg.ep)
    return device


def join_process_group(local_rank: int) -> torch.device:
    """This rank's device, and torch.distributed on the platform's backend (gloo on CPU, nccl on CUDA); any backend's
    rank calls it (the FSDP2 worker too) before building its model."""
    plat = get_platform()
    # GPU only: a CPU rank has one device, so no CPU test can pick the wrong one here. On CUDA, Ray's placement sets
    # CUDA_VISIBLE_DEVICES per actor and local_rank indexes what it left visible (test_gpu_placement checks, on
    # logical GPUs, which GPU ids and CUDA_VISIBLE_DEVICES each actor gets); set before init_process_group so nccl
    # binds this device.
    if plat.is_gpu:
        torch.cuda.set_device(int(local_rank))
    if not dist.is_initialized():
        dist.init_process_group(plat.dist_backend)
    return plat.device(torch.cuda.current_device() if plat.is_gpu else 0)


def build_loaded_model(cfg: PolicyConfig, device: torch.device, *, checkpoint: str | Path | None = None, **build_kw):
    """(gpt, model_dir, hf_config, dtype): cfg.model's architecture as a megatron GPTModel on `device`, in cfg's
    precision, holding the folder's HF weights, or a megatron-rl checkpoint's when `checkpoint` is given (model
    weights only, resharded to this split). `build_kw` goes to `models.provider.build_model`."""
    from megatron_rl.models.hf_io import HFCheckpoint
    from megatron_rl.models.mapping import load_hf_into_model
    from megatron_rl.models.provider import build_model

    plat = get_platform()
    model_dir = resolve_model_dir(cfg.model)
    hf_config = json.loads((model_dir / "config.json").read_text())
    dtype = plat.resolve_dtype(cfg.precision)
    # no random init: the loaded weights overwrite every parameter right after (build_model still tags the
    # tensor-parallel weights, which grad-norm and clipping rely on)
    gpt = build_model(hf_config, params_dtype=dtype, seed=cfg.seed, init_weights=False, **build_kw)
    if getattr(cfg, "value_head", False):  # a reward model / critic: its head before the weights (a checkpoint or an
        from megatron_rl.models.value_head import install_value_head  # export holds it)

        install_value_head(gpt, cfg.seed, hf_config.get("initializer_range", 0.02))
    gpt.to(device)
    if dtype != torch.float32:
        # megatron's local spec builds its norm weights in fp32 whatever params_dtype says (transformer-engine's
        # follow it): cast them so the model has one dtype on both platforms, and so does its export (the refit)
        for p in gpt.parameters():
            p.data = p.data.to(dtype)
    if checkpoint is not None:
        from megatron_rl.models.checkpoint import load_checkpoint

        load_checkpoint(str(checkpoint), gpt)
    elif getattr(cfg, "value_head", False):
        from megatron_rl.models.value_head import ValueModelWeights, load_value_head

        hf = HFCheckpoint(model_dir)
        load_hf_into_model(gpt, ValueModelWeights(hf, hf_config["vocab_size"], hf_config["hidden_size"]))
        load_value_head(gpt, hf)
    else:
        load_hf_into_model(gpt, HFCheckpoint(model_dir))
    return gpt, model_dir, hf_config, dtype


class ForwardPass:
    def _setup_forward(self, gpt) -> None:
        """The model's forward hooks and this rank's coordinates (after any LoRA install, before DDP)."""
        from megatron.core import parallel_state as ps

        from megatron_rl.policy.model_hooks import install_fused_head, install_logit_window

        cfg, plat = self.cfg, get_platform()
        self.spec = gpt.megatron_rl_spec
        tcfg = gpt.config
        self.shared_prefix = self._enable_shared_prefix(gpt)
        # varlen rows: the core attention of `build_model`'s spec takes them; a sliding window would be ignored
        cp = getattr(cfg, "cp", 1)
        self.varlen = packing.resolve_mode(cfg.packing, plat.default_packing, cp) == "varlen" \
            and self.spec.sliding_window is None
        self.cp = context_parallel.init_cp(cp)  # policy/context_parallel.py; size 1: no CP
        self.segment_multiple = packing.segment_multiple(cfg.tp, cp, tcfg.sequence_parallel)
        self._logit_window = install_logit_window(gpt)  # None on stages without the lm_head
        if cp > 1:
            self._check_context_parallel(gpt)
        # None there too, and where the head cannot be fused (model_hooks.install_fused_head says when); a value
        # model's output layer already returns its head's values (models/value_head.py)
        self.value_model = cfg.value_head  # build_loaded_model installed the head (last stage)
        self._fused_head = install_fused_head(gpt, ps.get_tensor_model_parallel_rank()) \
            if cfg.fused_lm_head and not self.value_model else None
        self.narrow_logits = True  # benches switch it off to measure the full-sequence lm_head
        tcfg.variable_seq_lengths = True  # micro-batches differ in length; PP exchanges shapes
        self.gpt = gpt
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.tp_size = ps.get_tensor_model_parallel_world_size()
        self.dp_size, self.dp_rank = self.cp.dp_size, self.cp.dp_rank  # data-parallel replicas, CP ranks apart
        self.is_output_rank = (ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0
                               and self.cp.rank == 0)
        self._replay = None  # MoE routing replay: used for batches that carry the engine's routing
        if self.spec.moe is not None and getattr(cfg, "moe_routing_replay", "off") != "off":
            from megatron_rl.policy.routing_replay import MegatronRoutingReplay

            self._replay = MegatronRoutingReplay(gpt)

    def _check_context_parallel(self, gpt) -> None:
        """What a context-parallel rank relies on (policy/context_parallel.py), or ValueError naming the key."""
        from megatron_rl.policy.model_hooks import install_position_rope

        cp = self.cfg.cp
        if not self.varlen:
            raise ValueError(f"policy.cp={cp} needs packed rows (policy.packing: varlen) and a model without sliding-"
                             "window attention")
        # each token's own rotary angle (install_position_rope); TE's fused RoPE takes one table per batch
        if gpt.config.apply_rope_fusion or (getattr(gpt, "rotary_pos_emb", None) is not None
                                            and not install_position_rope(gpt)):
            raise ValueError(f"policy.cp={cp} needs per-token RoPE positions, which fused RoPE (apply_rope_fusion) "
                             "does not take")
        last = getattr(gpt, "post_process", True)
        if last and self._logit_window is None:  # the lm_head must run on this rank's response positions only
            raise ValueError(f"policy.cp={cp} with multi-token prediction or sequence parallelism")

    def _enable_shared_prefix(self, gpt) -> bool:
        """Patch the model for packed groups, unless configured off or the model cannot take custom masks."""
        from megatron_rl.policy.model_hooks import install_explicit_mask_attention, install_position_rope

        if not self.cfg.shared_prefix:
            return False
        # megatron replaces any given mask by its sliding-window mask, and TE's fused RoPE takes one position table
        # for the whole batch: both would silently ignore the packed layout
        if self.spec.sliding_window is not None or gpt.config.apply_rope_fusion:
            return False
        return install_position_rope(gpt) and install_explicit_mask_attention(gpt) > 0

    def _micro_batches(self, batch: RolloutBatch) -> list[batching.MicroBatchRows]:
        batching.check_batch(batch, self.spec.vocab_size, self.spec.max_position_embeddings)
        if len(batch) < self.dp_size:
            raise ValueError(f"batch of {len(batch)} sequences cannot feed {self.dp_size} data-parallel ranks")
        # plan (which units form each micro-batch) -> rows (its tensors); the loss then gathers per token from them.
        # Experts at DP > 1: equal micro-batch counts over DP ranks (megatron_worker's module doc)
        # the budget is what one rank holds: a context-parallel row holds cp x it
        plan = packing.plan_split_rows(batch, shared=self.shared_prefix, varlen=self.varlen,
                                       max_tokens=self.cfg.max_tokens_per_microbatch, ranks=self.cp.size,
                                       key="policy.cp", dp_size=self.dp_size, dp_rank=self.dp_rank,
                                       multiple=self.segment_multiple,
                                       equal_counts=self.dp_size > 1 and self.spec.moe is not None)
        from megatron_rl.policy.routing_replay import attach

        return attach(batch, [batching.rows(batch, units, varlen=self.varlen, multiple=self.segment_multiple)
                              for units in plan], self._replay)

    def _forward(self, model, mb: batching.MicroBatchRows):
        """(output, mb as the loss sees it): on the last stage the logits cover only the response window (columns
        from the first response prediction on, `model_hooks.install_logit_window`) and the returned mb is narrowed
        to match; elsewhere the output is the stage's hidden states and mb is unchanged."""
        if self.cp.size > 1:
            return self._forward_share(model, mb)
        view = mb
        if self._logit_window is not None:
            self._logit_window.start, view = batching.response_window(mb) if self.narrow_logits else (0, mb)
        mask = mb.attention_mask.to(self.device) if mb.attention_mask is not None else None
        if self._replay is not None:  # this stage's routers replay this micro-batch's record (or route themselves)
            self._replay.set(mb.routing)
        return model(mb.tokens.to(self.device), mb.position_ids.to(self.device), mask,
                     packed_seq_params=batching.packed_on(mb.packed, self.device)), view

    def _forward_share(self, model, mb: batching.MicroBatchRows):
        """`_forward` at CP > 1: the model runs this rank's share of the row (policy/context_parallel.py), the
        lm_head on its response positions; the view is the whole row's, carrying the share (`cp`), and
        `_token_stats` hands back the whole row's statistics. The logit window is always narrowed here: the
        statistics are gathered by response position."""
        share = context_parallel.split_row(mb.packed, mb.resp_mask, self.cp.size, self.cp.rank, self.cp.group)
        tokens, positions, params = context_parallel.local_row(mb, share)
        view = mb
        if self._logit_window is not None:
            if mb.filler:
                self._logit_window.start = 0
            else:
                self._logit_window.start, view = share.resp_local, batching.response_window(mb)[1]
        if self._replay is not None:
            self._replay.set(None if mb.routing is None else mb.routing[:, share.cols])
        out = model(tokens.to(self.device), positions.to(self.device), None,
                    packed_seq_params=batching.packed_on(params, self.device))
        return out, dataclasses.replace(view, cp=share)

    def _token_stats(self, output: torch.Tensor, mb: batching.MicroBatchRows, temperature):
        """(logprobs, entropy) per token of `mb`'s targets (the view `_forward` returned): at CP > 1 this rank's
        response positions', then the whole row's gathered (`context_parallel.gather_responses`)."""
        share = mb.cp
        if share is None:
            return self._local_token_stats(output, mb.targets, temperature)
        if output.shape[1] == 0:  # no response position on this rank: still part of the graph (its backward runs
            lp = ent = output[..., 0] * 0.0  # the attention's collectives like every other CP rank's)
        else:
            lp, ent = self._local_token_stats(output, mb.targets[:, share.resp_at[share.rank]], temperature)
        return context_parallel.gather_responses(lp, share), context_parallel.gather_responses(ent, share)

    def _local_token_stats(self, output: torch.Tensor, targets: torch.Tensor, temperature):
        """(logprobs, entropy) per token of the last stage's output: hidden states [b, s, h] after a fused head's
        forward (no logits are ever formed, kernels/linear.py), else this rank's vocabulary shard of the logits.
        `temperature`: a float, or the engine's whole sampling rule (`sampling_filter.TokenScoring`): with top-k /
        top-p the logprobs are those of the filtered distribution the engine sampled from (the entropy is not).
        A value model's output is [b, s, 1], its values: they stand where logprobs do (entropy 0)."""
        from kernels import linear_token_logprobs, token_logprobs_and_entropy
        from megatron.core import parallel_state as ps

        from megatron_rl.policy.sampling_filter import as_scoring, filter_logprobs

        if self.value_model:
            values = output[..., 0].float()
            return values, torch.zeros_like(values)
        scoring = as_scoring(temperature)
        tp = self.tp_size > 1
        group = self.tp_group if tp else None
        head = self._fused_head
        targets = targets.to(output.device)
        start = ps.get_tensor_model_parallel_rank() * output.shape[-1] if tp else 0
        if head is not None and head.weight is not None:
            # the kernel sums the hidden gradient over TP, as the output layer's own backward would
            lp, ent = linear_token_logprobs(output, head.weight, targets, tp_group=group,
                                            vocab_start_index=head.vocab_start, temperature=scoring.temperature,
                                            return_entropy=True)
        else:
            head = None
            lp, ent = token_logprobs_and_entropy(output, targets, tp_group=group, vocab_start_index=start,
                                                 temperature=scoring.temperature)
        return filter_logprobs(lp, output, head, targets, scoring, group, start), ent

    def _topk_inputs(self, output: torch.Tensor, mb: batching.MicroBatchRows, fields, flat_lp: torch.Tensor,
                     temperature: float) -> dict:
        """Top-k distillation's loss inputs for a micro-batch (`LossInputs.teacher_topk_logprobs` and the student's
        differentiable `student_topk_logprobs`, policy/topk.py); {} when the batch carries no teacher top-k.
        `fields`: the step's `step_inputs.StepFields`."""
        teacher = fields.teacher_topk(mb, flat_lp.device)
        if teacher is None:
            return {}
        if mb.cp is not None:  # the config loader refuses it first (config/distillation.py)
            raise ValueError("top-k distillation (distillation.topk) with policy.cp > 1")
        from megatron.core import parallel_state as ps

        from megatron_rl.policy.sampling_filter import as_scoring
        from megatron_rl.policy.topk import logprobs_at

        ids, teacher_lps = teacher
        tp = self.tp_size > 1
        student = logprobs_at(batching.flat(output, mb), self._fused_head, ids, batching.flat(mb.targets, mb),
                              flat_lp, as_scoring(temperature).temperature, self.tp_size,
                              ps.get_tensor_model_parallel_rank() * output.shape[-1] if tp else 0)
        return {"teacher_topk_logprobs": teacher_lps, "student_topk_logprobs": student}

    def _schedule(self, mbs, step_fn, forward_only: bool):
        from megatron.core.pipeline_parallel import get_forward_backward_func

        return get_forward_backward_func()(
            forward_step_func=step_fn, data_iterator=iter(mbs), model=[self.model], num_microbatches=len(mbs),
            seq_length=max(mb.tokens.shape[1] for mb in mbs), micro_batch_size=max(mb.tokens.shape[0] for mb in mbs),
            forward_only=forward_only)

    @torch.no_grad()
    def logprobs(self, batch: RolloutBatch, temperature: float = 1.0, with_entropy: bool = False):
        """{batch index: response-token logprobs} (and entropies) from output ranks; None elsewhere."""
        self._require_resident("compute logprobs")
        mbs = self._micro_batches(batch)
        out: dict[int, Any] = {}

        def step(data_iter, model):
            logits, mb = self._forward(model, next(data_iter))

            def loss_func(logits):
                if mb.filler:
                    return logits.sum() * 0.0, {}
                lp, ent = self._token_stats(logits, mb, temperature)
                for i, l, e in zip(mb.indices, batching.split_rows(lp, mb), batching.split_rows(ent, mb)):
                    out[i] = (l.float().cpu(), e.float().cpu()) if with_entropy else l.float().cpu()
                return lp.sum() * 0.0, {}

            return logits, loss_func

        self.model.eval()
        self._schedule(mbs, step, forward_only=True)
        self.model.train()
        return out if self.is_output_rank else None
