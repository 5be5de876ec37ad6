"""The one training loop of every algorithm (GRPO, SFT, DPO): what does not depend on how a step gets its batch.

`run_loop(cfg, c, point, algo)` resumes (weights, optimizer, the data stream's position), opens the tracker, runs the
step-0 baseline, then for each step: the algorithm's `step` (which calls the given `checkpoint()` while the trainer
state is resident, on the checkpoint cadence), the non-finite skip/abort rule, the algorithm's own aborts, the
validation cadence, the record, and a failed checkpoint save stopping the run after its step is logged; at the end
the summary. An algorithm (`Algorithm`) is a data path plus a loss: GRPO samples and scores a rollout
(`algorithms/grpo.py`), SFT and DPO take the next batch of a JSONL file (`algorithms/supervised.py`).
"""
from __future__ import annotations

import random
import shutil
import sys
import time
from pathlib import Path

from megatron_rl.algorithms.tracking import Tracker
from megatron_rl.algorithms.trackers import start_trackers
from megatron_rl.config import Config, dump_yaml


class NonFiniteAbort(RuntimeError):
    pass


class CheckpointSaveError(RuntimeError):
    pass


def checkpoint_root(cfg: Config) -> Path:
    return Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else Path(cfg.output.dir) / "checkpoints"


def save(cfg: Config, c, root: Path, step: int, pending: list[dict] | None = None,
         stream_state: dict | None = None) -> None:
    """Checkpoint `step`: the policy's state plus the driver's (the data stream's position, Python's random state,
    async GRPO's rollouts already sampled for later steps); only the newest checkpoint.keep_last are kept.
    `stream_state`: the stream's position taken with `pending` (in-flight rollouts draw prompts meanwhile)."""
    from megatron_rl.distributed.worker_group import WorkerDiedError

    stream = stream_state if stream_state is not None else c.train_stream.state_dict()
    state = {"step": step, "stream": stream, "py_random": list(random.getstate()[1]),
             "pending_rollouts": pending or []}
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


def resume(cfg: Config, c, latest: Path | None) -> tuple[int, dict]:
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


class Algorithm:
    """What an algorithm gives the loop. The defaults are those of an algorithm without them."""

    name = "train"
    max_steps: int
    max_minutes: float | None = None  # a time budget from t_start (grpo.max_minutes): its last step ends the run
    t_start: float = 0.0  # time.monotonic() when the run started
    val_every: int = 0
    max_nonfinite_steps: int = 3
    nonfinite_key = "max_nonfinite_steps"  # the config key named when the run aborts
    keeps_samples = False  # samples.jsonl (completions): GRPO's
    panels = None  # metrics.png's panels (tracking.PLOTS when None)

    def begin(self, start: int, driver_state: dict) -> None:
        """After the resume, before the tracker opens (GRPO: refit the engines, start async sampling)."""

    def baseline(self, tracker: Tracker) -> None:
        """Step 0 of a fresh run (validation before any update)."""

    def step(self, step: int, checkpoint) -> dict:
        raise NotImplementedError

    def save(self, step: int) -> None:
        raise NotImplementedError

    def on_record(self, step: int, rec: dict, tracker: Tracker) -> None:
        """Right after the step, before any abort (GRPO: its samples, its empty-step count)."""

    def check_abort(self, step: int, rec: dict, tracker: Tracker) -> None:
        """After the non-finite rule; raise to stop the run (log `rec` first to keep it)."""

    def validate(self, step: int, tracker: Tracker) -> dict:
        return {}

    def after_log(self, step: int, rec: dict) -> None:
        """After the record is written (GRPO: the generator/trainer mismatch guard)."""

    def summary(self, tracker: Tracker, out: Path) -> None:
        pass

    def close(self) -> None:
        pass


def run_loop(cfg: Config, c, point, algo: Algorithm) -> int:
    """`algo` on the running parts `c` (`build.Components`) from the resume point `point`
    (`algorithms.resume.resume_point`) to algo.max_steps. `megatron_rl.build.run` builds the parts, calls this and
    shuts them down; this closes what it opened (the tracker, the algorithm's own parts)."""
    out = Path(cfg.output.dir)
    tracker = None
    finished = False
    try:
        # after build()'s pre-flight checks: a config refused there never replaces the one the checkpoints were made
        # with (resume_point compares against it)
        dump_yaml(cfg, out / "config.yaml")
        start, driver_state = resume(cfg, c, point.checkpoint)
        algo.begin(start, driver_state)
        tracker = Tracker(out, resume_step=start, total_steps=algo.max_steps, tensorboard=cfg.logging.tensorboard,
                          plots=cfg.logging.plots, progress=cfg.logging.progress, plot_every=cfg.logging.plot_every,
                          sinks=start_trackers(cfg, out), samples=algo.keeps_samples, desc=algo.name,
                          **({"panels": algo.panels} if algo.panels else {}))
        if start == 0:
            algo.baseline(tracker)
        nonfinite = 0
        step_s = 0.0  # the last step's wall time: the estimate of the next one's, for the time budget
        for step in range(start + 1, algo.max_steps + 1):
            t_step = time.monotonic()
            # the step expected to cross the time budget is the last: it checkpoints and validates like step max_steps
            last = step == algo.max_steps or (algo.max_minutes is not None and step > start + 1 and
                                              t_step + step_s - algo.t_start >= algo.max_minutes * 60)
            due = cfg.checkpoint.every_steps and (step % cfg.checkpoint.every_steps == 0 or last)
            save_failed: list[CheckpointSaveError] = []

            def checkpoint(s=step):
                try:
                    algo.save(s)
                except CheckpointSaveError as e:  # the step finishes and is logged; the run stops after that
                    save_failed.append(e)

            # the checkpoint is written inside the step, while the trainer's state is resident (colocated handover)
            rec = algo.step(step, checkpoint if due else None)
            algo.on_record(step, rec, tracker)
            nonfinite = nonfinite + 1 if rec["skipped"] and not rec.get("no_trainable_groups") else 0
            if nonfinite:
                print(f"[megatron-rl] step {step}: non-finite loss or gradient, update skipped "
                      f"({nonfinite} in a row)", file=sys.stderr, flush=True)
            if nonfinite and nonfinite >= algo.max_nonfinite_steps:
                tracker.log(rec)  # the aborting step's record is kept too
                raise NonFiniteAbort(f"{nonfinite} consecutive steps with non-finite loss/gradients "
                                     f"({algo.nonfinite_key}={algo.max_nonfinite_steps}); aborting")
            algo.check_abort(step, rec, tracker)
            # the last step always validates (when validation is on): a run ends with its held-out score
            if algo.val_every and (step % algo.val_every == 0 or last) and not save_failed:
                rec.update(algo.validate(step, tracker))
            tracker.log(rec)
            if save_failed:
                raise save_failed[0]
            algo.after_log(step, rec)
            step_s = time.monotonic() - t_step
            if last and step < algo.max_steps:
                print(f"[megatron-rl] step {step}: the time budget ({algo.name}.max_minutes={algo.max_minutes}) ends "
                      f"the run after {(time.monotonic() - algo.t_start) / 60:.1f} min; re-run the command to go on",
                      flush=True)
                break
        algo.summary(tracker, out)
        finished = True
        return 0
    finally:
        algo.close()
        if tracker is not None:
            tracker.close(failed=not finished)
