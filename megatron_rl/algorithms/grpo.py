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

import random
import shutil
import sys
import time
from pathlib import Path

import torch

from megatron_rl.algorithms.evaluate import evaluate
from megatron_rl.algorithms.loss import mismatch_metrics
from megatron_rl.algorithms.mismatch_guard import check_mismatch
from megatron_rl.algorithms.loss_fn import GRPOLossFn
from megatron_rl.algorithms.async_rollouts import RolloutPipeline, SampledRollout, sample_step
from megatron_rl.algorithms.rollout import build_rollout

MULTITURN_METRICS = ("turns_mean", "tool_calls_mean", "env_errors", "observation_tokens", "env_s")
from megatron_rl.algorithms.samples import pick_train_samples
from megatron_rl.algorithms.trainable import rescale_metrics, trainable_part, why_not_skippable
from megatron_rl.algorithms.throughput import matmul_params_of, phase_flops_per_s
from megatron_rl.algorithms.trackers import start_trackers
from megatron_rl.algorithms.tracking import Tracker
from megatron_rl.config import Config, dump_yaml
from megatron_rl.distributed.parallel_dims import layout_of
from megatron_rl.platform import device_telemetry


class NonFiniteAbort(RuntimeError):
    pass


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
    out = {"val_accuracy": greedy["val_accuracy"]}
    if cfg.grpo.val_pass_k > 0:
        sampled = evaluate(c.generator, c.val_items, c.reward_fn, c.tokenizer, n=cfg.grpo.val_pass_k,
                           temperature=g.temperature, top_p=g.top_p, max_tokens=g.max_new_tokens,
                           version=c.handover.version,
                           seed=cfg.grpo.seed, **episodes)
        out.update(val_pass_at_k=sampled["val_pass_at_k"], val_sample_accuracy=sampled["val_accuracy"])
    out.update({k: greedy[k] for k in ("val_turns_mean", "val_tool_calls_mean", "val_env_errors") if k in greedy})
    # wall time from the start of this process's run (set-up included): "accuracy within N minutes"
    out["time_since_start_s"] = time.monotonic() - t_start
    return out


class CheckpointSaveError(RuntimeError):
    pass


def _save(cfg: Config, c, root: Path, step: int, pending: list[dict] | None = None) -> None:
    from megatron_rl.distributed.worker_group import WorkerDiedError

    state = {"step": step, "stream": c.train_stream.state_dict(), "py_random": list(random.getstate()[1]),
             "pending_rollouts": pending or []}  # async: rollouts already sampled for later steps
    path = root / f"step_{step}"
    try:
        c.policy.save(str(path), extra=state)
    except WorkerDiedError:
        raise
    except Exception as e:  # e.g. a full disk: say which checkpoint failed and that the previous one still stands
        from megatron_rl.models.checkpoint import latest_checkpoint

        cause = (str(e).strip().splitlines() or [type(e).__name__])[-1]
        prev = latest_checkpoint(root)
        raise CheckpointSaveError(
            f"saving checkpoint {path} failed: {cause}{_space_hint(root, prev)}; nothing of it was kept, and "
            + (f"the previous checkpoint {prev} is intact (re-running resumes from it)" if prev
               else "there is no earlier checkpoint")) from e
    done = sorted((p for p in root.glob("step_*") if p.is_dir() and p.name.split("_")[-1].isdigit()),
                  key=lambda p: int(p.name.split("_")[-1]))
    for old in done[:-cfg.checkpoint.keep_last] if cfg.checkpoint.keep_last > 0 else []:
        shutil.rmtree(old, ignore_errors=True)


def _space_hint(root: Path, prev: Path | None) -> str:
    """Writers do not always surface ENOSPC (torch's zip writer reports "unexpected pos"): name a full disk."""
    try:
        free = shutil.disk_usage(root).free
        need = sum(f.stat().st_size for f in prev.rglob("*") if f.is_file()) if prev else 0
    except OSError:
        return ""
    if need and free < need:
        return f" (the filesystem of {root} has {free / 2**20:.0f} MiB free; a checkpoint needs about " \
               f"{need / 2**20:.0f} MiB)"
    return ""


def _resume(cfg: Config, c, latest: Path | None) -> tuple[int, dict]:
    """(the step to continue after, the driver state saved with it); `latest` as `resume.resume_point` chose it."""
    if latest is None:
        if cfg.init_from:  # a stage chain: start from the previous stage's weights, fresh optimizer and data
            c.handover.to_trainer()
            c.policy.group.call("load_weights", cfg.init_from)
            print(f"[megatron-rl] initialised from {cfg.init_from}")
        return 0, {}
    c.handover.to_trainer()
    state = c.policy.load(str(latest))
    c.train_stream.load_state_dict(state["stream"])
    print(f"[megatron-rl] resumed from {latest} (step {state['step']})")
    return int(state["step"]), state


