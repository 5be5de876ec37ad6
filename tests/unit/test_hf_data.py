"""data.source: hf: verl-format parquet, plain CSV / JSONL tables, save_to_disk folders and parquet shards read with
the `datasets` library; dotted keys; bad records named by file and row, or skipped and counted. Every test writes its
own files (and points the datasets cache into tmp_path)."""
import json

import pytest

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
datasets = pytest.importorskip("datasets")

from megatron_rl.config.loader import ConfigError, apply_overrides, from_dict, validate  # noqa: E402
from megatron_rl.config.schema import DataConfig  # noqa: E402
from megatron_rl.data import (  # noqa: E402
    DataError, HFDataset, PromptStream, build_prompt_from_messages, load_dataset, load_tokenizer,
)
from megatron_rl.data.hf_dataset import lookup, parse_answer  # noqa: E402
from tests.unit.test_data import SMOL, CharTokenizer, needs_smol  # noqa: E402


@pytest.fixture(autouse=True)
def datasets_cache(tmp_path, monkeypatch):
    """datasets converts each file into its cache: keep that in the test's folder, not ~/.cache."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")


def verl_row(i, question, answer, system=None):
    prompt = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": question}]
    return {"data_source": "toy_math", "prompt": prompt, "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": answer}, "extra_info": {"split": "train", "index": i}}


VERL_ROWS = [verl_row(0, "What is 2 + 3?", "5"), verl_row(1, "What is 7 * 6?", "42", system="Be brief."),
             verl_row(2, "What is 10 - 4?", "6")]


def write_parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def hf_cfg(path, **kw):
    return DataConfig(source="hf", path=str(path), **kw)


def test_verl_parquet_chat_prompt_nested_answer_and_meta(tmp_path):
    p = write_parquet(tmp_path / "train.parquet", VERL_ROWS)
    # a chat-list prompt is the conversation as it stands: no system prompt, few-shot or template is added
    cfg = hf_cfg(p, system_prompt="SYSTEM-PROMPT", few_shot=[{"user": "SHOT-Q", "assistant": "SHOT-A"}],
                 prompt_template="Problem: {problem}")
    ds = load_dataset(cfg, CharTokenizer(), "train")
    assert isinstance(ds, HFDataset) and ds.kind == "hf" and ds.source == f"hf:{p}" and len(ds) == 3
    items = list(ds)
    assert [it.answer for it in items] == ["5", "42", "6"]
    assert items[0].prompt_text == "User: What is 2 + 3?\nAssistant:"
    assert items[1].prompt_text == "System: Be brief.\n\nUser: What is 7 * 6?\nAssistant:"
    assert not any(s in it.prompt_text for it in items for s in ("SYSTEM-PROMPT", "SHOT", "Problem:"))
    meta = items[1].meta
    assert meta["data_source"] == "toy_math" and meta["ability"] == "math"
    assert meta["extra_info"] == {"split": "train", "index": 1} and meta["reward_model"]["style"] == "rule"
    assert meta["file"] == str(p) and meta["row"] == 1 and "prompt" not in meta
    assert ds.stats() == {"num_items": 3, "num_too_long": 0, "num_malformed": 0}
    # a resumable stream over it, as training uses it
    assert len(PromptStream(ds, batch_size=2, seed=0).next_batch()) == 2


@needs_smol
def test_chat_list_prompt_uses_the_chat_template(tmp_path):
    tok = load_tokenizer(SMOL)
    p = write_parquet(tmp_path / "train.parquet", VERL_ROWS)
    item = load_dataset(hf_cfg(p, system_prompt="ignored"), tok, "train").item(1)
    messages = VERL_ROWS[1]["prompt"]
    assert item.prompt_ids == tok.apply_chat_template(messages, add_generation_prompt=True)
    assert item.prompt_text == tok.render_chat(messages, add_generation_prompt=True)
    assert item.prompt_text.endswith("<|im_start|>assistant\n") and "ignored" not in item.prompt_text
    assert build_prompt_from_messages(messages, hf_cfg(p), tok) == (item.prompt_ids, item.prompt_text)


def test_plain_string_prompts_from_csv_and_jsonl_use_the_template(tmp_path):
    csv = tmp_path / "data.csv"
    csv.write_text('question,answer\n"What is 2 + 3?",5\n"Half of 3?",1.5\n')
    jsonl = tmp_path / "data.jsonl"
    jsonl.write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in [("Q1", "x = 2"), ("Q2", 7)]))
    for path, answers in ((csv, ["5", "1.5"]), (jsonl, ["x = 2", "7"])):
        cfg = hf_cfg(path, prompt_key="question", answer_key="answer", system_prompt="SYS",
                     prompt_template="Solve: {problem}")
        ds = load_dataset(cfg, CharTokenizer(), "train")
        assert [ds.item(i).answer for i in range(len(ds))] == answers, path
        first = ds.item(0)
        assert first.prompt_text.startswith("System: SYS\n\nUser: Solve: ") and "answer" not in first.meta
        assert "question" not in first.meta and first.meta["row"] == 0


def test_csv_number_column_with_an_empty_cell(tmp_path):
    """pandas reads a number column with an empty cell as floats: 17.0 is the answer "17", the empty one is named."""
    p = tmp_path / "data.csv"
    p.write_text("question,answer\nq0,17\nq1,\nq2,3\n")
    cfg = hf_cfg(p, prompt_key="question", answer_key="answer")
    with pytest.raises(DataError, match=rf"^{p}: row 1: field 'answer' missing"):
        load_dataset(cfg, CharTokenizer(), "train")
    ds = load_dataset(hf_cfg(p, prompt_key="question", answer_key="answer", skip_malformed=True), CharTokenizer(),
                      "train")
    assert [ds.item(i).answer for i in range(len(ds))] == ["17", "3"] and ds.num_malformed == 1


def test_save_to_disk_folders(tmp_path):
    ds = datasets.Dataset.from_list(VERL_ROWS)
    ds.save_to_disk(str(tmp_path / "saved"))
    got = load_dataset(hf_cfg(tmp_path / "saved"), CharTokenizer(), "train")
    assert [got.item(i).answer for i in range(3)] == ["5", "42", "6"] and got.item(0).meta["file"] == str(
        tmp_path / "saved")
    # a DatasetDict folder: one split is read as it is; with several the message names a split's folder
    datasets.DatasetDict({"train": ds}).save_to_disk(str(tmp_path / "one"))
    assert len(load_dataset(hf_cfg(tmp_path / "one"), CharTokenizer(), "train")) == 3
    datasets.DatasetDict({"train": ds, "test": ds.select([0])}).save_to_disk(str(tmp_path / "two"))
    with pytest.raises(DataError, match=r"splits \['test', 'train'\]; name the split's folder"):
        load_dataset(hf_cfg(tmp_path / "two"), CharTokenizer(), "train")
    val = load_dataset(DataConfig(source="hf", val_path=str(tmp_path / "two" / "test")), CharTokenizer(), "val")
    assert len(val) == 1


def test_parquet_shard_folder_names_the_shard_and_its_row(tmp_path):
    shards = tmp_path / "shards"
    shards.mkdir()
    write_parquet(shards / "part-00000.parquet", VERL_ROWS[:2])
    bad = [verl_row(5, "ok", "1"), verl_row(6, "What is 1 + 1?", "2")]
    bad[1]["reward_model"]["ground_truth"] = None
    write_parquet(shards / "part-00001.parquet", bad)
    with pytest.raises(DataError) as e:
        load_dataset(hf_cfg(shards), CharTokenizer(), "train")
    assert str(e.value).startswith(f"{shards / 'part-00001.parquet'}: row 1: field 'reward_model.ground_truth' "
                                   "missing")
    ds = load_dataset(hf_cfg(shards, skip_malformed=True), CharTokenizer(), "train")
    assert [ds.item(i).answer for i in range(len(ds))] == ["5", "42", "1"] and ds.num_malformed == 1
    assert ds.item(2).meta["file"] == str(shards / "part-00001.parquet") and ds.item(2).meta["row"] == 0


def test_dotted_keys():
    rec = {"a": {"b": {"c": 3}}, "x.y": "dotted column", "n": None, "s": "text"}
    assert lookup(rec, "a.b.c") == (3, "")
    assert lookup(rec, "x.y") == ("dotted column", "")
    assert lookup(rec, "n.k")[1] == " ('n' is null)"
    assert lookup(rec, "s.k")[1] == " ('s' is a str, not a record)"
    assert parse_answer(204, "k") == "204" and parse_answer(3.0, "k") == "3" and parse_answer(" 1/2 ", "k") == "1/2"


def test_deeply_nested_keys(tmp_path):
    rows = [{"item": {"question": {"text": "What is 3 + 4?"}}, "labels": {"gold": {"value": 7}}}]
    p = write_parquet(tmp_path / "nested.parquet", rows)
    ds = load_dataset(hf_cfg(p, prompt_key="item.question.text", answer_key="labels.gold.value"), CharTokenizer(),
                      "train")
    it = ds.item(0)
    assert it.answer == "7" and "What is 3 + 4?" in it.prompt_text and it.meta["labels"] == {"gold": {"value": 7}}


def _bad(**change):
    row = verl_row(3, "What is 1 + 1?", "2")
    for key, value in change.items():
        if key == "ground_truth":
            row["reward_model"] = {"style": "rule", "ground_truth": value}
        else:
            row[key] = value
    return row


@pytest.mark.parametrize("row, why", [
    (_bad(ground_truth=None), "field 'reward_model.ground_truth' missing"),
    (_bad(ground_truth="  "), "field 'reward_model.ground_truth' is empty"),
    (_bad(reward_model=None), "field 'reward_model.ground_truth' missing ('reward_model' is null)"),
    (_bad(prompt=[]), "field 'prompt' is an empty chat list"),
    (_bad(prompt=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]),
     "field 'prompt': a chat list must end with a user message"),
    (_bad(prompt=[{"role": "robot", "content": "hi"}]), "field 'prompt[0]' must be a message"),
])
def test_bad_parquet_row_is_named_by_file_and_row(tmp_path, row, why):
    p = write_parquet(tmp_path / "train.parquet", VERL_ROWS + [row])
    with pytest.raises(DataError) as e:
        load_dataset(hf_cfg(p), CharTokenizer(), "train")
    assert str(e.value).startswith(f"{p}: row 3: {why}"), str(e.value)
    assert "data.skip_malformed=true" in str(e.value)


@pytest.mark.parametrize("record, why", [
    ({"prompt": "x", "reward_model": {"ground_truth": ["2", "3"]}}, "'reward_model.ground_truth' must be a string or a "
                                                                    "number, got list"),
    ({"prompt": 5, "reward_model": {"ground_truth": "2"}}, "'prompt' must be a string or a chat list"),
    ({"prompt": "x", "reward_model": {"ground_truth": True}}, "must be a string or a number, got bool"),
    ({"prompt": "   ", "reward_model": {"ground_truth": "2"}}, "field 'prompt' is empty"),
    ({"prompt": "x", "reward_model": {"style": "rule"}}, "field 'reward_model.ground_truth' missing"),
])
def test_bad_jsonl_record_through_hf_is_named(tmp_path, record, why):
    p = tmp_path / "data.jsonl"
    good = {"prompt": "What is 1 + 1?", "reward_model": {"ground_truth": "2"}}
    p.write_text(json.dumps(good) + "\n" + json.dumps(record) + "\n")
    with pytest.raises(DataError) as e:
        load_dataset(hf_cfg(p), CharTokenizer(), "train")
    assert str(e.value).startswith(f"{p}: row 1: ") and why in str(e.value), str(e.value)


def test_missing_column_and_unreadable_paths_are_named(tmp_path):
    p = write_parquet(tmp_path / "train.parquet", VERL_ROWS)
    with pytest.raises(DataError, match=rf"^{p}: no field for data.answer_key='answer'; its records have: "
                                        "data_source, prompt, ability, reward_model, extra_info"):
        load_dataset(hf_cfg(p, answer_key="answer"), CharTokenizer(), "train")
    (tmp_path / "data.txt").write_text("hello")
    with pytest.raises(DataError, match="unknown extension '.txt'; data.source=hf reads a .parquet"):
        load_dataset(hf_cfg(tmp_path / "data.txt"), CharTokenizer(), "train")
    with pytest.raises(DataError, match="no such file or folder"):
        load_dataset(hf_cfg(tmp_path / "nope.parquet"), CharTokenizer(), "train")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="neither datasets' save_to_disk files"):
        load_dataset(hf_cfg(tmp_path / "empty"), CharTokenizer(), "train")
    (tmp_path / "broken.parquet").write_bytes(b"not parquet")
    with pytest.raises(DataError, match=r"broken.parquet: cannot be read by datasets \(ArrowInvalid"):
        load_dataset(hf_cfg(tmp_path / "broken.parquet"), CharTokenizer(), "train")
    with pytest.raises(DataError, match="data.path must name"):
        load_dataset(DataConfig(source="hf"), CharTokenizer(), "train")
    assert load_dataset(hf_cfg(p), CharTokenizer(), "val") is None  # no data.val_path: no validation split


def test_skip_malformed_counts_and_limit_keeps_first_usable(tmp_path):
    rows = [VERL_ROWS[0], _bad(ground_truth=None), VERL_ROWS[1], _bad(prompt=[]), VERL_ROWS[2]]
    p = write_parquet(tmp_path / "train.parquet", rows)
    ds = load_dataset(hf_cfg(p, skip_malformed=True), CharTokenizer(), "train")
    assert len(ds) == 3 and ds.num_malformed == 2 and ds.stats()["num_malformed"] == 2
    assert [ds.item(i).meta["row"] for i in range(3)] == [0, 2, 4]
    val = load_dataset(DataConfig(source="hf", val_path=str(p), skip_malformed=True), CharTokenizer(), "val", size=2)
    assert [val.item(i).answer for i in range(len(val))] == ["5", "42"]
    only_bad = write_parquet(tmp_path / "bad.parquet", [_bad(ground_truth=None)])
    with pytest.raises(DataError, match="no usable records"):
        load_dataset(hf_cfg(only_bad, skip_malformed=True), CharTokenizer(), "train")


def _config(*overrides):
    return validate(from_dict(apply_overrides({}, list(overrides))), check_model=False)


def test_config_keys_and_checks():
    cfg = _config("data.source=hf", "data.path=train.parquet")
    assert (cfg.data.prompt_key, cfg.data.answer_key) == ("prompt", "reward_model.ground_truth")
    with pytest.raises(ConfigError, match="data.path is required when data.source is 'hf'"):
        _config("data.source=hf")
    with pytest.raises(ConfigError, match="data.answer_key='reward_model.' must be a field name or a dotted path"):
        _config("data.source=hf", "data.path=x.parquet", "data.answer_key=reward_model.")
    # reasoning-gym's scorer needs reasoning-gym items: refused before any work, not at the first reward
    with pytest.raises(ConfigError, match="reward.kind=reasoning_gym scores reasoning-gym tasks only"):
        _config("data.source=hf", "data.path=x.parquet", "reward.kind=reasoning_gym")
