"""The planner and context parallelism (policy.cp): a rank's activations and logits are its 1/CP share of each row,
the optimizer shards over DP x CP (megatron-core sees CP ranks as data-parallel ones), each pass pays the K/V
all-gathers; a 128K-token row of a 70B model fits 128 H100s only with CP, and the plan's config says so."""
import pytest

from megatron_rl.planner import search as P
from megatron_rl.planner.cost_model import train_memory, train_side_times
from megatron_rl.planner.presets import GPUS
from megatron_rl.planner.recipe import layout_overrides

H100 = GPUS["h100"]
LONG = P.Workload(seq_len=131072, samples=64, prompt_len=2048)


def test_cp_divides_a_ranks_activations_and_shards_the_optimizer_wider():
    _, spec, _ = P.resolve_model("llama3.1-8b")
    for recompute in (False, True):
        one, _ = train_memory(spec, 2, 1, 4, recompute, LONG)
        for cp in (2, 4):
            split, _ = train_memory(spec, 2, 1, 4 // cp, recompute, LONG, cp=cp)
            assert split["activations"] == pytest.approx(one["activations"] / cp)
            assert split["logits"] == pytest.approx(one["logits"] / cp)
            # the same 8 ranks hold the model: weights and gradients whole, the optimizer sharded over all of them
            for key in ("weights", "grads", "optimizer"):
                assert split[key] == pytest.approx(one[key]), key


def test_cp_pays_its_gathers():
    """The same 8 GPUs (TP 2) as DP 4, CP 2 x DP 2 and CP 4: the same compute per GPU, plus the gathers, which grow
    with (cp-1)/cp and stay small next to a 128K row's compute; a logprob pass pays them too."""
    _, spec, _ = P.resolve_model("llama3.1-8b")
    wl = P.Workload(seq_len=131072, samples=64, prompt_len=2048, logprob_passes=1)
    times = [train_side_times(spec, H100, 2, 1, 4 // cp, True, wl, cp=cp) for cp in (1, 2, 4)]
    for key in ("train", "logprobs"):
        assert times[0][key] < times[1][key] < times[2][key] < 1.05 * times[0][key], key
    # each rank receives (cp-1)/cp of its replica's K/V per layer and pass, and on the same GPUs a CP-4 replica
    # holds twice the tokens of a CP-2 one: 2 x (3/4) / (1/2) = 3x the extra time
    extra = [t["train"] - times[0]["train"] for t in times[1:]]
    assert extra[1] == pytest.approx(3 * extra[0], rel=1e-6)


def test_a_128k_row_of_a_70b_model_fits_128_h100s_only_with_cp(monkeypatch):
    _, spec, _ = P.resolve_model("llama3.1-70b")
    plans = P.plan(spec, 128, H100, LONG, top=3, _search_more=False)
    assert plans and all(p.cp > 1 and p.tp * p.pp * p.cp * p.dp == p.train_gpus == 128 for p in plans)
    assert f"policy.cp={plans[0].cp}" in layout_overrides(plans[0], H100)
    monkeypatch.setattr(P, "CP_OPTIONS", (1,))
    with pytest.raises(P.Infeasible, match="training needs .* GiB per GPU"):
        P.plan(spec, 128, H100, LONG, top=3, _search_more=False)
