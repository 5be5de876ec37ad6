"""One layout truth: the planner proposes only layouts the loader and build() accept (the same rule functions), its
async/disaggregated step model, and `--write-config` (the chosen layout as a config the loader accepts)."""
import json
from pathlib import Path

import pytest
import yaml

from megatron_rl.planner import search as P
from megatron_rl.config import ConfigError, load_config
from megatron_rl.config.loader import validate
from megatron_rl.config.schema import GRPOConfig, LossConfig
from megatron_rl.distributed.parallel_dims import device_layout, layout_of
from megatron_rl.models.provider import model_spec
from megatron_rl.planner.recipe import layout_overrides, typed_config, workload_from_config
from megatron_rl.planner.cost_model import _straddles
from megatron_rl.planner.presets import GPUS

REPO = Path(__file__).resolve().parents[2]
H100 = GPUS["h100"]


def _layout(**kw):
    base = dict(tp=1, pp=1, dp=None, colocated=True, gen_tp=1, gen_dp=None)
    return device_layout(**dict(base, **kw))


def test_device_layout_by_hand():
    # colocated: the policy takes the 8 devices (dp = 8 / (2*2)), engines share them (8 / gen-TP 2 = 4 of them)
    lay = _layout(devices=8, tp=2, pp=2, gen_tp=2)
    assert (lay.policy.dp, lay.policy.world_size, lay.gen_dp, lay.bundles) == (2, 8, 4, 8)
    assert lay.engines == [[0, 1], [2, 3], [4, 5], [6, 7]]
    # disaggregated: one TP-2 engine takes 2 of the 8 devices, the policy the other 6 (dp = 6 / 2)
    lay = _layout(devices=8, tp=2, colocated=False, gen_tp=2, max_staleness=1)
    assert (lay.policy.dp, lay.policy.world_size, lay.engines, lay.bundles) == (3, 6, [[6, 7]], 8)
    # 6 devices left do not split into TP-4 replicas without an explicit dp; with dp=1 four ranks + 2 engines fit
    with pytest.raises(ValueError, match=r"policy.tp\*pp = 4 does not divide the 6 of 8 devices.*set policy.dp"):
        _layout(devices=8, tp=4, colocated=False, gen_dp=2)
    assert _layout(devices=8, tp=4, dp=1, colocated=False, gen_dp=2).bundles == 6
    with pytest.raises(ValueError, match="leave no device for the policy"):
        _layout(devices=1, colocated=False)
    with pytest.raises(ValueError, match=r"policy.tp\*pp\*dp = 8 ranks do not fit cluster"):
        _layout(devices=8, dp=8, colocated=False)
    with pytest.raises(ValueError, match="generation.dp\\*tp = 3\\*2 engine devices do not fit the 4 devices"):
        _layout(devices=4, gen_tp=2, gen_dp=3)
    with pytest.raises(ValueError, match="grpo.max_staleness=2 needs cluster.colocated=false"):
        _layout(devices=4, max_staleness=2)


def test_loader_uses_the_same_layout_rules(tmp_path):
    base = REPO / "configs" / "base.yaml"
    with pytest.raises(ConfigError, match="leave no device for the policy"):
        load_config(base, ["cluster.devices_per_node=1", "cluster.colocated=false"], check_model=False)
    cfg = load_config(base, ["cluster.devices_per_node=4", "cluster.colocated=false", "generation.dp=2"],
                      check_model=False)
    assert (layout_of(cfg).policy.world_size, layout_of(cfg).bundles) == (2, 4)  # 4 devices - 2 engines
    # megatron-core splits the FFN over TP: an odd width is refused before anything starts (a new loader rule)
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"num_attention_heads": 4, "num_key_value_heads": 2,
                                                   "num_hidden_layers": 2, "intermediate_size": 99}))
    with pytest.raises(ConfigError, match="policy.tp=2 does not divide intermediate_size=99"):
        load_config(base, [f"policy.model={model}", "policy.tp=2"])


