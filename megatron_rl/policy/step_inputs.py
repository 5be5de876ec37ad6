"""What a training step hands its loss function, whatever the backend: the batch's per-sequence fields as tensors,
a micro-batch's `LossInputs` from its flat logprobs and entropies, and the metrics it returns, reduced.

Both policy backends (`megatron_worker.py`, `fsdp2_worker.py`) build the loss inputs here, so the same `loss_fn` sees
the same numbers from either, and the `TrainResult` metrics are summed the same way (the loss function already
divides by the global counts: policy/loss_api.py).
"""
from __future__ import annotations

import torch

from megatron_rl.policy import batching
from megatron_rl.policy.interface import RolloutBatch
from megatron_rl.policy.loss_api import LossInputs


class StepFields:
    """One training call's per-sequence tensors and normalisers, read by every micro-batch's loss."""

    def __init__(self, batch: RolloutBatch):
        if batch.advantages is not None and len(batch.advantages) != len(batch):
            raise ValueError(f"train() got {len(batch.advantages)} advantages for {len(batch)} sequences")
        self.batch = batch
        self.n_tokens, self.n_seqs = batch.loss_normalizers()
        # no advantages (SFT, DPO): zeros, so the loss contract keeps one shape
        self.adv = torch.tensor(batch.advantages if batch.advantages is not None else [0.0] * len(batch),
                                dtype=torch.float32)
        self.groups = torch.tensor(batch.group_ids, dtype=torch.long) if batch.group_ids is not None else None
        lens = batch.response_lens()
        for name, values in batch.fields.items():  # RolloutBatch.fields: one entry per sequence, tensors its length
            if len(values) != len(batch):
                raise ValueError(f"RolloutBatch.fields[{name!r}] has {len(values)} entries for {len(batch)} sequences")
            bad = [i for i, (v, n) in enumerate(zip(values, lens)) if torch.is_tensor(v) and v.numel() != n]
            if bad:
                raise ValueError(f"RolloutBatch.fields[{name!r}][{bad[0]}] has {values[bad[0]].numel()} values for "
                                 f"{lens[bad[0]]} response tokens")
        self.roles = torch.tensor(batch.seq_roles, dtype=torch.float32) if batch.seq_roles is not None else None

    def teacher_topk(self, mb: batching.MicroBatchRows, dev) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Top-k distillation: (the teacher's ids [n, k], their logprobs [n, k] fp32) at the micro-batch's n response
        positions in `batching.flat` order, for the backend's student logprobs at those ids; None without them."""
        batch = self.batch
        if batch.teacher_topk_ids is None:
            return None
        ids = torch.cat([batch.teacher_topk_ids[i] for i in mb.indices]).to(dev)
        return ids, torch.cat([batch.teacher_topk_logprobs[i].float() for i in mb.indices]).to(dev)

    def loss_inputs(self, mb: batching.MicroBatchRows, flat_lp: torch.Tensor, flat_ent: torch.Tensor,
                    extra: dict | None = None) -> LossInputs:
        """The micro-batch's loss inputs; `extra`: more LossInputs fields (top-k distillation's)."""
        batch, dev = self.batch, flat_lp.device
        seq_ids = torch.cat([torch.full((n,), i, dtype=torch.long) for i, n in zip(mb.indices, mb.resp_lens)])
        old = batching.gather_field(batch.old_logprobs, mb)
        # observation tokens of multi-turn trajectories are context: mask 0 (RolloutBatch.loss_mask)
        mask = batching.gather_field(batch.loss_mask, mb)
        return LossInputs(
            logprobs=flat_lp.float(), entropy=flat_ent.float(), advantages=self.adv[seq_ids].to(dev),
            mask=mask.to(dev) if mask is not None else torch.ones_like(flat_lp, dtype=torch.float32),
            seq_ids=seq_ids.to(dev),
            old_logprobs=old.to(dev) if old is not None else flat_lp.detach().float(),
            ref_logprobs=_to(batching.gather_field(batch.ref_logprobs, mb), dev),
            gen_logprobs=_to(batching.gather_field(batch.gen_logprobs, mb), dev),
            teacher_logprobs=_to(batching.gather_field(batch.teacher_logprobs, mb), dev),
            fields={k: self._field(v, mb).to(dev) for k, v in batch.fields.items()},
            **(extra or {}),
            num_global_tokens=float(self.n_tokens), num_global_seqs=float(self.n_seqs),
            seqs=torch.tensor(mb.indices, dtype=torch.long, device=dev),
            seq_groups=_to(self.groups[mb.indices] if self.groups is not None else None, dev),
            seq_roles=_to(self.roles[mb.indices] if self.roles is not None else None, dev))

    @staticmethod
    def _field(values: list, mb: batching.MicroBatchRows) -> torch.Tensor:
        """One RolloutBatch.fields entry over the micro-batch's response tokens (`batching.flat` order): per-token
        tensors as they are, a per-sequence number repeated over its sequence's tokens."""
        if any(torch.is_tensor(values[i]) for i in mb.indices):
            return batching.gather_field(values, mb)
        return torch.cat([torch.full((n,), float(values[i])) for i, n in zip(mb.indices, mb.resp_lens)]
                         or [torch.zeros(0)])


def reduced_metrics(loss: torch.Tensor, metrics: dict, mb: batching.MicroBatchRows) -> dict[str, torch.Tensor]:
    """A micro-batch's metrics as float64 host scalars, with its loss and the positions it fed (packed rows,
    padding included: the FLOP count's tokens)."""
    out = {k: torch.as_tensor(v, dtype=torch.float64).detach().cpu() for k, v in metrics.items()}
    out.setdefault("loss", loss.detach().double().cpu())
    out["num_tokens_fed"] = torch.tensor(float(mb.tokens.numel()), dtype=torch.float64)
    return out


def once_per_group(reduced_list, rank: int):
    """A CP or SP group's ranks compute the same metrics from the whole rows: rank 0's count, the others' are 0."""
    return [{k: v * 0 for k, v in d.items()} for d in reduced_list] if rank else reduced_list


def sum_metrics(reduced_list, dp_group=None) -> dict[str, float]:
    """Metrics are already globally normalised per micro-batch: sum them, then over the DP replicas of `dp_group`
    (None: this rank holds them all). Every DP rank must agree on the key set; a loss function returns a fixed set."""
    from megatron_rl.distributed.collectives import all_reduce_scalars

    keys = sorted({k for d in (reduced_list or []) for k in d})
    sums = {k: sum(float(d[k]) for d in reduced_list if k in d) for k in keys}
    if dp_group is not None and keys:
        # the helper puts the numbers where the DP group's backend needs them (NCCL: this rank's GPU)
        sums = all_reduce_scalars(sums, dp_group)
    return sums


def _to(t: torch.Tensor | None, dev) -> torch.Tensor | None:
    return None if t is None else t.to(dev)
