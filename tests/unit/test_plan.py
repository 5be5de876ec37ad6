"""The planner: parameter counts against megatron-core's own models, the memory/time model's shape, speed, refusals."""
import json
import time

import pytest

from megatron_rl.planner import search as P
from megatron_rl.models.provider import model_spec
from megatron_rl.planner.presets import GPUS, MODELS
from megatron_rl.distributed.launch import run_distributed
from tests import cli_runner  # `python -m megatron_rl` forked from a preloaded server


def _tiny(arch="llama", *, tied=False, vocab=1000, hidden=64, heads=4, kv=2, head_dim=None, ffn=96, layers=4):
    cfg = {"architectures": ["LlamaForCausalLM" if arch == "llama" else "Qwen2ForCausalLM"],
           "model_type": arch if arch == "llama" else "qwen2", "num_hidden_layers": layers, "hidden_size": hidden,
           "intermediate_size": ffn, "num_attention_heads": heads, "num_key_value_heads": kv, "vocab_size": vocab,
           "tie_word_embeddings": tied, "max_position_embeddings": 128, "hidden_act": "silu", "rms_norm_eps": 1e-6}
    if head_dim:
        cfg["head_dim"] = head_dim
    return cfg


TINY = {
    "llama-gqa-untied": _tiny(),
    "llama-tied": _tiny(tied=True, vocab=1234),
    "qwen2-bias-tied": _tiny("qwen2", tied=True, vocab=777),
    "qwen2-bias-untied": _tiny("qwen2", kv=4, layers=2),
    "wide-q": _tiny(head_dim=32, vocab=300),  # q width 4 x 32 = 128 > hidden 64, as in Qwen3
}


TINY_MOE = {  # every layer MoE: 8 experts of width 48, top 2 (the trainer trains MoE at TP 1)
    "qwen3-moe": {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_hidden_layers": 2,
                  "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 48, "num_attention_heads": 4,
                  "num_key_value_heads": 2, "head_dim": 32, "num_experts": 8, "num_experts_per_tok": 2,
                  "vocab_size": 300, "tie_word_embeddings": False, "norm_topk_prob": True,
                  "max_position_embeddings": 128, "hidden_act": "silu", "rms_norm_eps": 1e-6},
}


def _count_body(rank, world, configs, moe_configs=None):
    """Each layout: initialise parallel_state, build every tiny GPTModel, count this rank's parameters."""
    import torch  # noqa: F401
    from megatron.core import parallel_state as ps

    from megatron_rl.models.provider import build_model
    from megatron_rl.platform import install_megatron_cpu_compat

    install_megatron_cpu_compat()
    out = {}
    for tp, pp in ((1, 1), (2, 1), (1, 2)):
        if tp * pp > world:
            continue
        ps.destroy_model_parallel()
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
        for name, cfg in configs.items():
            model = build_model(cfg, init_weights=False, layer_spec="local")
            out[(name, tp, pp)] = (ps.get_pipeline_model_parallel_rank(), sum(p.numel() for p in model.parameters()))
    for ep in (1, 2):  # expert parallelism: each rank builds its 8 / ep experts
        ps.destroy_model_parallel()
        ps.initialize_model_parallel(expert_model_parallel_size=ep)
        for name, cfg in (moe_configs or {}).items():
            model = build_model(cfg, init_weights=False, layer_spec="local")
            out[(name, "ep", ep)] = sum(p.numel() for p in model.parameters())
    ps.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def megatron_counts():
    """Per-rank parameter counts of real megatron-core GPTModels (TP=1, TP=2, PP=2), one 2-process gloo launch."""
    return run_distributed(_count_body, world_size=2, args=(TINY, TINY_MOE), timeout=300)


@pytest.mark.parametrize("name", sorted(TINY))
def test_parameter_counts_match_megatron_core_at_tp1(megatron_counts, name):
    spec = model_spec(TINY[name])
    _, got = megatron_counts[0][(name, 1, 1)]
    assert P.stage_params(spec, 1, 1) == [got]
    assert spec.num_parameters(padded=True) == got  # and ModelSpec agrees (padded vocab rows included)


