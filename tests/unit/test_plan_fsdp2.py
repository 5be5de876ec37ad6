"""The planner's FSDP2 backend (planner/fsdp2_cost.py) against a real HF model, torch's AdamW, and the CLI."""
import pytest

from megatron_rl.models.provider import model_spec
from megatron_rl.models.tiny import make_tiny_hf_model, tiny_hf_config
from megatron_rl.planner import search as P
from megatron_rl.planner.fsdp2_cost import fsdp2_memory, fsdp2_plan, unit_params
from megatron_rl.planner.presets import GPUS, MODELS


@pytest.mark.parametrize("kind", ["llama", "qwen2"])  # untied / tied-or-biased variants the repo's tests build
def test_sharded_state_is_the_hf_models_params_grads_and_adamw_state_over_world(kind):
    import torch

    model = make_tiny_hf_model(kind)
    # what the worker holds before sharding: fp32 params, fp32 grads, and AdamW's state after one step
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt = torch.optim.AdamW(model.parameters())
    opt.step()
    state = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if t.dim() > 0)
    full = sum(p.numel() * p.element_size() + p.grad.numel() * p.grad.element_size() for p in model.parameters())
    full += state
    spec = model_spec(tiny_hf_config(kind))
    wl = P.Workload(seq_len=64, prompt_len=8, samples=4)
    for world in (1, 2, 4, 8):
        assert fsdp2_memory(spec, world, wl)["sharded"] == pytest.approx(full / world)
    # the all-gathered units: the root (embedding, final norm, lm_head) and the decoder layers, as HF groups them
    root, layers = unit_params(spec)
    assert len(layers) == len(model.model.layers)
    assert layers == [sum(p.numel() for p in layer.parameters()) for layer in model.model.layers]
    in_layers = sum(p.numel() for layer in model.model.layers for p in layer.parameters())
    assert root == sum(p.numel() for p in model.parameters()) - in_layers


def test_fsdp2_memory_falls_with_world_size_where_megatron_dp_without_distributed_optimizer_does_not():
    spec = model_spec(MODELS["llama3.1-8b"])
    gpu = GPUS["h100"]
    wl = P.Workload(seq_len=4096)
    replicated = P.Workload(seq_len=4096, distributed_optimizer=False)
    fsdp = [fsdp2_plan(spec, w, gpu, wl).peak_gib for w in (1, 2, 8, 64)]
    megatron = [sum(P.train_memory(spec, 1, 1, w, False, replicated)[0].values()) for w in (1, 2, 8, 64)]
    assert all(a > b for a, b in zip(fsdp, fsdp[1:]))
    assert megatron == pytest.approx([megatron[0]] * 4)
    # 8B at fp32 with AdamW is 16 B/param = 128 GB: one H100 cannot hold it, 8 of them can (2 B/param each)
    assert not fsdp2_plan(spec, 1, gpu, wl).fits and fsdp2_plan(spec, 8, gpu, wl).fits
    assert fsdp2_plan(spec, 8, gpu, wl).memory_gib["sharded"] == pytest.approx(16 * 8.03e9 / 8 / 2**30, rel=0.01)
    # what stays per GPU whatever the world: activations (TP 1, no recompute) and the gathered bf16 units
    big = fsdp2_plan(spec, 4096, gpu, wl).memory_gib
    assert big["activations"] == pytest.approx(P.train_memory(spec, 1, 1, 1, False, wl)[0]["activations"])
    assert big["gathered"] > 2 * 2 * 4096 * 128256 / 2**30  # the untied embedding and lm_head, bf16, at least


