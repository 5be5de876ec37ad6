"""SFT / DPO data: the trained tokens are exactly the assistant's (checked against renderings made here with the HF
tokenizer directly), every bad line is one DataError naming file, line and field, and the epoch stream resumes
exactly."""
from __future__ import annotations

import json

import pytest

from megatron_rl.algorithms.supervised_batches import ExampleStream, pair_batch, sft_batch
from megatron_rl.data.datasets import DataError
from megatron_rl.data.supervised import read_pairs, read_sft
from megatron_rl.data.tokenizer import tokenizer_for
from megatron_rl.paths import default_model_dir

pytestmark = pytest.mark.skipif(not (default_model_dir() / "tokenizer.json").is_file(),
                                reason="the embedded SmolLM2 tokenizer (launch/setup_env.sh)")


@pytest.fixture(scope="module")
def tok():
    return tokenizer_for(default_model_dir())


@pytest.fixture(scope="module")
def hf():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(default_model_dir()))


def write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_messages_train_assistant_turns_only(tmp_path, tok, hf):
    msgs = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
            {"role": "user", "content": "and 3+3?"}, {"role": "assistant", "content": "6"}]
    (ex,) = read_sft(write(tmp_path / "a.jsonl", [{"messages": msgs}]), tok, 512)
    full = hf.encode(hf.apply_chat_template(msgs, tokenize=False), add_special_tokens=False)
    assert list(ex.ids) == full
    trained = [t for t, m in zip(ex.ids[ex.prompt_len:], ex.loss_mask) if m]
    context = [t for t, m in zip(ex.ids[ex.prompt_len:], ex.loss_mask) if not m]
    # each assistant turn's content and its end-of-turn marker; the second user turn and the assistant header
    assert hf.decode(trained) == "4<|im_end|>\n6<|im_end|>\n"
    assert hf.decode(context) == "<|im_start|>user\nand 3+3?<|im_end|>\n<|im_start|>assistant\n"
    prompt = hf.apply_chat_template(msgs[:1], tokenize=False, add_generation_prompt=True)
    assert hf.decode(list(ex.ids[:ex.prompt_len])) == prompt


def test_prompt_completion_trains_completion_and_eos(tmp_path, tok, hf):
    (ex,) = read_sft(write(tmp_path / "a.jsonl", [{"prompt": "Say hi", "completion": "hi there"}]), tok, 512)
    assert hf.decode(list(ex.ids[ex.prompt_len:])) == "hi there" + hf.eos_token
    assert all(ex.loss_mask)
    batch = sft_batch([ex, ex])
    assert batch.num_response_tokens() == 2 * len(ex.loss_mask)


def test_pairs_share_the_prompt_in_one_group(tmp_path, tok, hf):
    rows = [{"prompt": "Q1", "chosen": "good", "rejected": "bad answer"},
            {"prompt": [{"role": "user", "content": "Q2"}], "chosen": [{"role": "assistant", "content": "yes"}],
             "rejected": "no"}]
    pairs = read_pairs(write(tmp_path / "p.jsonl", rows), tok, 512)
    assert hf.decode(list(pairs[1].chosen)) == "yes" + hf.eos_token
    b = pair_batch(pairs)
    assert b.group_ids == [0, 0, 1, 1] and b.seq_roles == [1.0, 0.0, 1.0, 0.0] and b.keep_groups
    assert b.input_ids[0][:b.prompt_lens[0]] == b.input_ids[1][:b.prompt_lens[1]]
    assert hf.decode(b.input_ids[1][b.prompt_lens[1]:]) == "bad answer" + hf.eos_token


def test_reward_model_pairs_carry_trls_margin_and_end_where_transformers_scores(tmp_path, tok, hf):
    """A line's `margin` (TRL's column) reaches both sequences of its pair (0 on a line without one); each sequence
    loses its trailing pad tokens and gains one score token (value_head.scored_sequence)."""
    from megatron_rl.algorithms.supervised_batches import rm_pair_batch
    from megatron_rl.models.value_head import SCORE_TOKEN

    rows = [{"prompt": "Q1", "chosen": "good", "rejected": "bad", "margin": 0.5},
            {"prompt": "Q2", "chosen": "yes", "rejected": "no"}]
    pairs = read_pairs(write(tmp_path / "p.jsonl", rows), tok, 512)
    assert [p.margin for p in pairs] == [0.5, None]
    pad = hf.eos_token_id  # SmolLM2 pads with its EOS, which ends every response
    b = rm_pair_batch(pairs, pad_id=pad)
    assert b.fields["margin"] == [0.5, 0.5, 0.0, 0.0]
    plain = pair_batch(pairs)
    for got, want in zip(b.input_ids, plain.input_ids):
        assert want[-1] == pad and got == want[:-1] + [SCORE_TOKEN]
    assert "margin" not in rm_pair_batch(pairs[1:], pad_id=pad).fields