@pytest.mark.parametrize("name", sorted(TINY))
def test_parameter_counts_match_megatron_core_per_rank_at_tp2_and_pp2(megatron_counts, name):
    spec = model_spec(TINY[name])
    for rank in range(2):
        _, got = megatron_counts[rank][(name, 2, 1)]
        assert P.stage_params(spec, 2, 1) == [got], (name, "tp2", rank)
        stage, got = megatron_counts[rank][(name, 1, 2)]
        assert P.stage_params(spec, 1, 2)[stage] == got, (name, "pp2", stage)  # tied + PP: the last stage's copy


def test_moe_parameter_counts_match_megatron_core_per_rank_at_ep1_and_ep2(megatron_counts):
    spec = model_spec(TINY_MOE["qwen3-moe"])
    for rank in range(2):
        assert megatron_counts[rank][("qwen3-moe", "ep", 1)] == P.stage_params(spec, 1, 1)[0]
        assert megatron_counts[rank][("qwen3-moe", "ep", 2)] == P.stage_params(spec, 1, 1, ep=2)[0], rank
    expert = 3 * 64 * 48
    assert P.stage_params(spec, 1, 1)[0] - P.stage_params(spec, 1, 1, ep=2)[0] == 2 * 4 * expert  # 2 layers x 4


def test_presets_have_the_published_parameter_counts():
    published = {"qwen2.5-1.5b": 1_543_714_304, "r1-distill-qwen-1.5b": 1_777_088_000,
                 "llama3.1-8b": 8_030_261_248, "qwen2.5-32b": 32_763_876_352, "llama3.1-70b": 70_553_706_496}
    for name, n in published.items():
        spec = model_spec(MODELS[name])
        assert spec.num_parameters() == n, name
        assert sum(P.stage_params(spec, 1, 1)) == spec.num_parameters(padded=True), name
        # sharding only moves parameters around: all TP ranks of all stages hold the model (plus replicated norms)
        tp, pp = 2, 2
        total = sum(P.stage_params(spec, tp, pp)) * tp
        replicated = (tp - 1) * (spec.num_layers * 2 * spec.hidden_size + spec.hidden_size)
        extra_tied = spec.padded_vocab_for(tp) * spec.hidden_size if spec.tied_embeddings else 0
        assert total == spec.with_tp(tp).num_parameters(padded=True) + replicated + extra_tied, name


def test_memory_model_responds_to_each_knob():
    spec = model_spec(MODELS["llama3.1-8b"])
    wl = P.Workload(seq_len=4096)
    base, _ = P.train_memory(spec, 1, 1, 1, False, wl)
    sharded, _ = P.train_memory(spec, 1, 1, 8, False, wl)
    assert sharded["optimizer"] == pytest.approx(base["optimizer"] / 8)  # distributed optimizer over DP
    assert base["weights"] * 2 == pytest.approx(base["grads"])  # bf16 weights, fp32 grads
    recomputed, _ = P.train_memory(spec, 1, 1, 1, True, wl)
    assert recomputed["activations"] < base["activations"] / 5
    tp2, _ = P.train_memory(spec, 2, 1, 1, False, wl)
    assert tp2["weights"] < base["weights"] * 0.51 and tp2["activations"] < base["activations"]
    # logits are bf16 values + gradient, never an fp32 [tokens, V] softmax buffer
    assert base["logits"] == pytest.approx(4 * 4096 * spec.padded_vocab_for(1) / 2**30)
    longer, _ = P.train_memory(spec, 1, 1, 1, False, P.Workload(seq_len=8192))
    assert longer["activations"] == pytest.approx(2 * base["activations"])


