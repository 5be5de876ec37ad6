"""The SFT and DPO losses under the worker's loss contract (`policy/loss_api.py`): per micro-batch, normalised by
the global counts, so the sum over micro-batches and data-parallel ranks is the batch loss however it was split.

SFT (`sft_loss`), over the trained (assistant) tokens t with mask m:
    tokens:    L = -sum_t m_t log pi(t) / (trained tokens of the batch)
    sequences: L = -(1/N) sum_i [ sum_t m_it log pi(t) / sum_t m_it ]            (N: sequences of the batch)

DPO (`dpo_loss`), per pair (y_w chosen, y_l rejected) with log pi(y) the sum of the response's token logprobs (their
mean with `average_logprobs`) and ref the frozen reference's:
    h = [log pi(y_w) - log ref(y_w)] - [log pi(y_l) - log ref(y_l)]
    sigmoid (DPO, Rafailov et al. 2023; conservative with label smoothing e):
               L = -(1 - e) log sigmoid(beta h) - e log sigmoid(-beta h)
    ipo (Azar et al. 2023):   L = (h - 1 / (2 beta))^2
    hinge (SLiC, Zhao et al. 2023):  L = max(0, 1 - beta h)
    + sft_loss_weight x the chosen response's token-mean NLL (RPO)
and the batch loss is the mean over pairs. Metrics (means over pairs, as TRL names them): rewards_chosen =
beta (log pi(y_w) - log ref(y_w)), rewards_rejected likewise, rewards_margin their difference, rewards_accuracy the
fraction with chosen > rejected, logps_chosen / logps_rejected the policy's log pi(y), logps_accuracy the fraction
with log pi(y_w) > log pi(y_l) (the policy's own preference, defined before training too).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_rl.config.schema import DPOConfig
from megatron_rl.policy.loss_api import LossInputs


def per_sequence(values: torch.Tensor, mask: torch.Tensor, seq_ids: torch.Tensor, seqs: torch.Tensor):
    """(sum of values x mask, sum of mask) of each sequence in `seqs`, in that order: [m], [m]."""
    onehot = (seq_ids[None, :] == seqs[:, None]).to(values.dtype)  # [m, n]; m and n are one micro-batch's
    return onehot @ (values * mask), onehot @ mask


def sft_loss(logprobs, mask, seq_ids, seqs, *, normalizer: str, num_global_tokens: float, num_global_seqs: float):
    if normalizer == "tokens":
        loss = -(logprobs * mask).sum() / num_global_tokens
    elif normalizer == "sequences":
        sums, counts = per_sequence(logprobs, mask, seq_ids, seqs)
        loss = -(sums / counts.clamp(min=1)).sum() / num_global_seqs
    else:
        raise ValueError(f"sft.loss_normalizer must be tokens or sequences, got {normalizer!r}")
    return loss, {"loss": loss.detach()}


def pair_positions(seqs: torch.Tensor, groups: torch.Tensor, roles: torch.Tensor) -> tuple[list[int], list[int]]:
    """Positions (within `seqs`) of each pair's chosen and rejected sequence; every group must be complete here."""
    chosen: dict[int, int] = {}
    rejected: dict[int, int] = {}
    for pos, (g, r) in enumerate(zip(groups.tolist(), roles.tolist())):
        (chosen if r > 0.5 else rejected)[g] = pos
    if set(chosen) != set(rejected) or len(chosen) + len(rejected) != len(seqs):
        raise ValueError(f"a micro-batch holds incomplete preference pairs (groups {sorted(set(groups.tolist()))}): "
                         "a pair needs one chosen and one rejected sequence together (RolloutBatch.keep_groups)")
    keys = sorted(chosen)
    return [chosen[g] for g in keys], [rejected[g] for g in keys]


