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
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert f"reward_mean first 5 steps {first:.3f} -> last 5 steps {last:.3f}" in out
    assert "0.100 (step 0) -> 0.400 (step 6); best 0.500 at step 3, 2.0 min after start" in out
