"""Reading a tracker's run back with the tracker library's own reader, for the tests that compare it with
metrics.jsonl (tests/unit/test_trackers.py with synthetic records, tests/integration/test_python_api.py with a run)."""
from __future__ import annotations

import json
import os
import subprocess
import sys


def wandb_isolated_env(tmp_path) -> dict[str, str]:
    """wandb keeps staging copies, caches and settings under $HOME by default: these keep them in a test's folder."""
    env = {var: str(tmp_path / var.lower()) for var in ("WANDB_DATA_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR")}
    return {**env, "WANDB_ERROR_REPORTING": "false"}


def expected_points(lines):
    """step -> {name: value} of every number in metrics.jsonl (booleans as 0/1; null values are not logged)."""
    return {r["step"]: {k: float(v) for k, v in r.items() if k != "step" and v is not None} for r in lines}


def wandb_records(out, env: dict | None = None):
    """The records of the offline run under <out>/wandb, as wandb's own reader of .wandb files prints them."""
    [run_dir] = (out / "wandb").glob("offline-run-*")
    r = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", str(run_dir), "--json"],
                       capture_output=True, text=True, timeout=120,
                       env={**os.environ, **(env or {}), "WANDB_MODE": "offline"})
    assert r.returncode == 0, r.stderr
    return [json.loads(line) for line in r.stdout.splitlines() if line.strip()]


def wandb_points(records):
    """step -> {name: value} of the run's history (wandb's own `_step`, `_runtime`, ... left out, and the
    `samples/<split>` tables, which history holds as artifact references: `wandb_tables`)."""
    history = [x["history"] for x in records if x["type"] == "history"]
    points = {h["step"].get("num", 0): {k: float(v) for k, v in h["item"].items()
                                        if not k.startswith(("_", "samples/"))} for h in history}
    return {step: p for step, p in points.items() if p}


def wandb_tables(records) -> dict[int, set[str]]:
    """step -> names of the tables logged at it (the samples of `samples.jsonl`)."""
    out: dict[int, set[str]] = {}
    for x in records:
        if x["type"] == "history":
            h = x["history"]
            # a table's history entry is flattened into fields: samples/train._type, samples/train.nrows, ...
            names = {k.split(".")[0] for k in h["item"] if k.startswith("samples/")}
            if names:
                out.setdefault(h["step"].get("num", 0), set()).update(names)
    return out


def mlflow_run(out, experiment):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{out / 'mlflow.db'}")
    [run] = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    return client, run


def mlflow_points(client, run, lines):
    """step -> {name: value} of every metric name metrics.jsonl has, from MLflow's metric histories."""
    got: dict[int, dict] = {}
    for name in {k for r in lines for k in r if k != "step"}:
        for m in client.get_metric_history(run.info.run_id, name):
            got.setdefault(m.step, {})[name] = m.value
    return got