def dpo_loss(logprobs, ref_logprobs, mask, seq_ids, seqs, groups, roles, *, cfg: DPOConfig, num_global_pairs: float):
    lp_sum, n = per_sequence(logprobs, mask, seq_ids, seqs)
    ref_sum, _ = per_sequence(ref_logprobs.to(logprobs.dtype), mask, seq_ids, seqs)
    if cfg.average_logprobs:
        lp, ref = lp_sum / n.clamp(min=1), ref_sum / n.clamp(min=1)
    else:
        lp, ref = lp_sum, ref_sum
    c, r = pair_positions(seqs, groups, roles)
    c, r = torch.tensor(c, device=lp.device), torch.tensor(r, device=lp.device)
    h = (lp[c] - ref[c]) - (lp[r] - ref[r])
    if cfg.loss == "sigmoid":
        eps = cfg.label_smoothing
        per_pair = -(1 - eps) * F.logsigmoid(cfg.beta * h) - eps * F.logsigmoid(-cfg.beta * h)
    elif cfg.loss == "ipo":
        per_pair = (h - 1 / (2 * cfg.beta)) ** 2
    elif cfg.loss == "hinge":
        per_pair = torch.relu(1 - cfg.beta * h)
    else:
        raise ValueError(f"dpo.loss must be sigmoid, ipo or hinge, got {cfg.loss!r}")
    metrics = {}
    if cfg.sft_loss_weight:
        nll = -lp_sum[c] / n[c].clamp(min=1)
        per_pair = per_pair + cfg.sft_loss_weight * nll
        metrics["sft_loss"] = nll.detach().sum() / num_global_pairs
    loss = per_pair.sum() / num_global_pairs
    rc, rr = (cfg.beta * (lp[c] - ref[c])).detach(), (cfg.beta * (lp[r] - ref[r])).detach()
    mean = lambda v: v.sum() / num_global_pairs  # noqa: E731  (summed over micro-batches and ranks by the worker)
    metrics.update(loss=loss.detach(), rewards_chosen=mean(rc), rewards_rejected=mean(rr),
                   rewards_accuracy=mean((rc > rr).to(rc.dtype)), rewards_margin=mean(rc - rr),
                   logps_chosen=mean(lp[c].detach()), logps_rejected=mean(lp[r].detach()),
                   logps_accuracy=mean((lp[c] > lp[r]).detach().to(rc.dtype)))
    return loss, metrics


class SFTLossFn:
    """Picklable: shipped to the policy ranks."""

    def __init__(self, normalizer: str = "tokens"):
        self.normalizer = normalizer

    def __call__(self, inp: LossInputs):
        return sft_loss(inp.logprobs, inp.mask, inp.seq_ids, inp.seqs, normalizer=self.normalizer,
                        num_global_tokens=inp.num_global_tokens, num_global_seqs=inp.num_global_seqs)


class DPOLossFn:
    def __init__(self, cfg: DPOConfig):
        self.cfg = cfg

    def __call__(self, inp: LossInputs):
        if inp.ref_logprobs is None or inp.seq_groups is None or inp.seq_roles is None:
            raise ValueError("the DPO loss needs reference logprobs, group ids and roles (algorithms/supervised_"
                             "batches.pair_batch)")
        return dpo_loss(inp.logprobs, inp.ref_logprobs, inp.mask, inp.seq_ids, inp.seqs, inp.seq_groups,
                        inp.seq_roles, cfg=self.cfg, num_global_pairs=inp.num_global_seqs / 2)


def batch_inputs(batch, logprobs: list[torch.Tensor], ref_logprobs: list[torch.Tensor] | None = None) -> LossInputs:
    """The whole batch as one micro-batch's `LossInputs` (no gradient): the validation loss with the same
    function the training step uses."""
    lens = batch.response_lens()
    seq_ids = torch.cat([torch.full((n,), i, dtype=torch.long) for i, n in enumerate(lens)])
    lp = torch.cat([t.float() for t in logprobs])
    n_tokens, n_seqs = batch.loss_normalizers()
    return LossInputs(
        logprobs=lp, entropy=None, advantages=torch.zeros_like(lp), mask=batch.trained_mask().float(),
        seq_ids=seq_ids, old_logprobs=lp, gen_logprobs=None,
        ref_logprobs=torch.cat([t.float() for t in ref_logprobs]) if ref_logprobs is not None else None,
        num_global_tokens=float(n_tokens), num_global_seqs=float(n_seqs), seqs=torch.arange(len(batch)),
        seq_groups=torch.tensor(batch.group_ids) if batch.group_ids is not None else None,
        seq_roles=torch.tensor(batch.seq_roles, dtype=torch.float32) if batch.seq_roles is not None else None,
        fields={k: torch.cat([x.reshape(-1).float() if torch.is_tensor(x) else torch.full((n,), float(x))
                              for x, n in zip(v, lens)]) for k, v in batch.fields.items()})
