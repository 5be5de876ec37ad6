"""The GRPO loop: a single controller over narrow interfaces (see DESIGN.md, "One GRPO step").

    megatron-rl train configs/demo_cpu.yaml [key=value ...]

Re-running the same command resumes from the newest complete checkpoint under `<output.dir>/checkpoints`.
Weight versions: the generator starts at version 0 (the initial weights); after training step s the policy streams
its weights as version s, and step s+1 refuses to generate with anything else.
"""
from __future__ import annotations

import random
import shutil
import signal
import sys
import time
from pathlib import Path

import torch

from megatron_rl.algorithms.evaluate import evaluate
from megatron_rl.algorithms.loss import mismatch_metrics
from megatron_rl.algorithms.loss_fn import GRPOLossFn
from megatron_rl.algorithms.rollout import build_rollout, sample_groups
from megatron_rl.algorithms.tracking import Tracker
from megatron_rl.config import Config, dump_yaml
from megatron_rl.platform import device_telemetry, get_platform

BUCKET_BYTES = 256 << 20


class NonFiniteAbort(RuntimeError):
    pass


def _to_trainer(cfg: Config, c) -> None:
    """Colocated: after generating, the engine frees its device memory and the trainer's state comes back.
    (No-ops on CPU, where both live in host memory.)"""
    if cfg.cluster.colocated:
        c.generator.sleep()
        c.policy.onload()


def _refit(c, version: int, colocated_handover: bool = False) -> float:
    """Stream the policy's weights into the generator as `version`. With a colocated handover (after training):
    the engine's weights wake first, the refit fills them, the trainer's state goes to host memory, and only then
    the KV cache is allocated again, so the two never hold the device at full size together."""
    t0 = time.perf_counter()
    if colocated_handover:
        c.generator.wake_up(["weights"])
    handle = c.policy.send_weights(version, get_platform().refit_transport_colocated, BUCKET_BYTES)
    c.generator.receive_weights(handle.to_dict())
    if colocated_handover:
        c.policy.offload()
        c.generator.wake_up(["kv_cache"])
    return time.perf_counter() - t0


def _validate(cfg: Config, c, version: int, t_start: float) -> dict:
    g = cfg.generation
    greedy = evaluate(c.generator, c.val_items, c.reward_fn, c.tokenizer, n=1, temperature=0.0, top_p=1.0,
                      max_tokens=g.max_new_tokens, version=version)
    out = {"val_accuracy": greedy["val_accuracy"]}
    if cfg.grpo.val_pass_k > 0:
        sampled = evaluate(c.generator, c.val_items, c.reward_fn, c.tokenizer, n=cfg.grpo.val_pass_k,
                           temperature=g.temperature, top_p=g.top_p, max_tokens=g.max_new_tokens, version=version,
                           seed=cfg.grpo.seed)
        out.update(val_pass_at_k=sampled["val_pass_at_k"], val_sample_accuracy=sampled["val_accuracy"])
    # wall time from the start of this process's run (set-up included): "accuracy within N minutes"
    out["time_since_start_s"] = time.monotonic() - t_start
    return out


class CheckpointSaveError(RuntimeError):
    pass


def _save(cfg: Config, c, root: Path, step: int) -> None:
    from megatron_rl.distributed.worker_group import WorkerDiedError

    state = {"step": step, "stream": c.train_stream.state_dict(), "py_random": list(random.getstate()[1])}
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


def _remove_partial_checkpoints(root: Path) -> None:
    """A run killed while saving leaves `step_N.tmp-XXXX` (never picked for resuming); remove it, so crashes do not
    pile up dead checkpoint-sized directories. Only `.tmp-` dirs: an `.old-` dir may hold the only complete copy."""
    for partial in sorted(root.glob("*.tmp-*")) if root.is_dir() else []:
        if partial.is_dir():
            print(f"[megatron-rl] removing partial checkpoint {partial} (a save was interrupted)", flush=True)
            shutil.rmtree(partial, ignore_errors=True)


