"""EnvironmentPool with real worker processes: state per trajectory in its worker, and failures that end only their
own trajectory (raised, timeout, garbage, worker died) while the rest of the batch completes.

The environment class below is loaded in the workers by its import path (this module), so keep the imports light.
"""
import math
import os
import signal
import time

import pytest

from megatron_rl.environments.interface import EnvironmentLoadError, StepResult
from megatron_rl.environments.runner import EnvironmentPool, Failure

CLS = f"{__name__}:Scripted"
TIMEOUT = 1.0


class Scripted:
    """item["mode"] picks the behaviour of step(); "ok" counts turns and ends with reward 1 at item["turns"]."""

    def __init__(self, greeting: str = "count"):
        if greeting == "explode":
            raise ValueError("bad greeting")
        self.greeting = greeting

    def reset(self, item):
        self.mode, self.turns, self.n = item.get("mode", "ok"), item.get("turns", 3), 0
        if self.mode == "reset_raise":
            raise KeyError("no such row")
        if self.mode == "reset_garbage":
            return "not a list of messages"
        return [{"role": "user", "content": f"start {item.get('name', '')}"}]

    def step(self, messages):
        self.n += 1
        if self.mode == "raise":
            raise RuntimeError("environment bug")
        if self.mode == "hang":  # Python-level: the worker's soft timeout ends it, the worker lives on
            time.sleep(60)
        if self.mode == "hang_in_c":  # SIGALRM blocked, like work stuck in C: only the parent's kill ends it
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
            time.sleep(60)
        if self.mode == "swallow":  # catches the soft timeout and goes on: still a timeout
            try:
                time.sleep(60)
            except BaseException:
                return StepResult(None, 1.0, True)
        if self.mode == "garbage":
            return {"reward": 1.0}
        if self.mode == "nan":
            return StepResult(None, math.nan, True)
        if self.mode == "bad_message":
            return StepResult([{"role": "tool", "content": 42}], 0.0, False)
        if self.mode == "die":
            os._exit(3)
        if self.n >= self.turns:
            return StepResult(None, 1.0, True, {"turns": self.n})
        # the count proves the instance (its state) survived between calls
        return StepResult([{"role": "user", "content": f"{self.greeting} {self.n}"}], 0.0, False)


class BadWarmup(Scripted):
    @classmethod
    def warmup(cls):
        raise OSError("cannot reach the tool server")


class SlowWarmup(Scripted):
    @classmethod
    def warmup(cls):
        time.sleep(60)


class NotAnEnvironment:
    def reset(self, item):
        return []


def assistant(text="..."):
    return [{"role": "assistant", "content": text}]


@pytest.fixture
def pool():
    p = EnvironmentPool(CLS, {}, num_workers=2, timeout_s=TIMEOUT, grace_s=0.5)
    yield p
    p.shutdown()


def test_state_per_trajectory_lives_in_its_worker(pool):
    ids = ["a", "b", "c", "d"]
    opening = pool.reset(ids, [{"name": i, "turns": 3} for i in ids])
    assert opening == [[{"role": "user", "content": f"start {i}"}] for i in ids]
    # spread over both workers, two each
    assert sorted(pool.worker_of(i) for i in ids) == sorted(pool.worker_pids() * 2)
    for n in (1, 2):
        results = pool.step(ids, [assistant()] * 4)
        assert [r.observation for r in results] == [[{"role": "user", "content": f"count {n}"}]] * 4
        assert not any(r.done for r in results)
    results = pool.step(ids, [assistant()] * 4)
    assert [(r.reward, r.done, r.metrics) for r in results] == [(1.0, True, {"turns": 3})] * 4
    assert pool.live() == 0  # done trajectories are forgotten
    with pytest.raises(ValueError, match="not live"):
        pool.step(["a"], [assistant()])
    assert pool.errors == {"raised": 0, "timeout": 0, "garbage": 0, "worker_died": 0}


