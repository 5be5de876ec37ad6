"""Qwen3 dense, Qwen3-MoE and Mixtral as specs, configs and pure mappings (no process groups).

The reference is transformers itself: its parameter counts, and the tensors `save_pretrained` writes (per-expert on
disk even though transformers 5 fuses experts in memory).
"""
import tempfile

import pytest
import torch

from megatron_rl.models.hf_io import HFCheckpoint
from megatron_rl.models.mapping import (
    expected_hf_shapes, expert_owner, hf_to_megatron_shard, mapping_table, megatron_shards_to_hf,
)
from megatron_rl.models.provider import UnsupportedModelError, model_spec, transformer_config
from megatron_rl.models.hf_io import disk_state_dict
from megatron_rl.models.tiny import make_tiny_hf_model, tiny_hf_config
from megatron_rl.platform import get_platform

KINDS = ("qwen3", "qwen3_moe", "mixtral")


@pytest.fixture(scope="module", params=KINDS)
def model(request):
    hf = make_tiny_hf_model(request.param)
    return request.param, hf, model_spec(hf.config), disk_state_dict(hf)


def test_disk_state_dict_is_what_save_pretrained_writes(model):
    kind, hf, _, state = model
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        ck = HFCheckpoint(d)
        saved = {k: ck[k] for k in ck}
    assert sorted(saved) == sorted(state)
    assert all(torch.equal(saved[k], state[k]) for k in saved)
    if kind == "qwen3_moe":
        assert "model.layers.1.mlp.experts.3.down_proj.weight" in saved and "model.layers.0.mlp.gate.weight" in saved
    if kind == "mixtral":
        assert "model.layers.0.block_sparse_moe.experts.2.w3.weight" in saved


def test_parameter_count_and_expected_shapes_match_transformers(model):
    _, hf, spec, state = model
    assert spec.num_parameters() == sum(p.numel() for p in hf.parameters())
    assert expected_hf_shapes(spec) == {k: tuple(v.shape) for k, v in state.items()}


def test_specs():
    q3, qm, mx = (model_spec(tiny_hf_config(k)) for k in KINDS)
    assert q3.qk_norm and q3.moe is None and q3.head_dim == 32 != q3.hidden_size // q3.num_heads
    assert qm.qk_norm and (qm.moe.num_experts, qm.moe.topk, qm.moe.ffn_hidden_size) == (4, 2, 64)
    assert not qm.moe.norm_topk_prob and mx.moe.norm_topk_prob and not mx.qk_norm
    assert mx.moe.ffn_hidden_size == 64  # Mixtral's expert width is intermediate_size
    # transformers saves Qwen3-MoE's expert count as num_local_experts: both spellings are read
    cfg = tiny_hf_config("qwen3_moe")
    cfg["num_local_experts"] = cfg.pop("num_experts")
    assert model_spec(cfg).moe == qm.moe
    # active parameters: the router and top-k of the experts
    idle = 2 * qm.num_layers * 3 * qm.hidden_size * 64
    assert qm.num_active_parameters == qm.num_parameters() - idle


@pytest.mark.parametrize("change,match", [
    ({"mlp_only_layers": [0]}, "mlp_only_layers"), ({"decoder_sparse_step": 2}, "decoder_sparse_step"),
    ({"use_sliding_window": True, "sliding_window": 16}, "use_sliding_window"),
    ({"attention_bias": True}, "attention_bias"),
])
def test_unsupported_qwen3_moe_layouts_are_named(change, match):
    with pytest.raises(UnsupportedModelError, match=match):
        model_spec(dict(tiny_hf_config("qwen3_moe"), **change))


def test_mixtral_jitter_and_parallel_splits_are_named():
    with pytest.raises(UnsupportedModelError, match="router_jitter_noise"):
        model_spec(dict(tiny_hf_config("mixtral"), router_jitter_noise=0.1))
    mx = model_spec(tiny_hf_config("mixtral"))
    mx.validate_parallel(2, 2, 4)
    with pytest.raises(ValueError, match="num_experts=4 is not divisible by ep=3"):
        mx.validate_parallel(1, 1, 3)
    with pytest.raises(ValueError, match="expert ffn size 64 is not divisible by tp=3"):
        mx.validate_parallel(3, 1, 1)
    with pytest.raises(ValueError, match="needs a mixture-of-experts model"):
        model_spec(tiny_hf_config("qwen3")).validate_parallel(1, 1, 2)


