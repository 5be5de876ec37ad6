"""Context parallelism on the Megatron backend (policy.cp, policy/context_parallel.py): at CP = 2, alone and with
TP = 2, PP = 2 or DP = 2, one logprob pass and one training step on varlen rows with cascade prefixes and uneven
lengths give the logprobs, loss, gradient norm and updated weights of CP = 1 and of the unpacked HF + torch AdamW
reference, in fp32 to 1e-5, also with full activation recompute; a tiny Qwen3-MoE at CP = 2 equals CP = 1; each CP
rank holds half of every row, in megatron's zig-zag chunks. The batch's one-token completions are segments shorter
than 2 * CP: padded to 2 * CP, they need no refusal.
"""
import pytest
import torch

from megatron_rl.distributed.launch import run_distributed
from megatron_rl.models.tiny import write_tiny_hf_model
from tests.distributed.policy_bodies import close_lists
from tests.distributed import cp_bodies

TWO = [n for n, (size, _) in cp_bodies.LAYOUTS.items() if size == 2]
FOUR = [n for n, (size, _) in cp_bodies.LAYOUTS.items() if size == 4]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(write_tiny_hf_model(tmp_path_factory.mktemp("tiny") / "llama", "llama", seed=5))


@pytest.fixture(scope="module")
def two(model_dir, tmp_path_factory):
    moe_dir = str(write_tiny_hf_model(tmp_path_factory.mktemp("tiny") / "moe", "qwen3_moe", seed=3))
    return run_distributed(cp_bodies.cp_vs_reference, 2, args=(model_dir, TWO, moe_dir), timeout=900)[0]


@pytest.fixture(scope="module")
def four(model_dir):
    return run_distributed(cp_bodies.cp_vs_reference, 4, args=(model_dir, FOUR), timeout=900)[0]


def _results(two, four, name):
    return two if name in TWO else four


@pytest.mark.parametrize("name", [n for n in cp_bodies.LAYOUTS if n.startswith("cp2")])
def test_cp_equals_reference_and_cp1(two, four, name):
    res = _results(two, four, name)
    r = res[name]
    close_lists(r["logprobs"], res["ref_lps"], 1e-5)
    close_lists([r["train_logprobs"][i] for i in range(res["n"])], res["ref_lps"], 1e-5)
    assert r["metrics"]["loss"] == pytest.approx(res["ref_loss"], rel=1e-5, abs=1e-7)
    assert r["metrics"]["grad_norm"] == pytest.approx(res["ref_norm"], rel=1e-5)
    ref = res["ref_state"]
    assert r["after"] and set(r["after"]) <= set(ref)
    for k, v in r["after"].items():
        torch.testing.assert_close(v, ref[k], atol=2e-6, rtol=1e-5, msg=lambda s: f"{name} {k}: {s}")
    cp1 = two["cp1_dp2"]  # the same step without context parallelism
    close_lists(r["logprobs"], cp1["logprobs"], 1e-5)
    for key in ("loss", "grad_norm", "tokens"):
        assert r["metrics"][key] == pytest.approx(cp1["metrics"][key], rel=1e-5, abs=1e-7), key
    for k, v in r["after"].items():
        torch.testing.assert_close(v, cp1["after"][k], atol=1e-5, rtol=0, msg=lambda s: f"{name} {k}: {s}")


@pytest.mark.parametrize("name", [n for n in cp_bodies.LAYOUTS if n.startswith("cp2")])
def test_each_cp_rank_holds_its_zigzag_half(two, four, name):
    r = _results(two, four, name)[name]
    coords = r["coords"]
    by_rank = {}
    for c, rows, local in zip(coords, r["rows"], r["local"]):
        assert all(n % 4 == 0 for n in rows), rows  # every segment padded to 2 * cp
        by_rank.setdefault((c["dp_rank"], c["tp"], c["pp"]), []).append((c["cp_rank"], rows, local))
    for ranks in by_rank.values():
        assert sorted(cr for cr, _, _ in ranks) == [0, 1]
        (_, rows0, loc0), (_, rows1, loc1) = sorted(ranks)
        assert rows0 == rows1  # a CP group plans the same micro-batches
        for n, (_, a), (_, b) in zip(rows0, loc0, loc1):
            assert len(a) == len(b) == n // 2 and sorted(a + b) == list(range(n))
            assert a == sorted(a) and 0 in a and n - 1 in a  # rank 0: first and last chunk of each segment
    assert r["outputs"] == max(c["dp_rank"] for c in coords) + 1  # one output rank per data-parallel replica


def test_moe_layers_at_cp2_equal_cp1(two):
    a, b = two["cp2_moe"], two["cp1_moe"]
    close_lists(a["logprobs"], b["logprobs"], 1e-5)
    close_lists([a["train_logprobs"][i] for i in range(len(a["logprobs"]))], b["logprobs"], 1e-5)
    for key in ("loss", "grad_norm", "tokens"):
        assert a["metrics"][key] == pytest.approx(b["metrics"][key], rel=1e-5, abs=1e-7), key
    assert a["after"].keys() == b["after"].keys() and any("experts" in k for k in a["after"])
    for k, v in a["after"].items():
        torch.testing.assert_close(v, b["after"][k], atol=1e-5, rtol=0, msg=lambda s: f"{k}: {s}")
