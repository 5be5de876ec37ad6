"""policy.lora in the config: defaults, YAML, and bad settings as one-line errors naming the key."""
import pytest

from megatron_rl.config import ConfigError, load_config
from megatron_rl.config.schema import LoraConfig, PolicyConfig
from megatron_rl.models.lora_targets import ATTENTION, TARGETS, resolve_targets
from megatron_rl.models.tiny import tiny_hf_config, write_tiny_hf_model


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {k: write_tiny_hf_model(root / k, k) for k in ("qwen2", "qwen3_moe", "mixtral")}


def _load(tmp_path, model, lora: str):
    p = tmp_path / "c.yaml"
    p.write_text(f"policy: {{model: {model}, lora: {lora}}}\n")
    return load_config(p)


def test_off_by_default_and_defaults_in_one_place(tmp_path, models):
    assert PolicyConfig().lora is None
    cfg = _load(tmp_path, models["qwen2"], "{}")
    assert cfg.policy.lora == LoraConfig()
    assert cfg.policy.lora.target_modules == ["all-linear"]
    cfg = _load(tmp_path, models["qwen2"], "{rank: 8, alpha: 16, target_modules: [q_proj, v_proj]}")
    assert (cfg.policy.lora.rank, cfg.policy.lora.alpha, cfg.policy.lora.target_modules) == (8, 16.0,
                                                                                             ["q_proj", "v_proj"])


@pytest.mark.parametrize("model, lora, match", [
    ("qwen2", "{rank: 0}", r"^policy\.lora\.rank must be >= 1, got 0$"),
    ("qwen2", "{rank: -4}", r"^policy\.lora\.rank must be >= 1"),
    ("qwen2", "{alpha: 0}", r"^policy\.lora\.alpha must be > 0"),
    ("qwen2", "{dropout: 1.0}", r"^policy\.lora\.dropout must be in \[0, 1\)"),
    ("qwen2", "{target_modules: [q_proj, lm_head]}", r"^policy\.lora\.target_modules: 'lm_head' is no linear layer"),
    ("qwen2", "{target_modules: [qkv_proj]}", r"^policy\.lora\.target_modules: 'qkv_proj' is no linear layer"),
    ("qwen2", "{target_modules: []}", r"^policy\.lora\.target_modules is empty"),
    ("qwen3_moe", "{target_modules: [q_proj, gate_proj]}",
     r"^policy\.lora\.target_modules: 'gate_proj' is an expert projection of this mixture-of-experts model"),
    ("mixtral", "{target_modules: [w1]}", r"^policy\.lora\.target_modules: 'w1' is an expert projection"),
    ("qwen2", "{rnak: 4}", r"unknown key 'policy\.lora\.rnak'"),
])
def test_bad_settings_are_one_line_errors_naming_the_key(tmp_path, models, model, lora, match):
    with pytest.raises(ConfigError) as e:
        _load(tmp_path, models[model], lora)
    msg = str(e.value).split(": ", 1)[1] if str(e.value).startswith(str(tmp_path)) else str(e.value)
    assert "\n" not in str(e.value)
    assert __import__("re").search(match, msg), str(e.value)


def test_target_resolution_follows_peft_names():
    dense = tiny_hf_config("qwen2")
    assert [t.hf for t in resolve_targets(["all-linear"], dense)] == list(TARGETS)
    assert [t.hf for t in resolve_targets("all-linear", dense)] == list(TARGETS)
    # PEFT's all-linear on an MoE model adapts its dense linears: here the attention (experts take none)
    assert [t.hf for t in resolve_targets(["all-linear"], tiny_hf_config("qwen3_moe"))] == list(ATTENTION)
    got = resolve_targets(["v_proj", "q_proj", "down_proj"], dense)
    assert [(t.hf, t.module, t.kind, t.slot) for t in got] == [
        ("q_proj", "self_attention.linear_qkv", "column", 0), ("v_proj", "self_attention.linear_qkv", "column", 2),
        ("down_proj", "mlp.linear_fc2", "row", 0)]


def _load_refit(tmp_path, model, overrides):
    p = tmp_path / "c.yaml"
    p.write_text(f"policy: {{model: {model}}}\n")
    return load_config(p, overrides)


def test_adapter_refit_is_off_by_default_and_needs_lora(tmp_path, models):
    from megatron_rl.config.schema import GenerationConfig

    assert GenerationConfig().lora_refit == "merged"
    cfg = _load_refit(tmp_path, models["qwen2"], ["policy.lora.rank=8", "generation.lora_refit=adapter",
                                                  "generation.sleep_level=1"])
    assert (cfg.generation.lora_refit, cfg.policy.lora.rank) == ("adapter", 8)
    # engines on devices of their own never sleep: any level goes
    cfg = _load_refit(tmp_path, models["qwen2"], ["policy.lora.rank=8", "generation.lora_refit=adapter",
                                                  "cluster.colocated=false"])
    assert cfg.generation.sleep_level == 2


@pytest.mark.parametrize("overrides, match", [
    (["generation.lora_refit=adapter"],
     r"^generation\.lora_refit=adapter sends the engines LoRA adapters, but policy\.lora is not set"),
    (["generation.lora_refit=adapter", "policy.lora.rank=8"], r"^generation\.sleep_level=2 discards the engine's base"),
    (["generation.lora_refit=adapter", "policy.lora.rank=1024", "generation.sleep_level=1"],
     r"^policy\.lora\.rank=1024: vLLM serves adapters of rank <= 512"),
    (["generation.lora_refit=fused"], r"generation\.lora_refit"),
])
def test_adapter_refit_errors_name_the_key(tmp_path, models, overrides, match):
    with pytest.raises(ConfigError) as e:
        _load_refit(tmp_path, models["qwen2"], overrides)
    msg = str(e.value).split(": ", 1)[1] if str(e.value).startswith(str(tmp_path)) else str(e.value)
    assert "\n" not in str(e.value)
    assert __import__("re").search(match, msg), str(e.value)


