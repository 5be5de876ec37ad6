"""Feed the trainer only the sequences that carry gradient.

A sequence whose advantage is exactly 0 (in GRPO: every sample of a group whose rewards are all equal) adds nothing
to the policy-gradient loss of any variant here: grpo's clipped ratio, gspo's sequence ratio and cispo's REINFORCE
term are all products with the advantage, and importance weights and masks only multiply them. So when nothing
else in the loss reaches every token (no KL term, no entropy bonus, no MoE load-balancing loss), leaving those
sequences out of the forward and backward passes gives the same gradient, provided the loss still divides by the
whole step's token and sequence counts (`RolloutBatch.step_tokens` / `step_seqs`). The optimizer step itself still
happens (Adam's moments and weight decay move even on a zero gradient), so at least `min_seqs` sequences are kept.

After the first steps most groups are all right or all wrong (the CPU demo: only 16-32 of its 64 sequences carry
gradient from step 3 on), and the training pass was the larger part of a step there. verl/DAPO's dynamic sampling
drops such groups too, but renormalises over what is left (a larger step); this keeps the update exactly what the
full batch gives.

Per-token metrics the worker reports (entropy, clip_frac, ratio_mean, ...) are then shares of the whole step's
count; `rescale_metrics` turns them back into means over the trained tokens. `loss` and `pg_loss` stay as the step's
loss: the left-out sequences' share of it is exactly 0.
"""
from __future__ import annotations

from megatron_rl.config.schema import Config
from megatron_rl.policy.interface import RolloutBatch

# worker metrics that are the step's value as they stand (left-out tokens contribute exactly 0 to them)
_STEP_VALUES = {"loss", "pg_loss", "grad_norm", "lr", "num_tokens_fed", "policy_peak_memory_gb"}
_SEQ_SHARES = {"is_masked_seq_frac"}


def why_not_skippable(cfg: Config) -> str | None:
    """None where zero-advantage sequences may be left out without changing the update; else the config key that
    puts gradient on every token."""
    loss = cfg.grpo.loss
    if getattr(cfg, "algorithm", "grpo") == "ppo":  # the critic's GAE advantage is per token, on every sequence
        return "algorithm"
    if getattr(cfg, "distillation", None) is not None:  # the teacher's advantage is per token, on every sequence
        return "distillation"
    if loss.kl_coef != 0.0:
        return "grpo.loss.kl_coef"
    if loss.entropy_coef != 0.0:
        return "grpo.loss.entropy_coef"
    if cfg.policy.moe_aux_loss_coef != 0.0:
        return "policy.moe_aux_loss_coef"
    return None


def trainable_part(batch: RolloutBatch, min_seqs: int = 1) -> RolloutBatch:
    """The sequences of `batch` with a nonzero advantage (topped up to `min_seqs` with the shortest of the others),
    carrying `batch`'s own normalisers. Returns `batch` itself when every sequence carries gradient."""
    n = len(batch)
    idx = [i for i, a in enumerate(batch.advantages) if a != 0.0]
    if len(idx) == n:
        return batch
    if len(idx) < min(min_seqs, n):
        rest = sorted((i for i in range(n) if batch.advantages[i] == 0.0), key=lambda i: len(batch.input_ids[i]))
        idx = sorted(idx + rest[:min(min_seqs, n) - len(idx)])
    part = batch.subset(idx)
    part.step_tokens, part.step_seqs = batch.loss_normalizers()
    return part


def rescale_metrics(metrics: dict, part: RolloutBatch) -> dict:
    """Worker metrics of a trained `part` -> per-token means over the tokens it trained (see module docstring)."""
    step_tokens, step_seqs = part.loss_normalizers()
    tok = step_tokens / max(part.num_response_tokens(), 1)
    seq = step_seqs / max(len(part), 1)
    return {k: v if k in _STEP_VALUES else v * (seq if k in _SEQ_SHARES else tok) for k, v in metrics.items()}
