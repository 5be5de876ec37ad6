"""Checkpoint metadata, verification and discovery, and HF folder I/O — no processes, no megatron models."""
import json

import pytest
import torch

from megatron_rl.models import checkpoint as ck
from megatron_rl.models import hf_io


def _fake_checkpoint(path, step, version=ck.FORMAT_VERSION):
    (path / "dist").mkdir(parents=True)
    (path / "dist" / "__0_0.distcp").write_bytes(b"weights" * 100)
    (path / "extra_state.pt").write_bytes(b"extra")
    files = {n: {"sha256": ck.sha256_file(path / n), "bytes": (path / n).stat().st_size}
             for n in ("dist/__0_0.distcp", "extra_state.pt")}
    meta = {"format": ck.FORMAT, "format_version": version, "step": step, "created": float(step), "files": files}
    (path / ck.METADATA).write_text(json.dumps(meta))
    return path


def test_verify_accepts_intact_and_names_corrupt_or_missing_files(tmp_path):
    c = _fake_checkpoint(tmp_path / "step_1", 1)
    assert ck.verify_checkpoint(c)["step"] == 1
    (c / "dist" / "__0_0.distcp").write_bytes(b"weightz" * 100)  # same size, different content
    with pytest.raises(ck.CheckpointError, match=r"__0_0\.distcp is corrupt"):
        ck.verify_checkpoint(c)
    (c / "extra_state.pt").unlink()
    with pytest.raises(ck.CheckpointError, match=r"extra_state\.pt is missing"):
        ck.verify_checkpoint(c)


def test_format_version_and_missing_metadata_are_named(tmp_path):
    c = _fake_checkpoint(tmp_path / "old", 1, version=99)
    with pytest.raises(ck.CheckpointError, match=r"metadata\.json: format_version 99 is not supported"):
        ck.read_metadata(c)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ck.CheckpointError, match="not a complete checkpoint"):
        ck.read_metadata(tmp_path / "empty")
    assert not ck.is_checkpoint(tmp_path / "empty")


def test_latest_checkpoint_ignores_partial_and_broken(tmp_path):
    assert ck.latest_checkpoint(tmp_path / "nothing") is None
    _fake_checkpoint(tmp_path / "step_1", 1)
    _fake_checkpoint(tmp_path / "step_5", 5)
    _fake_checkpoint(tmp_path / "step_9.tmp-abcd", 9)  # an interrupted save, even with metadata
    (tmp_path / "step_7" / "dist").mkdir(parents=True)  # no metadata.json
    _fake_checkpoint(tmp_path / "step_8", 8, version=0)  # another format version
    (tmp_path / "step_6").mkdir()
    (tmp_path / "step_6" / ck.METADATA).write_text("{not json")
    assert ck.latest_checkpoint(tmp_path) == tmp_path / "step_5"


def test_checksums_cover_every_file_but_metadata(tmp_path):
    c = _fake_checkpoint(tmp_path / "c", 1)
    (c / "hf").mkdir()
    (c / "hf" / "config.json").write_text("{}")
    assert sorted(ck._checksums(c)) == ["dist/__0_0.distcp", "extra_state.pt", "hf/config.json"]


def test_safetensors_parts_index_and_reader(tmp_path):
    tensors = [(f"w{i}", torch.full((100,), float(i))) for i in range(5)]
    tensors.append(("view", torch.arange(1000.0)[:10]))  # a view of a bigger storage is stored alone
    parts = hf_io.write_safetensors_parts(iter(tensors), tmp_path, "part-pp0000", max_bytes=900)
    assert len(parts) == 3
    files = hf_io.finalize_safetensors(tmp_path, parts)
    assert files[-1] == hf_io.INDEX_FILE and files[0] == "model-00001-of-00003.safetensors"
    reader = hf_io.HFCheckpoint(tmp_path)
    assert sorted(reader) == sorted(n for n, _ in tensors)
    for n, t in tensors:
        assert torch.equal(reader[n], t) and reader.shape(n) == tuple(t.shape)
    with pytest.raises(KeyError, match="nope"):
        reader["nope"]


def test_reader_errors_name_files(tmp_path):
    with pytest.raises(hf_io.WeightsError, match="neither model.safetensors"):
        hf_io.HFCheckpoint(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(hf_io.WeightsError, match="pytorch_model.bin is not supported"):
        hf_io.HFCheckpoint(tmp_path)
    (tmp_path / hf_io.SINGLE_FILE).write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{garbage")
    with pytest.raises(hf_io.WeightsError, match=r"model\.safetensors is corrupt"):
        hf_io.HFCheckpoint(tmp_path)


def test_check_hf_weights_names_tensor_file_and_shapes(tmp_path):
    from safetensors.torch import save_file

    save_file({"a": torch.zeros(2, 3)}, str(tmp_path / hf_io.SINGLE_FILE))
    reader = hf_io.HFCheckpoint(tmp_path)
    hf_io.check_hf_weights(reader, {"a": (2, 3)}, "config.json")
    with pytest.raises(hf_io.WeightsError, match=r"'a' in .*model\.safetensors has shape \[2, 3\].*\[3, 2\]"):
        hf_io.check_hf_weights(reader, {"a": (3, 2)}, "config.json")
    with pytest.raises(hf_io.WeightsError, match="'b' required by config.json is missing"):
        hf_io.check_hf_weights(reader, {"b": (1,)}, "config.json")


def test_dtype_names():
    assert hf_io.resolve_dtype("bf16") is torch.bfloat16 and hf_io.resolve_dtype("torch.float32") is torch.float32
    assert hf_io.dtype_name(torch.bfloat16) == "bfloat16"
    with pytest.raises(ValueError, match="unknown dtype"):
        hf_io.resolve_dtype("int8")
