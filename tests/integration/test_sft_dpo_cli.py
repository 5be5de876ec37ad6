"""`megatron-rl sft`, `megatron-rl dpo` and `megatron-rl rm` end to end through the real CLI (Ray + megatron-core policy ranks, no vLLM
engine) on a tiny model with the SmolLM2 tokenizer and the tiny data fixtures: the records, checkpoints and the
validation loss; a stopped SFT run re-run with more steps reproduces the uninterrupted run's records (across an
epoch boundary); a bad data line is one line naming file, line and field, before any worker starts. `-m slow`: the
same SFT and DPO runs on policy.backend=fsdp2."""
from __future__ import annotations

import json
import shutil
import math
import subprocess
import sys
from pathlib import Path

import pytest

from tests import cli_runner  # `python -m megatron_rl` forked from a preloaded server

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures"
# 12 examples, 4 per step: 3 steps an epoch, so step 4 starts the second epoch's permutation
COMMON = ("policy.precision=fp32", "logging.progress=false", "logging.tensorboard=false", "logging.plots=false",
          "policy.optimizer.lr=1e-3", "policy.scheduler.decay=cosine", "policy.scheduler.warmup_steps=1",
          "policy.scheduler.decay_steps=4", "checkpoint.every_steps=2")


def run(algo: str, out: Path, model: Path, *extra: str, timeout: int = 600) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "megatron_rl", algo, str(REPO / "configs" / f"{algo}_cpu.yaml"),
           f"policy.model={model}", f"output.dir={out}", *COMMON, *extra]
    return cli_runner.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO)


