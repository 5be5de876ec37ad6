"""Typed config: inheritance, overrides, errors naming the key path, and every shipped YAML validates."""
import json
from pathlib import Path

import pytest

from megatron_rl.config import ConfigError, apply_overrides, load_config, read_yaml_tree
from megatron_rl.config.schema import Config

REPO = Path(__file__).resolve().parents[2]


def write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return p


def tiny_model_dir(tmp_path, heads=4, kv=2, layers=4):
    d = tmp_path / "model"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(
        {"num_attention_heads": heads, "num_key_value_heads": kv, "num_hidden_layers": layers}))
    return d


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_validates(path):
    tree = read_yaml_tree(path)
    if "stages" in tree:  # a stage chain: every stage must load and validate, each initialised from the last
        from megatron_rl.algorithms.stages import load_stages

        for st in load_stages(path):
            load_config(st.config, st.overrides + ["init_from=/prev/step_1"], check_model=False)
        return
    # the model is checked separately (it may be a path on a cluster); everything else must be valid here
    cfg = load_config(path, check_model=False)
    assert isinstance(cfg, Config)


def test_inheritance_and_overrides(tmp_path):
    write(tmp_path, "base.yaml", "policy:\n  tp: 2\n  optimizer: {lr: 1.0e-5, clip_grad: 0.5}\n")
    child = write(tmp_path, "child.yaml", "defaults: base.yaml\npolicy:\n  optimizer: {lr: 3.0e-6}\n")
    model = tiny_model_dir(tmp_path)
    cfg = load_config(child, [f"policy.model={model}", "grpo.max_steps=7", "cluster.devices_per_node=2"])
    assert cfg.policy.tp == 2  # inherited
    assert cfg.policy.optimizer.lr == 3e-6  # child wins
    assert cfg.policy.optimizer.clip_grad == 0.5  # sibling key of an overridden one survives the merge
    assert cfg.grpo.max_steps == 7  # command line wins
    assert cfg.generation.max_new_tokens == Config().generation.max_new_tokens  # schema default


def test_misspelt_key_names_full_path(tmp_path):
    p = write(tmp_path, "bad.yaml", "policy:\n  optimizer:\n    lrr: 1.0\n")
    with pytest.raises(ConfigError, match=r"policy\.optimizer\.lrr"):
        load_config(p, check_model=False)


def test_misspelt_section_and_override(tmp_path):
    p = write(tmp_path, "ok.yaml", "{}\n")
    with pytest.raises(ConfigError, match=r"'polcy'"):
        load_config(p, ["polcy.tp=2"], check_model=False)


@pytest.mark.parametrize("override,match", [
    ("grpo.max_steps=ten", r"grpo\.max_steps: expected an integer"),
    ("policy.precision=fp8", r"policy\.precision: 'fp8' is not one of"),
    ("generation.temperature=0", r"generation\.temperature must be > 0"),
    ("policy.optimizer.lr=[1]", r"policy\.optimizer\.lr: expected a number"),
    ("grpo.loss.ratio_clip_c=0.5", r"grpo\.loss\.ratio_clip_c"),
    ("logging.tensorboard=maybe", r"logging\.tensorboard: expected true/false"),
    ("generation.gpu_memory_utilization=1.5", r"generation\.gpu_memory_utilization must be in \(0, 1\]"),
    ("generation.sleep_level=3", r"generation\.sleep_level: 3 is not one of"),
])
def test_wrong_values_name_key(tmp_path, override, match):
    p = write(tmp_path, "ok.yaml", "{}\n")
    with pytest.raises(ConfigError, match=match):
        load_config(p, [override], check_model=False)


def test_fp16_is_refused_with_the_reason(tmp_path):
    why = r"policy\.precision: 'fp16' is refused: fp16 needs dynamic loss scaling.*use bf16 \(or fp32\)"
    with pytest.raises(ConfigError, match=why):
        load_config(write(tmp_path, "fp16.yaml", "policy: {precision: fp16}\n"), check_model=False)
    with pytest.raises(ConfigError, match=why):
        load_config(write(tmp_path, "ok.yaml", "{}\n"), ["policy.precision=fp16"], check_model=False)
    for ok in ("auto", "bf16", "fp32"):
        assert load_config(tmp_path / "ok.yaml", [f"policy.precision={ok}"], check_model=False).policy.precision == ok