def train_step(cfg: Config, c, step: int, loss_fn, checkpoint=None, rollout: SampledRollout | None = None,
               before_refit=None, weights_step: int | None = None, samples: list | None = None) -> dict:
    """One GRPO step; returns the metrics record (without validation). `checkpoint()`, when given, runs while the
    trainer holds the device (after the refit, before the handover back to the generator). `samples`, when given,
    receives logging.samples_per_step of the step's completions (`samples.pick_train_samples`).

    Synchronous: the rollout is sampled here, from the weights of step `weights_step` (default step - 1). Async
    (`async_rollouts.RolloutPipeline`): the rollout comes sampled, and `before_refit()` joins the background sampling
    of a later step before the engines' weights change."""
    T = cfg.generation.temperature
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
    # multi-turn rollouts (algorithms/episodes.py): what the environments did
    rec.update({k: gstats[k] for k in MULTITURN_METRICS if k in gstats})
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

    c.handover.to_trainer()
    t0 = time.perf_counter()
    # async: the rollout's own logprobs are the behaviour policy's, not the current weights': recompute "old" ones
    if cfg.grpo.recomputes_old_logprobs():
        batch.old_logprobs = c.policy.logprobs(batch, T)
    if cfg.grpo.loss.kl_coef > 0:
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
        "token_mult_prob_error": mm["token_mult_prob_error"], "gen_kl_error": mm["gen_kl_error"],
        "response_len_mean": sum(batch.response_lens()) / len(batch),
        "num_sequences_trained": sum(len(p) for p in parts),
        "num_tokens": sum(len(x) for x in batch.input_ids),
        "time_logprobs_s": time_logprobs, "time_train_s": time_train, "time_refit_s": refit_s,
        "skipped": any(r.skipped for r in results), "no_trainable_groups": False,
    })
    # optional counters: present when their feature is on (importance masks, DAPO overlong handling)
    rec.update({k: m[k] for k in ("is_masked_token_frac", "is_masked_seq_frac") if k in m})
    rec.update({k: gstats[k] for k in ("num_overlong_filtered", "num_overlong_penalized") if k in gstats})
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


def checkpoint_root(cfg: Config) -> Path:
    return Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else Path(cfg.output.dir) / "checkpoints"


