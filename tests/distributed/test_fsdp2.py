"""The FSDP2 backend (policy/fsdp2_worker.py) at DP=2 against the megatron backend and HF transformers: the same
GRPO step gives the same logprobs, entropies, loss, gradient norm and updated weights in fp32; its export before
training is the HF checkpoint; offloaded it refuses every read, onloaded it gives the same numbers; save -> step ==
load -> step bit for bit; a bf16 step stays near the fp32 reference; the MoE router's load-balancing loss is
megatron's. One 2-process launch (fsdp2_bodies.backends_agree) serves every test here."""
import pytest
import torch

from megatron_rl.distributed.launch import run_distributed
from megatron_rl.models.tiny import write_tiny_hf_model
from tests.distributed import fsdp2_bodies


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("fsdp2")
    model_dir = str(write_tiny_hf_model(root / "qwen2", "qwen2", seed=3))
    llama_dir = str(write_tiny_hf_model(root / "llama", "llama", seed=3))
    moe_dir = str(write_tiny_hf_model(root / "qwen3_moe", "qwen3_moe", seed=3))
    return run_distributed(fsdp2_bodies.backends_agree, 2, args=(model_dir, str(root / "ckpt"), llama_dir, moe_dir),
                           timeout=900)


def test_logprobs_and_entropy_equal_megatron_and_hf(results):
    r = results[0]
    meg, fs = r["megatron"], r["fsdp2"]
    for got, want, hf in zip(fs["logprobs"], meg["logprobs"], r["hf_logprobs"]):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
        torch.testing.assert_close(got, hf, atol=1e-5, rtol=0)
    for got, want in zip(fs["entropy"], meg["entropy"]):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    for got, want in zip(fs["train_logprobs"], meg["logprobs"]):  # the training forward's own
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_same_grpo_step_on_both_backends(results):
    r = results[0]
    meg, fs = r["megatron"]["metrics"], r["fsdp2"]["metrics"]
    for key in ("loss", "entropy"):
        assert fs[key] == pytest.approx(meg[key], rel=1e-5, abs=1e-7), key
    assert fs["grad_norm"] == pytest.approx(meg["grad_norm"], rel=1e-5)
    assert fs["grad_norm"] > 1.0  # clipped (clip_grad=1.0): the clipping rule is compared too
    assert fs["tokens"] == pytest.approx(1.0) and meg["tokens"] == pytest.approx(1.0)
    assert fs["lr"] == meg["lr"]
    after_m, after_f = r["megatron"]["after"], r["fsdp2"]["after"]
    assert set(after_f) == set(after_m)
    moved = 0
    for k, v in after_f.items():
        torch.testing.assert_close(v, after_m[k], atol=1e-5, rtol=1e-5, msg=lambda s: f"{k}: {s}")
        moved += not torch.equal(v, r["fsdp2"]["before"][k])
    assert moved == len(after_f)  # every tensor took the update (weight decay or gradient)


def test_activation_recompute_reruns_each_layer_and_changes_no_update(results):
    r = results[0]
    rc, plain = r["recompute"], r["fsdp2"]
    n_train, n_fwd = rc["attn_calls"]
    # _step runs logprobs (once per micro-batch), train (forward, then again in the backward: twice) and the
    # reference logprobs (once): 4x one forward pass's calls; without recompute it would be 3x
    assert n_fwd > 0 and n_train == 4 * n_fwd, rc["attn_calls"]
    for key in ("loss", "entropy", "grad_norm", "lr"):
        assert rc["metrics"][key] == pytest.approx(plain["metrics"][key], rel=1e-6, abs=1e-8), key
    for k, v in rc["after"].items():
        torch.testing.assert_close(v, plain["after"][k], atol=1e-6, rtol=1e-6, msg=lambda s: f"{k}: {s}")


def test_uneven_microbatch_counts_ran_fillers(results):
    counts = results[0]["fillers"]
    assert len({n for n, _ in counts}) == 1  # equal counts: every forward all-gathers over DP
    assert sum(f for _, f in counts) >= 1


def test_export_before_training_is_the_hf_checkpoint(results):
    r = results[0]
    exp, hf = r["fsdp2"]["before"], r["hf_state"]
    assert set(exp) == set(hf)
    for k in hf:
        assert torch.equal(exp[k], hf[k]), k
    assert r["info"]["num_params"] == sum(v.numel() for v in hf.values())


