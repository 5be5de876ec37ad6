"""data.source: hf end to end through the real CLI: a verl-format parquet (chat-list `prompt`, `reward_model`
{style, ground_truth}, data_source / ability / extra_info) trains the demo model (configs/demo_cpu.yaml, the embedded
SmolLM2-135M-Instruct) for 2 GRPO steps, with rewards scored by math-verify against the parquet's ground truth; and a
bad row of such a parquet is named by file and row before Ray starts.

The parquet has two records and a step takes one prompt, so the two steps see each record once (epoch 0 of the
prompt stream, whose order the test recomputes). One asks for 1 + 1 in \\boxed{} (SmolLM2-135M samples "2" in about
half of its answers at temperature 1.0: 8 samples all miss with probability ~0.1 %); the other's ground truth is a
number no completion contains, so its step's reward must be exactly 0.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from megatron_rl.config.loader import from_dict
from megatron_rl.data import PromptStream, load_dataset, load_tokenizer
from megatron_rl.paths import default_model_dir
from tests import cli_runner  # `python -m megatron_rl` forked from a preloaded server

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
datasets = pytest.importorskip("datasets")

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "demo_cpu.yaml"
SMOL = default_model_dir()
pytestmark = pytest.mark.skipif(not (SMOL / "config.json").is_file(),
                                reason=f"no embedded SmolLM2 at {SMOL}: run launch/setup_env.sh")

EASY = {"data_source": "toy_math", "ability": "math",
        "prompt": [{"role": "user", "content": "What is 1 + 1? Put your final answer within \\boxed{}."}],
        "reward_model": {"style": "rule", "ground_truth": "2"}, "extra_info": {"split": "train", "index": 0}}
IMPOSSIBLE = {"data_source": "toy_math", "ability": "math",
              "prompt": [{"role": "user", "content": "Name a colour. Put your final answer within \\boxed{}."}],
              "reward_model": {"style": "rule", "ground_truth": "918273645"}, "extra_info": {"split": "train",
                                                                                              "index": 1}}


def cli(tmp_path: Path, *overrides: str, timeout: int = 300) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "megatron_rl", "train", str(CONFIG), f"output.dir={tmp_path / 'run'}",
           "data.source=hf", "reward.kind=auto", "reward.answer_format=auto", *overrides]
    env = {**os.environ, "HF_DATASETS_CACHE": str(tmp_path / "hf_cache")}  # datasets' Arrow copy stays here
    return cli_runner.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO, env=env)


@pytest.mark.slow
def test_verl_parquet_trains_the_demo_model_two_steps(tmp_path, monkeypatch):
    """Opt-in (`-m slow`): reading verl's parquet rows and scoring against their ground truth is
    tests/unit/test_hf_data.py, the same file through the CLI up to the data check
    test_bad_parquet_row_is_named_before_ray_starts below, and the training loop every CLI run; every line it runs is
    run there too (tests/tools/redundant_tests.py and a labelled coverage run, 2026-12-07)."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")
    data = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist([EASY, IMPOSSIBLE]), data)
    r = cli(tmp_path, f"data.path={data}", "grpo.max_steps=2", "grpo.num_prompts_per_step=1",
            "grpo.num_generations_per_prompt=8", "grpo.val_every=0", "generation.max_new_tokens=16",
            "generation.temperature=1.0", "generation.kv_cache_memory_mb=128", "checkpoint.every_steps=0",
            "logging.progress=false", "logging.plots=false", "reward.num_workers=1")
    assert r.returncode == 0, f"train failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
    out = tmp_path / "run"
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps = [x for x in recs if "reward_mean" in x]
    assert [x["step"] for x in steps] == [1, 2]
    for x in steps:
        assert x["num_sequences"] == 8 and x["num_reward_errors"] == 0 and x["num_reward_timeouts"] == 0
        for k in ("loss", "grad_norm", "entropy", "num_tokens", "time_step_s"):
            assert x.get(k) is not None, (k, x)
    # which record each step trained on: the stream's own order (the data and grpo.seed as the run resolved them)
    cfg = from_dict(yaml.safe_load((out / "config.yaml").read_text()))
    assert (cfg.data.source, cfg.data.path) == ("hf", str(data))
    stream = PromptStream(load_dataset(cfg.data, load_tokenizer(SMOL), "train"), 1, seed=cfg.grpo.seed)
    order = [stream.next_batch()[0].answer for _ in range(2)]
    assert sorted(order) == ["2", "918273645"]
    reward = {answer: x["reward_mean"] for answer, x in zip(order, steps)}
    assert reward["918273645"] == 0.0  # scored against the ground truth: nothing the model writes equals it
    assert reward["2"] > 0.0, steps  # and "2" is what it writes for 1 + 1 (about half of its samples)


def test_bad_parquet_row_is_named_before_ray_starts(tmp_path):
    data = tmp_path / "train.parquet"
    bad = json.loads(json.dumps(IMPOSSIBLE))
    bad["reward_model"]["ground_truth"] = None
    pq.write_table(pa.Table.from_pylist([EASY, EASY, bad]), data)
    r = cli(tmp_path, f"data.path={data}", timeout=120)
    assert r.returncode == 2, r.stderr[-3000:]
    assert f"data error: {data}: row 2: field 'reward_model.ground_truth' missing" in r.stderr, r.stderr[-3000:]
    assert "Traceback" not in r.stderr and not (tmp_path / "run" / "logs").exists()
