"""Qwen3 dense, Qwen3-MoE and Mixtral on real megatron-core over gloo, against HF transformers (fp32).

- logits equal HF's (max |diff| <= 1e-4) at TP=1, TP=2, PP=2 and (MoE) EP=2; slow: TP=2 x EP=2 on 4 ranks;
- EP=2 with a different token count on each rank (data parallelism): logits, and expert gradients equal HF's
  gradients of the loss summed over both ranks' sequences (backward through the token dispatcher);
- `iter_hf_tensors` (the export and refit path) gives back exactly the on-disk HF tensors under their on-disk names
  (per-expert keys), each once over the pipeline stages, at every layout including EP=2;
- (slow) the conversion tool round trip HF -> Megatron -> HF is bit-exact with EP=2 on both sides (export with
  EP > 1), and across layouts: saved at TP=2 x EP=2, exported at TP=1 x PP=2; Qwen3 dense at TP=2 x PP=2.
"""
import json

import pytest
import torch

from megatron_rl.distributed.launch import run_distributed
from megatron_rl.models.hf_io import HFCheckpoint
from megatron_rl.models.tiny import tiny_hf_config, write_tiny_hf_model
from megatron_rl.weights import convert
from tests.distributed import moe_bodies

ATOL = 1e-4
LAYOUTS = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2)]  # (tp, pp, ep) on 2 ranks


def _check(results, kind, layout):
    tp, pp, ep = layout
    key = f"tp{tp}_pp{pp}_ep{ep}"
    per_rank = [r[kind][key] for r in results]
    last = [x["logits"] for x in per_rank if x["logits"] is not None]
    assert len(last) == len(results) // pp, "every rank of the last stage has the logits"
    assert max(last) <= ATOL, (kind, key, last)
    assert all(x["export_equal"] for x in per_rank), "exported tensors must be bit-identical to the HF ones"
    stages = {x["pp_rank"]: x["export_names"] for x in per_rank}  # the ranks of a stage export the same
    names = [n for s in sorted(stages) for n in stages[s]]
    assert len(names) == len(set(names)), "no tensor is exported by two stages"
    assert sorted(names) == per_rank[0]["expected_names"], "exactly the on-disk HF keys"


@pytest.fixture(scope="module")
def suite():
    return run_distributed(moe_bodies.parity_suite, world_size=2, args=(LAYOUTS,))


@pytest.fixture(scope="module")
def results(suite):
    return [r["layouts"] for r in suite]


@pytest.mark.parametrize("kind", moe_bodies.KINDS)
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: "tp{}_pp{}_ep{}".format(*x))
def test_logits_equal_hf_and_export_is_exact(results, kind, layout):
    if kind == "qwen3" and layout[2] > 1:
        # a dense model has no experts to shard: every rank's model builder refuses EP=2, naming why, before it
        # builds anything (a dense model built under EP=2 would train with parallel state that means nothing)
        for r in results:
            refused = r[kind]["tp1_pp1_ep2"]["refused"]
            assert refused and "cannot be split tp=1 pp=1 ep=2: expert parallelism ep=2 needs a mixture-of-experts " \
                               "model" in refused, refused
        return
    _check(results, kind, layout)


@pytest.mark.slow
def test_tp2_ep2_on_four_ranks():
    results = run_distributed(moe_bodies.layouts_vs_hf, world_size=4, args=([(2, 1, 2)], ("qwen3_moe", "mixtral")))
    for kind in ("qwen3_moe", "mixtral"):
        _check(results, kind, (2, 1, 2))


def _check_uneven(per_rank):
    # data parallelism gives the EP ranks different token counts (13 and 6 here): the alltoall dispatcher carries
    # them, and an expert's gradient sums the tokens of both ranks routed to it
    for r in per_rank:
        assert r["logits"] <= ATOL
        assert r["expert_grad"] <= 1e-5 * max(1.0, r["grad_scale"]), r


def test_ep2_with_uneven_tokens_per_rank_matches_hf_logits_and_expert_grads(suite):
    _check_uneven([r["uneven"]["qwen3_moe"] for r in suite])


@pytest.mark.slow
def test_ep2_uneven_tokens_mixtral():
    _check_uneven(run_distributed(moe_bodies.ep2_uneven_tokens_and_grads, world_size=2, args=("mixtral",)))


def _tensors(folder):
    ck = HFCheckpoint(folder)
    return {k: ck[k] for k in ck}


def _assert_same(src, back):
    a, b = _tensors(src), _tensors(back)
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name
    assert json.loads((src / "config.json").read_text()) == json.loads((back / "config.json").read_text())


@pytest.mark.slow
def test_convert_round_trip_at_ep2_is_bit_exact(tmp_path):
    hf = write_tiny_hf_model(tmp_path / "hf", "qwen3_moe")
    assert json.loads((hf / "config.json").read_text()).get("num_local_experts") == 4  # the saved spelling
    to_m = convert.hf_to_megatron(hf, tmp_path / "ckpt", ep=2)
    meta = json.loads((tmp_path / "ckpt" / "metadata.json").read_text())
    assert to_m["ep"] == 2 and meta["layout"] == {"tp": 1, "pp": 1, "ep": 2, "world_size": 2}
    convert.megatron_to_hf(tmp_path / "ckpt", tmp_path / "back", ep=2)
    _assert_same(hf, tmp_path / "back")


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_convert_saved_at_tp2_ep2_exports_at_pp2(tmp_path, kind):
    hf = write_tiny_hf_model(tmp_path / "hf", kind)
    assert convert.main(["hf-to-megatron", "--hf", str(hf), "--out", str(tmp_path / "ckpt"), "--tp", "2",
                         "--ep", "2"]) == 0
    assert convert.main(["megatron-to-hf", "--ckpt", str(tmp_path / "ckpt"), "--out", str(tmp_path / "back"),
                         "--pp", "2"]) == 0
    _assert_same(hf, tmp_path / "back")


@pytest.mark.slow
def test_convert_qwen3_dense_tp2_pp2_round_trip(tmp_path):
    hf = write_tiny_hf_model(tmp_path / "hf", "qwen3")
    convert.hf_to_megatron(hf, tmp_path / "ckpt", tp=2, pp=2)
    convert.megatron_to_hf(tmp_path / "ckpt", tmp_path / "back", tp=2, pp=2)
    _assert_same(hf, tmp_path / "back")


def test_ep_for_a_dense_model_is_refused_before_any_process_starts(tmp_path):
    hf = tmp_path / "hf"  # the split is checked from config.json alone, before the weights are looked at
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(tiny_hf_config("qwen3")))
    with pytest.raises(ValueError, match="ep=2 needs a mixture-of-experts model"):
        convert.hf_to_megatron(hf, tmp_path / "ckpt", ep=2)
    assert not (tmp_path / "ckpt").exists()