def test_engine_kv_rule(tmp_path):
    model = tmp_path / "m3"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"num_attention_heads": 12, "num_key_value_heads": 3,
                                                   "num_hidden_layers": 2, "intermediate_size": 96}))
    base = REPO / "configs" / "base.yaml"
    # 3 KV heads: vLLM splits them at TP 3 (not offered), replicates them at TP 6, refuses TP 4 (neither way)
    with pytest.raises(ConfigError, match="generation.tp=4 neither divides nor is a multiple of num_key_value_h"):
        load_config(base, [f"policy.model={model}", "cluster.devices_per_node=4", "generation.tp=4"])
    assert load_config(base, [f"policy.model={model}", "cluster.devices_per_node=6", "generation.tp=6"])


def _tiny_spec(**over):
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 6, "hidden_size": 512,
           "intermediate_size": 1376, "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 32000,
           "tie_word_embeddings": False, "max_position_embeddings": 4096, "hidden_act": "silu", "rms_norm_eps": 1e-6}
    return model_spec(dict(cfg, **over))


def test_candidates_follow_the_runtime_rules():
    spec = _tiny_spec()  # 8 heads, 2 KV heads, 6 layers, ffn 1376 = 2^5 * 43
    assert P._tp_options(spec, H100, vllm=False) == [1, 2]  # megatron: KV heads 2 % 4 != 0
    assert P._tp_options(spec, H100, vllm=True) == [1, 2, 4, 8]  # vLLM replicates the 2 KV heads past TP 2
    assert P._pp_options(spec) == [1, 2, 3, 6]
    odd = _tiny_spec(intermediate_size=1375)  # no TP > 1 can split this FFN
    assert P._tp_options(odd, H100, vllm=False) == [1]
    wl = P.Workload(samples=256, seq_len=2048)
    for gpus, colocated in ((8, True), (8, False), (12, False)):
        plans = P.plan(odd, gpus, H100, wl, colocated=colocated, top=100)
        assert plans and all(p.tp == 1 for p in plans)


@pytest.mark.parametrize("name,gpus", [("qwen2.5-1.5b", 8), ("llama3.1-8b", 16), ("qwen2.5-32b", 64),
                                       ("llama3.1-70b", 32)])
@pytest.mark.parametrize("mode", ["colocated", "disaggregated", "async"])
def test_every_plan_is_a_config_the_loader_accepts(name, gpus, mode):
    _, spec, _ = P.resolve_model(name)
    colocated, k = mode == "colocated", int(mode == "async")
    plans = P.plan(spec, gpus, H100, P.Workload(seq_len=4096), colocated=colocated, max_staleness=k, top=100)
    assert plans
    for p in plans:
        # counts by hand: the trainer's ranks, vLLM's instances, and every GPU of the job used exactly once
        assert p.tp * p.pp * p.cp * p.dp == p.train_gpus and p.gen_tp * p.gen_instances == p.gen_gpus
        assert (p.train_gpus if colocated else p.train_gpus + p.gen_gpus) == gpus == p.total_gpus
        cfg = typed_config(REPO / "configs" / "base.yaml", layout_overrides(p, H100))
        validate(cfg, check_model=False)  # the loader's layout checks (ConfigError otherwise)
        lay = layout_of(cfg)
        assert (lay.policy.world_size, lay.gen_devices, lay.bundles) == (p.train_gpus, p.gen_gpus, gpus)
        assert lay.bundles <= cfg.cluster.num_nodes * cfg.cluster.devices_per_node
        assert cfg.cluster.devices_per_node <= H100.gpus_per_host and cfg.grpo.max_staleness == k
        assert 0 < cfg.generation.gpu_memory_utilization < 1


def test_async_step_is_the_slower_side_plus_refit():
    _, spec, _ = P.resolve_model("llama3.1-8b")
    wl = P.Workload(samples=2048, seq_len=4096, avg_len=1129, prompt_len=200, optimizer_steps=4, logprob_passes=2)
    kw = dict(tp=1, pp=2, dp=4, gen_tp=1, gen_gpus=8, recompute=True, colocated=False)
    sync, off = P.evaluate(spec, H100, wl, **kw), P.evaluate(spec, H100, wl, max_staleness=1, **kw)
    assert sync.times_s == off.times_s and sync.times_s["switch"] == 0  # same phases, nothing moves to the host
    t = off.times_s
    assert sync.step_s == pytest.approx(t["generate"] + t["logprobs"] + t["train"] + t["refit"])
    assert off.step_s == pytest.approx(max(t["generate"], t["logprobs"] + t["train"]) + t["refit"])
    assert off.step_s < sync.step_s and off.tokens_per_s_per_gpu == pytest.approx(2048 * 1129 / off.step_s / 16)
    refused = P.evaluate(spec, H100, wl, **dict(kw, colocated=True, gen_gpus=8), max_staleness=1)
    assert isinstance(refused, str) and "needs cluster.colocated=false" in refused
    with pytest.raises(P.Infeasible, match="needs cluster.colocated=false"):
        P.plan(spec, 16, H100, wl, colocated=True, max_staleness=1)


