"""Datasets, prompts and tokenizers: split determinism/disjointness, JSONL errors, stream resume, chat templates."""
import dataclasses
import json

import pytest

from megatron_rl.config.schema import DataConfig
from megatron_rl.data import (
    DataError, PromptStream, SentencePieceTokenizer, build_messages, build_prompt, load_dataset, load_tokenizer,
    render_plain,
)
from megatron_rl.data.tokenizer import Tokenizer
from megatron_rl.paths import default_model_dir

SMOL = default_model_dir()
needs_smol = pytest.mark.skipif(not (SMOL / "tokenizer.json").exists(), reason=f"no SmolLM2 tokenizer at {SMOL}")


class CharTokenizer(Tokenizer):
    """One id per character and the plain template: fast and dependency-free for dataset tests."""
    eos_token_id, pad_token_id = 0, 0

    def encode(self, text):
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)

    def render_chat(self, messages, add_generation_prompt=True):
        return render_plain(messages, add_generation_prompt)

    def apply_chat_template(self, messages, add_generation_prompt=True):
        return self.encode(self.render_chat(messages, add_generation_prompt))

    encode_plain = apply_chat_template


RG = dict(source="reasoning_gym", task="chain_sum",
          task_params={"min_terms": 3, "max_terms": 4, "min_digits": 2, "max_digits": 3})


def rg_cfg(**kw):
    return DataConfig(**{**RG, "train_size": 200, **kw})


def questions(ds, n=None):
    return [ds.raw(i)[0] for i in range(n or len(ds))]


def test_reasoning_gym_split_is_deterministic_and_keeps_entry():
    tok = CharTokenizer()
    a, b = load_dataset(rg_cfg(), tok, "train"), load_dataset(rg_cfg(), tok, "train")
    assert questions(a) == questions(b)
    item = a.item(0)
    entry = item.meta["entry"]
    assert item.answer == entry["answer"] and entry["question"] in item.prompt_text
    assert item.meta["task"] == "chain_sum" and item.source == "reasoning_gym:chain_sum"
    other = load_dataset(rg_cfg(train_seed=5), tok, "train")
    assert questions(other, 20) != questions(a, 20)


def test_train_and_val_splits_are_disjoint():
    tok = CharTokenizer()
    cfg = rg_cfg(train_size=2000, train_seed=1, val_seed=2)
    train = set(questions(load_dataset(cfg, tok, "train")))
    val = questions(load_dataset(cfg, tok, "val", size=300))
    # reasoning-gym seeds item i with seed+i: without the split stride, val item i would be train item i+1
    assert not train.intersection(val)
    with pytest.raises(DataError, match="val_seed"):
        load_dataset(rg_cfg(val_seed=1), tok, "val")


def test_unknown_task_param_names_the_key():
    with pytest.raises(DataError, match="task_params"):
        load_dataset(rg_cfg(task_params={"no_such_param": 3}), CharTokenizer(), "train")


def test_max_prompt_length_filtering_is_counted():
    tok = CharTokenizer()
    cfg = rg_cfg(max_prompt_tokens=1000)
    ds = load_dataset(cfg, tok, "train")
    lens = sorted(len(ds.item(i).prompt_ids) for i in range(50))
    limit = lens[25]
    short = load_dataset(dataclasses.replace(cfg, max_prompt_tokens=limit), tok, "train")
    kept = [short.item(i) for i in range(50)]
    n_long = sum(1 for L in lens if L > limit)
    assert sum(k is None for k in kept) == n_long == short.num_too_long > 0
    assert all(len(k.prompt_ids) <= limit for k in kept if k is not None)
    stream = PromptStream(short, batch_size=7, seed=0)
    assert all(len(it.prompt_ids) <= limit for it in stream.next_batch())


def write_jsonl(tmp_path, lines, name="data.jsonl"):
    p = tmp_path / name
    p.write_text("\n".join(lines) + "\n")
    return p


GOOD = [json.dumps({"problem": "What is 1/2 + 1/4?", "answer": "\\frac{3}{4}", "solution": "add"}),
        json.dumps({"problem": "AIME: find n.", "answer": 204}),
        ""]


@pytest.mark.parametrize("bad, why", [
    ("{not json", "invalid JSON"),
    (json.dumps({"problem": "x"}), "missing field 'answer'"),
    (json.dumps({"answer": "3"}), "missing field 'problem'"),
    (json.dumps({"problem": 3, "answer": "3"}), "'problem' must be"),
    (json.dumps({"problem": "x", "answer": ["3"]}), "'answer' must be"),
    (json.dumps({"problem": "x", "answer": "3", "solution": 5}), "'solution' must be"),
    (json.dumps(["problem", "answer"]), "expected a JSON object"),
])
def test_jsonl_malformed_line_names_file_and_line(tmp_path, bad, why):
    p = write_jsonl(tmp_path, GOOD + [bad])
    cfg = DataConfig(source="jsonl", path=str(p))
    with pytest.raises(DataError) as e:
        load_dataset(cfg, CharTokenizer(), "train")
    assert f"{p}:4:" in str(e.value) and why in str(e.value)


