"""PPO with a learned critic (`algorithm: ppo`, run by `megatron-rl train`; docs/algorithms.md).

GRPO's loop and data path (`algorithms/grpo.py`: sample, score, train, refit; async and multi-turn included), with
one more turn between the rollout and the policy's: the critic's (`critic_turn`). The critic, value-head ranks of the
policy's backend and split (`build.start_critic`), scores each response token's state (V_t: the value head on the
prefix before token t, where the policy's logprob of t is read), GAE turns the sequence rewards and those values into
per-token advantages and returns (`algorithms/gae.py`), the critic takes its optimizer step on PPO2's clipped value
loss, and the policy trains on the advantages (`ppo_loss.PPOPolicyLossFn`: GRPO's clipped surrogate, token by token).

    rewards    each sequence's reward on its last trained token; with ppo.kl_in_reward, minus
               grpo.loss.kl_coef x (log pi_old - log pi_ref) on every trained token (the policy's turn comes first)
    advantages GAE(gamma, lam) over the trained tokens, whitened over the step when ppo.whiten_advantages
    critic    0.5 x max((V - R)^2, (clip(V, V_old +- critic.value_clip) - R)^2), its own optimizer and schedule

The first critic.warmup_steps steps train the critic alone. Checkpoints: the critic's state goes to
`<checkpoints>/critic/step_N` (in its turn) before the policy's `step_N`, which is what a resume looks for; resuming
step N loads both, so a resumed run continues exactly as an uninterrupted one.
"""
from __future__ import annotations

import dataclasses
import shutil
import time

import torch

from megatron_rl.algorithms.gae import gae, token_rewards
from megatron_rl.algorithms.grpo import GRPO
from megatron_rl.algorithms.ppo_loss import ADVANTAGES, OLD_VALUES, RETURNS, PPOPolicyLossFn, ValueLossFn
from megatron_rl.algorithms.trainer import CheckpointSaveError, checkpoint_root, run_loop
from megatron_rl.config import Config
from megatron_rl.policy.interface import TokenScoring

CRITIC_DIR = "critic"  # under the checkpoint root: critic/step_N beside the policy's step_N


def critic_turn(cfg: Config, c, batch, seq_rewards: list[float], value_loss_fn) -> dict:
    """The critic's turn of one step on `batch` (a RolloutBatch) with its sequences' rewards: GAE's advantages,
    returns and the old values go on `batch.fields`; the critic trains on them. Returns the step's critic metrics."""
    t0 = time.perf_counter()
    lengths = batch.response_lens()
    mask = batch.trained_mask().bool()
    kl = None
    if cfg.ppo.kl_in_reward:  # the policy's two passes first: the KL of each sampled token to the reference
        g = cfg.generation
        T = TokenScoring(g.temperature, g.top_k, g.top_p)  # the engine's sampling rule (policy/sampling_filter.py)
        c.handover.to_trainer()
        batch.old_logprobs = c.policy.logprobs(batch, T)
        batch.ref_logprobs = c.policy.reference_logprobs(batch, T)
        log_ratio = torch.cat([o.float() for o in batch.old_logprobs]) - torch.cat(
            [r.float() for r in batch.ref_logprobs])
        clamp = cfg.grpo.loss.kl_clamp
        kl = log_ratio.clamp(-clamp, clamp) if clamp is not None else log_ratio
    c.handover.to_critic()
    values = [v.float() for v in c.critic.logprobs(batch)]
    v = torch.cat(values) if values else torch.zeros(0)
    rewards = token_rewards(seq_rewards, mask, lengths, kl, cfg.grpo.loss.kl_coef if kl is not None else 0.0)
    adv, ret = gae(rewards, v, mask, lengths, gamma=cfg.ppo.gamma, lam=cfg.ppo.lam)
    raw = adv
    if cfg.ppo.whiten_advantages and int(mask.sum()) > 1:
        a = adv[mask]
        adv = torch.where(mask, (adv - a.mean()) / (a.std() + 1e-8), torch.zeros_like(adv))
    batch.fields[ADVANTAGES] = list(adv.split(lengths))
    batch.fields[RETURNS] = list(ret.split(lengths))
    batch.fields[OLD_VALUES] = values
    t1 = time.perf_counter()
    res = c.critic.train(batch, value_loss_fn, 1.0)
    c.handover.record_critic()
    m = res.metrics
    r, vm = ret[mask], v[mask]
    out = {"value_loss": m.get("value_loss"), "value_clip_frac": m.get("value_clip_frac"),
           "critic_grad_norm": m.get("grad_norm"), "critic_lr": m.get("lr"),
           "critic_peak_memory_gb": m.get("policy_peak_memory_gb"), "critic_skipped": res.skipped,
           "values_mean": float(vm.mean()) if vm.numel() else 0.0,
           "returns_mean": float(r.mean()) if r.numel() else 0.0,
           "advantages_mean": float(raw[mask].mean()) if r.numel() else 0.0,
           # 1 - Var(R - V) / Var(R): how much of the returns' spread the critic's values explain (1: all, <= 0: none)
           "explained_variance": float(1 - (r - vm).var() / r.var()) if r.numel() > 1 and r.var() > 0 else 0.0,
           "time_critic_s": time.perf_counter() - t0, "time_critic_train_s": time.perf_counter() - t1}
    if kl is not None:
        out["kl_in_reward"] = float(kl[mask].mean()) if mask.any() else 0.0
    return out