def test_impossible_parallel_layout_names_model(tmp_path):
    model = tiny_model_dir(tmp_path, heads=9, kv=3, layers=30)  # SmolLM2's shape
    p = write(tmp_path, "c.yaml", f"policy: {{model: {model}}}\ncluster: {{devices_per_node: 4}}\n")
    with pytest.raises(ConfigError, match=r"policy\.tp=2 does not divide num_attention_heads=9"):
        load_config(p, ["policy.tp=2"])
    with pytest.raises(ConfigError, match=r"policy\.pp=4 does not divide num_hidden_layers=30"):
        load_config(p, ["policy.pp=4"])
    assert load_config(p, ["policy.tp=3", "policy.dp=1"]).policy.tp == 3


def test_layout_must_fit_cluster(tmp_path):
    p = write(tmp_path, "c.yaml", "cluster: {devices_per_node: 2}\n")
    with pytest.raises(ConfigError, match=r"do not fit cluster"):
        load_config(p, ["policy.tp=2", "policy.pp=2"], check_model=False)


def test_inheritance_cycle_and_missing_parent(tmp_path):
    write(tmp_path, "a.yaml", "defaults: b.yaml\n")
    write(tmp_path, "b.yaml", "defaults: a.yaml\n")
    with pytest.raises(ConfigError, match="cycle"):
        read_yaml_tree(tmp_path / "a.yaml")
    write(tmp_path, "c.yaml", "defaults: nowhere.yaml\n")
    with pytest.raises(ConfigError, match="nowhere.yaml"):
        read_yaml_tree(tmp_path / "c.yaml")


def test_override_syntax():
    tree = apply_overrides({"a": {"keep": 1}}, ["a.b=[1, 2]", "a.c=null", "d=true"])
    assert tree == {"a": {"keep": 1, "b": [1, 2], "c": None}, "d": True}
    with pytest.raises(ConfigError, match="key.path=value"):
        apply_overrides({}, ["policy.tp"])
    # an optional section that is off (null, as a saved config.yaml writes it) is switched on by a key under it
    tree = apply_overrides({"logging": {"wandb": None}}, ["logging.wandb.mode=offline"])
    assert tree == {"logging": {"wandb": {"mode": "offline"}}}
    with pytest.raises(ConfigError, match="'a' is not a section"):
        apply_overrides({"a": 3}, ["a.b=1"])


def test_scientific_notation_without_dot_is_a_float(tmp_path):
    p = write(tmp_path, "c.yaml", "policy: {optimizer: {lr: 1e-6}}\n")  # YAML 1.1 reads this as a string
    assert load_config(p, check_model=False).policy.optimizer.lr == 1e-6


@pytest.mark.parametrize("colocated,expected", [("true", 0.5), ("false", 0.9)])
def test_engine_memory_share_follows_the_placement(tmp_path, colocated, expected):
    """Unset, vLLM's share of an engine device is half when the trainer comes back onto it between rollouts, and
    vLLM's own 0.9 when the engine owns its device; an explicit value wins."""
    p = write(tmp_path, "ok.yaml", "{}\n")
    over = [f"cluster.colocated={colocated}", "cluster.devices_per_node=2"]
    assert load_config(p, over, check_model=False).generation.gpu_memory_utilization == expected
    explicit = load_config(p, over + ["generation.gpu_memory_utilization=0.7"], check_model=False)
    assert explicit.generation.gpu_memory_utilization == 0.7