def test_moe_export_has_the_on_disk_per_expert_names(results):
    """transformers 5 holds an MoE layer's experts fused ([experts, 2 x ffn, hidden]); the refit and the export send
    them as the saved files name them, one tensor per expert and projection (vLLM's loader reads those names)."""
    r = results[0]["moe"]
    exp, disk = r["exported"], r["disk"]
    assert any(".mlp.experts.3.gate_proj.weight" in k for k in disk)  # the reference really is per expert
    assert set(exp) == set(disk)
    for k in disk:
        assert torch.equal(exp[k], disk[k]), k


def test_moe_load_balancing_loss_is_megatrons(results):
    """policy.moe_aux_loss_coef on the tiny Qwen3-MoE at DP=2: the FSDP2 step (router logits from HF's routers,
    policy/router_aux.py) is megatron-core's aux_loss step, on micro-batches with padded rows and a filler; the
    loss metric stays the policy loss, and the aux term moves the update (coef 0 is compared too)."""
    r = results[0]["moe_aux"]
    for coef, by in r.items():
        meg, fs = by["megatron"], by["fsdp2"]
        assert fs["shapes"] == meg["shapes"]  # the same rows and padding routed on both
        assert any(n > 1 for shapes in fs["shapes"] for n, _, _ in shapes)  # a padded multi-row micro-batch
        assert any(f for shapes in fs["shapes"] for *_, f in shapes)  # and a filler
        assert fs["metrics"]["loss"] == pytest.approx(meg["metrics"]["loss"], rel=1e-5, abs=1e-7), coef
        assert fs["metrics"]["grad_norm"] == pytest.approx(meg["metrics"]["grad_norm"], rel=1e-5), coef
        assert set(fs["after"]) == set(meg["after"])
        for k, v in fs["after"].items():
            torch.testing.assert_close(v, meg["after"][k], atol=1e-5, rtol=1e-5, msg=lambda s: f"{coef} {k}: {s}")
    off, on = (r[c]["fsdp2"] for c in fsdp2_bodies.MOE_AUX_COEFS)
    assert on["metrics"]["loss"] == off["metrics"]["loss"]  # the aux term is not in the reported loss
    assert on["metrics"]["grad_norm"] > off["metrics"]["grad_norm"] * 1.05  # measured 3.60 vs 3.33
    # measured 2e-3 (weights agree across backends to 1e-7)
    assert max(float((on["after"][k] - off["after"][k]).abs().max()) for k in on["after"]) > 1e-4


def test_reference_logprobs_are_the_initial_weights(results):
    r = results[0]
    for got, want in zip(r["fsdp2"]["ref_logprobs"], r["fsdp2"]["logprobs"]):
        torch.testing.assert_close(got, want, atol=0, rtol=0)
    for got, want in zip(r["fsdp2"]["ref_logprobs"], r["megatron"]["ref_logprobs"]):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_offloaded_worker_refuses_and_onload_restores(results):
    for r in results:
        assert r["refused"] == {"logprobs": True, "train": True, "export": True, "reference": True}
        assert r["offload_report"]["state"] == "offloaded" and r["offload_report"]["device_bytes"] == 0
        assert r["offload_report"]["host_bytes"] >= r["resident_report"]["device_bytes"] > 0
        assert r["onload_report"]["state"] == "resident"
        assert r["onload_report"]["device_bytes"] == r["resident_report"]["device_bytes"]
        assert r["onload_identical"]


def test_save_load_next_step_bit_identical(results):
    r = results[0]["resume"]
    assert r["steps"] == (3, 3)
    assert r["extra"] == {"data_position": 8}
    peak = "policy_peak_memory_gb"  # the process's peak so far, not a property of the step
    assert {k: v for k, v in r["m_a"].items() if k != peak} == {k: v for k, v in r["m_b"].items() if k != peak}
    assert r["same"] is True
    for rank in results:  # a save that fails on a full disk: named, nothing partial kept, the previous one intact
        full = rank["resume"]["full_disk"]
        assert full["error"] and "No space left on device" in full["error"], full
        assert full["partial_left"] == [] and full["previous_step"] == results[0]["ckpt_meta"]["step"], full
    meta = results[0]["ckpt_meta"]
    assert meta["backend"] == "fsdp2" and meta["layout"]["dp"] == 2 and meta["step"] == 2


