"""The HF ⇄ megatron mapping as pure functions: layouts, TP/PP sharding, padding, exact round trips."""
import pytest
import torch

from megatron_rl.models.mapping import (
    expected_hf_shapes, hf_to_megatron_shard, layer_range, mapping_table, megatron_shards_to_hf,
)
from megatron_rl.models.provider import model_spec
from megatron_rl.models.tiny import make_tiny_hf_model


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model(request):
    hf = make_tiny_hf_model(request.param)
    return model_spec(hf.config), hf.state_dict()


def _expected_hf(spec, state):
    return {k: v for k, v in state.items() if not (spec.tied_embeddings and k == "lm_head.weight")}


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2), (2, 2)])
@pytest.mark.parametrize("layer_spec", ["local", "te"])
def test_round_trip_is_exact(model, tp, pp, layer_spec):
    spec, state = model
    shards = [[hf_to_megatron_shard(state, spec, t, tp, p, pp, layer_spec=layer_spec) for t in range(tp)]
              for p in range(pp)]
    back = megatron_shards_to_hf(shards, spec, layer_spec=layer_spec)
    want = _expected_hf(spec, state)
    assert sorted(back) == sorted(want)
    for k in want:
        assert torch.equal(back[k], want[k]), k


def test_expected_shapes_match_transformers(model):
    spec, state = model
    assert expected_hf_shapes(spec) == {k: tuple(v.shape) for k, v in _expected_hf(spec, state).items()}


def test_shard_names_and_shapes_tp2_pp2(model):
    spec, state = model
    h, tp = spec.hidden_size, 2
    first = hf_to_megatron_shard(state, spec, 1, tp, 0, 2)
    last = hf_to_megatron_shard(state, spec, 1, tp, 1, 2)
    assert first["embedding.word_embeddings.weight"].shape == (spec.padded_vocab_for(tp) // tp, h)
    assert first["decoder.layers.0.self_attention.linear_qkv.weight"].shape == (spec.qkv_rows // tp, h)
    assert first["decoder.layers.0.mlp.linear_fc1.weight"].shape == (2 * spec.ffn_hidden_size // tp, h)
    assert first["decoder.layers.0.mlp.linear_fc2.weight"].shape == (h, spec.ffn_hidden_size // tp)
    assert first["decoder.layers.0.self_attention.linear_proj.weight"].shape == (h, spec.num_heads * spec.head_dim // tp)
    assert first["decoder.layers.0.input_layernorm.weight"].shape == (h,)
    assert "decoder.final_layernorm.weight" in last and "embedding.word_embeddings.weight" not in last
    assert "output_layer.weight" in last  # tied models keep a copy of the embedding on the last stage
    assert not any(k.startswith("decoder.layers.2") for k in first) and "decoder.layers.1.mlp.linear_fc2.weight" in last
    # the last stage's local layer 0 is global layer 2
    torch.testing.assert_close(last["decoder.layers.0.input_layernorm.weight"],
                               state["model.layers.2.input_layernorm.weight"], rtol=0, atol=0)
    if spec.qkv_bias:
        assert first["decoder.layers.0.self_attention.linear_qkv.bias"].shape == (spec.qkv_rows // tp,)


def test_te_names_fuse_layernorms(model):
    spec, state = model
    te = hf_to_megatron_shard(state, spec, 0, 1, 0, 1, layer_spec="te")
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in te
    assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in te
    assert not any("input_layernorm" in k or "pre_mlp_layernorm" in k for k in te)


def test_qkv_is_interleaved_per_query_group(model):
    spec, state = model
    d, qpg = spec.head_dim, spec.queries_per_group
    fused = hf_to_megatron_shard(state, spec, 0, 1, 0, 1)["decoder.layers.0.self_attention.linear_qkv.weight"]
    q, k, v = (state[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv")
    for g in range(spec.num_kv_heads):
        block = fused[g * (qpg + 2) * d:(g + 1) * (qpg + 2) * d]
        assert torch.equal(block[: qpg * d], q[g * qpg * d:(g + 1) * qpg * d])  # the group's query heads
        assert torch.equal(block[qpg * d:(qpg + 1) * d], k[g * d:(g + 1) * d])  # then its key head
        assert torch.equal(block[(qpg + 1) * d:], v[g * d:(g + 1) * d])  # then its value head
    # at TP=2 each rank holds whole groups
    r1 = hf_to_megatron_shard(state, spec, 1, 2, 0, 1)["decoder.layers.0.self_attention.linear_qkv.weight"]
    assert torch.equal(r1, fused[fused.shape[0] // 2:])


def test_fc1_holds_gate_then_up_per_rank(model):
    spec, state = model
    gate, up = state["model.layers.1.mlp.gate_proj.weight"], state["model.layers.1.mlp.up_proj.weight"]
    f = spec.ffn_hidden_size
    r1 = hf_to_megatron_shard(state, spec, 1, 2, 0, 1)["decoder.layers.1.mlp.linear_fc1.weight"]
    assert torch.equal(r1, torch.cat([gate[f // 2:], up[f // 2:]]))


def test_vocab_padding_rows_are_zero_and_on_the_last_rank(model):
    spec, state = model
    emb = state["model.embed_tokens.weight"]
    r0 = hf_to_megatron_shard(state, spec, 0, 2, 0, 1)["embedding.word_embeddings.weight"]
    r1 = hf_to_megatron_shard(state, spec, 1, 2, 0, 1)["embedding.word_embeddings.weight"]
    assert torch.equal(r0, emb[:128]) and torch.equal(r1[: spec.vocab_size - 128], emb[128:])
    assert torch.count_nonzero(r1[spec.vocab_size - 128:]) == 0


def test_dtype_cast_and_table_kinds(model):
    spec, state = model
    bf = hf_to_megatron_shard(state, spec, 0, 1, 0, 1, dtype=torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 for t in bf.values())
    kinds = {e.kind for e in mapping_table(spec)}
    assert kinds <= {"replicated", "row", "vocab", "qkv", "fc1"}


def test_layer_range():
    assert list(layer_range(4, 2, 1)) == [2, 3]
    with pytest.raises(ValueError, match="evenly"):
        layer_range(5, 2, 0)
