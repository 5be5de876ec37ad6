"""What a run leaves behind for people and tools: metrics.jsonl, samples.jsonl (`algorithms/samples.py`), TensorBoard
events, PNG plots, a progress bar, and the experiment trackers of `algorithms/trackers.py` (W&B, MLflow), which get
every record metrics.jsonl gets.

metrics.jsonl holds one flat JSON object per step (tests/integration/test_grpo.py pins its keys); resuming appends,
after dropping lines for steps past the checkpoint the run resumed from, so the file always describes one consistent
history.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Sequence

from megatron_rl.algorithms.samples import SampleFile, markdown_table
from megatron_rl.algorithms.trackers import numeric_metrics
from megatron_rl.paths import read_metrics

# (title, keys) per panel; missing keys are skipped
PLOTS = [
    ("reward", ["reward_mean", "val_accuracy", "val_pass_at_k", "val_rm_score_mean"]),
    ("generator / trainer mismatch", ["token_mult_prob_error"]),
    ("response length (tokens)", ["response_len_mean"]),
    ("seconds per step", ["time_generate_s", "time_logprobs_s", "time_train_s", "time_refit_s", "time_step_s"]),
]

# SFT / DPO runs (algorithms/supervised.py)
SUPERVISED_PLOTS = [
    ("loss", ["loss", "val_loss"]),
    ("DPO rewards (beta x log-ratio)", ["rewards_chosen", "rewards_rejected", "rewards_margin"]),
    ("DPO preference accuracy", ["rewards_accuracy", "val_rewards_accuracy", "val_logps_accuracy"]),
    ("reward model: scores", ["chosen_rewards", "rejected_rewards", "margin"]),
    ("reward model: pairwise accuracy", ["accuracy", "val_accuracy"]),
    ("seconds per step", ["time_logprobs_s", "time_train_s", "time_step_s"]),
]


def trend_line(label: str, values: Sequence[float], fmt: str) -> str:
    """The run's trend for the closing summary: the mean of the first k steps against the last k, k at most 5 and at
    most half the steps (windows that overlap would compare a step with itself); a one-step run gives its value."""
    if len(values) == 1:
        return f"{label} {values[0]:{fmt}} (one step)"
    k = min(5, len(values) // 2)
    first, last = sum(values[:k]) / k, sum(values[-k:]) / k
    return f"{label} first {k} step{'s' * (k > 1)} {first:{fmt}} -> last {k} step{'s' * (k > 1)} {last:{fmt}}"


def validation_line(label: str, vals: list[dict], key: str, fmt: str) -> str:
    """"<label> a (step 0) -> b (step N)" over the validation records (one record: its value alone)."""
    first, last = vals[0], vals[-1]
    if len(vals) == 1:
        return f"{label} {first[key]:{fmt}} (step {first['step']}; no validation after it)"
    return f"{label} {first[key]:{fmt}} (step {first['step']}) -> {last[key]:{fmt}} (step {last['step']})"


class Tracker:
    def __init__(self, out_dir: str | Path, *, resume_step: int, total_steps: int, tensorboard: bool, plots: bool,
                 progress: bool, plot_every: int = 1, sinks: Sequence = (), samples: bool = True,
                 desc: str = "grpo", panels: Sequence = tuple(PLOTS)):
        """sinks: started experiment trackers (`trackers.start_trackers`); closed by `close()`. samples: keep
        samples.jsonl (logging.samples_per_step > 0)."""
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / "metrics.jsonl"
        self.sinks = list(sinks)
        self.history: list[dict] = []
        if self.path.exists():
            self.history = [r for r in read_metrics(self.dir) if resume_step > 0 and r.get("step", 0) <= resume_step]
            self._rewrite()
        self.samples = SampleFile(self.dir, resume_step) if samples else None
        self.plots, self.plot_every = plots, max(1, plot_every)
        self.panels = list(panels)
        self.tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(self.dir / "tensorboard"))
            except Exception as e:  # tensorboard missing: keep running, say so once
                print(f"[megatron-rl] TensorBoard disabled: {e}")
        self.bar = None
        if progress:
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, initial=resume_step, desc=desc, unit="step", dynamic_ncols=True)

    def _rewrite(self) -> None:
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in self.history))
        os.replace(tmp, self.path)

    def _append(self, rec: dict) -> dict:
        """Write one record to metrics.jsonl and hand the same record to TensorBoard and the trackers."""
        rec = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in rec.items()}
        self.history.append(rec)
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        metrics = numeric_metrics(rec)
        if self.tb is not None:
            for k, v in metrics.items():
                self.tb.add_scalar(k, v, rec["step"])
            self.tb.flush()
        for sink in self.sinks:
            sink.log(rec["step"], metrics)
        return rec

    def log(self, rec: dict) -> None:
        rec = self._append(rec)
        step = rec["step"]
        if self.bar is not None:
            post = {"reward": f"{rec.get('reward_mean', 0):.3f}", "s/step": f"{rec.get('time_step_s', 0):.1f}"}
            if "reward_mean" not in rec and rec.get("loss") is not None:  # SFT / DPO: no reward, a loss
                post = {"loss": f"{rec['loss']:.4f}", "s/step": f"{rec.get('time_step_s', 0):.1f}"}
            if rec.get("val_accuracy", rec.get("val_rm_score_mean")) is not None:
                post["val"] = f"{rec.get('val_accuracy', rec.get('val_rm_score_mean')):.3f}"
            self.bar.set_postfix(post)
            self.bar.update(1)
        if self.plots and step % self.plot_every == 0:
            self.plot()

    def log_validation(self, step: int, vals: dict) -> None:
        """A validation-only record (e.g. the baseline before training): kept in the history for the plot."""
        self._append({"step": step, **vals})

    def log_samples(self, step: int, split: str, rows: list[dict]) -> None:
        """A step's kept completions (`samples.py`): samples.jsonl, a TensorBoard text table, the trackers' tables."""
        if self.samples is None or not rows:
            return
        self.samples.write(rows)
        if self.tb is not None:
            self.tb.add_text(f"samples/{split}", markdown_table(rows), step)
            self.tb.flush()
        for sink in self.sinks:
            try:
                sink.log_samples(step, split, rows)
            except Exception as e:  # a table the tracker refuses costs the table, not the run
                print(f"[megatron-rl] {type(sink).__name__} could not log samples: {e}", flush=True)

    def plot(self) -> Path | None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(2, 2, figsize=(11, 7))
        for ax, (title, keys) in zip(axes.flat, self.panels):
            for k in keys:
                pts = [(r["step"], r[k]) for r in self.history if r.get(k) is not None]
                if pts:
                    ax.plot(*zip(*pts), marker="." if len(pts) < 50 else None, label=k)
            ax.set_title(title)
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
            if ax.lines:
                ax.legend(fontsize=7)
        fig.tight_layout()
        out = self.dir / "metrics.png"
        tmp = self.dir / "metrics.tmp.png"
        fig.savefig(tmp, dpi=90)
        plt.close(fig)
        os.replace(tmp, out)
        return out

    def close(self, failed: bool = False) -> None:
        """failed: the run stopped on an error (the trackers mark their run failed)."""
        if self.bar is not None:
            self.bar.close()
        if self.tb is not None:
            self.tb.close()
        png = self.dir / "metrics.png"
        plot = png if self.plots and png.is_file() else None
        for sink in self.sinks:
            try:
                sink.finish(plot, failed)
            except Exception as e:  # a tracker that cannot finish must not hide the run's own outcome
                print(f"[megatron-rl] {type(sink).__name__} could not finish its run: {e}", flush=True)
        self.sinks = []