def _resume(cfg: Config, c, root: Path) -> int:
    from megatron_rl.models.checkpoint import latest_checkpoint

    _remove_partial_checkpoints(root)
    latest = latest_checkpoint(root) if cfg.checkpoint.resume else None
    if latest is None:
        if cfg.init_from:  # a stage chain: start from the previous stage's weights, fresh optimizer and data
            c.policy.group.call("load_weights", cfg.init_from)
            print(f"[megatron-rl] initialised from {cfg.init_from}")
            return 0
        return 0
    state = c.policy.load(str(latest))
    c.train_stream.load_state_dict(state["stream"])
    print(f"[megatron-rl] resumed from {latest} (step {state['step']})")
    return int(state["step"])


def train_step(cfg: Config, c, step: int, loss_fn) -> dict:
    """One GRPO step; returns the metrics record (without validation)."""
    T = cfg.generation.temperature
    t_step = time.perf_counter()
    t0 = time.perf_counter()
    groups, gstats = sample_groups(cfg, _SeededGenerator(c.generator, cfg.grpo.seed * 100_003 + step),
                                   c.train_stream, c.reward_fn, c.tokenizer, version=step - 1)
    _to_trainer(cfg, c)
    roll = build_rollout(cfg, groups, gstats)
    batch = roll.batch
    time_generate = time.perf_counter() - t0
    if len(batch) == 0:
        raise RuntimeError(f"step {step}: no trainable sequences (all groups dropped or all responses empty)")

    t0 = time.perf_counter()
    several = cfg.grpo.optimizer_steps_per_rollout > 1
    if several or not cfg.grpo.reuse_onpolicy_logprobs:
        batch.old_logprobs = c.policy.logprobs(batch, T)
    if cfg.grpo.loss.kl_coef > 0:
        batch.ref_logprobs = c.policy.reference_logprobs(batch, T)
    time_logprobs = time.perf_counter() - t0

    t0 = time.perf_counter()
    results = [c.policy.train(mb, loss_fn, T) for mb in _split(batch, cfg.grpo.optimizer_steps_per_rollout)]
    time_train = time.perf_counter() - t0
    first = results[0]
    train_lps = batch.old_logprobs if batch.old_logprobs is not None else first.logprobs
    skipped = any(r.skipped for r in results)

    refit_s = _refit(c, step, colocated_handover=cfg.cluster.colocated)
    mask = torch.ones(sum(len(x) for x in batch.gen_logprobs))
    mm = mismatch_metrics(torch.cat(batch.gen_logprobs), torch.cat([t.float() for t in train_lps]), mask)
    rewards = roll.rewards.flatten()
    n_tokens = sum(len(x) for x in batch.input_ids)
    elapsed = time.perf_counter() - t_step
    m = first.metrics
    rec = {
        "step": step, "reward_mean": float(rewards.mean()), "reward_std": float(rewards.std()) if rewards.numel() > 1
        else 0.0, "loss": m.get("loss"), "kl": m.get("kl", 0.0), "entropy": m.get("entropy"),
        "clip_frac": m.get("clip_frac"), "grad_norm": m.get("grad_norm"), "lr": m.get("lr"),
        "token_mult_prob_error": mm["token_mult_prob_error"], "gen_kl_error": mm["gen_kl_error"],
        "response_len_mean": sum(batch.response_lens()) / len(batch), "num_tokens": n_tokens,
        "tokens_per_s": n_tokens / elapsed, "time_generate_s": time_generate, "time_logprobs_s": time_logprobs,
        "time_train_s": time_train, "time_refit_s": refit_s, "time_step_s": elapsed, "skipped": skipped,
        "num_sequences": len(batch), "num_reward_timeouts": gstats.get("num_timeouts", 0),
        "num_reward_errors": gstats.get("num_errors", 0),
        "num_groups_dropped": gstats.get("num_groups_dropped", 0), "truncated_frac":
            gstats["num_truncated"] / max(gstats["num_samples"], 1),
    }
    rec.update(device_telemetry())
    return rec


class _SeededGenerator:
    """Passes a per-step seed, so a resumed run samples exactly what the uninterrupted run sampled at that step."""

    def __init__(self, gen, seed: int):
        self.gen, self.seed = gen, seed

    def generate(self, prompts, **kw):
        kw.setdefault("seed", self.seed)
        self.seed += 1  # refill draws of dynamic sampling get fresh randomness
        return self.gen.generate(prompts, **kw)


