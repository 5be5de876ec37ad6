"""`grpo.max_minutes`: the shared loop (`algorithms/trainer.run_loop`) ends a run at the step expected to cross its
time budget, with that step's checkpoint and validation, as if it were the last step; without a budget nothing
changes. The clock is a fake one the fake algorithm's steps advance, so the test is exact whatever the machine."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from megatron_rl.algorithms import trainer
from megatron_rl.algorithms.resume import ResumePoint
from megatron_rl.config.schema import Config

STEP_S = 60.0


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class Timed(trainer.Algorithm):
    name = "grpo"

    def __init__(self, clock: Clock, max_steps: int, max_minutes, val_every: int):
        self.clock, self.max_steps, self.max_minutes, self.val_every = clock, max_steps, max_minutes, val_every
        self.t_start = clock.t
        self.saved, self.validated, self.stepped = [], [], []

    def step(self, step: int, checkpoint) -> dict:
        self.clock.t += STEP_S
        self.stepped.append(step)
        if checkpoint is not None:
            checkpoint()
        return {"step": step, "skipped": False, "no_trainable_groups": False}

    def save(self, step: int) -> None:
        self.saved.append(step)

    def validate(self, step: int, tracker) -> dict:
        self.validated.append(step)
        return {"val_accuracy": 0.5}


def run(tmp_path, monkeypatch, *, max_minutes, max_steps=10, every=3, val_every=4):
    clock = Clock()
    monkeypatch.setattr(trainer.time, "monotonic", clock)
    cfg = Config()
    cfg.output.dir = str(tmp_path / "out")
    (tmp_path / "out").mkdir()
    cfg.checkpoint.every_steps = every
    cfg.logging.plots = cfg.logging.progress = cfg.logging.tensorboard = False
    algo = Timed(clock, max_steps, max_minutes, val_every)
    assert trainer.run_loop(cfg, SimpleNamespace(), ResumePoint(None, 0), algo) == 0
    return algo


def test_the_step_expected_to_cross_the_budget_is_the_last(tmp_path, monkeypatch, capsys):
    # 60 s steps, 3.5 min: before step 4 the clock reads 180 s and the last step took 60 s, so 240 s > 210 s
    algo = run(tmp_path, monkeypatch, max_minutes=3.5)
    assert algo.stepped == [1, 2, 3, 4]
    assert algo.saved == [3, 4]  # every_steps=3, and the last step's
    assert algo.validated == [4]  # val_every=4 would also validate 4; the last step always does
    assert "the time budget (grpo.max_minutes=3.5) ends the run after 4.0 min" in capsys.readouterr().out


def test_a_budget_ending_off_the_schedule_still_saves_and_validates(tmp_path, monkeypatch):
    algo = run(tmp_path, monkeypatch, max_minutes=2.5, val_every=5)  # before step 3: 120 + 60 >= 150
    assert algo.stepped == [1, 2, 3] and algo.saved == [3] and algo.validated == [3]


@pytest.mark.parametrize("budget", [None, 60.0])
def test_no_budget_or_a_large_one_runs_every_step(tmp_path, monkeypatch, budget):
    algo = run(tmp_path, monkeypatch, max_minutes=budget)
    assert algo.stepped == list(range(1, 11)) and algo.saved == [3, 6, 9, 10] and algo.validated == [4, 8, 10]


def test_the_first_step_always_runs(tmp_path, monkeypatch):
    """No step time to go by yet: a budget already spent at set-up still trains one step (and saves it)."""
    algo = run(tmp_path, monkeypatch, max_minutes=0.001)
    assert algo.stepped == [1, 2] and algo.saved == [2]
