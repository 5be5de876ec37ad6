"""Conversion tool: HF → Megatron (TP=2, PP=2) → HF is bit-exact and loads in transformers; bad input fails clearly.

The round trips spawn real gloo ranks (4 for TP=2 x PP=2). Bad-input checks fail in the pre-flight, before any
process starts, and must leave nothing at --out.
"""
import json
import shutil
from pathlib import Path

import pytest
import torch

from megatron_rl.models.checkpoint import CheckpointError
from megatron_rl.models.hf_io import WeightsError
from megatron_rl.models.provider import UnsupportedModelError
from megatron_rl.models.tiny import make_tiny_hf_model
from megatron_rl.weights import convert

TEMPLATE = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"


def _write_hf(folder: Path, kind: str, **save_kw) -> Path:
    model = make_tiny_hf_model(kind)
    model.save_pretrained(folder, **save_kw)
    (folder / "chat_template.jinja").write_text(TEMPLATE)
    (folder / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 256, "eos_token": "<e>"}))
    return folder


def _tensors(folder: Path) -> dict:
    from megatron_rl.models.hf_io import HFCheckpoint

    ck = HFCheckpoint(folder)
    return {k: ck[k] for k in ck}


def _no_leftovers(out: Path):
    assert not out.exists()
    assert not list(out.parent.glob(out.name + ".tmp-*"))


@pytest.fixture(scope="module")
def llama_round_trip(tmp_path_factory):
    root = tmp_path_factory.mktemp("convert_llama")
    hf = _write_hf(root / "hf", "llama")
    to_m = convert.hf_to_megatron(hf, root / "ckpt", tp=2, pp=2)
    to_hf = convert.megatron_to_hf(root / "ckpt", root / "back", tp=2, pp=2, max_shard_bytes=300_000)
    return root, to_m, to_hf


@pytest.fixture(scope="module")
def qwen2_round_trip(tmp_path_factory):
    root = tmp_path_factory.mktemp("convert_qwen2")
    hf = _write_hf(root / "hf", "qwen2", max_shard_size="300KB")  # sharded input with an index
    assert (hf / "model.safetensors.index.json").exists()
    assert convert.main(["hf-to-megatron", "--hf", str(hf), "--out", str(root / "ckpt"), "--tp", "2"]) == 0
    assert convert.main(["megatron-to-hf", "--ckpt", str(root / "ckpt"), "--out", str(root / "back")]) == 0
    assert convert.main(["megatron-to-hf", "--ckpt", str(root / "ckpt"), "--out", str(root / "back_bf16"),
                         "--dtype", "bf16"]) == 0
    return root


def test_llama_tp2_pp2_round_trip_is_bit_exact(llama_round_trip):
    root, to_m, to_hf = llama_round_trip
    assert (root / "ckpt" / "metadata.json").exists() and to_m["tp"] == 2 and to_m["pp"] == 2
    assert len(to_hf["files"]) > 2 and "model.safetensors.index.json" in to_hf["files"]  # sharded output
    src, back = _tensors(root / "hf"), _tensors(root / "back")
    assert sorted(src) == sorted(back)
    for name in src:
        assert src[name].dtype == back[name].dtype and torch.equal(src[name], back[name]), name


