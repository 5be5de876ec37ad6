"""Resume selection before anything starts (algorithms/resume.py, models/checkpoint.newest_intact_checkpoint): damaged
checkpoints skipped with their fault named, none intact refused, a changed config refused naming its keys."""
import pytest
import yaml

from megatron_rl.algorithms import resume
from megatron_rl.config import ConfigError, dump_yaml, load_config, to_dict
from megatron_rl.models import checkpoint as ck
from tests.unit.test_models_checkpoint import _fake_checkpoint

DEMO = "configs/demo_cpu.yaml"


def _cfg(*overrides):
    return load_config(DEMO, list(overrides), check_model=False)


def _truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    return len(data), len(data) // 2


def test_newest_intact_skips_damaged_ones_naming_file_and_sizes(tmp_path):
    for s in (1, 2, 3):
        _fake_checkpoint(tmp_path / f"step_{s}", s)
    shard = tmp_path / "step_3" / "dist" / "__0_0.distcp"
    full, half = _truncate(shard)
    (tmp_path / "step_4").mkdir()  # a step directory whose metadata.json is gone
    _fake_checkpoint(tmp_path / "step_9.tmp-x", 9)  # an interrupted save is no candidate at all
    damaged = []
    path, meta = ck.newest_intact_checkpoint(tmp_path, on_damaged=lambda p, why: damaged.append((p, why)))
    assert (path, meta["step"]) == (tmp_path / "step_2", 2)
    assert damaged == [
        (tmp_path / "step_4", f"{tmp_path / 'step_4' / 'metadata.json'} is missing: {tmp_path / 'step_4'} is not a "
                              "complete checkpoint"),
        (tmp_path / "step_3", f"{shard} has {half} bytes, metadata.json says {full}"),
    ]
    assert ck.latest_checkpoint(tmp_path) == tmp_path / "step_3"  # the unverified pick resume used before


def test_no_intact_checkpoint_refused_naming_each(tmp_path):
    assert ck.newest_intact_checkpoint(tmp_path / "none") is None
    for s in (1, 2):
        _fake_checkpoint(tmp_path / f"step_{s}", s)
    (tmp_path / "step_1" / "extra_state.pt").unlink()
    flipped = tmp_path / "step_2" / "dist" / "__0_0.distcp"
    flipped.write_bytes(b"weightz" * 100)
    with pytest.raises(ck.CheckpointError) as e:
        ck.newest_intact_checkpoint(tmp_path)
    msg = str(e.value)
    assert msg.startswith(f"no intact checkpoint to resume from in {tmp_path}: {tmp_path / 'step_2'} ({flipped} is "
                          f"corrupt (sha256 differs from metadata.json)); {tmp_path / 'step_1'} "
                          f"({tmp_path / 'step_1' / 'extra_state.pt'} is missing)"), msg
    assert "\n" not in msg


def test_changed_run_keys_names_what_changes_the_run_only():
    saved = _cfg()
    now = _cfg("data.task_params.min_terms=3", "reward.format_reward=0.5", "generation.temperature=0.7",
               # none of these changes what is trained
               "grpo.max_steps=99", "grpo.val_every=0", "logging.plots=false", "output.dir=elsewhere",
               "checkpoint.keep_last=5", "reward.num_workers=4", "policy.threads=1")
    got = resume.changed_run_keys(to_dict(saved), to_dict(now))
    assert got == [("data.task_params.min_terms", saved.data.task_params["min_terms"], 3),
                   ("generation.temperature", saved.generation.temperature, 0.7),
                   ("reward.format_reward", saved.reward.format_reward, 0.5)]
    assert resume.changed_run_keys(to_dict(saved), to_dict(_cfg())) == []
    # a key only one side has (an older run's config.yaml) counts as changed
    old = to_dict(saved)
    del old["data"]["skip_malformed"]
    assert resume.changed_run_keys(old, to_dict(saved)) == [("data.skip_malformed", None, False)]