def test_packing_auto_is_the_platforms_choice(tmp_path):
    """`policy.packing: auto` becomes varlen on GPU (a block mask would send attention down the unfused O(s^2) path)
    and on CPU none for rows up to MASKED_ROW_TOKENS, where the mask layout measured as fast, varlen above; an
    explicit value wins."""
    import torch

    from megatron_rl.platform import Platform, get_platform

    from megatron_rl.platform import MASKED_ROW_TOKENS

    p = write(tmp_path, "ok.yaml", "{}\n")
    short = ["data.max_prompt_tokens=256", "generation.max_new_tokens=32", "grpo.num_generations_per_prompt=8"]
    cfg = load_config(p, short, check_model=False)
    assert cfg.longest_train_row() == 256 + 8 * 32  # one group's row: its prompt once, its 8 responses
    assert cfg.policy.packing == get_platform().default_packing == "none"
    assert load_config(p, short + ["policy.packing=varlen"], check_model=False).policy.packing == "varlen"
    # CPU rows above MASKED_ROW_TOKENS: varlen, whose memory grows with the row, not with its square; the bound is
    # the config's (a multi-turn group: its prompt and G whole trajectories' budgets)
    long = load_config(p, ["data.max_prompt_tokens=256", "generation.max_new_tokens=128"], check_model=False)
    assert long.longest_train_row() == 256 + long.grpo.num_generations_per_prompt * 128 > MASKED_ROW_TOKENS
    assert long.policy.packing == "varlen"
    assert load_config(p, ["data.max_prompt_tokens=256", "generation.max_new_tokens=128", "policy.packing=none"],
                       check_model=False).policy.packing == "none"  # asked for
    multi = load_config(p, short + ["environment.cls=a.b:C", "environment.max_tokens=1024"], check_model=False)
    assert multi.longest_train_row() == 256 + 8 * (1024 - 256) and multi.policy.packing == "varlen"
    # without shared_prefix a row is one sequence
    assert load_config(p, short + ["policy.shared_prefix=false"], check_model=False).longest_train_row() == 288
    gpu = Platform("cuda", "nccl", torch.bfloat16, "triton", "cuda_ipc", "collective", False)
    assert gpu.default_packing == "varlen" and gpu.packing_for(100) == "varlen"


def test_stage_chain_runs_its_stages_in_order_with_the_run_it_is_given(tmp_path):
    """`run_chain` loads each stage (overrides on top), hands it to `run` (the CLI and the API pass `build.run`)
    initialised from the previous stage's last checkpoint, and stops at the first non-zero status."""
    from megatron_rl.algorithms.stages import run_chain

    model = tiny_model_dir(tmp_path)
    for name in ("a", "b"):
        write(tmp_path, f"{name}.yaml", f"policy: {{model: {model}}}\noutput: {{dir: {tmp_path / name}}}\n"
                                         "grpo: {max_steps: 2}\n")
    chain = write(tmp_path, "chain.yaml", "stages:\n  - config: a.yaml\n  - config: b.yaml\n"
                                          "    overrides: [grpo.max_steps=3]\n")
    seen = []

    def run(cfg):
        seen.append((cfg.output.dir, cfg.init_from, cfg.grpo.max_steps, cfg.grpo.seed))
        return 0

    assert run_chain(chain, ["grpo.seed=7"], run=run) == 0
    assert seen == [(str(tmp_path / "a"), None, 2, 7),
                    (str(tmp_path / "b"), str(tmp_path / "a" / "checkpoints" / "step_2"), 3, 7)]
    failed = []
    assert run_chain(chain, [], run=lambda cfg: failed.append(cfg.output.dir) or 3) == 3
    assert failed == [str(tmp_path / "a")]  # the second stage never starts


def test_stage_chain_sft_then_grpo(tmp_path):
    """An SFT stage (algorithm: sft) is always handed to `run` (which knows its epochs' step count and says when it
    is complete); the GRPO stage after it starts from its last checkpoint."""
    from megatron_rl.algorithms.stages import run_chain

    model = tiny_model_dir(tmp_path)
    data = write(tmp_path, "d.jsonl", '{"prompt": "p", "completion": "c"}\n')
    write(tmp_path, "a.yaml", f"algorithm: sft\npolicy: {{model: {model}}}\noutput: {{dir: {tmp_path / 'a'}}}\n"
                              f"data: {{path: {data}}}\nsft: {{max_steps: 4, batch_size: 2}}\n")
    write(tmp_path, "b.yaml", f"policy: {{model: {model}}}\noutput: {{dir: {tmp_path / 'b'}}}\n")
    chain = write(tmp_path, "chain.yaml", "stages:\n  - config: a.yaml\n  - config: b.yaml\n")
    seen = []
    assert run_chain(chain, [], run=lambda cfg: seen.append((cfg.algorithm, cfg.init_from)) or 0) == 0
    assert seen == [("sft", None), ("grpo", str(tmp_path / "a" / "checkpoints" / "step_4"))]