def test_jsonl_skip_malformed_counts(tmp_path):
    extra = ["{oops", json.dumps({"problem": "x"}), json.dumps({"problem": "q", "answer": "7"})]
    p = write_jsonl(tmp_path, GOOD + extra)
    ds = load_dataset(DataConfig(source="jsonl", path=str(p), skip_malformed=True), CharTokenizer(), "train")
    assert len(ds) == 3 and ds.num_malformed == 2 and ds.stats()["num_malformed"] == 2
    assert [ds.item(i).answer for i in range(3)] == ["\\frac{3}{4}", "204", "7"]
    assert ds.item(0).meta == {"solution": "add", "line": 1} and ds.item(2).meta["line"] == 6
    assert load_dataset(DataConfig(source="jsonl", path=str(p)), CharTokenizer(), "val") is None
    capped = load_dataset(DataConfig(source="jsonl", val_path=str(p), skip_malformed=True), CharTokenizer(), "val",
                          size=2)
    assert len(capped) == 2


def test_prompt_stream_resume_sees_identical_prompts():
    tok = CharTokenizer()
    ds = load_dataset(rg_cfg(train_size=23), tok, "train")  # batches straddle epoch boundaries
    straight = PromptStream(ds, batch_size=5, seed=3)
    first = [straight.next_batch() for _ in range(3)]
    state = json.loads(json.dumps(straight.state_dict()))  # survives a checkpoint round-trip
    expected = [[it.prompt_ids for it in straight.next_batch()] for _ in range(8)]
    resumed = PromptStream(load_dataset(rg_cfg(train_size=23), tok, "train"), batch_size=5, seed=3)
    resumed.load_state_dict(state)
    assert [[it.prompt_ids for it in resumed.next_batch()] for _ in range(8)] == expected
    # one epoch visits every item once; the next epoch is a different order
    whole = PromptStream(ds, batch_size=23, seed=3)
    e0, e1 = [questions_of(whole.next_batch()) for _ in range(2)]
    assert sorted(e0) == sorted(questions(ds)) and e0 != e1
    assert len(first) == 3
    with pytest.raises(ValueError, match="seed"):
        PromptStream(ds, batch_size=5, seed=4).load_state_dict(state)


def questions_of(batch):
    return [it.meta["entry"]["question"] for it in batch]


def test_messages_have_system_few_shot_and_template():
    cfg = DataConfig(system_prompt="Answer in tags.", prompt_template="Q: {problem}",
                     few_shot=[{"user": "1 + 1 =", "assistant": "<answer>2</answer>"}])
    msgs = build_messages("3 + 4 =", cfg)
    assert msgs == [{"role": "system", "content": "Answer in tags."}, {"role": "user", "content": "1 + 1 ="},
                    {"role": "assistant", "content": "<answer>2</answer>"}, {"role": "user", "content": "Q: 3 + 4 ="}]
    ids, text = build_prompt("3 + 4 =", cfg, CharTokenizer())
    assert text == "System: Answer in tags.\n\nUser: 1 + 1 =\nAssistant: <answer>2</answer>\n\nUser: Q: 3 + 4 =\n" \
                   "Assistant:"
    assert ids == CharTokenizer().encode(text)


@needs_smol
def test_smollm2_chat_template_prompt_contains_few_shot_exchange():
    tok = load_tokenizer(SMOL)
    cfg = DataConfig(system_prompt="Give only the final number inside <answer></answer> tags.",
                     few_shot=[{"user": "12 + 5 =", "assistant": "<answer>17</answer>"}])
    ids, text = build_prompt("4 - 1 - 7 =", cfg, tok)
    decoded = tok.decode(ids, skip_special_tokens=False)
    assert decoded == text
    assert "<|im_start|>user\n12 + 5 =<|im_end|>\n<|im_start|>assistant\n<answer>17</answer><|im_end|>" in decoded
    assert decoded.endswith("<|im_start|>user\n4 - 1 - 7 =<|im_end|>\n<|im_start|>assistant\n")
    assert decoded.index("Give only the final number") < decoded.index("12 + 5")
    assert tok.has_chat_template and tok.eos_token_id == tok.encode("<|im_end|>")[0]
    plain_ids, plain_text = build_prompt("4 - 1 - 7 =", dataclasses.replace(cfg, use_chat_template=False), tok)
    assert "<|im_start|>" not in plain_text and plain_text.endswith("User: 4 - 1 - 7 =\nAssistant:")


def test_sentencepiece_tokenizer_plain_template(tmp_path):
    import sentencepiece as spm

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(f"User: what is {i} + {3 * i}?\nAssistant: the answer is {4 * i}"
                                for i in range(300)))
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(tmp_path / "tokenizer"), vocab_size=300,
                                   model_type="bpe", unk_id=0, bos_id=1, eos_id=2, pad_id=3, minloglevel=2,
                                   # Llama-2's settings: newlines survive as byte pieces, text is not normalised
                                   byte_fallback=True, normalization_rule_name="identity",
                                   remove_extra_whitespaces=False)
    folder = tmp_path / "sp_only"
    folder.mkdir()
    (tmp_path / "tokenizer.model").rename(folder / "tokenizer.model")
    tok = load_tokenizer(folder)
    assert isinstance(tok, SentencePieceTokenizer) and not tok.has_chat_template
    assert (tok.eos_token_id, tok.pad_token_id) == (2, 3)
    msgs = [{"role": "user", "content": "what is 2 + 6?"}]
    ids = tok.apply_chat_template(msgs)
    assert ids[0] == 1  # BOS, as Llama-style SentencePiece models expect
    assert tok.decode(ids) == "User: what is 2 + 6?\nAssistant:"
    assert tok.decode(tok.encode("the answer is 8")) == "the answer is 8"
    assert load_tokenizer(folder / "tokenizer.model").vocab_size == 300


def test_bad_few_shot_names_the_key():
    with pytest.raises(ValueError, match=r"data.few_shot\[0\]"):
        build_messages("x", DataConfig(few_shot=[{"user": "only a question"}]))