def train_loop(cfg: Config, c, point, *, t_start: float) -> int:
    """GRPO on the running parts `c` (`build.Components`), from the resume point `point`
    (`algorithms.resume.resume_point`) to grpo.max_steps; t_start: when the run started (validation records time
    since it). `megatron_rl.build.run` builds the parts, calls this and shuts them down; this closes what it opened
    (the tracker, the async rollout pipeline)."""
    out, root = Path(cfg.output.dir), checkpoint_root(cfg)
    tracker = pipeline = None
    finished = False
    try:
        # after build()'s pre-flight checks: a config refused there never replaces the one the checkpoints were made
        # with (resume_point compares against it)
        dump_yaml(cfg, out / "config.yaml")
        start, driver_state = _resume(cfg, c, point.checkpoint)
        if start > 0 or cfg.init_from:  # loaded a checkpoint or a previous stage's weights: the engine needs them
            c.handover.refit()
        c.handover.to_generator()
        tracker = Tracker(out, resume_step=start, total_steps=cfg.grpo.max_steps, tensorboard=cfg.logging.tensorboard,
                          plots=cfg.logging.plots, progress=cfg.logging.progress, plot_every=cfg.logging.plot_every,
                          sinks=start_trackers(cfg, out), samples=cfg.logging.samples_per_step > 0)
        if start == 0 and c.val_items:
            base = _validate(cfg, c, t_start, 0, tracker)
            tracker.log_validation(0, base)
            passk = f", pass@{cfg.grpo.val_pass_k} {base['val_pass_at_k']:.3f}" if "val_pass_at_k" in base else ""
            print(f"[megatron-rl] step 0 validation: greedy accuracy {base['val_accuracy']:.3f}{passk}", flush=True)
        loss_fn = GRPOLossFn(cfg.grpo.loss)
        nonfinite = empty = 0
        weights_step = start  # the step whose weights the trainer (and, after each refit, the engines) hold
        if cfg.grpo.max_staleness > 0:
            pipeline = RolloutPipeline(cfg, c, start, driver_state.get("pending_rollouts"))
        for step in range(start + 1, cfg.grpo.max_steps + 1):
            due = cfg.checkpoint.every_steps and (step % cfg.checkpoint.every_steps == 0 or step == cfg.grpo.max_steps)
            save_failed: list[CheckpointSaveError] = []

            def checkpoint(s=step):
                try:
                    _save(cfg, c, root, s, pending=pipeline.state() if pipeline is not None else None)
                except CheckpointSaveError as e:  # the step finishes and is logged; the run stops after that
                    save_failed.append(e)

            # the checkpoint is written inside the step, while the trainer's state is resident (colocated handover)
            samples: list[dict] = []
            rec = train_step(cfg, c, step, loss_fn, checkpoint=checkpoint if due else None,
                             rollout=pipeline.take(step, weights_step) if pipeline is not None else None,
                             before_refit=pipeline.join if pipeline is not None else None, weights_step=weights_step,
                             samples=samples)
            tracker.log_samples(step, "train", samples)  # before any abort below: the completions say why
            if not rec["no_trainable_groups"]:
                weights_step = step
            empty = empty + 1 if rec["no_trainable_groups"] else 0
            nonfinite = nonfinite + 1 if rec["skipped"] and not rec["no_trainable_groups"] else 0
            if empty:
                print(f"[megatron-rl] step {step}: no trainable group ({rec['num_groups_dropped']} dropped with "
                      f"all-equal rewards), update skipped ({empty} in a row)", file=sys.stderr, flush=True)
            elif rec["skipped"]:
                print(f"[megatron-rl] step {step}: non-finite loss or gradient, update skipped "
                      f"({nonfinite} in a row)", file=sys.stderr, flush=True)
            if nonfinite and nonfinite >= cfg.grpo.max_nonfinite_steps:
                tracker.log(rec)  # the aborting step's record is kept too
                raise NonFiniteAbort(f"{nonfinite} consecutive steps with non-finite loss/gradients "
                                     f"(grpo.max_nonfinite_steps={cfg.grpo.max_nonfinite_steps}); aborting")
            if empty and empty >= cfg.grpo.max_empty_steps:
                tracker.log(rec)
                raise EmptyStepsAbort(f"{empty} consecutive steps without a trainable group "
                                      f"(grpo.max_empty_steps={cfg.grpo.max_empty_steps}): every group's rewards were "
                                      "all equal; the task is too hard or too easy for this policy, or the reward is "
                                      "broken; aborting")
            if cfg.grpo.val_every and step % cfg.grpo.val_every == 0 and c.val_items and not save_failed:
                rec.update(_validate(cfg, c, t_start, step, tracker))
            tracker.log(rec)
            if save_failed:
                raise save_failed[0]
            # after logging, so an aborting step's record is kept: warns naming the step, or raises MismatchAbort.
            # A stale rollout (async) was generated by older weights: its gap to the trainer is expected, not a bug
            if rec.get("staleness_max", 0) == 0:
                check_mismatch(rec, cfg.grpo, step)
        _summary(cfg, tracker, out)
        finished = True
        return 0
    finally:
        if pipeline is not None:
            pipeline.close()
        if tracker is not None:
            tracker.close(failed=not finished)


def _summary(cfg: Config, tracker: Tracker, out: Path) -> None:
    h = tracker.history
    steps = [r["reward_mean"] for r in h if "reward_mean" in r]  # validation-only records carry no reward
    if not steps:
        return
    k = min(5, len(steps))
    first, last = sum(steps[:k]) / k, sum(steps[-k:]) / k
    vals = [r for r in h if r.get("val_accuracy") is not None]
    print(f"[megatron-rl] done: reward_mean first {k} steps {first:.3f} -> last {k} steps {last:.3f}")
    if vals:
        best = max(vals, key=lambda r: r["val_accuracy"])
        print(f"[megatron-rl] validation greedy accuracy {vals[0]['val_accuracy']:.3f} (step {vals[0]['step']}) -> "
              f"{vals[-1]['val_accuracy']:.3f} (step {vals[-1]['step']}); best {best['val_accuracy']:.3f} at step "
              f"{best['step']}, {best.get('time_since_start_s', 0) / 60:.1f} min after start "
              f"(up to {cfg.grpo.val_num_prompts} held-out prompts)")
    plot = tracker.plot() if cfg.logging.plots else None
    print(f"[megatron-rl] metrics: {(out / 'metrics.jsonl').resolve()}")
    if plot:
        print(f"[megatron-rl] plots:   {plot.resolve()}")