def test_bf16_step_near_the_fp32_reference(results):
    """bf16 keeps 8 significant bits: logprobs and the loss agree to a few 1e-2; the update must point where the fp32
    step's does, with its size: test_policy's bf16 bounds, the same bar as the megatron backend's.

    This step once ran at lr 1e-3 (the megatron one at 1e-2) and its q_proj updates measured cos 0.935-0.989, so
    the bounds were loosened to 0.9 and 10 %. The cause was the step size, not the backend: the check differences
    bf16 weights exported before and after the step, and at lr 1e-3 the q_proj/k_proj updates of this model are
    only 1-4 bf16 spacings of their small weights (median update 4.6e-5 to 2.3e-4 from layer 3 to layer 0, spacing
    5.3e-5). Rounding those two exports alone, applied to the exact fp32 step, gives q_proj cos 0.88-0.99 and norms
    up to 13 % off; at lr 1e-2, cos >= 0.9999. At lr 1e-2 the FSDP2 step measured (2026-12-05) cos >= 0.9988 for
    every matrix and norms within 0.16 %. A lost, mis-scaled or mis-signed gradient gives ~0, a norm far off, or a
    grad_norm off by the DP factor; an lr 5 % off fails the norm bound."""
    r = results[0]["bf16"]
    lp_err = torch.cat([(g.float() - w).abs() for g, w in zip(r["logprobs"], r["ref_lps"])])
    assert lp_err.max() < 0.1 and lp_err.mean() < 0.02, (lp_err.max(), lp_err.mean())
    assert r["metrics"]["loss"] == pytest.approx(r["ref_loss"], rel=0.05, abs=0.01)
    assert r["metrics"]["grad_norm"] == pytest.approx(r["ref_norm"], rel=0.05)
    assert all(v.dtype == torch.bfloat16 for v in r["after"].values())  # the export (the refit) is bf16
    got_all, ref_all = [], []
    for k, v in r["after"].items():
        if v.dim() != 2:
            continue  # norm weights ~1.0: a 1e-2 update is a few bf16 spacings there (kept in the fp32 master)
        d_got = (v.float() - r["before"][k].float()).flatten()
        d_ref = (r["ref_state"][k].float() - r["before"][k].float()).flatten()
        assert torch.nn.functional.cosine_similarity(d_got, d_ref, dim=0) > 0.99, k
        assert d_got.norm() == pytest.approx(float(d_ref.norm()), rel=0.02), k
        got_all.append(d_got)
        ref_all.append(d_ref)
    assert torch.nn.functional.cosine_similarity(torch.cat(got_all), torch.cat(ref_all), dim=0) > 0.995