def test_raise_hang_and_garbage_end_only_their_own_trajectory(pool):
    modes = ["raise", "ok", "hang", "ok", "garbage", "nan", "bad_message", "swallow", "ok"]
    ids = [f"t{i}" for i in range(len(modes))]
    pids = pool.worker_pids()
    assert not any(isinstance(r, Failure) for r in pool.reset(ids, [{"mode": m} for m in modes]))
    start = time.monotonic()
    results = pool.step(ids, [assistant()] * len(ids))
    elapsed = time.monotonic() - start
    by_mode = dict(zip(ids, results))
    for tid, mode in zip(ids, modes):
        r = by_mode[tid]
        if mode == "ok":
            assert r == StepResult([{"role": "user", "content": "count 1"}], 0.0, False), r
            continue
        assert (r.observation, r.reward, r.done) == (None, 0.0, True), (mode, r)
        expected = {"raise": "raised", "hang": "timeout", "swallow": "timeout"}.get(mode, "garbage")
        assert r.metrics["env_error"] == expected, (mode, r.metrics)
    assert "RuntimeError: environment bug" in by_mode["t0"].metrics["env_error_detail"]
    assert "finite number" in by_mode["t5"].metrics["env_error_detail"]
    assert "content must be a string" in by_mode["t6"].metrics["env_error_detail"]
    assert pool.errors == {"raised": 1, "timeout": 2, "garbage": 3, "worker_died": 0}
    # soft timeouts: no worker was killed, and the two hangs (on different workers or one after the other) took
    # about the timeout each, not the 60 s they asked for
    assert pool.worker_pids() == pids and pool.num_restarts == 0
    assert elapsed < 4 * TIMEOUT + 5
    # the survivors kept their state; the failed ones are gone
    ok = [t for t, m in zip(ids, modes) if m == "ok"]
    assert [r.observation[0]["content"] for r in pool.step(ok, [assistant()] * 3)] == ["count 2"] * 3
    assert pool.live() == 3


def test_reset_failures_are_counted_and_leave_no_instance(pool):
    out = pool.reset(["x", "y", "z"], [{"mode": "reset_raise"}, {"mode": "reset_garbage"}, {}])
    assert isinstance(out[0], Failure) and out[0].kind == "raised" and "KeyError" in out[0].detail
    assert isinstance(out[1], Failure) and out[1].kind == "garbage" and "list of messages" in out[1].detail
    assert out[2] == [{"role": "user", "content": "start "}]
    assert pool.errors["raised"] == 1 and pool.errors["garbage"] == 1
    assert pool.live() == 1
    pool.reset(["x"], [{}])  # a failed id is free again


def test_hang_in_c_kills_only_its_worker_and_its_neighbours_lose_state(pool):
    # placement: a -> worker 0, b -> worker 1, c -> worker 0 (least loaded, ties to the lowest)
    pool.reset(["a", "b", "c"], [{"mode": "hang_in_c"}, {}, {}])
    w0, w1 = pool.worker_of("a"), pool.worker_of("b")
    assert pool.worker_of("c") == w0 != w1
    results = pool.step(["a", "b", "c"], [assistant()] * 3)
    assert results[0].metrics["env_error"] == "timeout" and "killed" in results[0].metrics["env_error_detail"]
    assert results[1].observation == [{"role": "user", "content": "count 1"}]
    assert results[2].metrics["env_error"] == "worker_died"  # its instance died with worker 0
    assert pool.errors == {"raised": 0, "timeout": 1, "garbage": 0, "worker_died": 1}
    assert pool.num_restarts == 1
    pids = pool.worker_pids()
    assert w0 not in pids and w1 in pids
    # the other worker's trajectory kept its state; the replacement takes new trajectories
    assert pool.step(["b"], [assistant()])[0].observation[0]["content"] == "count 2"
    pool.reset(["d"], [{}])
    assert pool.worker_of("d") not in (w0, w1)
    assert pool.step(["d"], [assistant()])[0].observation[0]["content"] == "count 1"


def test_killed_worker_is_replaced(pool):
    pool.reset(["a", "b", "c", "d"], [{}, {}, {"mode": "die"}, {}])
    victim, other = pool.worker_of("a"), pool.worker_of("b")
    os.kill(victim, signal.SIGKILL)  # between calls, from outside (the OOM killer, an operator)
    time.sleep(0.2)
    results = pool.step(["a", "b"], [assistant()] * 2)
    assert results[0].metrics["env_error"] == "worker_died" and "SIGKILL" in results[0].metrics["env_error_detail"]
    assert results[1].observation[0]["content"] == "count 1"
    assert victim not in pool.worker_pids() and other in pool.worker_pids()
    # c (os._exit inside step) was on the killed worker too: already lost. d dies with... nothing: it is on `other`
    assert pool.step(["c"], [assistant()])[0].metrics["env_error"] == "worker_died"
    assert pool.step(["d"], [assistant()])[0].observation[0]["content"] == "count 1"
    # a worker dying during a call
    pool.reset(["e"], [{"mode": "die"}])
    dying = pool.worker_of("e")
    r = pool.step(["e"], [assistant()])[0]
    assert r.metrics["env_error"] == "worker_died" and "exit status 3" in r.metrics["env_error_detail"]
    assert dying not in pool.worker_pids() and len(pool.worker_pids()) == 2
    assert pool.errors["worker_died"] == 3 and pool.num_restarts == 2