def test_engines_stay_inside_an_nvlink_domain():
    assert not _straddles(6, 10, 2, 8)  # engines on GPUs 6-7, 8-9, ...: aligned
    assert _straddles(5, 4, 2, 8)  # 5-6, 7-8: the second crosses GPU 8
    assert not _straddles(3, 4, 2, 8)  # 3-4, 5-6: inside the first 8
    _, spec, _ = P.resolve_model("llama3.1-8b")
    for p in P.plan(spec, 24, H100, P.Workload(seq_len=4096), colocated=False, top=200):
        first = p.train_gpus
        for i in range(p.gen_instances):
            lo, hi = first + i * p.gen_tp, first + (i + 1) * p.gen_tp - 1
            assert lo // 8 == hi // 8, (p.train_gpus, p.gen_tp)


def test_logprob_passes_follow_the_loop():
    assert GRPOConfig().logprob_passes() == 0 == P.Workload().logprob_passes  # one step reuses its forward
    assert GRPOConfig(optimizer_steps_per_rollout=4).logprob_passes() == 1
    assert GRPOConfig(max_staleness=1).logprob_passes() == 1  # async recomputes "old" logprobs
    assert GRPOConfig(max_staleness=1, loss=LossConfig(kl_coef=1e-3)).logprob_passes() == 2


def test_workload_is_read_from_the_recipe():
    # configs/deepscaler_1.5b_8k.yaml: 128 prompts x 8, max_model_len 8192, 16384-token micro-batches, no KL
    wl = workload_from_config(typed_config(REPO / "configs" / "deepscaler_1.5b_8k.yaml", []), prompt_len=300,
                              avg_len=None)
    assert (wl.samples, wl.seq_len, wl.mb_tokens, wl.logprob_passes, wl.mean_len) == (1024, 8192, 16384, 0, 4096)
    # the 16K stage adds a KL term (one reference pass) and doubles the context
    wl = workload_from_config(typed_config(REPO / "configs" / "deepscaler_1.5b_16k.yaml", []), prompt_len=300,
                              avg_len=6000)
    assert (wl.seq_len, wl.logprob_passes, wl.mean_len) == (16384, 1, 6000)


def _hf_folder(tmp_path, name="m", **over):
    d = tmp_path / name
    d.mkdir()
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 8, "hidden_size": 1024,
           "intermediate_size": 2816, "num_attention_heads": 16, "num_key_value_heads": 4, "vocab_size": 32000,
           "tie_word_embeddings": False, "max_position_embeddings": 4096, "hidden_act": "silu", "rms_norm_eps": 1e-6}
    (d / "config.json").write_text(json.dumps(dict(cfg, **over)))
    return d


