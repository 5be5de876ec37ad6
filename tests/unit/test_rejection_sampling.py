"""Rejection sampling (`megatron_rl.data.rejection_sampling`): scored samples -> SFT examples and DPO pairs that
`megatron-rl sft`/`dpo` read back, checked against hand-built expectations."""
from __future__ import annotations

import json

import pytest

from megatron_rl.data.datasets import DataError
from megatron_rl.data.rejection_sampling import dpo_pairs, main, read_samples, sft_examples

P0 = [{"role": "user", "content": "1 + 2 ="}]
P1 = [{"role": "user", "content": "5 - 7 ="}]


def row(index, completion, reward, prompt=None, finish="stop"):
    return {"index": index, "sample": 0, "prompt": prompt or (P0 if index == 0 else P1), "completion": completion,
            "reward": reward, "finish_reason": finish}


ROWS = [row(0, "<answer>3</answer>", 1.0), row(0, " <answer>3</answer> ", 1.0),  # the same text, twice
        row(0, "<answer>4</answer>", 0.0), row(0, "<answer>12</answer>", 0.0),
        row(0, "<answer>3", 1.0, finish="length"),  # cut off: never trained
        row(1, "<answer>2</answer>", 0.0), row(1, "<answer>-2</answer>", 1.0), row(1, "<answer>-3</answer>", 0.5)]


def test_sft_keeps_distinct_correct_finished_samples():
    assert sft_examples(ROWS, per_prompt=5) == [{"prompt": P0, "completion": "<answer>3</answer>"},
                                                {"prompt": P1, "completion": "<answer>-2</answer>"}]
    # a lower bar admits the partly-right sample
    assert [e["completion"] for e in sft_examples(ROWS, per_prompt=5, threshold=0.5)] == \
        ["<answer>3</answer>", "<answer>-2</answer>", "<answer>-3</answer>"]


def test_dpo_pairs_one_correct_with_one_wrong_per_prompt():
    pairs = dpo_pairs(ROWS, per_prompt=3, seed=0)
    assert [(p["prompt"], p["chosen"]) for p in pairs] == [(P0, "<answer>3</answer>"), (P1, "<answer>-2</answer>")]
    assert pairs[0]["rejected"] in ("<answer>4</answer>", "<answer>12</answer>")
    assert {p["rejected"] for p in pairs[1:]} <= {"<answer>2</answer>", "<answer>-3</answer>"}
    # a prompt with only right (or only wrong) samples gives no pair
    assert dpo_pairs([row(0, "a", 1.0), row(0, "b", 1.0), row(1, "c", 0.0)], per_prompt=2) == []
    # the wrong sample is drawn in a seeded order: some seed picks each of prompt 0's two wrong samples
    assert {dpo_pairs(ROWS, per_prompt=1, seed=s)[0]["rejected"] for s in range(20)} == \
        {"<answer>4</answer>", "<answer>12</answer>"}


def test_the_written_files_are_what_sft_and_dpo_read(tmp_path):
    from megatron_rl.data.supervised import read_pairs, read_sft
    from megatron_rl.data.tokenizer import load_tokenizer
    from megatron_rl.paths import default_model_dir

    if not (default_model_dir() / "config.json").is_file():
        pytest.skip("the embedded model is missing: run launch/setup_env.sh")
    samples = tmp_path / "samples.jsonl"
    samples.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    assert main([str(samples), "--sft", str(tmp_path / "sft.jsonl"), "--dpo", str(tmp_path / "dpo.jsonl")]) == 0
    tok = load_tokenizer(str(default_model_dir()))
    sft = read_sft(tmp_path / "sft.jsonl", tok, 2048, True)
    pairs = read_pairs(tmp_path / "dpo.jsonl", tok, 2048, True)
    assert len(sft) == 2 and len(pairs) == 2
    # the prompt is the conversation rendered with the generation prompt, as the sample was drawn from
    prompt_ids = tok.apply_chat_template(P0, add_generation_prompt=True)
    assert list(sft[0].ids[:sft[0].prompt_len]) == prompt_ids and list(pairs[0].prompt) == prompt_ids
    assert list(sft[0].ids[sft[0].prompt_len:]) == tok.encode("<answer>3</answer>") + [tok.eos_token_id]


def test_a_bad_samples_line_is_named(tmp_path, capsys):
    p = tmp_path / "s.jsonl"
    p.write_text(json.dumps(ROWS[0]) + "\n" + json.dumps({"index": 1, "prompt": P1, "reward": 1.0}) + "\n")
    with pytest.raises(DataError, match=r"s\.jsonl:2: missing field 'completion'"):
        read_samples(p)
    assert main([str(p), "--sft", str(tmp_path / "o.jsonl")]) == 2
    assert "s.jsonl:2: missing field 'completion'" in capsys.readouterr().err
    assert not (tmp_path / "o.jsonl").exists()  # nothing half-written