def _peft_targets(kind: str, target_modules) -> list[str]:
    """The module paths under decoder layer 0 that PEFT itself puts adapters on (the independent reference)."""
    from peft import LoraConfig as PeftLora, get_peft_model

    from megatron_rl.models.tiny import make_tiny_hf_model

    model = get_peft_model(make_tiny_hf_model(kind), PeftLora(r=2, target_modules=target_modules))
    head = "base_model.model.model.layers.0."
    return [n[len(head):-len(".lora_A")] for n, _ in model.named_modules()
            if n.startswith(head) and n.endswith(".lora_A")]


@pytest.mark.parametrize("kind, target_modules", [
    ("phi3", "all-linear"), ("phi3", ["qkv_proj"]), ("phi3", ["o_proj", "gate_up_proj"]),
    ("gemma2", "all-linear"), ("olmo2", ["q_proj", "down_proj"]), ("qwen2", ["self_attn.v_proj", "up_proj"]),
])
def test_fsdp2_targets_are_the_linears_peft_adapts(kind, target_modules):
    """The FSDP2 backend adapts transformers' modules as they are: its selection is PEFT's, also for the fused
    projections (Phi-3's qkv_proj) that the megatron backend's mapping does not know."""
    from megatron_rl.models.hf_layers import decoder_layers, linear_paths
    from megatron_rl.models.lora_targets import select_hf_linears
    from megatron_rl.models.tiny import make_tiny_hf_model

    paths = linear_paths(decoder_layers(make_tiny_hf_model(kind)))
    assert sorted(select_hf_linears(target_modules, paths, moe=False)) == sorted(_peft_targets(kind, target_modules))


def test_fsdp2_lora_targets_are_checked_against_the_model_before_start(tmp_path, tmp_path_factory):
    root = tmp_path_factory.mktemp("unmapped")
    phi3 = write_tiny_hf_model(root / "phi3", "phi3")
    moe = write_tiny_hf_model(root / "qwen3_moe", "qwen3_moe")
    cfg = _load_refit(tmp_path, phi3, ["policy.backend=fsdp2", "policy.lora.target_modules=[qkv_proj]"])
    assert cfg.policy.lora.target_modules == ["qkv_proj"]
    with pytest.raises(ConfigError, match=r"policy\.lora\.target_modules: 'q_proj' is no linear layer .*qkv_proj"):
        _load_refit(tmp_path, phi3, ["policy.backend=fsdp2", "policy.lora.target_modules=[q_proj]"])
    with pytest.raises(ConfigError, match=r"'gate_proj' is no linear layer .*experts and routers take no adapters"):
        _load_refit(tmp_path, moe, ["policy.backend=fsdp2", "policy.lora.target_modules=[q_proj, gate_proj]"])
    _load_refit(tmp_path, moe, ["policy.backend=fsdp2", "policy.lora.rank=4"])  # all-linear: the attention


def test_peft_spellings_are_taken_as_peft_writes_them(tmp_path, models):
    """A LoRA block copied from a PEFT recipe: `r`, `lora_alpha`, `lora_dropout` and `target_modules: all-linear`
    as a string (PEFT's LoraConfig accepts each); the same values as our own names give."""
    peft = _load(tmp_path, models["qwen2"], "{r: 8, lora_alpha: 16, lora_dropout: 0.05, target_modules: all-linear}")
    ours = _load(tmp_path, models["qwen2"], "{rank: 8, alpha: 16, dropout: 0.05, target_modules: [all-linear]}")
    assert peft.policy.lora == ours.policy.lora == LoraConfig(rank=8, alpha=16.0, dropout=0.05)
    cli = _load_refit(tmp_path, models["qwen2"], ["policy.lora.r=4", "policy.lora.target_modules=all-linear"])
    assert (cli.policy.lora.rank, cli.policy.lora.target_modules) == (4, ["all-linear"])


@pytest.mark.parametrize("lora, match", [
    ("{r: 8, rank: 8}", r"policy\.lora\.r: PEFT's name for rank, which is also given"),
    ("{target_modules: q_proj}", r"policy\.lora\.target_modules: 'q_proj' as a string is a PEFT regular expression"),
])
def test_peft_spellings_refused_where_ambiguous(tmp_path, models, lora, match):
    with pytest.raises(ConfigError, match=match):
        _load(tmp_path, models["qwen2"], lora)


def test_an_override_error_names_the_override_not_the_file(tmp_path, models):
    p = tmp_path / "c.yaml"
    p.write_text(f"policy: {{model: {models['qwen2']}}}\n")
    with pytest.raises(ConfigError) as e:
        load_config(p, ["grpo.max_steps=3", "policy.lora.rnak=4"])
    assert str(e.value).startswith("command-line override 'policy.lora.rnak=4': unknown key 'policy.lora.rnak'")
    assert str(p) not in str(e.value)
    p.write_text(f"policy: {{model: {models['qwen2']}, lora: {{rnak: 4}}}}\n")
    with pytest.raises(ConfigError) as e:  # written in the file: the file is named
        load_config(p, ["grpo.max_steps=3"])
    assert str(e.value).startswith(f"{p}: unknown key 'policy.lora.rnak'")