def test_write_config_is_the_best_plan_and_loads(tmp_path, capsys):
    model = _hf_folder(tmp_path)
    base = tmp_path / "recipe.yaml"
    base.write_text("grpo: {num_generations_per_prompt: 16, optimizer_steps_per_rollout: 2}\n"
                    "data: {max_prompt_tokens: 1024}\npolicy: {max_tokens_per_microbatch: 8192}\n")
    args = ["--model", str(model), "--gpus", "16", "--gen-gpus", "4", "--max-staleness", "2", "--base", str(base),
            "--samples", "512", "--seq-len", "4096", "--prompt-len", "300"]
    assert P.main(args + ["--json"]) == 0
    best = json.loads(capsys.readouterr().out)[0]
    out = tmp_path / "sub" / "planned.yaml"
    assert P.main(args + ["--write-config", str(out)]) == 0
    assert "wrote" in capsys.readouterr().out
    assert yaml.safe_load(out.read_text())["defaults"] == "../recipe.yaml"
    cfg = load_config(out)  # model check included: config.json is here
    assert (cfg.policy.tp, cfg.policy.pp, cfg.policy.dp, cfg.policy.activation_recompute) == (
        best["tp"], best["pp"], best["dp"], best["recompute"])
    assert (cfg.generation.tp, cfg.generation.dp * cfg.generation.tp) == (best["gen_tp"], 4)
    assert (cfg.cluster.num_nodes, cfg.cluster.devices_per_node, cfg.cluster.colocated) == (2, 8, False)
    assert cfg.grpo.max_staleness == 2 and cfg.policy.model == str(model)
    # workload flags as keys: 512 samples / 16 generations; 4096 - 1024 response tokens; recipe values kept
    assert (cfg.grpo.num_prompts_per_step, cfg.generation.max_new_tokens, cfg.generation.max_model_len) == (
        32, 3072, 4096)
    assert (cfg.grpo.optimizer_steps_per_rollout, cfg.policy.max_tokens_per_microbatch) == (2, 8192)


def test_write_config_refusals_leave_no_file(tmp_path, capsys):
    model = _hf_folder(tmp_path)
    other = _hf_folder(tmp_path, "other", num_hidden_layers=4)
    out = tmp_path / "planned.yaml"
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"policy: {{model: {other}}}\n")
    cases = [
        (["--model", str(model), "--gpus", "8", "--samples", "100"], "not a multiple of grpo.num_generations"),
        (["--model", "llama3.1-8b", "--gpus", "8", "--seq-len", "4096"], "does not say where the weights are"),
        (["--model", "llama3.1-8b", "--gpus", "8", "--seq-len", "4096", "--base", str(recipe)],
         "the plan is for llama3.1-8b, but the config trains"),
        (["--model", "deepseek-v3", "--gpus", "256", "--seq-len", "1536", "--base", str(recipe)], "planning only"),
        (["--model", str(model), "--gpus", "8", "--colocated", "--max-staleness", "1"], "needs cluster.colocated"),
        (["--model", str(model), "--gpus", "8", "--colocated", "--gen-gpus", "2"], "needs --disaggregated"),
    ]
    for argv, why in cases:
        assert P.main(argv + ["--write-config", str(out)]) == 2, argv
        assert why in capsys.readouterr().err, argv
    # a recipe the loader refuses once validated: nothing written, no temporary file left
    bad = tmp_path / "bad.yaml"
    bad.write_text("grpo: {loss: {ratio_clip_c: 0.5}}\n")
    assert P.main(["--model", str(model), "--gpus", "8", "--base", str(bad), "--seq-len", "2048",
                   "--write-config", str(out)]) == 2
    err = capsys.readouterr().err
    assert "does not load: " in err and "grpo.loss.ratio_clip_c" in err
    assert list(tmp_path.glob("*planned*")) == []


def test_help_names_the_modes():
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), pytest.raises(SystemExit):
        P.main(["--help"])
    text = buf.getvalue()
    for needle in ("--max-staleness", "--gen-gpus", "--write-config", "max(generate, logprobs + train) + refit",
                   "grpo.num_prompts_per_step = N / grpo.num_generations_per_prompt", "Memory per GPU"):
        assert needle in text, needle


def test_bench_v04_sync_and_async_within_a_quarter():
    """bench/plan_vs_nemo_rl.py: NeMo-RL v0.4 Llama-3.1-8B on 16 H100s, on-policy and one-step-off, at its layouts."""
    import importlib.util

    path = REPO / "bench" / "plan_vs_nemo_rl.py"
    spec = importlib.util.spec_from_file_location("plan_vs_nemo_rl", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    table = bench.rows()
    at = [r for r in table if r["which"] == "NeMo-RL layout"]
    sync, off = (at[i] for i in bench.ASYNC_PAIR)
    assert (sync["pub_step_s"], off["pub_step_s"], off["mode"]) == (97.7, 74.6, "1-step off")
    for r in (sync, off):
        assert abs(r["step_s"] / r["pub_step_s"] - 1) < 0.25, r
    assert "on 8+8" in off["layout"]  # NeMo-RL's split: one node trains, one generates
    assert bench.async_speedup(table)["estimated"] > 1.0  # the overlap pays at this layout, as published