def test_resume_point_refuses_a_changed_config_unless_allowed(tmp_path, capsys):
    out, root = tmp_path / "run", tmp_path / "run" / "checkpoints"
    root.mkdir(parents=True)
    dump_yaml(_cfg(f"output.dir={out}"), out / "config.yaml")
    for s in (1, 2):
        _fake_checkpoint(root / f"step_{s}", s)
    _fake_checkpoint(root / "step_3.tmp-abc", 3)
    changed = _cfg(f"output.dir={out}", "data.task_params.min_terms=3")
    with pytest.raises(ConfigError) as e:
        resume.resume_point(changed, out, root)
    assert str(e.value) == (
        f"resuming {root / 'step_2'} would change the run: data.task_params.min_terms (2 -> 3) (vs "
        f"{out / 'config.yaml'}); use another output.dir for a new run, or set checkpoint.allow_config_change=true "
        "to resume anyway")
    assert not (root / "step_3.tmp-abc").exists()  # the partial save was removed first
    assert "removing partial checkpoint" in capsys.readouterr().out

    allowed = _cfg(f"output.dir={out}", "data.task_params.min_terms=3", "checkpoint.allow_config_change=true")
    assert resume.resume_point(allowed, out, root) == resume.ResumePoint(root / "step_2", 2)
    assert "warning: resuming" in capsys.readouterr().err
    # same config, more steps: resumes; a damaged newest one is skipped with a warning naming it and the file
    _truncate(root / "step_2" / "extra_state.pt")
    assert resume.resume_point(_cfg(f"output.dir={out}", "grpo.max_steps=80"), out, root) == \
        resume.ResumePoint(root / "step_1", 1)
    err = capsys.readouterr().err
    assert f"warning: checkpoint {root / 'step_2'} is damaged: {root / 'step_2' / 'extra_state.pt'} has 2 bytes, " \
           f"metadata.json says 5; resuming from {root / 'step_1'} instead" in err, err
    # checkpoint.resume=false starts over whatever is there
    assert resume.resume_point(_cfg(f"output.dir={out}", "checkpoint.resume=false"), out, root).checkpoint is None


def test_saved_config_round_trips_without_changes(tmp_path):
    """config.yaml as the loop writes it compares equal to the config it was written from (floats, nulls, lists)."""
    cfg = _cfg("policy.optimizer.lr=3e-6", "generation.stop=['</answer>']", "grpo.loss.ratio_clip_c=3")
    dump_yaml(cfg, tmp_path / "config.yaml")
    assert resume.changed_run_keys(yaml.safe_load((tmp_path / "config.yaml").read_text()), to_dict(cfg)) == []


def test_environment_keys_change_a_multiturn_run_only():
    saved = to_dict(_cfg())
    before_section = {k: v for k, v in saved.items() if k != "environment"}  # a config.yaml older than the section
    assert resume.changed_run_keys(before_section, saved) == []
    multi = to_dict(_cfg("environment.cls=megatron_rl.environments.guess_number:GuessNumber"))
    assert [k for k, _, _ in resume.changed_run_keys(saved, multi)] == ["environment.cls"]
    more_turns = to_dict(_cfg("environment.cls=megatron_rl.environments.guess_number:GuessNumber",
                              "environment.max_turns=6", "environment.num_workers=4", "environment.timeout_s=30"))
    assert resume.changed_run_keys(multi, more_turns) == [("environment.max_turns", 4, 6)]


def test_sft_and_dpo_runs_compare_their_own_section():
    base = to_dict(load_config("configs/sft_cpu.yaml", ["algorithm=sft"], check_model=False))
    changed = {**base, "sft": {**base["sft"], "loss_normalizer": "sequences", "max_steps": 9, "val_every": 1},
               "grpo": {**base["grpo"], "num_prompts_per_step": 3}, "generation": {**base["generation"],
                                                                                  "temperature": 0.5}}
    # the objective changed; steps, validation and the unused GRPO/generation keys do not change an SFT run
    assert resume.changed_run_keys(base, changed) == [("sft.loss_normalizer", "tokens", "sequences")]
    assert resume.changed_run_keys(base, {**base, "algorithm": "dpo"}) == [("algorithm", "sft", "dpo")]
    # a GRPO config saved before the algorithm key existed still resumes as GRPO
    grpo = to_dict(load_config("configs/demo_cpu.yaml", check_model=False))
    legacy = {k: v for k, v in grpo.items() if k not in ("algorithm", "sft", "dpo")}
    assert resume.changed_run_keys(legacy, grpo) == []
