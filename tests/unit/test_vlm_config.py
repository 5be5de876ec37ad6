"""A vision-language model folder (models/vlm.py): recognised from its config, refused by the megatron backend in one
line naming policy.backend, and read by the fsdp2 backend's checks as its language model's shape."""
from __future__ import annotations

import json

import pytest

from megatron_rl.config.loader import ConfigError, load_config
from megatron_rl.config.preflight import _model_spec
from megatron_rl.models.provider import shape_spec
from megatron_rl.models.vlm import is_vision_language, text_config
from megatron_rl.paths import REPO_ROOT

DEMO = REPO_ROOT / "configs" / "demo_cpu.yaml"
# the shape of a Gemma-3 / Qwen2.5-VL config.json: the language model nested in text_config (what transformers writes)
VLM = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "tie_word_embeddings": True,
       "text_config": {"model_type": "gemma3_text", "vocab_size": 300, "hidden_size": 64, "intermediate_size": 128,
                       "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
                       "max_position_embeddings": 512},
       "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 64, "image_size": 56, "patch_size": 14}}


@pytest.fixture
def vlm_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(VLM))
    return tmp_path


def test_recognised_and_its_text_model_read(vlm_dir):
    assert is_vision_language(VLM) and not is_vision_language(VLM["text_config"])
    t = text_config(VLM)
    assert t["hidden_size"] == 64 and t["tie_word_embeddings"] is True and "vision_config" not in t
    spec = shape_spec(vlm_dir)
    assert (spec.architecture, spec.num_layers, spec.hidden_size, spec.vocab_size, spec.num_kv_heads,
            spec.head_dim, spec.max_position_embeddings, spec.tied_embeddings) == \
        ("Gemma3ForConditionalGeneration", 2, 64, 300, 1, 32, 512, True)


def test_megatron_refuses_it_naming_the_backend(vlm_dir):
    cfg = load_config(DEMO, [f"policy.model={vlm_dir}", "policy.backend=megatron"])
    with pytest.raises(ConfigError) as e:
        _model_spec(cfg, vlm_dir)
    msg = str(e.value)
    assert "\n" not in msg and "vision-language model (Gemma3ForConditionalGeneration)" in msg
    assert "policy.backend=megatron" in msg and "policy.backend=fsdp2" in msg
    spec, _ = _model_spec(load_config(DEMO, [f"policy.model={vlm_dir}", "policy.backend=fsdp2"]), vlm_dir)
    assert spec.hidden_size == 64


@pytest.mark.parametrize("override, key", [
    ("environment.cls=megatron_rl.environments.guess_number:GuessNumber", "environment.cls: not yet"),
    ("grpo.inflight_weight_updates=true grpo.max_staleness=1 cluster.colocated=false cluster.devices_per_node=2",
     "grpo.inflight_weight_updates / grpo.partial_rollouts: not yet")])
def test_rollouts_whose_requests_carry_no_images_are_refused(vlm_dir, override, key):
    cfg = load_config(DEMO, [f"policy.model={vlm_dir}", "policy.backend=fsdp2", *override.split()], check_model=False)
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        _model_spec(cfg, vlm_dir)


@pytest.mark.parametrize("override, key", [("policy.packing=varlen", "policy.packing=varlen"),
                                           ("policy.tp=2", "policy.tp=2"), ("policy.sp=2", "policy.sp=2")])
def test_fsdp2_refuses_layouts_a_vlm_row_cannot_take(vlm_dir, override, key):
    cfg = load_config(DEMO, [f"policy.model={vlm_dir}", "policy.backend=fsdp2", "cluster.devices_per_node=2",
                                override], check_model=False)
    with pytest.raises(ConfigError, match=key.replace(".", r"\.") + ": a vision-language model trains one sequence"):
        _model_spec(cfg, vlm_dir)