def test_transformer_config_fields():
    q3 = transformer_config(model_spec(tiny_hf_config("qwen3")))
    assert q3.qk_layernorm and q3.kv_channels == 32 and q3.num_moe_experts is None
    qm = transformer_config(model_spec(tiny_hf_config("qwen3_moe")), ep=2)
    assert (qm.num_moe_experts, qm.moe_router_topk, qm.moe_ffn_hidden_size) == (4, 2, 64)
    assert qm.moe_router_pre_softmax  # norm_topk_prob=false: softmax over all experts, no renormalisation
    assert qm.moe_expert_capacity_factor is None and not qm.moe_grouped_gemm  # no token dropping
    assert qm.moe_router_load_balancing_type == "none" and qm.expert_model_parallel_size == 2
    assert qm.moe_token_dispatcher_type == get_platform().moe_token_dispatcher
    mx = transformer_config(model_spec(tiny_hf_config("mixtral")), moe_router_load_balancing_type="aux_loss")
    assert not mx.moe_router_pre_softmax and mx.moe_router_load_balancing_type == "aux_loss"
    assert mx.moe_aux_loss_coeff == 0.02  # the HF config's router_aux_loss_coef


LAYOUTS = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (2, 2, 1), (1, 1, 2), (2, 2, 2), (1, 1, 4)]


@pytest.mark.parametrize("kind,tp,pp,ep", [(k, *lay) for k in KINDS for lay in LAYOUTS
                                           if k != "qwen3" or lay[2] == 1])  # EP needs experts
def test_round_trip_is_exact(kind, tp, pp, ep):
    hf = make_tiny_hf_model(kind)
    spec, state = model_spec(hf.config), disk_state_dict(hf)
    shards = [[hf_to_megatron_shard(state, spec, r % tp, tp, p, pp, ep_rank=r // tp, ep_size=ep)
               for r in range(tp * ep)] for p in range(pp)]
    back = megatron_shards_to_hf(shards, spec, ep_size=ep)
    assert sorted(back) == sorted(state)
    for k in state:
        assert torch.equal(back[k], state[k]), k


def test_experts_are_sharded_by_global_index():
    spec = model_spec(tiny_hf_config("qwen3_moe"))
    state = disk_state_dict(make_tiny_hf_model("qwen3_moe"))
    assert [expert_owner(spec, e, 2) for e in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    r1 = hf_to_megatron_shard(state, spec, 1, 2, 0, 1, ep_rank=1, ep_size=2)
    experts = sorted(k for k in r1 if ".experts." in k)
    assert experts == [f"decoder.layers.{i}.mlp.experts.local_experts.{j}.linear_fc{n}.weight"
                       for i in range(2) for j in range(2) for n in (1, 2)]
    # EP rank 1, local expert 0 = global expert 2; TP rank 1 holds the second half of its gate and of its up rows
    x = "model.layers.0.mlp.experts.2."
    gate, up, down = (state[x + p + "_proj.weight"] for p in ("gate", "up", "down"))
    assert torch.equal(r1["decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"],
                       torch.cat([gate[32:], up[32:]]))
    assert torch.equal(r1["decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.weight"], down[:, 32:])
    assert torch.equal(r1["decoder.layers.0.mlp.router.weight"], state["model.layers.0.mlp.gate.weight"])
    assert torch.equal(r1["decoder.layers.0.self_attention.q_layernorm.weight"],
                       state["model.layers.0.self_attn.q_norm.weight"])


def test_te_spec_keeps_moe_norm_separate():
    spec = model_spec(tiny_hf_config("mixtral"))
    names = {e.mcore_name("te", 0, 0) for e in mapping_table(spec)}
    assert "decoder.layers.0.pre_mlp_layernorm.weight" in names  # an MoE layer has no fused fc1 to hold it
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in names
