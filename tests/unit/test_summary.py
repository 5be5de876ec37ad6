"""The run's closing summary: reward averages over training steps only, and the best validation point."""
from __future__ import annotations

from megatron_rl.algorithms.grpo import _summary
from megatron_rl.algorithms.tracking import Tracker
from megatron_rl.config.schema import Config


def test_summary_averages_training_steps_and_reports_best_validation(tmp_path, capsys):
    cfg = Config()
    cfg.logging.plots = False
    t = Tracker(tmp_path, resume_step=0, total_steps=6, tensorboard=False, plots=False, progress=False)
    t.log_validation(0, {"val_accuracy": 0.1, "time_since_start_s": 30.0})  # no reward: must not dilute the mean
    rewards = [0.0, 0.1, 0.2, 0.3, 0.4, 1.0]
    for step, r in enumerate(rewards, 1):
        rec = {"step": step, "reward_mean": r}
        if step == 3:
            rec.update(val_accuracy=0.5, time_since_start_s=120.0)
        if step == 6:
            rec.update(val_accuracy=0.4, time_since_start_s=240.0)
        t.log(rec)
    t.close()
    _summary(cfg, t, tmp_path)
    out = capsys.readouterr().out
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3  # 6 steps: two windows of 3 that do not overlap
    assert f"reward_mean first 3 steps {first:.3f} -> last 3 steps {last:.3f}" in out
    assert "0.100 (step 0) -> 0.400 (step 6); best 0.500 at step 3, 2.0 min after start" in out


def test_short_runs_compare_windows_that_do_not_overlap():
    """3 steps: the first step against the last (not the mean of all three against itself); 1 step: its value."""
    from megatron_rl.algorithms.tracking import trend_line, validation_line

    assert trend_line("reward_mean", [0.1, 0.5, 0.3], ".3f") == "reward_mean first 1 step 0.100 -> last 1 step 0.300"
    assert trend_line("loss", [2.0, 1.0, 1.0, 0.5], ".2f") == "loss first 2 steps 1.50 -> last 2 steps 0.75"
    assert trend_line("loss", [0.25], ".2f") == "loss 0.25 (one step)"
    assert trend_line("r", [float(i) for i in range(12)], ".1f") == "r first 5 steps 2.0 -> last 5 steps 9.0"
    one = [{"step": 0, "val_loss": 1.5}]
    assert validation_line("validation loss", one, "val_loss", ".2f") == \
        "validation loss 1.50 (step 0; no validation after it)"