def test_round_trip_config_tokenizer_and_transformers_load(llama_round_trip):
    from transformers import AutoModelForCausalLM

    root, _, _ = llama_round_trip
    a = json.loads((root / "hf" / "config.json").read_text())
    b = json.loads((root / "back" / "config.json").read_text())
    assert a == b
    for name in ("chat_template.jinja", "tokenizer_config.json", "generation_config.json"):
        assert (root / "back" / name).read_bytes() == (root / "hf" / name).read_bytes(), name
    orig = AutoModelForCausalLM.from_pretrained(root / "hf", dtype=torch.float32).eval()
    loaded = AutoModelForCausalLM.from_pretrained(root / "back", dtype=torch.float32).eval()
    ids = torch.randint(0, 250, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(orig(ids).logits, loaded(ids).logits)


def test_export_outside_a_run_gets_a_card_without_recipe(llama_round_trip):
    # the checkpoint came from hf-to-megatron, not from a run's checkpoints/ folder: base and step only
    root, _, to_hf = llama_round_trip
    card = (root / "back" / "README.md").read_text()
    assert "README.md" in to_hf["files"]
    assert f"at step 0 (base: **{root / 'hf'}**" in card and "not inside a training run's folder" in card
    assert "## Metrics" not in card and "## Recipe" not in card


def test_qwen2_sharded_input_round_trip_and_bf16_export(qwen2_round_trip):
    root = qwen2_round_trip
    src, back, bf16 = _tensors(root / "hf"), _tensors(root / "back"), _tensors(root / "back_bf16")
    assert sorted(src) == sorted(back) == sorted(bf16)
    assert "lm_head.weight" in back and "model.layers.0.self_attn.q_proj.bias" in back  # untied, QKV bias
    for name in src:
        assert torch.equal(src[name], back[name]), name
        assert bf16[name].dtype == torch.bfloat16 and torch.equal(src[name].to(torch.bfloat16), bf16[name]), name
    assert json.loads((root / "back_bf16" / "config.json").read_text())["dtype"] == "bfloat16"


def test_checkpoint_metadata_records_checksums_and_config(llama_round_trip):
    root, _, _ = llama_round_trip
    meta = json.loads((root / "ckpt" / "metadata.json").read_text())
    assert meta["format_version"] == 1 and meta["layout"] == {"tp": 2, "pp": 2, "ep": 1, "world_size": 4}
    assert meta["hf_config"]["architectures"] == ["LlamaForCausalLM"]
    assert any(f.startswith("dist/") for f in meta["files"]) and "hf/chat_template.jinja" in meta["files"]
    assert all(len(v["sha256"]) == 64 for v in meta["files"].values())


# ------------------------------------------------------------------------------------------------ bad input

def test_unsupported_architecture_names_config_and_value(llama_round_trip, capsys):
    root, _, _ = llama_round_trip
    bad = root / "bad_arch"
    shutil.copytree(root / "hf", bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match=r"config\.json.*GPT2LMHeadModel.*gpt2"):
        convert.hf_to_megatron(bad, root / "out_arch")
    assert convert.main(["hf-to-megatron", "--hf", str(bad), "--out", str(root / "out_arch")]) == 2
    assert "GPT2LMHeadModel" in capsys.readouterr().err
    _no_leftovers(root / "out_arch")


def test_missing_and_corrupt_hf_shards_name_the_file(qwen2_round_trip):
    root = qwen2_round_trip
    index = json.loads((root / "hf" / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[-1]
    missing = root / "hf_missing"
    shutil.copytree(root / "hf", missing)
    (missing / shard).unlink()
    with pytest.raises(WeightsError, match=f"{shard}.*missing"):
        convert.hf_to_megatron(missing, root / "out_missing")
    _no_leftovers(root / "out_missing")
    corrupt = root / "hf_corrupt"
    shutil.copytree(root / "hf", corrupt)
    data = (corrupt / shard).read_bytes()
    (corrupt / shard).write_bytes(data[: len(data) // 2])  # truncated download
    with pytest.raises(WeightsError, match=f"{shard}.*corrupt"):
        convert.hf_to_megatron(corrupt, root / "out_corrupt")
    _no_leftovers(root / "out_corrupt")


def test_shape_mismatch_and_missing_tensor_name_the_tensor(llama_round_trip):
    from safetensors.torch import save_file

    root, _, _ = llama_round_trip
    bad = root / "bad_shape"
    shutil.copytree(root / "hf", bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["intermediate_size"] = 176
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(WeightsError, match=r"model\.layers\.0\.mlp\.gate_proj\.weight.*model\.safetensors.*176"):
        convert.hf_to_megatron(bad, root / "out_shape")
    _no_leftovers(root / "out_shape")
    gone = root / "missing_tensor"
    shutil.copytree(root / "hf", gone)
    state = _tensors(gone)
    del state["model.norm.weight"]
    save_file(state, str(gone / "model.safetensors"))
    with pytest.raises(WeightsError, match=r"model\.norm\.weight.*missing"):
        convert.hf_to_megatron(gone, root / "out_gone")


def test_existing_out_is_refused(llama_round_trip):
    root, _, _ = llama_round_trip
    with pytest.raises(FileExistsError, match="already exists"):
        convert.hf_to_megatron(root / "hf", root / "ckpt")
    with pytest.raises(FileExistsError, match="already exists"):
        convert.megatron_to_hf(root / "ckpt", root / "back")


def test_checkpoint_version_corruption_and_incompleteness_are_named(llama_round_trip):
    root, _, _ = llama_round_trip
    old = root / "ckpt_v0"
    shutil.copytree(root / "ckpt", old)
    meta = json.loads((old / "metadata.json").read_text())
    meta["format_version"] = 0
    (old / "metadata.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=r"metadata\.json.*format_version 0"):
        convert.megatron_to_hf(old, root / "out_v0")
    _no_leftovers(root / "out_v0")

    corrupt = root / "ckpt_corrupt"
    shutil.copytree(root / "ckpt", corrupt)
    victim = sorted((corrupt / "dist").glob("*.distcp"))[0]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"{victim.name}.*corrupt"):
        convert.megatron_to_hf(corrupt, root / "out_corrupt")
    _no_leftovers(root / "out_corrupt")

    partial = root / "ckpt_partial"
    shutil.copytree(root / "ckpt", partial)
    (partial / "metadata.json").unlink()  # what a crash before completion leaves
    with pytest.raises(convert.ConversionError, match="not a checkpoint"):
        convert.megatron_to_hf(partial, root / "out_partial")
    _no_leftovers(root / "out_partial")
