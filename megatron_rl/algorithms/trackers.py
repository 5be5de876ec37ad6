"""Experiment trackers beside metrics.jsonl: Weights & Biases (`logging.wandb`) and MLflow (`logging.mlflow`).

Both are optional extras (`pip install -e '.[wandb]'`, `'.[mlflow]'`). Each receives exactly the records written to
metrics.jsonl, under the same names (numbers only: booleans as 0/1; null, i.e. non-finite, values are left out),
with `step` as the x-axis; the kept completions of samples.jsonl as a table per step and split (W&B: a Table
`samples/<split>`; MLflow: a markdown artifact `samples/<split>_step_<N>.md`); the resolved config as the run's
parameters; and metrics.png as an artifact when the run ends. Every start of `megatron-rl train` opens a new tracker run named after output.dir: a resumed training shows
up as a second run, and metrics.jsonl stays the one complete history. That a configured tracker's package is installed
is a pre-flight check (`config/preflight.py: require_trackers`), made before anything starts.
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path

from megatron_rl.config import to_dict
from megatron_rl.config.preflight import require_trackers


def numeric_metrics(rec: dict) -> dict[str, float]:
    """The record's values a tracker plots: numbers (booleans as 0/1), without `step` and without nulls."""
    return {k: float(v) for k, v in rec.items()
            if k != "step" and isinstance(v, (int, float)) and math.isfinite(v)}


def flat_params(tree: dict, prefix: str = "") -> dict[str, str]:
    """The resolved config as `policy.optimizer.lr` -> "1e-05"; strings as they are, everything else as JSON."""
    out: dict[str, str] = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flat_params(v, key + "."))
        else:
            out[key] = v if isinstance(v, str) else json.dumps(v)
    return out


class WandbTracker:
    def __init__(self, c, out_dir: Path, config: dict):
        import wandb

        self._wandb = wandb
        # reinit="create_new": a fresh run even inside a process (a notebook) that already has one open
        self.run = wandb.init(project=c.project, entity=c.entity, name=c.name or out_dir.name, mode=c.mode,
                              dir=str(out_dir), config=config, reinit="create_new")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def log_samples(self, step: int, split: str, rows: list[dict]) -> None:
        cols = list(rows[0])
        table = self._wandb.Table(columns=cols, data=[[r.get(c) for c in cols] for r in rows])
        self.run.log({f"samples/{split}": table}, step=step)

    def finish(self, plot: Path | None, failed: bool) -> None:
        if plot is not None:
            art = self._wandb.Artifact(f"run-{self.run.id}-metrics", type="plot")
            art.add_file(str(plot))
            self.run.log_artifact(art)
        self.run.finish(exit_code=1 if failed else 0)


class MlflowTracker:
    def __init__(self, c, out_dir: Path, config: dict):
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        out_dir = out_dir.resolve()
        self.client = MlflowClient(c.tracking_uri or f"sqlite:///{out_dir / 'mlflow.db'}")
        exp = self.client.get_experiment_by_name(c.experiment)
        if exp is not None:
            exp_id = exp.experiment_id
        else:  # the default local store keeps its artifacts in the run's folder too (the server's choice otherwise)
            where = (out_dir / "mlflow").as_uri() if c.tracking_uri is None else None
            exp_id = self.client.create_experiment(c.experiment, artifact_location=where)
        self.run_id = self.client.create_run(exp_id, run_name=c.run_name or out_dir.name).info.run_id
        params = [Param(k, v) for k, v in flat_params(config).items()]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 parameters per batch
            self.client.log_batch(self.run_id, params=params[i:i + 100])

    def log(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in metrics.items()])

    def log_samples(self, step: int, split: str, rows: list[dict]) -> None:
        from megatron_rl.algorithms.samples import markdown_table

        self.client.log_text(self.run_id, markdown_table(rows), f"samples/{split}_step_{step}.md")

    def finish(self, plot: Path | None, failed: bool) -> None:
        if plot is not None:
            self.client.log_artifact(self.run_id, str(plot))
        self.client.set_terminated(self.run_id, "FAILED" if failed else "FINISHED")


_TRACKERS = {"wandb": WandbTracker, "mlflow": MlflowTracker}


def start_trackers(cfg, out_dir: str | Path) -> list:
    """Open a run in every configured tracker (none configured: an empty list, nothing imported)."""
    require_trackers(cfg.logging)
    config, started = to_dict(cfg), []
    try:
        for section, cls in _TRACKERS.items():
            c = getattr(cfg.logging, section)
            if c is not None:
                started.append(cls(c, Path(out_dir), config))
    except BaseException:
        for t in started:
            t.finish(None, failed=True)
        raise
    return started
