"""What the GRPO loop needs from a trainer, and nothing more (backend-free).

A `RolloutBatch` holds whole sequences (prompt + response token ids). Per-token fields are aligned with the
*response* tokens of each sequence: entry k of sequence i refers to token `input_ids[i][prompt_lens[i] + k]`,
predicted from everything before it. Outputs keep the batch's sequence order, however the worker splits it.

`loss_mask` marks which response tokens are trained. A multi-turn trajectory's "response" is everything after the
first prompt: the engine's tokens of every assistant turn, and between them the observation tokens (tool output,
feedback, the chat template's turn markers) that the environment wrote. Those are context: the model reads them but
never produced them, so they carry no gradient and count in no normaliser, entropy, KL or mismatch metric. Their
logprobs are still computed (the row is fed whole), and simply not used.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional, Protocol

import torch


@dataclass
class RolloutBatch:
    input_ids: list[list[int]]  # prompt + response tokens, one list per sequence
    prompt_lens: list[int]
    advantages: Optional[list[float]] = None  # one per sequence (GRPO: group-relative)
    old_logprobs: Optional[list[torch.Tensor]] = None  # per response token; None -> use the training forward's own
    ref_logprobs: Optional[list[torch.Tensor]] = None
    gen_logprobs: Optional[list[torch.Tensor]] = None  # generator's logprobs of the sampled tokens
    group_ids: Optional[list[int]] = None  # sequences sharing a prompt (shared-prefix packing)
    # per response token: True = trained (the engine sampled it), False = context (an observation); None: all trained
    loss_mask: Optional[list[torch.Tensor]] = None
    # The loss normalisers (response tokens, sequences) when this batch is the part of a step that carries gradient
    # (`algorithms/trainable.py`); None: this batch's own counts.
    step_tokens: Optional[int] = None
    step_seqs: Optional[int] = None
    # The loss couples the sequences of a group (DPO: a pair's chosen and rejected): each group stays in one
    # micro-batch on one DP rank, shared-prefix packed or not (`policy/packing.py`)
    keep_groups: bool = False
    # one number per sequence handed to the loss as `LossInputs.seq_roles` (DPO: 1 chosen, 0 rejected); None: none
    seq_roles: Optional[list[float]] = None
    # per response token: a frozen distillation teacher's logprobs of the sampled tokens (algorithms/distill_loss.py)
    teacher_logprobs: Optional[list[torch.Tensor]] = None
    # top-k distillation: per response token the teacher's k most likely next ids and their logprobs, [n, k] each
    teacher_topk_ids: Optional[list[torch.Tensor]] = None
    teacher_topk_logprobs: Optional[list[torch.Tensor]] = None
    # More per-sequence fields, keyed by name, each handed to the loss as `LossInputs.fields[name]` over the
    # micro-batch's response tokens: a number per sequence (repeated over its tokens) or a tensor per sequence of its
    # response length. An algorithm adds its own (PPO's token advantages, returns, old values) here without editing
    # this class, `subset` or either worker (policy/step_inputs.py gathers them)
    fields: dict[str, list] = field(default_factory=dict)
    # MoE routing replay (policy/routing_replay.py): per sequence, the experts the engine routed each of its tokens
    # to, [len(input_ids), MoE layers, k] integers, -1 where the engine did not run the token (prefix-cached prompt
    # tokens, the last sampled token, observations): the trainer routes those itself. None: it routes every token.
    # A model input over the whole sequence, not a loss field, hence not in `fields`.
    routed_experts: Optional[list[torch.Tensor]] = None
    # More per-sequence model inputs, keyed by the model's argument name: a vision-language prompt's processor
    # outputs (`pixel_values` of its images, `image_grid_thw`, ...), None for a sequence without them. The worker hands
    # them to the model's forward with the sequence's tokens; like `fields`, a new one needs no edit here
    model_inputs: dict[str, list] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.input_ids)

    def add_model_inputs(self, per_sequence: list[Optional[dict]]) -> None:
        """`model_inputs` from one dict (or None) per sequence: a key any sequence has, None where one lacks it."""
        for key in sorted({k for v in per_sequence if v for k in v}):
            self.model_inputs[key] = [v.get(key) if v else None for v in per_sequence]

    def subset(self, idx: list[int]) -> "RolloutBatch":
        """The sequences at `idx`, in that order, with every per-sequence field (normalisers: their own counts)."""
        def pick(v):
            return None if v is None else [v[i] for i in idx]

        return RolloutBatch(pick(self.input_ids), pick(self.prompt_lens), pick(self.advantages),
                            pick(self.old_logprobs), pick(self.ref_logprobs), pick(self.gen_logprobs),
                            pick(self.group_ids), loss_mask=pick(self.loss_mask), keep_groups=self.keep_groups,
                            seq_roles=pick(self.seq_roles), teacher_logprobs=pick(self.teacher_logprobs),
                            teacher_topk_ids=pick(self.teacher_topk_ids),
                            teacher_topk_logprobs=pick(self.teacher_topk_logprobs),
                            fields={k: pick(v) for k, v in self.fields.items()},
                            routed_experts=pick(self.routed_experts),
                            model_inputs={k: pick(v) for k, v in self.model_inputs.items()})

    def loss_normalizers(self) -> tuple[int, int]:
        """(response tokens, sequences) the loss divides by."""
        return (self.num_response_tokens() if self.step_tokens is None else self.step_tokens,
                len(self) if self.step_seqs is None else self.step_seqs)

    def response_lens(self) -> list[int]:
        return [len(ids) - p for ids, p in zip(self.input_ids, self.prompt_lens)]

    def num_response_tokens(self) -> int:
        """Response tokens the loss trains: all of them, or those `loss_mask` keeps."""
        if self.loss_mask is None:
            return sum(self.response_lens())
        return int(sum(int(m.sum()) for m in self.loss_mask))

    def trained_mask(self) -> torch.Tensor:
        """The loss mask of every response token, concatenated in batch order (float, 1 = trained)."""
        if self.loss_mask is None:
            return torch.ones(sum(self.response_lens()))
        return torch.cat([m.reshape(-1).float() for m in self.loss_mask]) if self.loss_mask else torch.ones(0)


# loss_fn(logprobs, batch fields for the micro-batch, normalisers) -> (scalar loss, metrics); see policy/loss_api.py
LossFn = Callable[..., tuple[torch.Tensor, dict[str, Any]]]


@dataclass(frozen=True)
class TokenScoring:
    """How the engine sampled, which the policy's token logprobs must describe (policy/sampling_filter.py): passed
    wherever a bare temperature is accepted (logprobs, reference_logprobs, train)."""
    temperature: float = 1.0
    top_k: int = -1  # <= 0: no top-k filter
    top_p: float = 1.0  # >= 1: no top-p filter
    max_kept: int = 1024  # top-p alone: how many of the most likely tokens are looked at

    @property
    def filtered(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0


def as_scoring(t) -> TokenScoring:
    return t if isinstance(t, TokenScoring) else TokenScoring(float(t))


@dataclass
class TrainResult:
    metrics: dict[str, float] = field(default_factory=dict)  # loss, kl, clip_frac, entropy, grad_norm, lr, ...
    logprobs: Optional[list[torch.Tensor]] = None  # the training forward's own logprobs (detached), batch order
    skipped: bool = False  # non-finite loss or gradients: the update was not applied


class PolicyWorker(Protocol):
    def logprobs(self, batch: RolloutBatch) -> list[torch.Tensor]:
        """Per-response-token log p under the current weights (plus entropies via `logprobs_and_entropy`)."""

    def reference_logprobs(self, batch: RolloutBatch) -> list[torch.Tensor]:
        """Same, under the frozen reference weights (for the KL term)."""

    def train(self, batch: RolloutBatch, loss_fn: LossFn) -> TrainResult:
        """One optimizer step over the whole batch (split into token-budget micro-batches internally)."""

    def export_weights(self, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """HF-named full tensors in buckets of about `bucket_bytes` (for refit and HF export)."""

    def save(self, path: str, extra: dict | None = None) -> None: ...

    def load(self, path: str) -> dict: ...

    def offload(self) -> None:
        """Colocated handover: weights, gradients and optimizer state leave device memory (host copies kept);
        until `onload()`, every call that reads them raises `megatron_rl.lifecycle.LifecycleError`."""

    def onload(self) -> None: ...

    def release_refit(self) -> None:
        """The generator has loaded the last `send_weights` update: free what the transport kept for it."""

    def memory_report(self) -> dict:
        """{"state", "device_bytes", "host_bytes", ...} per rank: where the trainer's state is now."""