def ok(r: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert r.returncode == 0, f"failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
    return r


def records(out: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}


@pytest.fixture(scope="module")
def model(tiny_model_factory):
    return tiny_model_factory("sft_tiny", seed=5, tied=True)


@pytest.fixture(scope="module")
def sft_full(model, tmp_path_factory):
    out = tmp_path_factory.mktemp("sft") / "full"
    ok(run("sft", out, model, "sft.max_steps=4", "sft.val_every=2"))
    return out


def test_sft_records_checkpoints_and_validation(sft_full):
    recs = records(sft_full)
    assert sorted(recs) == [0, 1, 2, 3, 4]
    assert set(recs[0]) >= {"val_loss"}  # the baseline before any update
    for s in (1, 2, 3, 4):
        r = recs[s]
        assert {"loss", "grad_norm", "lr", "num_trained_tokens", "tokens_per_s", "epoch"} <= set(r), s
        assert r["loss"] > 0 and r["grad_norm"] > 0 and not r["skipped"]
    assert [recs[s]["epoch"] for s in (1, 2, 3, 4)] == [0, 0, 0, 1]
    # the lr each step trained at, from the definitions: a 1-step warm-up is the full lr at once (no step at lr 0),
    # then cosine from 1e-3 to min_lr 0 over decay_steps=4, reached after the last step (so every step learns)
    want = [1e-3 * 0.5 * (1 + math.cos(math.pi * i / 4)) for i in range(4)]
    assert [recs[s]["lr"] for s in (1, 2, 3, 4)] == pytest.approx(want, rel=1e-6) and min(want) > 0
    assert recs[4]["val_loss"] < recs[0]["val_loss"]  # lr 1e-3 on the training file itself: it learns
    assert sorted(p.name for p in (sft_full / "checkpoints").iterdir()) == ["step_2", "step_4"]
    saved = (sft_full / "config.yaml").read_text()
    assert "algorithm: sft" in saved


def test_sft_rerun_resumes_and_matches_uninterrupted_run(sft_full, model, tmp_path):
    # the stopped run: a copy of the uninterrupted one without its step-4 checkpoint (what stopping after step 2
    # leaves, plus the lines of steps 3-4, which resuming drops): one CLI run fewer (~45 s on 2 cores)
    out = tmp_path / "resumed"
    shutil.copytree(sft_full, out, ignore=shutil.ignore_patterns("logs"))
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_2", "step_4"]
    shutil.rmtree(out / "checkpoints" / "step_4")
    r = ok(run("sft", out, model, "sft.max_steps=4", "sft.val_every=2"))
    assert "resumed from" in r.stdout and "(step 2)" in r.stdout
    got, want = records(out), records(sft_full)
    assert sorted(got) == [0, 1, 2, 3, 4]
    for s in (3, 4):
        for k in ("epoch", "num_tokens", "num_trained_tokens", "lr"):
            assert got[s][k] == want[s][k], (s, k)
        for k in ("loss", "grad_norm"):
            assert got[s][k] == pytest.approx(want[s][k], rel=1e-6), (s, k)
    assert got[4]["val_loss"] == pytest.approx(want[4]["val_loss"], rel=1e-6)


def test_dpo_two_steps_at_dp2(model, tmp_path):
    out = tmp_path / "dpo"
    r = ok(run("dpo", out, model, "dpo.max_steps=2", "dpo.val_every=2", "cluster.devices_per_node=2",
               "dpo.sft_loss_weight=0.1"))
    assert not list((out / "logs").glob("generator-*"))  # no engine was started
    recs = records(out)
    keys = {"loss", "grad_norm", "tokens_per_s", "rewards_chosen", "rewards_rejected", "rewards_accuracy",
            "rewards_margin", "logps_chosen", "logps_rejected", "logps_accuracy", "sft_loss", "time_logprobs_s"}
    for s in (1, 2):
        assert keys <= set(recs[s]), keys - set(recs[s])
    # step 1's forward runs on the initial weights, which are the reference: h = 0, the loss is log 2 + the NLL term
    assert recs[1]["rewards_margin"] == 0.0 and recs[1]["loss"] == pytest.approx(0.6931 + 0.1 * recs[1]["sft_loss"],
                                                                                   abs=1e-3)
    assert "val_rewards_accuracy" in recs[2] and "val_loss" in recs[0]
    # before any update the policy is the reference: no implicit reward yet, but its own preference is defined; two
    # steps later the policy has left the (frozen) reference, so the implicit rewards part (a reference that followed
    # the policy would keep the margin at 0)
    assert recs[0]["val_rewards_margin"] == 0.0 and "val_logps_accuracy" in recs[0]
    assert recs[2]["val_rewards_margin"] != 0.0


@pytest.mark.parametrize("algo,line,field", [
    ("sft", {"prompt": "What is 1 + 1?", "completion": ""}, "field 'completion' is empty"),
    ("sft", {"prompt": "What is 1 + 1?", "completion": "2 " * 600}, "field 'completion': the example has"),
    ("dpo", {"prompt": "What is 1 + 1?", "chosen": "2"}, "missing field 'rejected'"),
    ("rm", {"prompt": "What is 1 + 1?", "chosen": "2", "rejected": ""}, "field 'rejected' is empty"),
])
def test_bad_data_line_named_before_any_worker(model, tmp_path, algo, line, field):
    fixture = FIXTURES / f"{'dpo' if algo == 'rm' else algo}_tiny.jsonl"  # a reward model reads DPO's pairs
    good = [json.loads(x) for x in fixture.read_text().splitlines()[:3]]
    data = tmp_path / "bad.jsonl"
    data.write_text("".join(json.dumps(x) + "\n" for x in good + [line]))
    r = run(algo, tmp_path / "out", model, f"data.path={data}", f"{algo}.max_seq_len=512", timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    err = [x for x in r.stderr.splitlines() if x.strip()]
    assert err == [f"data error: {data}:4: {err[0].split(':4: ', 1)[1]}"] and field in err[0], r.stderr
    assert "starting" not in r.stdout and not (tmp_path / "out" / "logs").exists()  # nothing was started


@pytest.mark.parametrize("backend", ["megatron", "fsdp2"])
def test_rm_trains_and_its_export_scores_like_the_trainer(model, tmp_path, backend):
    """`megatron-rl rm` two steps, then `convert megatron-to-hf`: transformers' AutoModelForSequenceClassification
    loads the export, and its scores of the held-out pairs give the trainer's last validation (TRL's loss in plain
    torch, the pairwise accuracy and margin), on either backend. The tiny model pads with <|im_end|>, which ends
    every response: both score a sequence at the token before it."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForSequenceClassification

    from megatron_rl.data.supervised import read_pairs
    from megatron_rl.data.tokenizer import tokenizer_for

    out = tmp_path / "rm"
    ok(run("rm", out, model, "rm.max_steps=2", "rm.val_every=2", "rm.center_rewards_coefficient=0.01",
           f"policy.backend={backend}"))
    recs = records(out)
    for s in (1, 2):
        assert {"loss", "grad_norm", "accuracy", "margin", "chosen_rewards", "rejected_rewards"} <= set(recs[s]), s
    assert {"val_loss", "val_accuracy", "val_margin"} <= set(recs[0]) and recs[2]["val_loss"] != recs[0]["val_loss"]
    hf = out / "hf"
    cli_runner.run([sys.executable, "-m", "megatron_rl", "convert", "megatron-to-hf", "--ckpt",
                    str(out / "checkpoints"), "--out", str(hf)], check=True, capture_output=True, timeout=300, cwd=REPO)
    config = json.loads((hf / "config.json").read_text())
    assert config["architectures"] == ["LlamaForSequenceClassification"] and config["num_labels"] == 1
    assert "AutoModelForSequenceClassification" in (hf / "README.md").read_text()
    rm = AutoModelForSequenceClassification.from_pretrained(hf, dtype=torch.float32).eval()
    pairs = read_pairs(FIXTURES / "dpo_tiny.jsonl", tokenizer_for(model), 10**6)
    with torch.no_grad():
        score = lambda ids: rm(input_ids=torch.tensor([ids])).logits[0, 0]  # noqa: E731
        chosen = torch.stack([score(p.prompt + p.chosen) for p in pairs])
        rejected = torch.stack([score(p.prompt + p.rejected) for p in pairs])
    loss = -F.logsigmoid(chosen - rejected).mean() + 0.01 * ((chosen + rejected) ** 2).mean()
    assert recs[2]["val_loss"] == pytest.approx(float(loss), rel=1e-4)
    assert recs[2]["val_accuracy"] == pytest.approx(float((chosen > rejected).float().mean()))
    assert recs[2]["val_margin"] == pytest.approx(float((chosen - rejected).mean()), rel=1e-3, abs=1e-4)


def _fsdp2_and_megatron(algo, sft_full, model, tmp_path):
    """The same CLI run on policy.backend=fsdp2 and on megatron (SFT: the uninterrupted run above; DPO at dp2)."""
    steps = ("sft.max_steps=4", "sft.val_every=2") if algo == "sft" else \
        ("dpo.max_steps=2", "dpo.val_every=2", "cluster.devices_per_node=2", "dpo.sft_loss_weight=0.1")
    ok(run(algo, tmp_path / "fsdp2", model, *steps, "policy.backend=fsdp2"))
    if algo == "dpo":
        ok(run(algo, tmp_path / "megatron", model, *steps))
    return records(tmp_path / "fsdp2"), records(sft_full if algo == "sft" else tmp_path / "megatron")


@pytest.mark.slow
@pytest.mark.parametrize("algo", ["sft", "dpo"])
def test_fsdp2_backend_runs_sft_and_dpo(sft_full, model, tmp_path, algo):
    got, want = _fsdp2_and_megatron(algo, sft_full, model, tmp_path)
    assert sorted(got) == sorted(want)
    assert sorted(p.name for p in (tmp_path / "fsdp2" / "checkpoints").iterdir()) == \
        (["step_2", "step_4"] if algo == "sft" else ["step_2"])
    for s, w in want.items():
        for k in ("num_trained_tokens", "epoch", "lr"):
            assert got[s].get(k) == w.get(k), (s, k)
    # on the initial weights (the validation baseline, step 1's forward) both backends compute the same losses
    assert got[0]["val_loss"] == pytest.approx(want[0]["val_loss"], rel=1e-5)
    for k in ("loss", "logps_chosen", "logps_rejected", "sft_loss"):
        if k in want[1]:
            assert got[1][k] == pytest.approx(want[1][k], rel=1e-5), k
    assert got[max(got)]["val_loss"] < got[0]["val_loss"]  # and the fsdp2 run learns


@pytest.mark.slow
def test_fsdp2_and_megatron_sft_gradients_agree(sft_full, model, tmp_path):
    """The tiny model's config names a pad token (<|im_end|>, in every chat prompt) whose embedding row transformers
    initialised to zero: HF's padding_idx would keep that row's gradient at zero, megatron trains it (a gradient norm
    of 114.7 against 13.26). The FSDP2 worker drops padding_idx, so both train the same function."""
    got, want = _fsdp2_and_megatron("sft", sft_full, model, tmp_path)
    for s in sorted(want):
        if "grad_norm" in want[s]:
            assert got[s]["grad_norm"] == pytest.approx(want[s]["grad_norm"], rel=1e-4), s
            assert got[s]["loss"] == pytest.approx(want[s]["loss"], rel=1e-4), s
