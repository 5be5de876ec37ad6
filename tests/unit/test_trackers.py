"""W&B and MLflow trackers, for real and offline: the Tracker writes metrics.jsonl and feeds the trackers; each run is
read back with the tracker library's own reader (wandb's `wandb leet inspect --json` on the offline run folder,
MLflow's MlflowClient on the local sqlite store) and compared with metrics.jsonl, the independent reference.
A configured tracker whose package is missing stops `megatron-rl train` before anything starts, naming the pip command.
"""
from __future__ import annotations

import base64
import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_rl.algorithms.trackers import start_trackers
from megatron_rl.algorithms.tracking import Tracker
from megatron_rl.config.schema import Config, MlflowConfig, WandbConfig
from tests.tracker_readback import (expected_points, mlflow_points, mlflow_run, wandb_isolated_env, wandb_points,
                                    wandb_records)

REPO = Path(__file__).resolve().parents[2]
# what a run logs: a baseline validation at step 0, then steps with floats, ints, booleans and a non-finite loss
RECORDS = [
    {"step": 1, "reward_mean": 0.25, "loss": 0.5, "num_tokens": 412, "skipped": False, "time_step_s": 1.5},
    {"step": 2, "reward_mean": 0.375, "loss": float("nan"), "num_tokens": 398, "skipped": True, "time_step_s": 1.25,
     "val_accuracy": 0.5},
    {"step": 3, "reward_mean": 0.5, "loss": 0.125, "num_tokens": 401, "skipped": False, "time_step_s": 1.0},
]
BASELINE = {"val_accuracy": 0.25, "time_since_start_s": 3.0}


@pytest.fixture
def wandb_env(tmp_path, monkeypatch):
    for var, value in wandb_isolated_env(tmp_path).items():
        monkeypatch.setenv(var, value)


def run_tracked(out, cfg, failed=False):
    """Log RECORDS through the Tracker (with a plot, as a run ends) and return metrics.jsonl's records."""
    t = Tracker(out, resume_step=0, total_steps=3, tensorboard=False, plots=True, progress=False,
                sinks=start_trackers(cfg, out))
    t.log_validation(0, BASELINE)
    for rec in RECORDS:
        t.log(dict(rec))
    t.plot()
    t.close(failed=failed)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_wandb_offline_run_reads_back_equal_to_metrics_jsonl(tmp_path, wandb_env):
    cfg = Config()
    cfg.logging.wandb = WandbConfig(project="mrl-test", mode="offline")
    out = tmp_path / "run"
    lines = run_tracked(out, cfg)
    assert lines[2]["loss"] is None  # the NaN is null in metrics.jsonl, and absent in the tracker below
    records = wandb_records(out)
    assert wandb_points(records) == expected_points(lines)
    [run_rec] = [x["run"] for x in records if x["type"] == "run"]
    assert run_rec["display_name"] == "run" and run_rec["project"] == "mrl-test"
    config = {k: v for k, v in run_rec["config"]["update"].items() if k != "_wandb"}
    assert config["policy"]["optimizer"]["lr"] == cfg.policy.optimizer.lr
    assert config["logging"]["wandb"]["mode"] == "offline" and config["grpo"]["max_steps"] == cfg.grpo.max_steps
    [art] = [x["artifact"] for x in records if x["type"] == "artifact"]
    [entry] = art["manifest"]["contents"]
    png = (out / "metrics.png").read_bytes()
    assert entry["path"] == "metrics.png" and int(entry["size"]) == len(png)
    assert entry["digest"] == base64.b64encode(hashlib.md5(png).digest()).decode()
    assert [x["exit"].get("exit_code", 0) for x in records if x["type"] == "exit"] == [0]


def test_mlflow_local_store_reads_back_equal_to_metrics_jsonl(tmp_path):
    cfg = Config()
    cfg.logging.mlflow = MlflowConfig(experiment="mrl-test")
    out = tmp_path / "run"
    lines = run_tracked(out, cfg)
    client, run = mlflow_run(out, "mrl-test")
    assert run.info.run_name == "run" and run.info.status == "FINISHED"
    assert mlflow_points(client, run, lines) == expected_points(lines)
    params = run.data.params
    assert params["policy.optimizer.lr"] == json.dumps(cfg.policy.optimizer.lr)
    assert params["data.task"] == cfg.data.task and params["checkpoint.dir"] == "null"
    assert params["logging.mlflow.experiment"] == "mrl-test"
    assert [a.path for a in client.list_artifacts(run.info.run_id)] == ["metrics.png"]
    local = client.download_artifacts(run.info.run_id, "metrics.png", str(tmp_path))
    assert open(local, "rb").read() == (out / "metrics.png").read_bytes()
    # the artifact store of the default local tracking store lives in the run's folder
    assert (out / "mlflow").is_dir()


def test_mlflow_marks_a_failed_run_failed(tmp_path):
    cfg = Config()
    cfg.logging.mlflow = MlflowConfig()
    out = tmp_path / "run"
    run_tracked(out, cfg, failed=True)
    _, run = mlflow_run(out, "megatron-rl")
    assert run.info.status == "FAILED"


@pytest.mark.parametrize("extra, override", [("wandb", "logging.wandb.mode=offline"), ("mlflow", "logging.mlflow={}")])
def test_missing_extra_stops_train_before_anything_starts(tmp_path, extra, override):
    # the package made unimportable the way Python documents it (a None entry in sys.modules), then the real CLI
    code = (f"import sys; sys.modules[{extra!r}] = None\n"
            "from megatron_rl.cli import main\n"
            "sys.exit(main(sys.argv[1:]))")
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-c", code, "train", str(REPO / "configs" / "demo_cpu.yaml"),
                        f"output.dir={tmp_path / 'run'}", override], capture_output=True, text=True, timeout=300,
                       cwd=REPO)
    assert r.returncode == 2, r.stdout + r.stderr
    assert (f"config error: logging.{extra} is set but {extra} is not installed: pip install -e '.[{extra}]'"
            in r.stderr), r.stderr
    assert "Ray" not in r.stdout + r.stderr and not (tmp_path / "run" / "logs").exists()  # no worker started
    assert time.monotonic() - t0 < 120