def test_tp_candidates_follow_megatron_and_vllm_rules():
    spec = model_spec(MODELS["qwen2.5-1.5b"])  # 12 heads, 2 KV heads
    assert P._tp_options(spec, GPUS["h100"], vllm=False) == [1, 2]  # megatron: num_query_groups % tp == 0
    assert P._tp_options(spec, GPUS["h100"], vllm=True) == [1, 2, 4]  # vLLM replicates KV heads; 12 % 8 != 0


@pytest.mark.parametrize("name", ["qwen2.5-1.5b", "llama3.1-8b", "qwen2.5-32b", "llama3.1-70b"])
def test_every_size_plans_within_a_second(name):
    _, spec, _ = P.resolve_model(name)
    for gpus in (8, 64, 512, 4096):
        for colocated in (True, False):
            # CPU time of this process, not wall time: other CI processes on the 2 cores do not count against it.
            # The search takes <= 0.12 s here (2-core EPYC, 2026-12-01); the bound guards against a blow-up.
            t0 = time.process_time()
            try:
                plans = P.plan(spec, gpus, GPUS["h100"], P.Workload(), colocated=colocated)
            except P.Infeasible as e:
                assert gpus == 8 and name in ("qwen2.5-32b", "llama3.1-70b"), (name, gpus, str(e))
                assert "does not fit" in str(e) and "fits from" in str(e)
            else:
                assert plans and all(p.step_s > 0 for p in plans)
                assert [p.step_s for p in plans] == sorted(p.step_s for p in plans)
                assert all(p.train_peak_gib <= P.usable_bytes(GPUS["h100"]) / 2**30 for p in plans)
            assert time.process_time() - t0 < 1.0, (name, gpus, colocated)


def test_impossible_requests_are_refused_with_the_reason(capsys):
    assert P.main(["--model", "llama3.1-70b", "--gpus", "8", "--gpu", "a100", "--seq-len", "32768"]) == 2
    err = capsys.readouterr().err
    assert "refused" in err and "does not fit on 8 x A100" in err and "GiB per GPU" in err
    assert P.main(["--model", "no-such-model", "--gpus", "8"]) == 2
    assert "llama3.1-8b" in capsys.readouterr().err  # the presets are listed
    assert P.main(["--model", "qwen2.5-1.5b", "--gpus", "1"]) == 2  # disaggregated needs 2 GPUs
    assert P.main(["--model", "qwen2.5-1.5b", "--gpus", "8", "--seq-len", "100", "--prompt-len", "200"]) == 2


def test_cli_table_and_json(capsys, tmp_path):
    assert P.main(["--model", "llama3.1-8b", "--gpus", "64", "--colocated", "--seq-len", "4096"]) == 0
    out = capsys.readouterr().out
    assert "binding constraint" in out and "train TP/PP/DP" in out and "step time" in out
    (tmp_path / "config.json").write_text(json.dumps(MODELS["qwen2.5-1.5b"]))
    assert P.main(["--model", str(tmp_path), "--gpus", "8", "--gpu", "h200", "--json"]) == 0
    plans = json.loads(capsys.readouterr().out)
    assert plans and {"tp", "pp", "dp", "gen_tp", "step_s", "memory_gib", "bound"} <= set(plans[0])


