"""samples.jsonl (`algorithms/samples.py`): which completions a step keeps, what a line holds, that a resumed run
appends without repeating the steps it replays, the TensorBoard text table; and the pre-flight warning for a prompt
whose answer form the verifier does not read."""
import json

import torch

from megatron_rl.algorithms.advantages import SampledGroups
from megatron_rl.algorithms.samples import SampleFile, markdown_table, pick_train_samples
from megatron_rl.algorithms.tracking import Tracker
from megatron_rl.config.preflight import answer_format_mismatch
from megatron_rl.config.schema import DataConfig, RewardConfig
from megatron_rl.data.datasets import PromptItem

FIELDS = {"step", "split", "group", "sample", "prompt", "completion", "answer", "reference", "reward",
          "finish_reason"}


def groups(num_groups=2, G=3) -> SampledGroups:
    payloads = [(PromptItem([1, 2], f"prompt {g}", str(g)),
                 [([5, 6], [-0.1, -0.2], f"g{g}s{j} <answer>{j}</answer>", "stop", str(j)) for j in range(G)])
                for g in range(num_groups)]
    rewards = torch.tensor([[float(j == g) + 0.5 * g for j in range(G)] for g in range(num_groups)])
    return SampledGroups(payloads=payloads, rewards=rewards)


def read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_pick_spreads_over_groups_and_carries_the_trained_reward():
    g = groups()
    rows = pick_train_samples(g, 3, step=7)
    assert [(r["group"], r["sample"]) for r in rows] == [(0, 0), (1, 0), (0, 1)]  # each group's first, then seconds
    assert all(set(r) == FIELDS and r["step"] == 7 and r["split"] == "train" for r in rows)
    for r in rows:
        assert r["reward"] == float(g.rewards[r["group"], r["sample"]])
        assert r["answer"] == str(r["sample"]) and r["reference"] == str(r["group"])
        assert r["completion"].startswith(f"g{r['group']}s{r['sample']}")
    assert len(pick_train_samples(g, 100, step=1)) == 6 and pick_train_samples(g, 0, step=1) == []
    # a sample without the answer (a pending rollout saved before answers were kept) still logs
    g.payloads[0][1][0] = g.payloads[0][1][0][:4]
    assert pick_train_samples(g, 1, step=1)[0]["answer"] is None


def test_resume_drops_replayed_steps_and_appends(tmp_path):
    f = SampleFile(tmp_path, resume_step=0)
    for step in (0, 1, 2, 3):
        f.write(pick_train_samples(groups(), 2, step))
    with open(f.path, "a") as fh:
        fh.write('{"step": 4, "spl')  # a crash mid-line
    f = SampleFile(tmp_path, resume_step=2)  # resumed from the step-2 checkpoint: steps 3 and 4 run again
    for step in (3, 4):
        f.write(pick_train_samples(groups(), 2, step))
    steps = [r["step"] for r in read(f.path)]
    assert steps == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    SampleFile(tmp_path, resume_step=0)  # a fresh run in the same folder starts a new file
    assert f.path.read_text() == ""


def test_tracker_writes_file_and_tensorboard_text(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    t = Tracker(tmp_path, resume_step=0, total_steps=1, tensorboard=True, plots=False, progress=False)
    rows = pick_train_samples(groups(), 2, step=1)
    rows[0]["completion"] = "a | b\nc"  # a pipe or newline must not break the table
    t.log_samples(1, "train", rows)
    t.close()
    assert read(tmp_path / "samples.jsonl") == rows
    acc = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0}).Reload()
    (event,) = acc.Tensors("samples/train/text_summary")
    text = event.tensor_proto.string_val[0].decode()
    assert event.step == 1 and text == markdown_table(rows) and "a \\| b<br>c" in text
    assert len(text.splitlines()) == 2 + len(rows)
    off = Tracker(tmp_path / "off", resume_step=0, total_steps=1, tensorboard=False, plots=False, progress=False,
                  samples=False)
    off.log_samples(1, "train", rows)
    assert not (tmp_path / "off" / "samples.jsonl").exists()


def test_mlflow_gets_a_markdown_table_per_step(tmp_path):
    from megatron_rl.algorithms.trackers import MlflowTracker
    from megatron_rl.config.schema import MlflowConfig

    t = MlflowTracker(MlflowConfig(experiment="mrl-samples"), tmp_path, {"a": 1})
    t.log_samples(3, "val", pick_train_samples(groups(), 1, step=3))
    assert [a.path for a in t.client.list_artifacts(t.run_id, "samples")] == ["samples/val_step_3.md"]
    t.finish(None, failed=False)


def test_answer_format_mismatch_warns_naming_both_keys():
    demo = DataConfig(system_prompt="Give the answer inside <answer></answer> tags.",
                      few_shot=[{"user": "1 + 1 =", "assistant": "<answer>2</answer>"}])
    msg = answer_format_mismatch(demo, RewardConfig(answer_format="boxed"))
    assert "data.system_prompt and data.few_shot" in msg and "reward.answer_format=boxed" in msg
    assert "\n" not in msg
    assert answer_format_mismatch(demo, RewardConfig(answer_format="answer_tag")) is None
    assert answer_format_mismatch(demo, RewardConfig(answer_format="auto")) is None
    boxed = DataConfig(prompt_template="{problem}\nPut the final answer in \\boxed{}.")
    msg = answer_format_mismatch(boxed, RewardConfig(answer_format="answer_tag"))
    assert msg.startswith("data.prompt_template shows \\boxed{}") and "answer_format=answer_tag" in msg
    assert answer_format_mismatch(boxed, RewardConfig(answer_format="boxed")) is None
    assert answer_format_mismatch(DataConfig(), RewardConfig(answer_format="boxed")) is None


def test_a_multiturn_sample_logs_what_the_model_saw_and_each_turn():
    """episode_fields: the prompt is reset()'s conversation as rendered (not the dataset row), the completion a
    transcript with roles, and the environment's error when one ended the trajectory."""
    from types import SimpleNamespace

    from megatron_rl.algorithms.advantages import Sample
    from megatron_rl.algorithms.samples import episode_fields

    class Tok:
        def decode(self, ids):
            return " ".join(f"t{i}" for i in ids)

    traj = SimpleNamespace(prompt_ids=[3, 4], opened=2, env_error="raised: RuntimeError: the tool crashed",
                           messages=[{"role": "system", "content": "s"}, {"role": "user", "content": "q"},
                                     {"role": "assistant", "content": "call"}, {"role": "tool", "content": "42"},
                                     {"role": "assistant", "content": "done"}])
    rec = episode_fields(traj, Tok())
    assert rec["prompt"] == "t3 t4" and rec["env_error"].endswith("the tool crashed")
    assert rec["turns"] == traj.messages[2:]
    assert rec["completion"] == "[assistant] call\n[tool] 42\n[assistant] done"
    g = groups(1, 1)
    g.payloads[0] = (g.payloads[0][0], [Sample([5], [-0.1], "raw", "stop", None, None, rec)])
    (row,) = pick_train_samples(g, 1, step=2)
    assert row["prompt"] == "t3 t4" and row["turns"] == rec["turns"] and row["env_error"] == rec["env_error"]