@pytest.mark.parametrize("reader,row,field", [
    ("sft", {"prompt": "x"}, "missing field 'completion'"),
    ("sft", {"prompt": "x", "completion": "  "}, "field 'completion' is empty"),
    ("sft", {"text": "x"}, "missing field 'messages' (or 'prompt' and 'completion')"),
    ("sft", {"messages": [{"role": "user", "content": "hi"}]}, "field 'messages' has no assistant turn"),
    ("sft", {"messages": [{"role": "user"}]}, "field 'messages': message 0 must be an object"),
    ("sft", {"prompt": "x", "completion": "long " * 300}, "field 'completion': the example has"),
    ("dpo", {"prompt": "x", "chosen": "a"}, "missing field 'rejected'"),
    ("dpo", {"chosen": "a", "rejected": "b"}, "missing field 'prompt'"),
    ("dpo", {"prompt": "x", "chosen": "", "rejected": "b"}, "field 'chosen' is empty"),
    ("dpo", {"prompt": "x", "chosen": "a", "rejected": [{"role": "user", "content": "b"}]},
     "field 'rejected': a completion's messages must all be assistant turns"),
    ("dpo", {"prompt": "x", "chosen": "a", "rejected": "long " * 300}, "field 'rejected': the example has"),
    ("dpo", "{not json", "invalid JSON"),
    ("dpo", {"prompt": "x", "chosen": "a", "rejected": "b", "margin": "big"}, "field 'margin' must be a number"),
])
def test_bad_line_is_named_with_file_line_and_field(tmp_path, tok, reader, row, field):
    good = {"prompt": "p", "completion": "c"} if reader == "sft" else {"prompt": "p", "chosen": "c", "rejected": "r"}
    path = write(tmp_path / "d.jsonl", [good, "", row])  # the blank line counts: the bad one is line 3
    read = read_sft if reader == "sft" else read_pairs
    with pytest.raises(DataError) as e:
        read(path, tok, 256)
    msg = str(e.value)
    assert msg.startswith(f"{path}:3: ") and field in msg and "\n" not in msg, msg


def test_stream_epochs_shuffle_and_exact_resume():
    s = ExampleStream(10, 4, seed=3, shuffle=True, min_batch=2)
    assert s.steps_per_epoch() == 3  # 4 + 4 + a tail of 2 (>= min_batch: kept)
    seen = [s.next_batch() for _ in range(3)]
    assert sorted(i for b in seen for i in b) == list(range(10)) and s.epoch == 0
    state = s.state_dict()
    nxt = [s.next_batch() for _ in range(3)]
    assert s.epoch == 1 and nxt[0] != seen[0]  # a new permutation per epoch
    again = ExampleStream(10, 4, seed=3, shuffle=True, min_batch=2)
    again.load_state_dict(state)
    assert [again.next_batch() for _ in range(3)] == nxt
    tail = ExampleStream(9, 4, seed=0, shuffle=False, min_batch=2)
    assert [tail.next_batch() for _ in range(3)] == [[0, 1, 2, 3], [4, 5, 6, 7], [0, 1, 2, 3]]  # tail of 1 dropped


def test_dry_run_reads_the_data_and_names_a_bad_line(tmp_path, capsys):
    """`megatron-rl sft|dpo --dry-run` checks the data file as a run would, before anything starts."""
    from megatron_rl.cli import main

    bad = write(tmp_path / "bad.jsonl", [{"prompt": "p", "chosen": "c", "rejected": "r"},
                                         {"prompt": "p", "chosen": "c"}])
    assert main(["dpo", "configs/dpo_cpu.yaml", f"data.path={bad}", "--dry-run"]) == 2
    assert capsys.readouterr().err.strip() == f"data error: {bad}:2: missing field 'rejected'"
    assert main(["sft", "configs/sft_cpu.yaml", "--dry-run"]) == 0
    assert '"algorithm": "sft"' in capsys.readouterr().out