def test_close_and_id_checks(pool):
    pool.reset(["a"], [{}])
    with pytest.raises(ValueError, match="live already"):
        pool.reset(["a"], [{}])
    with pytest.raises(ValueError, match="twice"):
        pool.step(["a", "a"], [assistant()] * 2)
    pool.close("a")
    pool.close("a")  # no-op
    assert pool.live() == 0
    pool.reset(["a"], [{}])
    assert pool.step(["a"], [assistant()])[0].observation[0]["content"] == "count 1"


@pytest.mark.parametrize("cls_path, kwargs, message", [
    ("no_such_module_xyz:Env", {}, "module 'no_such_module_xyz' not found"),
    (f"{__name__}:Missing", {}, "has no attribute 'Missing'"),
    (f"{__name__}:NotAnEnvironment", {}, "has no step()"),
    (CLS, {"greeting": "explode"}, "raised ValueError: bad greeting"),
    (CLS, {"colour": "red"}, "unexpected keyword argument 'colour'"),
])
def test_start_up_names_environment_cls_and_what_is_wrong(cls_path, kwargs, message):
    with pytest.raises(EnvironmentLoadError, match="environment.cls") as e:
        EnvironmentPool(cls_path, kwargs, num_workers=1, timeout_s=TIMEOUT)
    assert message in str(e.value)


def test_from_config():
    from megatron_rl.config.schema import EnvironmentConfig

    with pytest.raises(ValueError, match="environment.cls is not set"):
        EnvironmentPool.from_config(EnvironmentConfig())
    with EnvironmentPool.from_config(EnvironmentConfig(cls=CLS, kwargs={"greeting": "n ="}, num_workers=1)) as pool:
        assert (pool.num_workers, pool.timeout_s) == (1, 10.0)
        pool.reset(["a"], [{}])
        assert pool.step(["a"], [assistant()])[0].observation[0]["content"] == "n = 1"
    assert pool.worker_pids() == []  # shut down on leaving the block


def test_warmup_failures_stop_the_start_and_leave_no_worker():
    import multiprocessing

    with pytest.raises(RuntimeError, match="warmup\\(\\) raised OSError: cannot reach the tool server"):
        EnvironmentPool(f"{__name__}:BadWarmup", {}, num_workers=2, timeout_s=TIMEOUT)
    with pytest.raises(RuntimeError, match="did not start within 2s"):
        EnvironmentPool(f"{__name__}:SlowWarmup", {}, num_workers=1, timeout_s=TIMEOUT, startup_timeout_s=2)
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("env-worker")]


class Interrupted(Exception):
    pass


def test_an_interrupted_call_retires_the_busy_worker():
    """A call interrupted in the driver (Ctrl-C; here an alarm) leaves a worker that would answer the next request
    with the old reply: that worker is replaced, the idle one keeps its trajectories."""
    def interrupt(signum, frame):
        raise Interrupted()

    with EnvironmentPool(CLS, {}, num_workers=2, timeout_s=30) as pool:
        pool.reset(["hang", "ok"], [{"mode": "hang"}, {}])
        busy, idle = pool.worker_of("hang"), pool.worker_of("ok")
        assert pool.step(["ok"], [assistant()])[0].observation[0]["content"] == "count 1"
        old = signal.signal(signal.SIGALRM, interrupt)
        signal.setitimer(signal.ITIMER_REAL, 0.5)
        try:
            with pytest.raises(Interrupted):
                pool.step(["hang"], [assistant()])
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)
        assert busy not in pool.worker_pids() and idle in pool.worker_pids()
        assert pool.step(["hang"], [assistant()])[0].metrics["env_error"] == "worker_died"
        assert pool.step(["ok"], [assistant()])[0].observation[0]["content"] == "count 2"
        assert len(pool.worker_pids()) == 2