class PPO(GRPO):
    """PPO's data path for the shared loop: GRPO's, with the critic's turn before the policy's (module doc)."""

    name = "ppo"

    def __init__(self, cfg: Config, c, t_start: float):
        super().__init__(cfg, c, t_start)
        # KL in the reward: the loss's own KL term off (the reference pass still runs, in the critic's turn)
        loss = dataclasses.replace(cfg.grpo.loss, kl_coef=0.0) if cfg.ppo.kl_in_reward else cfg.grpo.loss
        self.loss_fn = PPOPolicyLossFn(loss)
        self.value_loss_fn = ValueLossFn(cfg.critic.value_clip)
        self.before_train = self._critic_turn
        self._step = 0

    def _critic_turn(self, batch, roll, rec: dict) -> bool:
        rec.update(critic_turn(self.cfg, self.c, batch, roll.seq_rewards, self.value_loss_fn))
        return self._step > self.cfg.critic.warmup_steps  # the critic's warm-up steps train it alone

    def step(self, step: int, checkpoint) -> dict:
        self._step = step
        return super().step(step, checkpoint)

    def on_record(self, step: int, rec: dict, tracker) -> None:
        # a non-finite critic step counts as a skipped step (the loop's max_nonfinite_steps rule)
        rec["skipped"] = bool(rec.get("skipped")) or bool(rec.get("critic_skipped"))
        super().on_record(step, rec, tracker)

    def begin(self, start: int, driver_state: dict) -> None:
        if start > 0:  # the policy's step_N is loaded (trainer.resume): the critic's of the same step too
            path = checkpoint_root(self.cfg) / CRITIC_DIR / f"step_{start}"
            if not path.is_dir():
                raise RuntimeError(f"resuming step {start}: the critic's checkpoint {path} is missing (a PPO run "
                                   "saves it beside the policy's); move the policy's step aside to resume an earlier "
                                   "step, or start over with checkpoint.resume=false")
            self.c.handover.to_critic()
            self.c.critic.load(str(path))
            self.c.handover.to_trainer()
            print(f"[megatron-rl] critic resumed from {path}", flush=True)
        super().begin(start, driver_state)

    def save(self, step: int) -> None:
        """The critic's state (in its turn) under critic/step_N, then the policy's step_N (the one a resume finds);
        critic steps without a policy checkpoint left are removed after."""
        root = checkpoint_root(self.cfg)
        path = root / CRITIC_DIR / f"step_{step}"
        c = self.c
        c.handover.to_critic()
        try:
            c.critic.save(str(path), extra={"step": step})
        except Exception as e:
            from megatron_rl.distributed.worker_group import WorkerDiedError

            if isinstance(e, WorkerDiedError):
                raise
            cause = (str(e).strip().splitlines() or [type(e).__name__])[-1]
            raise CheckpointSaveError(f"saving the critic's checkpoint {path} failed: {cause}; the previous "
                                      "checkpoint is intact (re-running resumes from it)") from e
        finally:
            c.handover.to_trainer()  # the policy's state resident again for its own save, then the refit
        super().save(step)
        kept = {p.name for p in root.glob("step_*") if p.is_dir()}
        for old in (root / CRITIC_DIR).glob("step_*"):
            if old.is_dir() and old.name not in kept:
                shutil.rmtree(old, ignore_errors=True)


def train_loop(cfg: Config, c, point, *, t_start: float) -> int:
    """PPO on the running parts `c` (`build.Components`, with a critic) from the resume point `point`."""
    return run_loop(cfg, c, point, PPO(cfg, c, t_start))
