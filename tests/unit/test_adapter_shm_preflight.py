"""The adapter-only refit's /dev/shm pre-flight and its gather (issue 54, item 8): every engine writes each adapter
version as a PEFT folder on tmpfs, so a small /dev/shm (Docker's default is 64 MB) fails a run mid-way unless the
start refuses it; and the adapters reach rank 0 only, not every rank."""
from __future__ import annotations

import json
from collections import namedtuple
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from megatron_rl.config import ConfigError, load_config
from megatron_rl.config import preflight
from megatron_rl.config.schema import LoraConfig
from megatron_rl.models.tiny import write_tiny_hf_model

Usage = namedtuple("Usage", "total used free")


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    return write_tiny_hf_model(tmp_path_factory.mktemp("m") / "qwen2", "qwen2")


def _by_hand(model_dir, rank: int, names) -> int:
    """rank x (in + out) per projection from config.json's numbers, fp32, every layer."""
    c = json.loads((model_dir / "config.json").read_text())
    h, nh, nkv, ffn = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["intermediate_size"]
    d = c.get("head_dim") or h // nh
    sizes = {"q_proj": h + nh * d, "k_proj": h + nkv * d, "v_proj": h + nkv * d, "o_proj": nh * d + h,
             "gate_proj": h + ffn, "up_proj": h + ffn, "down_proj": ffn + h}
    return 4 * rank * c["num_hidden_layers"] * sum(sizes[n] for n in names)


def test_adapter_bytes_match_a_count_from_the_config(qwen2):
    every = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    assert preflight.adapter_bytes(qwen2, LoraConfig(rank=8)) == _by_hand(qwen2, 8, every)
    assert preflight.adapter_bytes(qwen2, LoraConfig(rank=4, target_modules=["q_proj", "v_proj"])) == \
        _by_hand(qwen2, 4, ["q_proj", "v_proj"])


def _config(tmp_path, model, dp=2):
    p = tmp_path / "c.yaml"
    p.write_text(f"policy: {{model: {model}, lora: {{rank: 8}}}}\n"
                 f"generation: {{lora_refit: adapter, sleep_level: 1, dp: {dp}}}\n")
    return load_config(p)


def test_preflight_refuses_a_small_dev_shm_in_one_line(tmp_path, qwen2):
    import megatron_rl.paths as paths

    cfg = _config(tmp_path, qwen2)
    need = 2 * 2 * _by_hand(qwen2, 8, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    shm = tmp_path / "shm"
    shm.mkdir()
    with mock.patch.object(paths, "SHM_DIR", str(shm)), \
            mock.patch("shutil.disk_usage", lambda _p: Usage(need * 4, need * 3, need - 1)):
        with pytest.raises(ConfigError) as e:
            preflight.check_adapter_shm(cfg, qwen2)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("generation.lora_refit=adapter")
    assert f"= {need} bytes needed" in msg and f"has {need - 1} bytes free" in msg and str(shm) in msg
    with mock.patch.object(paths, "SHM_DIR", str(shm)), \
            mock.patch("shutil.disk_usage", lambda _p: Usage(need * 4, need * 3, need)):
        preflight.check_adapter_shm(cfg, qwen2)  # exactly enough


def test_preflight_runs_the_check(tmp_path, qwen2):
    """`preflight()` itself reaches the check for a GRPO run on this machine."""
    cfg = _config(tmp_path, qwen2, dp=1)
    with mock.patch.object(preflight, "check_adapter_shm", side_effect=ConfigError("shm")) as check, \
            mock.patch.object(preflight, "check_generation_memory"), \
            mock.patch.object(preflight, "check_generation_platform"), \
            mock.patch.object(preflight, "load_checked_tokenizer"), \
            mock.patch.object(preflight, "check_vocab"), mock.patch.object(preflight, "check_chat_template"), \
            mock.patch.object(preflight, "check_context"), mock.patch.object(preflight, "warn_answer_format"):
        with pytest.raises(ConfigError, match="^shm$"):
            preflight.preflight(cfg)
    check.assert_called_once()


def test_adapter_update_gathers_to_rank_0_only(tmp_path):
    """One gloo rank: rank 0 gets the adapters through a gather; no all-gather runs (that one copied every stage's
    adapters to every rank)."""
    from megatron_rl.policy.weights_out import WeightsOut

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        state = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.arange(6.0).view(2, 3)}
        worker = SimpleNamespace(lora=object(), rank=0, cfg=SimpleNamespace(lora=LoraConfig(rank=2)),
                                 model_dir=tmp_path, _require_resident=lambda *a, **k: None,
                                 _adapter_state=lambda: state, _is_exporter=lambda: True,
                                 _adapter_target_names=lambda: ["q_proj"])
        with mock.patch.object(dist, "all_gather_object", side_effect=AssertionError("all-gather to every rank")):
            update = WeightsOut.adapter_update(worker)
        assert torch.equal(update["tensors"][next(iter(state))], state[next(iter(state))])
        assert update["config"]["r"] == 2
    finally:
        dist.destroy_process_group()