def test_step_time_is_within_a_third_of_nemo_rl_published_runs():
    """bench/plan_vs_nemo_rl.py prints the full comparison; here only a loose guard on the model's calibration."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "bench" / "plan_vs_nemo_rl.py"
    spec = importlib.util.spec_from_file_location("plan_vs_nemo_rl", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rows = [r for r in bench.rows() if r["which"] == "NeMo-RL layout"]
    assert len(rows) == len(bench.NEMO_RL)  # every published run fits at its own layout
    for r in rows:
        if r["model"] == "deepseek-v3":  # plan-only, under half the published step: tests/unit/test_plan_moe.py
            continue
        err = (r["step_s"] - r["pub_step_s"]) / r["pub_step_s"]
        print(f"{r['model']}: estimated {r['step_s']:.1f} s vs published {r['pub_step_s']} s ({err:+.0%})")
        assert abs(err) < 1 / 3, r


def test_cli_delegates_plan_including_help():
    import subprocess
    import sys

    r = cli_runner.run([sys.executable, "-m", "megatron_rl", "plan", "--help"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and "Memory per GPU" in r.stdout and "--colocated" in r.stdout
    r = cli_runner.run([sys.executable, "-m", "megatron_rl", "plan", "--model", "qwen2.5-1.5b", "--gpus", "8",
                        "--colocated"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "binding constraint" in r.stdout, r.stderr


def test_decode_mode_follows_the_config_default_and_enforce_eager(capsys):
    from megatron_rl.config.schema import GenerationConfig

    # one default for both: vLLM's CUDA graphs on GPU, which the decode constants are calibrated for
    assert P.Workload().enforce_eager is GenerationConfig.enforce_eager is False
    spec = model_spec(MODELS["qwen2.5-1.5b"])
    graphs = P.evaluate(spec, GPUS["h100"], P.Workload(), tp=1, pp=1, dp=8, gen_tp=1, gen_gpus=8, recompute=False,
                        colocated=True)
    eager = P.evaluate(spec, GPUS["h100"], P.Workload(enforce_eager=True), tp=1, pp=1, dp=8, gen_tp=1, gen_gpus=8,
                       recompute=False, colocated=True)
    assert not graphs.eager_decode and eager.eager_decode
    # a small model's decode step is shorter than eager launching its layers: eager decode is slower, nothing else
    assert eager.times_s["generate"] > 1.3 * graphs.times_s["generate"]
    assert eager.times_s["train"] == graphs.times_s["train"]
    assert "eager kernel launches" in eager.bound and "eager" not in graphs.bound

    assert P.main(["--model", "qwen2.5-1.5b", "--gpus", "8", "--colocated"]) == 0
    assert "decode: CUDA graphs" in capsys.readouterr().out
    assert P.main(["--model", "qwen2.5-1.5b", "--gpus", "8", "--colocated", "--enforce-eager", "--json"]) == 0
    assert all(p["eager_decode"] for p in json.loads(capsys.readouterr().out))
    assert P.main(["--model", "qwen2.5-1.5b", "--gpus", "8", "--colocated", "--enforce-eager"]) == 0
    assert "decode: eager (generation.enforce_eager" in capsys.readouterr().out


# vLLM's custom all-reduce on H100, measured (github.com/sgl-project/sglang/pull/2904, "vllm" table, no CUDA graph):
# message bytes -> microseconds at TP 2 / 4 / 8
_VLLM_AR_H100_US = {512: (9.5, 9.1, 10.1), 4096: (8.8, 8.5, 9.3), 32768: (8.7, 9.2, 11.8),
                    262144: (12.9, 20.6, 24.1), 524288: (17.7, 26.9, 30.4), 1048576: (26.6, 40.2, 45.0)}


def test_decode_all_reduce_follows_vllms_measured_kernel_and_nccls_tree_latency():
    from megatron_rl.planner.cost_model import tp_allreduce_s

    h100 = GPUS["h100"]
    for size, measured in _VLLM_AR_H100_US.items():
        for tp, us in zip((2, 4, 8), measured):
            assert tp_allreduce_s(size, tp, h100) * 1e6 == pytest.approx(us, rel=0.25), (size, tp)
    assert tp_allreduce_s(1e6, 1, h100) == 0.0
    # TP 32 spans 4 nodes: NCCL's tree/LL latency from its tuning model, 6.8 + 2 x (7 x 0.6 + 2 x 5.0) = 35.2 us, plus
    # a 1 KB ring over the network (50 GB/s x 0.8)
    ring_us = 2 * 31 / 32 * 1024 / (50e9 * 0.8) * 1e6
    assert tp_allreduce_s(1024, 32, h100) * 1e6 == pytest.approx(35.2 + ring_us)
    assert tp_allreduce_s(1024, 16, h100) < tp_allreduce_s(1024, 32, h100) < tp_allreduce_s(1024, 64, h100)