def _split(batch, parts: int):
    """Mini-batches for several optimizer steps per rollout; whole groups stay together."""
    if parts <= 1:
        return [batch]
    from megatron_rl.policy.interface import RolloutBatch

    gids = sorted(set(batch.group_ids))
    out = []
    for k in range(parts):
        keep = set(gids[k::parts])
        idx = [i for i, g in enumerate(batch.group_ids) if g in keep]
        if not idx:
            continue

        def pick(v):
            return None if v is None else [v[i] for i in idx]

        out.append(RolloutBatch(pick(batch.input_ids), pick(batch.prompt_lens), pick(batch.advantages),
                                pick(batch.old_logprobs), pick(batch.ref_logprobs), pick(batch.gen_logprobs),
                                pick(batch.group_ids)))
    return out


def run(cfg: Config, config_path: str | None = None, overrides: list[str] | None = None) -> int:
    from megatron_rl.build import build

    t_start = time.monotonic()
    out = Path(cfg.output.dir)
    out.mkdir(parents=True, exist_ok=True)
    dump_yaml(cfg, out / "config.yaml")
    root = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else out / "checkpoints"
    random.seed(cfg.grpo.seed)
    torch.manual_seed(cfg.grpo.seed)
    print(f"[megatron-rl] starting: output in {out.resolve()}", flush=True)
    from megatron_rl.data.datasets import DataError

    try:
        c = build(cfg, out)
    except DataError as e:  # raised while reading the data, before Ray or any worker starts
        print(f"data error: {e}", file=sys.stderr, flush=True)
        return 2
    # scancel / kill send SIGTERM: turn it into an exception so the engine and Ray shut down cleanly (no leaked
    # /dev/shm segments); the last complete checkpoint is untouched either way. Installed after ray.init, which
    # replaces the handler with its own.
    signal.signal(signal.SIGTERM, _terminate)
    tracker = None
    try:
        start = _resume(cfg, c, root)
        if start > 0 or cfg.init_from:
            _refit(c, start)
        tracker = Tracker(out, resume_step=start, total_steps=cfg.grpo.max_steps, tensorboard=cfg.logging.tensorboard,
                          plots=cfg.logging.plots, progress=cfg.logging.progress, plot_every=cfg.logging.plot_every)
        if start == 0 and c.val_items:
            base = _validate(cfg, c, 0, t_start)
            tracker.log_validation(0, base)
            passk = f", pass@{cfg.grpo.val_pass_k} {base['val_pass_at_k']:.3f}" if "val_pass_at_k" in base else ""
            print(f"[megatron-rl] step 0 validation: greedy accuracy {base['val_accuracy']:.3f}{passk}", flush=True)
        loss_fn = GRPOLossFn(cfg.grpo.loss)
        nonfinite = 0
        for step in range(start + 1, cfg.grpo.max_steps + 1):
            rec = train_step(cfg, c, step, loss_fn)
            nonfinite = nonfinite + 1 if rec["skipped"] else 0
            if rec["skipped"]:
                print(f"[megatron-rl] step {step}: non-finite loss or gradient, update skipped "
                      f"({nonfinite} in a row)", file=sys.stderr, flush=True)
            if nonfinite and nonfinite >= cfg.grpo.max_nonfinite_steps:
                tracker.log(rec)  # the aborting step's record is kept too
                raise NonFiniteAbort(f"{nonfinite} consecutive steps with non-finite loss/gradients "
                                     f"(grpo.max_nonfinite_steps={cfg.grpo.max_nonfinite_steps}); aborting")
            if cfg.grpo.val_every and step % cfg.grpo.val_every == 0 and c.val_items:
                rec.update(_validate(cfg, c, step, t_start))
            tracker.log(rec)
            if cfg.checkpoint.every_steps and (step % cfg.checkpoint.every_steps == 0 or step == cfg.grpo.max_steps):
                _save(cfg, c, root, step)
        _summary(cfg, tracker, out)
        return 0
    finally:
        if tracker is not None:
            tracker.close()
        c.shutdown()


def _terminate(signum, _frame):
    raise SystemExit(128 + signum)


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