def test_the_sft_then_grpo_example_chain(capsys):
    """configs/sft_then_grpo_cpu.yaml: SFT on sft_cpu.yaml's data, then the GRPO demo from its final checkpoint."""
    from megatron_rl.algorithms.stages import load_stages, run_chain

    chain = REPO / "configs" / "sft_then_grpo_cpu.yaml"
    sft, grpo = [load_config(st.config, st.overrides, check_model=False) for st in load_stages(chain)]
    assert sft.algorithm == "sft" and Path(sft.data.path).name == "sft_tiny.jsonl"
    assert grpo.algorithm == "grpo" and grpo.data.source == "reasoning_gym" and grpo.init_from is None
    assert sft.output.dir != grpo.output.dir
    seen = []
    assert run_chain(chain, [], run=lambda cfg: seen.append(cfg) or 0) == 0
    assert [c.algorithm for c in seen] == ["sft", "grpo"]
    assert seen[1].init_from == str(Path(sft.output.dir) / "checkpoints" / "step_N")  # never run here: no step yet


def test_policy_backend_defaults_to_megatron_and_takes_fsdp2(tmp_path):
    p = write(tmp_path, "ok.yaml", "{}\n")
    assert load_config(p, [], check_model=False).policy.backend == "megatron"
    cfg = load_config(p, ["policy.backend=fsdp2"], check_model=False)
    assert cfg.policy.backend == "fsdp2" and cfg.policy.packing == "none"  # auto: padded rows on either platform
    assert load_config(p, ["policy.backend=fsdp2", "policy.packing=varlen"],
                       check_model=False).policy.packing == "varlen"  # asked for: one masked row per micro-batch
    with pytest.raises(ConfigError, match=r"policy\.backend: 'deepspeed' is not one of"):
        load_config(p, ["policy.backend=deepspeed"], check_model=False)


@pytest.mark.parametrize("override,match", [
    ("policy.pp=2", r"policy\.pp=2: policy\.backend=fsdp2 runs data and tensor parallelism only"),
    ("policy.ep=2", r"policy\.ep=2: policy\.backend=fsdp2 runs data and tensor parallelism only"),
])
def test_what_fsdp2_does_not_do_yet_is_refused_naming_the_key(tmp_path, override, match):
    p = write(tmp_path, "ok.yaml", "{}\n")
    with pytest.raises(ConfigError, match=match):
        load_config(p, ["policy.backend=fsdp2", override], check_model=False)
    load_config(p, [override], check_model=False)  # the megatron backend takes it


def test_reward_model_runs_derive_their_value_head_and_refuse_what_does_not_fit(tmp_path):
    """algorithm=rm gives the policy a value head (and no fused lm_head: there are no logits); nothing else may set
    policy.value_head; LoRA and a negative centring coefficient are refused, naming the key."""
    p = write(tmp_path, "rm.yaml", "data: {path: x.jsonl}\n")
    cfg = load_config(p, ["algorithm=rm"], check_model=False)
    assert cfg.policy.value_head and not cfg.policy.fused_lm_head
    assert not load_config(p, ["algorithm=dpo"], check_model=False).policy.value_head
    for over, match in ((["policy.value_head=true"], r"policy\.value_head is set by algorithm=rm"),
                        (["algorithm=rm", "rm.center_rewards_coefficient=-1"], r"rm\.center_rewards_coefficient"),
                        (["algorithm=rm", "policy.lora.rank=8"], r"policy\.lora"),
                        (["algorithm=rm", "data.path=null"], r"data\.path is required for algorithm=rm")):
        with pytest.raises(ConfigError, match=match):
            load_config(p, over, check_model=False)


def test_bare_on_and_off_are_the_words_not_booleans(tmp_path):
    """YAML 1.1 reads a bare `off` / `on` as a boolean: for a key whose values include the word it means the word,
    in a file and on the command line (grpo.mismatch_guard=off was refused as `False` before)."""
    p = tmp_path / "c.yaml"
    p.write_text("defaults: base.yaml\ngrpo: {mismatch_guard: off}\n")
    (tmp_path / "base.yaml").write_text(Path("configs/base.yaml").read_text())
    assert load_config(p).grpo.mismatch_guard == "off"
    cfg = load_config(p, ["grpo.loss.importance_mask=off", "grpo.mismatch_guard=off"])
    assert (cfg.grpo.loss.importance_mask, cfg.grpo.mismatch_guard) == ("off", "off")
    with pytest.raises(ConfigError, match=r"grpo\.mismatch_guard: True is not one of"):
        load_config(p, ["grpo.mismatch_guard=on"])  # no such word among its values: still refused
