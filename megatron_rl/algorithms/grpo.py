"""The GRPO loop: a single controller over narrow interfaces (README, "Who holds the device").

    megatron-rl train configs/demo_cpu.yaml [key=value ...]

Re-running the same command resumes from the newest intact checkpoint under `<output.dir>/checkpoints`, or says
the run is already complete; a config that changes the run is refused (`algorithms/resume.py`). The loop
(`train_loop`) is given its running parts: `megatron_rl.build.run` finds the resume point, builds them and shuts them
down.
Who holds the device when (colocated), and the weight versions (each refit is the next one; a rollout with another
version is refused): `algorithms/handover.py`. A step with no trainable group (dynamic sampling dropped them all) is
logged as skipped and changes nothing; `grpo.max_empty_steps` of them in a row abort the run.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from megatron_rl.algorithms.evaluate import evaluate
from megatron_rl.algorithms.loss import mismatch_metrics
from megatron_rl.algorithms.mismatch_guard import check_mismatch
from megatron_rl.algorithms.loss_fn import GRPOLossFn
from megatron_rl.algorithms.distill_loss import DistillLossFn
from megatron_rl.algorithms.async_rollouts import RolloutPipeline, SampledRollout, sample_step
from megatron_rl.algorithms.inflight_rollouts import InflightPipeline
from megatron_rl.algorithms.rollout import build_rollout

from megatron_rl.algorithms.samples import pick_train_samples
from megatron_rl.algorithms.step_warnings import WarningGate, step_warnings
from megatron_rl.algorithms.trainable import rescale_metrics, trainable_part, why_not_skippable
from megatron_rl.algorithms.throughput import matmul_params_of, phase_flops_per_s
from megatron_rl.algorithms.tracking import Tracker, trend_line, validation_line
from megatron_rl.algorithms.trainer import (Algorithm, CheckpointSaveError, NonFiniteAbort, checkpoint_root,  # noqa: F401
                                            run_loop)
from megatron_rl.algorithms.trainer import resume as _resume  # noqa: F401  (tests and benches import them from here)
from megatron_rl.algorithms.trainer import save as _save
from megatron_rl.config import Config
from megatron_rl.distributed.parallel_dims import layout_of
from megatron_rl.platform import device_telemetry
from megatron_rl.policy.interface import TokenScoring

# multi-turn rollouts' own metrics (episodes.py); env_error_first is the first failure's "trajectory: kind: detail"
MULTITURN_METRICS = ("turns_mean", "tool_calls_mean", "env_errors", "env_error_first", "observation_tokens", "env_s")
# in-flight rollouts' (inflight_rollouts.py): refits that landed in running requests, tokens too stale to train, groups
# still generating when the step took its batch, the engines' busy seconds, scoring that overlapped the trainer
INFLIGHT_METRICS = ("inflight_updates", "stale_tokens_masked", "stale_groups_dropped", "partial_carried",
                    "engine_busy_s", "time_reward_overlapped_s")


class EmptyStepsAbort(RuntimeError):
    pass


def _validate(cfg: Config, c, t_start: float, step: int, tracker: Tracker) -> dict:
    """Greedy accuracy (and pass@k) on the held-out items; their first completions go to samples.jsonl."""
    g = cfg.generation
    episodes = dict(env_pool=c.env_pool, cfg=cfg)  # multi-turn runs validate on whole episodes
    greedy = evaluate(c.generator, c.val_items, c.reward_fn, c.tokenizer, n=1, temperature=0.0, top_p=1.0,
                      max_tokens=g.max_new_tokens, version=c.handover.version, keep=cfg.logging.samples_per_step,
                      **episodes)
    tracker.log_samples(step, "val", [{**r, "step": step} for r in greedy.get("samples", [])])
    # a reward model alone (reward.kind model) defines no correct answer: its held-out mean score instead of accuracy
    model_only = cfg.reward.kind == "model"
    out = {"val_num_prompts": greedy["val_num_prompts"]}
    if not model_only:
        out["val_accuracy"] = greedy["val_accuracy"]
    out.update({k: greedy[k] for k in ("val_reward_mean", "val_rm_score_mean") if k in greedy})
    if cfg.grpo.val_pass_k > 0 and not model_only:
        sampled = evaluate(c.generator, c.val_items, c.reward_fn, c.tokenizer, n=cfg.grpo.val_pass_k,
                           temperature=g.temperature, top_p=g.top_p, max_tokens=g.max_new_tokens,
                           version=c.handover.version,
                           seed=cfg.grpo.seed, **episodes)
        out.update(val_pass_at_k=sampled["val_pass_at_k"], val_sample_accuracy=sampled["val_accuracy"])
    out.update({k: greedy[k] for k in ("val_turns_mean", "val_tool_calls_mean", "val_env_errors") if k in greedy})
    # wall time from the start of this process's run (set-up included): "accuracy within N minutes"
    out["time_since_start_s"] = time.monotonic() - t_start
    return out


def train_step(cfg: Config, c, step: int, loss_fn, checkpoint=None, rollout: SampledRollout | None = None,
               before_refit=None, weights_step: int | None = None, samples: list | None = None,
               before_train=None) -> dict:
    """One GRPO step; returns the metrics record (without validation). `checkpoint()`, when given, runs while the
    trainer holds the device (after the refit, before the handover back to the generator). `samples`, when given,
    receives logging.samples_per_step of the step's completions (`samples.pick_train_samples`).

    Synchronous: the rollout is sampled here, from the weights of step `weights_step` (default step - 1). Async
    (`async_rollouts.RolloutPipeline`): the rollout comes sampled, and `before_refit()` joins the background sampling
    of a later step before the engines' weights change.

    `before_train(batch, rollout, rec)`, when given, runs between the rollout and the policy's turn: PPO's critic turn
    (algorithms/ppo.py), which puts per-token advantages on the batch; it returns False for a step that trains no
    policy (the critic's warm-up): the policy and the engines' weights stay as they are."""
    g = cfg.generation
    # what the engine sampled from (temperature, top-k, top-p): the policy's logprobs describe the same distribution
    # (policy/sampling_filter.py); the teacher's are its plain softmax at that temperature
    T = TokenScoring(g.temperature, g.top_k, g.top_p)
    t_step = time.perf_counter()
    if rollout is None:
        rollout = sample_step(cfg, c, step, step - 1 if weights_step is None else weights_step)
    groups, gstats = rollout.groups, rollout.stats
    if samples is not None:
        samples.extend(pick_train_samples(groups, cfg.logging.samples_per_step, step))
    # steps between the weights that generated the rollout and the weights it trains (0 when synchronous)
    staleness = (step - 1 if weights_step is None else weights_step) - rollout.weights_step
    if staleness > cfg.grpo.max_staleness:
        raise RuntimeError(f"step {step}: rollout generated by the weights of step {rollout.weights_step} is "
                           f"{staleness} steps old (grpo.max_staleness={cfg.grpo.max_staleness})")
    t0 = time.perf_counter()
    roll = build_rollout(cfg, groups, gstats)
    batch = roll.batch
    rewards = roll.rewards.flatten()
    reward_s = gstats.get("reward_s", 0.0)
    rec = {"step": step, "time_generate_s": rollout.sampling_s - reward_s, "time_reward_s": reward_s,
           "time_rollout_s": time.perf_counter() - t0, "staleness_max": staleness,
           "num_sequences": len(batch), "num_reward_timeouts": gstats.get("num_timeouts", 0),
           "num_reward_errors": gstats.get("num_errors", 0), "num_groups_dropped": gstats.get("num_groups_dropped", 0),
           "truncated_frac": gstats["num_truncated"] / max(gstats["num_samples"], 1),
           "num_generated_tokens": gstats.get("num_generated_tokens", 0),
           "num_prompt_tokens": gstats.get("num_prompt_tokens", 0)}
    if gstats.get("rm_scored"):  # a reward model's mean score of the step's samples (rewards/model_reward.py)
        rec["rm_score_mean"] = gstats["rm_score_sum"] / gstats["rm_scored"]
    # multi-turn rollouts (algorithms/episodes.py): what the environments did
    rec.update({k: v for k, v in gstats.items() if k in MULTITURN_METRICS + INFLIGHT_METRICS or k.startswith("env/")})
    if rewards.numel():  # over the kept groups; absent (not 0) when dynamic sampling dropped every group
        rec.update(reward_mean=float(rewards.mean()), reward_std=float(rewards.std()) if rewards.numel() > 1 else 0.0)
    if len(batch) == 0:
        # every group was dropped (all-equal rewards under dynamic sampling) or every response was empty: nothing to
        # learn from this rollout. The weights stay as they are, so the engine keeps its version and the device.
        rec.update(skipped=True, no_trainable_groups=True)
        rec["time_wait_rollout_s"] = before_refit() if before_refit is not None else 0.0
        if checkpoint is not None:
            c.handover.to_trainer()
            checkpoint()
        return _finish(c, rec, t_step)

    if cfg.distillation is not None:  # the teacher's turn: it scores every sampled token (algorithms/distill_loss.py)
        t0 = time.perf_counter()
        c.handover.to_teacher()
        if cfg.distillation.topk > 0:
            k = cfg.distillation.topk
            batch.teacher_topk_ids, batch.teacher_topk_logprobs = c.teacher.topk_logprobs(batch, k, T.temperature)
        else:
            batch.teacher_logprobs = c.teacher.logprobs(batch, T.temperature)
        rec["time_teacher_s"] = time.perf_counter() - t0
    if before_train is not None and not before_train(batch, roll, rec):
        rec.update(skipped=False, no_trainable_groups=False, policy_trained=False)
        rec["time_wait_rollout_s"] = before_refit() if before_refit is not None else 0.0
        if checkpoint is not None:
            c.handover.to_trainer()
            checkpoint()
        return _finish(c, rec, t_step)
    c.handover.to_trainer()
    t0 = time.perf_counter()
    # async: the rollout's own logprobs are the behaviour policy's, not the current weights': recompute "old" ones
    # (unless an earlier turn did: PPO's KL-in-reward pass)
    if cfg.grpo.recomputes_old_logprobs() and batch.old_logprobs is None:
        batch.old_logprobs = c.policy.logprobs(batch, T)
    if cfg.grpo.loss.kl_coef > 0 and batch.ref_logprobs is None:
        batch.ref_logprobs = c.policy.reference_logprobs(batch, T)
    time_logprobs = time.perf_counter() - t0

    t0 = time.perf_counter()
    parts = _split(batch, cfg.grpo.optimizer_steps_per_rollout)
    if cfg.grpo.skip_zero_advantage and why_not_skippable(cfg) is None:
        parts = [trainable_part(p, min_seqs=layout_of(cfg).policy.dp) for p in parts]
    results = [c.policy.train(p, loss_fn, T) for p in parts]
    time_train = time.perf_counter() - t0
    # mismatch: the "old" pass covers the whole batch; else the on-policy pass reused as "old" logprobs is the
    # (only) mini-batch's forward before its update, over the sequences it trained
    compared = batch if batch.old_logprobs is not None else parts[0]
    gen_lps, train_lps = ((batch.gen_logprobs, batch.old_logprobs) if batch.old_logprobs is not None
                          else (parts[0].gen_logprobs, results[0].logprobs))
    rec["time_wait_rollout_s"] = before_refit() if before_refit is not None else 0.0
    if checkpoint is not None:  # before the refit, which leaves only the weights resident (policy/residency.py)
        checkpoint()
    refit_s = c.handover.refit()
    # over the tokens the engine sampled (observation tokens have no generator logprob worth comparing)
    mm = mismatch_metrics(torch.cat(gen_lps), torch.cat([t.float() for t in train_lps]), compared.trained_mask())
    m = _merge_minibatch_metrics([rescale_metrics(r.metrics, p) for r, p in zip(results, parts)])
    rec.update({
        "loss": m.get("loss"), "kl": m.get("kl", 0.0), "entropy": m.get("entropy"), "clip_frac": m.get("clip_frac"),
        "grad_norm": m.get("grad_norm"), "lr": m.get("lr"), "num_optimizer_steps": len(results),
        "policy_peak_memory_gb": m.get("policy_peak_memory_gb"),
        "token_mult_prob_error": mm["token_mult_prob_error"], "gen_kl_error": mm["gen_kl_error"],
        "response_len_mean": sum(batch.response_lens()) / len(batch),
        "num_sequences_trained": sum(len(p) for p in parts),
        "num_tokens": sum(len(x) for x in batch.input_ids),
        "time_logprobs_s": time_logprobs, "time_train_s": time_train, "time_refit_s": refit_s,
        "skipped": any(r.skipped for r in results), "no_trainable_groups": False,
    })
    # optional counters: present when their feature is on (importance masks, DAPO overlong handling)
    rec.update({k: m[k] for k in ("is_masked_token_frac", "is_masked_seq_frac", "reverse_kl") if k in m})
    rec.update({k: gstats[k] for k in ("num_overlong_filtered", "num_overlong_penalized", "num_fully_masked",
                                       "routing_recorded_frac")
                if k in gstats})
    # mini-batch metrics are means over the optimizer steps; the positions fed add up over them
    rec["num_tokens_fed"] = m.get("num_tokens_fed", 0.0) * len(results)
    rec.update(phase_flops_per_s(matmul_params_of(str(c.model_dir)), rec, tokens_fed=rec["num_tokens_fed"],
                                 logprob_passes=cfg.grpo.logprob_passes()))
    return _finish(c, rec, t_step)


def _finish(c, rec: dict, t_step: float) -> dict:
    """Hand the device back to the generator and close the record's timings."""
    c.handover.to_generator()
    rec["time_handover_s"] = c.handover.take_seconds()
    rec["time_step_s"] = time.perf_counter() - t_step
    rec["tokens_per_s"] = rec.get("num_tokens", 0) / rec["time_step_s"]
    rec.update(device_telemetry())
    return rec


def _merge_minibatch_metrics(per_step: list[dict]) -> dict:
    """Several optimizer steps per rollout: each metric is the mean over the mini-batches (each already normalised
    over its own tokens), except the learning rate, which is the last step's."""
    keys = {k for m in per_step for k in m}
    out = {k: sum(m[k] for m in per_step if k in m) / sum(1 for m in per_step if k in m) for k in keys}
    if "lr" in per_step[-1]:
        out["lr"] = per_step[-1]["lr"]
    return out


def _split(batch, parts: int):
    """Mini-batches for several optimizer steps per rollout; whole groups stay together."""
    if parts <= 1:
        return [batch]
    gids = sorted(set(batch.group_ids))
    out = []
    for k in range(parts):
        keep = set(gids[k::parts])
        idx = [i for i, g in enumerate(batch.group_ids) if g in keep]
        if idx:
            out.append(batch.subset(idx))
    return out


class GRPO(Algorithm):
    """GRPO's data path for the shared loop (`algorithms/trainer.py`): each step samples and scores a rollout (or
    takes the async pipeline's), trains it and refits the engines."""

    name = "grpo"
    nonfinite_key = "grpo.max_nonfinite_steps"

    def __init__(self, cfg: Config, c, t_start: float):
        self.cfg, self.c, self.t_start = cfg, c, t_start
        g = cfg.grpo
        self.max_steps, self.max_nonfinite_steps, self.max_minutes = g.max_steps, g.max_nonfinite_steps, g.max_minutes
        self.val_every = g.val_every if c.val_items else 0
        self.keeps_samples = cfg.logging.samples_per_step > 0
        # distillation: the same loop and loss with the teacher's per-token advantage (algorithms/distill_loss.py)
        self.loss_fn = DistillLossFn(g.loss, cfg.distillation) if cfg.distillation is not None else GRPOLossFn(g.loss)
        self.pipeline = None
        self.before_train = None  # a turn between the rollout and the policy's (PPO's critic)
        self.empty = 0
        self.samples: list[dict] = []
        self.warn = WarningGate()

    def begin(self, start: int, driver_state: dict) -> None:
        cfg, c = self.cfg, self.c
        if start > 0 or cfg.init_from:  # loaded a checkpoint or a previous stage's weights: the engine needs them
            c.handover.refit()
        c.handover.to_generator()
        self.weights_step = start  # the step whose weights the trainer (and, after each refit, the engines) hold
        self.start, self.pending = start, driver_state.get("pending_rollouts")

    def baseline(self, tracker: Tracker) -> None:
        if not self.c.val_items:
            return
        base = _validate(self.cfg, self.c, self.t_start, 0, tracker)
        tracker.log_validation(0, base)
        passk = f", pass@{self.cfg.grpo.val_pass_k} {base['val_pass_at_k']:.3f}" if "val_pass_at_k" in base else ""
        if "val_accuracy" in base:
            print(f"[megatron-rl] step 0 validation: greedy accuracy {base['val_accuracy']:.3f}{passk}", flush=True)
        else:  # reward.kind model
            print(f"[megatron-rl] step 0 validation: held-out reward-model score {base['val_rm_score_mean']:.3f}",
                  flush=True)

    def save(self, step: int) -> None:
        pending, stream = None, None
        if isinstance(self.pipeline, InflightPipeline):  # the admitted prompts and the stream's position together
            pending, stream = self.pipeline.state()
        elif self.pipeline is not None:
            pending = self.pipeline.state()
        _save(self.cfg, self.c, checkpoint_root(self.cfg), step, pending=pending, stream_state=stream)

    def step(self, step: int, checkpoint) -> dict:
        if self.cfg.grpo.max_staleness > 0 and self.pipeline is None:
            # async: started with the first step, after the baseline validation (which needs the engines alone)
            kind = InflightPipeline if self.cfg.grpo.inflight_weight_updates else RolloutPipeline
            self.pipeline = kind(self.cfg, self.c, self.start, self.pending)
        p = self.pipeline
        self.samples = []
        return train_step(self.cfg, self.c, step, self.loss_fn, checkpoint=checkpoint,
                          rollout=p.take(step, self.weights_step) if p is not None else None,
                          before_refit=p.join if p is not None else None, weights_step=self.weights_step,
                          samples=self.samples, before_train=self.before_train)

    def on_record(self, step: int, rec: dict, tracker: Tracker) -> None:
        tracker.log_samples(step, "train", self.samples)  # before any abort: the completions say why
        # a critic-only step (PPO's warm-up) leaves the weights as they were: they are this step's weights too, so
        # an async rollout sampled from them is as fresh as one from a trained step
        if not rec["no_trainable_groups"]:
            self.weights_step = step
        if isinstance(self.pipeline, InflightPipeline):  # the engines' version now holds these weights
            self.pipeline.note_weights(self.c.handover.version, self.weights_step)
        self.warn(step_warnings(rec, self.cfg))
        self.empty = self.empty + 1 if rec["no_trainable_groups"] else 0
        if self.empty:
            print(f"[megatron-rl] step {step}: no trainable group ({rec['num_groups_dropped']} dropped with "
                  f"all-equal rewards), update skipped ({self.empty} in a row)", file=sys.stderr, flush=True)

    def check_abort(self, step: int, rec: dict, tracker: Tracker) -> None:
        if self.empty and self.empty >= self.cfg.grpo.max_empty_steps:
            tracker.log(rec)
            raise EmptyStepsAbort(f"{self.empty} consecutive steps without a trainable group "
                                  f"(grpo.max_empty_steps={self.cfg.grpo.max_empty_steps}): every group's rewards "
                                  "were all equal; the task is too hard or too easy for this policy, or the reward is "
                                  "broken; aborting")

    def validate(self, step: int, tracker: Tracker) -> dict:
        if isinstance(self.pipeline, InflightPipeline):  # the engines alone: running requests finish first
            with self.pipeline.drained():
                return _validate(self.cfg, self.c, self.t_start, step, tracker)
        return _validate(self.cfg, self.c, self.t_start, step, tracker)

    def after_log(self, step: int, rec: dict) -> None:
        # warns naming the step, or raises MismatchAbort. A stale rollout (async) was generated by older weights:
        # its gap to the trainer is expected, not a bug
        if rec.get("staleness_max", 0) == 0:
            check_mismatch(rec, self.cfg.grpo, step)

    def summary(self, tracker: Tracker, out: Path) -> None:
        _summary(self.cfg, tracker, out)

    def close(self) -> None:
        if self.pipeline is not None:
            self.pipeline.close()


def train_loop(cfg: Config, c, point, *, t_start: float) -> int:
    """GRPO on the running parts `c` (`build.Components`), from the resume point `point`
    (`algorithms.resume.resume_point`) to grpo.max_steps; t_start: when the run started (validation records time
    since it). The loop itself is the shared one (`trainer.run_loop`)."""
    return run_loop(cfg, c, point, GRPO(cfg, c, t_start))


def _summary(cfg: Config, tracker: Tracker, out: Path) -> None:
    h = tracker.history
    steps = [r["reward_mean"] for r in h if "reward_mean" in r]  # validation-only records carry no reward
    if not steps:
        return
    vals = [r for r in h if r.get("val_accuracy") is not None]
    print(f"[megatron-rl] done: {trend_line('reward_mean', steps, '.3f')}")
    rm_vals = [r for r in h if r.get("val_rm_score_mean") is not None]
    if rm_vals and not vals:  # reward.kind model
        print(f"[megatron-rl] {validation_line('held-out reward-model score', rm_vals, 'val_rm_score_mean', '.3f')}")
    if vals:
        best = max(vals, key=lambda r: r["val_accuracy"])
        n = vals[-1].get("val_num_prompts")
        print(f"[megatron-rl] {validation_line('validation greedy accuracy', vals, 'val_accuracy', '.3f')}; best "
              f"{best['val_accuracy']:.3f} at step {best['step']}, {best.get('time_since_start_s', 0) / 60:.1f} min "
              f"after start" + (f" ({n} held-out prompts)" if n else ""))
    plot = tracker.plot() if cfg.logging.plots else None
    print(f"[megatron-rl] metrics: {(out / 'metrics.jsonl').resolve()}")
    if plot:
        print(f"[megatron-rl] plots:   {plot.resolve()}")
