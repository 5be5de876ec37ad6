"""policy.ep and policy.moe_aux_loss_coef: the layout rules of expert parallelism (against megatron-core's own rank
generator) and a one-line error naming the key for each combination megatron-core or megatron-rl refuses."""
import json

import pytest

from megatron_rl.config import ConfigError, load_config
from megatron_rl.distributed.parallel_dims import ParallelDims, layout_of

# (tp, pp, dp, ep): EP inside DP, with TP and PP around it
LAYOUTS = [(1, 1, 2, 2), (1, 1, 4, 2), (2, 1, 4, 2), (1, 2, 4, 2), (2, 2, 4, 4), (1, 1, 8, 4)]


def _groups(dims: ParallelDims, varying: str, coords) -> list[list[int]]:
    """Ranks sharing every coordinate but `varying`, as megatron lists its process groups."""
    out: dict[tuple, list[int]] = {}
    for r in range(dims.world_size):
        c = coords(r)
        out.setdefault(tuple(v for k, v in sorted(c.items()) if k != varying), []).append(r)
    return sorted(out.values())


@pytest.mark.parametrize("tp,pp,dp,ep", LAYOUTS)
def test_expert_coords_match_megatron_rank_generator(tp, pp, dp, ep):
    from megatron.core.parallel_state import RankGenerator

    dims = ParallelDims(tp=tp, pp=pp, dp=dp, ep=ep)
    dense = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=1, order="tp-cp-ep-dp-pp")
    expert = RankGenerator(tp=tp, ep=ep, dp=dp // ep, pp=pp, cp=1, order="tp-cp-ep-dp-pp")
    assert _groups(dims, "dp", dims.coords) == sorted(dense.get_ranks("dp"))
    assert _groups(dims, "ep", dims.expert_coords) == sorted(expert.get_ranks("ep"))
    assert _groups(dims, "edp", dims.expert_coords) == sorted(expert.get_ranks("dp"))  # expert-data-parallel
    assert _groups(dims, "tp", dims.expert_coords) == sorted(expert.get_ranks("tp"))
    assert dims.expert_dp == dp // ep and dims.world_size == tp * pp * dp  # EP adds no ranks


def _model(tmp_path, **extra):
    d = tmp_path / "model"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(
        {"num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, "intermediate_size": 128,
         **extra}))
    return d


def _load(tmp_path, devices, *overrides, **model):
    p = tmp_path / "c.yaml"
    p.write_text(f"policy: {{model: {_model(tmp_path, **model)}}}\ncluster: {{devices_per_node: {devices}}}\n")
    return load_config(p, list(overrides))


def test_valid_expert_layouts(tmp_path):
    cfg = _load(tmp_path, 2, "policy.ep=2", num_experts=4)
    assert cfg.policy.ep == 2 and cfg.policy.moe_aux_loss_coef == 0.0  # the schema's defaults: ep 1, no aux loss
    dims = layout_of(cfg).policy
    assert (dims.dp, dims.ep, dims.expert_dp) == (2, 2, 1)
    # the expert count under transformers' saved spelling; 4 devices: dp 4, each expert shard replicated twice
    dims = layout_of(_load(tmp_path, 4, "policy.ep=2", "policy.moe_aux_loss_coef=0.01",
                           num_local_experts=8)).policy
    assert (dims.world_size, dims.dp, dims.expert_dp) == (4, 4, 2)
    assert _load(tmp_path, 2).policy.ep == 1  # a dense model at the default ep


@pytest.mark.parametrize("devices,overrides,model,match", [
    (2, ["policy.ep=4"], {"num_experts": 8}, r"policy\.ep=4 must divide the data-parallel size dp=2"),
    (4, ["policy.ep=4", "policy.dp=2"], {"num_experts": 8}, r"policy\.ep=4 must divide the data-parallel size dp=2"),
    (4, ["policy.ep=4"], {"num_experts": 6}, r"policy\.ep=4 does not divide the expert count 6"),
    (2, ["policy.ep=2"], {}, r"policy\.ep=2 needs a mixture-of-experts model; this one is dense"),
    (2, ["policy.ep=0"], {"num_experts": 4}, r"policy\.ep must be >= 1, got 0"),
    (2, ["policy.tp=2"], {"num_experts": 4}, r"policy\.tp=2 with a mixture-of-experts model: .*sequence parallelism"),
    (2, ["policy.moe_aux_loss_coef=0.01"], {}, r"policy\.moe_aux_loss_coef=0\.01 needs a mixture-of-experts model"),
    (2, ["policy.moe_aux_loss_coef=-1"], {"num_experts": 4}, r"policy\.moe_aux_loss_coef must be >= 0, got -1"),
    # the world-size rule still holds with EP: tp*pp*dp ranks must fit the devices
    (2, ["policy.ep=2", "policy.dp=4"], {"num_experts": 4}, r"policy\.tp\*pp\*dp = 4 ranks do not fit cluster"),
    (2, ["policy.moe_routing_replay=on"], {}, r"policy\.moe_routing_replay=on: the model has no experts"),
    (2, ["policy.moe_routing_replay=on", "policy.activation_recompute=true", "policy.pp=2"], {"num_experts": 4},
     r"policy\.moe_routing_replay=on with policy\.activation_recompute=true needs policy\.pp=1"),
    (2, ["policy.moe_routing_replay=maybe"], {"num_experts": 4}, r"policy\.moe_routing_replay"),
])
def test_bad_expert_layouts_name_the_key(tmp_path, devices, overrides, model, match):
    with pytest.raises(ConfigError, match=match) as e:
        _load(tmp_path, devices, *overrides, **model)
    assert "\n" not in str(e.value)


def test_routing_replay_resolves_per_model_and_engine(tmp_path, monkeypatch):
    """policy.moe_routing_replay=auto: on for a MoE model (the CPU engine records routing), off for a dense one and
    where the engine cannot record (a GPU engine with CUDA graphs), where `on` is refused naming the key to change."""
    from megatron_rl import platform
    from megatron_rl.config.moe_rules import routing_replay_enabled

    moe = _load(tmp_path, 2, num_experts=4)
    assert moe.policy.moe_routing_replay == "auto" and routing_replay_enabled(moe, 4)
    assert not routing_replay_enabled(_load(tmp_path, 2), None)
    assert not routing_replay_enabled(_load(tmp_path, 2, "policy.moe_routing_replay=off", num_experts=4), 4)

    class GPU:
        is_gpu = True

    monkeypatch.setattr("megatron_rl.config.moe_rules.get_platform", lambda: GPU())
    assert not routing_replay_enabled(moe, 4)
    moe.generation.enforce_eager = True
    assert routing_replay_enabled(moe, 4)
    moe.generation.enforce_eager, moe.policy.moe_routing_replay = False, "on"
    with pytest.raises(ValueError, match=r"policy\.moe_routing_replay=on needs generation\.enforce_eager=true"):
        routing_replay_enabled(moe, 4)
    assert platform  # the real platform module is untouched (only the rule's reference was patched)