def test_fsdp2_collectives_follow_the_link_and_the_micro_batches():
    spec = model_spec(MODELS["llama3.1-8b"])
    gpu = GPUS["h100"]
    one = fsdp2_plan(spec, 1, gpu, P.Workload(seq_len=4096))
    assert one.collectives_s == 0.0  # nothing to gather on one rank
    inside = fsdp2_plan(spec, 8, gpu, P.Workload(seq_len=4096))  # one NVLink domain
    across = fsdp2_plan(spec, 16, gpu, P.Workload(seq_len=4096))  # the network
    # 16 ranks have half the micro-batches each but move them over a slower link
    assert across.collectives_s / inside.collectives_s > gpu.nvlink_gb_s / gpu.network_gb_s / 2 * 0.9
    # a forward-only logprob pass adds one all-gather per micro-batch, a quarter of a training micro-batch's bytes
    # in bf16 (2 of 2 + 2 + 4)
    kl = fsdp2_plan(spec, 8, gpu, P.Workload(seq_len=4096, logprob_passes=1))
    assert kl.collectives_s == pytest.approx(inside.collectives_s * 1.25)


def test_cli_prints_both_backends_and_each_alone(capsys):
    argv = ["--model", "llama3.1-8b", "--gpus", "64", "--colocated", "--seq-len", "4096"]
    assert P.main(argv) == 0
    out = capsys.readouterr().out
    assert "train TP/PP/DP" in out and "FSDP2 (policy.backend=fsdp2, DP " in out and "FSDP2 step time" in out
    assert "FSDP2 vs best Megatron" in out and "KL reference is on the host" in out and ": fits;" in out
    assert P.main(argv + ["--backend", "megatron"]) == 0
    out = capsys.readouterr().out
    assert "train TP/PP/DP" in out and "FSDP2" not in out
    assert P.main(argv + ["--backend", "fsdp2"]) == 0
    out = capsys.readouterr().out
    assert "train TP/PP/DP" not in out and "FSDP2 step time" in out
    # 8B on one GPU: neither backend fits; the FSDP2 line says so with its own numbers
    assert P.main(["--model", "llama3.1-8b", "--gpus", "1", "--colocated", "--seq-len", "4096"]) == 2
    cap = capsys.readouterr()
    assert "refused" in cap.err and "DP 1" in cap.out and "does not fit" in cap.out


def test_fsdp2_tp_splits_the_gathered_units_and_activations_and_is_chosen_where_tp1_does_not_fit():
    """policy.tp with fsdp2 (fsdp2_tp.py): the sharded state is 1/world either way; the gathered units and their
    gradients are each rank's TP slice; activations are Megatron's at that TP. At 16K tokens 8B does not fit on 8 H100s
    at TP 1; the planner then takes the fitting TP with the shortest training side (TP 2), at 4K it keeps TP 1."""
    from megatron_rl.planner.fsdp2_cost import best_fsdp2_plan, tp_sizes

    spec, gpu = model_spec(MODELS["llama3.1-8b"]), GPUS["h100"]
    wl = P.Workload(seq_len=16384)
    one, two = fsdp2_memory(spec, 8, wl), fsdp2_memory(spec, 8, wl, tp=2)
    assert two["sharded"] == one["sharded"]
    assert two["gathered"] == pytest.approx(one["gathered"] / 2)
    assert two["unsharded_grads"] == pytest.approx(one["unsharded_grads"] / 2)
    assert two["activations"] == pytest.approx(P.train_memory(spec, 2, 1, 4, False, wl)[0]["activations"] * 2**30)
    assert tp_sizes(spec, 8, gpu) == [1, 2, 4, 8]  # 32 heads, 8 KV heads, 128,256 tokens
    assert not fsdp2_plan(spec, 8, gpu, wl).fits and fsdp2_plan(spec, 8, gpu, wl, tp=2).fits
    assert best_fsdp2_plan(spec, 8, gpu, wl).tp == 2
    assert best_fsdp2_plan(spec, 8, gpu, P.Workload(seq_len=4096)).tp == 1
    # collectives: FSDP gathers each rank's TP slice over dp only
    from megatron_rl.planner.fsdp2_cost import fsdp2_collective_bytes

    assert fsdp2_collective_bytes(spec, 8, tp=2)[1] == pytest.approx(fsdp2_collective_bytes(spec, 4)[1] / 2)