@pytest.mark.parametrize("layout", list(fsdp2_bodies.PACKED_LAYOUTS))
def test_packed_layouts_give_the_unshared_megatron_step(results, layout):
    """Group rows (block mask), varlen rows (one masked row a micro-batch) and both together, on the FSDP2 backend,
    against the megatron backend's plain one-row-per-sequence step on the same grouped batch."""
    r = results[0]["packed"]
    meg, got = r["megatron"], r[layout]
    for a, b in zip(got["logprobs"], meg["logprobs"]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    for a, b in zip(got["entropy"], meg["entropy"]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    for a, b in zip(got["train_logprobs"], meg["logprobs"]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    for key in ("loss", "entropy", "grad_norm"):
        assert got["metrics"][key] == pytest.approx(meg["metrics"][key], rel=1e-5, abs=1e-7), key
    assert got["metrics"]["tokens"] == pytest.approx(1.0)
    for k, v in got["after"].items():
        torch.testing.assert_close(v, meg["after"][k], atol=1e-5, rtol=1e-5, msg=lambda s: f"{k}: {s}")


def test_packed_layouts_are_what_they_claim(results):
    """The layouts above are not the plain one: group rows hold several sequences under a mask, varlen micro-batches
    are one unpadded row, sharing the prompts feeds fewer tokens, a small budget splits the rows (uneven counts)."""
    from tests.distributed.shared_prefix_bodies import make_group_batch

    r = results[0]["packed"]
    total = lambda name, key: sum(s[key] for s in r[name]["shape"])  # noqa: E731 (over both DP ranks)
    ids = make_group_batch(1000).input_ids  # the lengths only (the vocabulary does not change them)
    assert total("group_rows", "rows") < r["n"] and total("group_rows", "masked") >= 1
    assert total("group_rows", "one_row") == 0
    for name in ("varlen", "varlen_shared", "varlen_shared_split"):
        real = total(name, "mbs") - total(name, "fillers")
        assert total(name, "one_row") == total(name, "masked") == total(name, "rows") == real, name
    assert total("varlen", "tokens") == sum(len(x) - 1 for x in ids)  # no padding at all
    assert total("varlen_shared", "tokens") < total("varlen", "tokens")  # each group's prompt once
    assert total("varlen_shared_split", "tokens") == total("varlen_shared", "tokens")
    assert total("varlen_shared_split", "mbs") > total("varlen_shared", "mbs")


@pytest.mark.parametrize("case", list(fsdp2_bodies.TP_CASES))
def test_same_grpo_step_at_tp2_on_both_backends(results, case):
    """DTensor TP on the HF projections and a vocab-split lm_head (fsdp2_tp.py) against megatron's TP=2: logprobs,
    entropies, loss, gradient norm and every updated tensor to 1e-5; each rank holds half of every split weight. The
    top-k / top-p case scores the filtered distribution on both (the function itself against a plain-torch filtered
    softmax: tests/unit/test_sampling_filter.py), and its logprobs are not the unfiltered ones."""
    r = results[0]["tp"][case]
    meg, fs = r["megatron"], r["fsdp2"]
    if case in fsdp2_bodies.FILTERED:
        plain = results[0]["tp"]["qwen2"]["megatron"]["logprobs"]
        assert min(float((f - p).max()) for f, p in zip(meg["logprobs"], plain)) > 1e-3  # the kept mass < 1
    for got, want in zip(fs["logprobs"] + fs["entropy"] + fs["train_logprobs"],
                         meg["logprobs"] + meg["entropy"] + meg["logprobs"]):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    for key in ("loss", "entropy", "grad_norm"):
        assert fs["metrics"][key] == pytest.approx(meg["metrics"][key], rel=1e-5, abs=1e-7), key
    assert fs["metrics"]["grad_norm"] > 1.0  # clipped: the clipping rule over mixed meshes is compared too
    assert set(fs["after"]) == set(meg["after"])
    for k, v in fs["after"].items():
        torch.testing.assert_close(v, meg["after"][k], atol=1e-5, rtol=1e-5, msg=lambda s: f"{k}: {s}")
        assert not torch.equal(v, fs["before"][k]), k
    for got, want in zip(fs["ref_logprobs"], fs["logprobs"]):  # the KL reference: the initial shards swapped back
        torch.testing.assert_close(got, want, atol=0, rtol=0)
    assert [i["tp_rank"] for i in r["info"]] == [0, 1] and {i["dp_size"] for i in r["info"]} == {1}
    full = {k: v.shape for k, v in fs["after"].items()}
    for name, local in r["local_shapes"].items():  # Megatron's split: which dimension each rank holds half of
        hf = name[len("lm."):]
        if any(p in hf for p in ("q_proj.", "k_proj.", "v_proj.", "gate_proj.", "up_proj.", "embed_tokens.",
                                 "lm_head.")):
            dim = 0  # column-parallel outputs (and their biases), the vocabulary
        elif hf.endswith(("o_proj.weight", "down_proj.weight")):
            dim = 1  # row-parallel inputs
        else:
            dim = None  # norms, row-parallel biases: replicated
        want = [n // 2 if d == dim else n for d, n in enumerate(full[hf])]
        assert list(local) == want, (name, local, full[hf])


def test_tp2_save_load_next_step_bit_identical(results):
    r = results[0]["tp"]["resume"]
    assert r["same"] is True and r["m_a"]["loss"] == r["m_b"]["loss"] and r["m_a"]["grad_norm"] == r["m_b"]["grad_norm"]
    assert r["meta"]["layout"]["tp"] == 2 and r["meta"]["layout"]["dp"] == 1


@pytest.mark.slow
def test_dp2_x_tp2_on_four_ranks(tmp_path):
    """FSDP over dp composed with DTensor TP (a 2-D mesh; the gradient norm over mixed meshes) against megatron's
    DP=2 x TP=2, every TP case, plus an exact resume (4 processes, ~25 s on 2 cores)."""
    dirs = {k: str(write_tiny_hf_model(tmp_path / k, k, seed=3)) for k in ("qwen2", "llama")}
    r = run_distributed(fsdp2_bodies.tp_steps, 4, args=(dirs, str(tmp_path / "ckpt")), timeout=900)[0]
    for case in fsdp2_bodies.TP_CASES:
        meg, fs = r[case]["megatron"], r[case]["fsdp2"]
        assert [(i["dp_rank"], i["tp_rank"]) for i in r[case]["info"]] == [(0, 0), (0, 1), (1, 0), (1, 1)]
        for got, want in zip(fs["logprobs"] + fs["train_logprobs"], meg["logprobs"] * 2):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
        assert fs["metrics"]["grad_norm"] == pytest.approx(meg["metrics"]["grad_norm"], rel=1e-5), case
        for k, v in fs["after"].items():
            torch.testing.assert_close(v, meg["after"][k], atol=1e-5, rtol=1e-5, msg=lambda s: f"{case} {k}: {s}")
    assert r["resume"]["same"] is True and r["resume"]["meta"]["layout"]["world_size"] == 4
