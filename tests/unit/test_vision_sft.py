"""SFT examples with images (data/vision_supervised.py) against transformers' processor itself: the ids are the
processor's rendering of the whole conversation with its images expanded, the trained tokens are what the assistant
turn adds to the prompt rendered with its generation prompt, the pixel tensors are the processor's; both image
layouts (verl's `<image>` markers with an `images` field, content parts) give the same example; bad lines are named
by file, line and field. tests/integration/test_vlm_grpo.py trains such examples through `megatron-rl sft`."""
from __future__ import annotations

import base64
import json

import pytest
import torch

from megatron_rl.data.datasets import DataError
from megatron_rl.data.synthetic_vision import solid_png


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    from megatron_rl.data.tokenizer import load_tokenizer
    from megatron_rl.data.vision_prompts import VisionProcessor
    from megatron_rl.models.tiny_vlm import write_tiny_vlm

    root = tmp_path_factory.mktemp("vsft")
    model = write_tiny_vlm(root / "model", seed=1)
    (root / "red.png").write_bytes(solid_png((230, 20, 20), (40, 32)))
    return root, VisionProcessor(model), load_tokenizer(str(model))


MARKERS = {"messages": [{"role": "user", "content": "<image>What colour is this?"},
                        {"role": "assistant", "content": "Red."}], "images": ["red.png"]}
PARTS = {"messages": [{"role": "user", "content": [{"type": "image", "image": "red.png"},
                                                   {"type": "text", "text": "What colour is this?"}]},
                      {"role": "assistant", "content": [{"type": "text", "text": "Red."}]}]}


def _write(root, name, *objs):
    path = root / name
    path.write_text("".join(json.dumps(o) + "\n" for o in objs))
    return path


def test_an_image_example_is_the_processors_rendering_with_the_assistant_turn_trained(vlm):
    from PIL import Image

    from megatron_rl.data.supervised import read_sft

    root, vision, tok = vlm
    ex_markers, ex_parts = read_sft(_write(root, "a.jsonl", MARKERS, PARTS), tok, 4096, vision=vision)
    proc = vision.processor
    image = Image.open(root / "red.png").convert("RGB")
    user = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is this?"}]}]
    full = user + [{"role": "assistant", "content": [{"type": "text", "text": "Red."}]}]
    enc = proc(text=proc.apply_chat_template(full, tokenize=False), images=[image], return_tensors="pt",
               add_special_tokens=False)
    prompt = proc(text=proc.apply_chat_template(user, add_generation_prompt=True, tokenize=False), images=[image],
                  return_tensors="pt", add_special_tokens=False)["input_ids"][0].tolist()
    want = enc["input_ids"][0].tolist()
    assert want[:len(prompt)] == prompt
    for ex in (ex_markers, ex_parts):
        assert list(ex.ids) == want and ex.prompt_len == len(prompt) and all(ex.loss_mask)
        assert vision.tokenizer.decode(want[len(prompt):]).startswith("Red.")
        assert set(ex.model_inputs) == set(enc) - {"input_ids", "attention_mask"}
        for k, v in ex.model_inputs.items():
            assert torch.equal(v, enc[k]), k
    # a data URL works as a path does
    url = "data:image/png;base64," + base64.b64encode((root / "red.png").read_bytes()).decode()
    (ex_url,) = read_sft(_write(root, "b.jsonl", {**MARKERS, "images": [url]}), tok, 4096, vision=vision)
    assert ex_url.ids == ex_markers.ids and torch.equal(ex_url.model_inputs["pixel_values"],
                                                        ex_markers.model_inputs["pixel_values"])


def test_prompt_completion_lines_train_the_completion_and_eos(vlm):
    from megatron_rl.data.supervised import read_sft

    root, vision, tok = vlm
    line = {"prompt": [MARKERS["messages"][0]], "completion": "Red.", "images": ["red.png"]}
    (ex,) = read_sft(_write(root, "c.jsonl", line), tok, 4096, vision=vision)
    comp = vision.tokenizer.encode("Red.", add_special_tokens=False) + [vision.tokenizer.eos_token_id]
    assert list(ex.ids[ex.prompt_len:]) == comp and len(ex.loss_mask) == len(comp)
    (msg,) = read_sft(_write(root, "d.jsonl", MARKERS), tok, 4096, vision=vision)
    assert ex.ids[:ex.prompt_len] == msg.ids[:msg.prompt_len]  # the same prompt as the messages layout's


@pytest.mark.parametrize("line, words", [
    ({**MARKERS, "images": []}, ["c.jsonl:2", "1 '<image>' marker", "'images' holds 0"]),
    ({**MARKERS, "images": ["missing.png"]}, ["c.jsonl:2", "images[0]", "missing.png"]),
    ({"messages": [MARKERS["messages"][0]], "images": ["red.png"]}, ["c.jsonl:2", "no assistant turn"]),
    ({"messages": [{"role": "robot", "content": "hi"}]}, ["c.jsonl:2", "message 0"]),
])
def test_a_bad_line_is_named_by_file_line_and_field(vlm, line, words):
    from megatron_rl.data.supervised import read_sft

    root, vision, tok = vlm
    with pytest.raises(DataError) as err:
        read_sft(_write(root, "c.jsonl", MARKERS, line), tok, 4096, vision=vision)
    for w in words:
        assert w in str(err.value), (w, str(err.value))


def test_an_example_longer_than_the_context_names_the_key(vlm):
    from megatron_rl.data.supervised import read_sft

    root, vision, tok = vlm
    (ex,) = read_sft(_write(root, "e.jsonl", MARKERS), tok, 4096, vision=vision)
    with pytest.raises(DataError, match=r"e.jsonl:1: .*sft.max_seq_len"):
        read_sft(_write(root, "e.jsonl", MARKERS), tok, len(ex.ids) - 1, vision=vision)


def test_a_preference_pair_reads_the_prompts_images_and_text_responses(vlm):
    from megatron_rl.data.supervised import read_pairs, read_sft

    root, vision, tok = vlm
    line = {"prompt": [MARKERS["messages"][0]], "chosen": "Red.", "rejected": "Blue.", "images": ["red.png"]}
    (pair,) = read_pairs(_write(root, "p.jsonl", line), tok, 4096, vision=vision)
    (sft,) = read_sft(_write(root, "s.jsonl", {**line, "completion": "Red."}), tok, 4096, vision=vision)
    eos = vision.tokenizer.eos_token_id
    assert pair.prompt == sft.ids[:sft.prompt_len]  # the processor's expanded prompt
    assert list(pair.chosen) == vision.tokenizer.encode("Red.", add_special_tokens=False) + [eos]
    assert list(pair.rejected) == vision.tokenizer.encode("Blue.", add_special_tokens=False) + [eos]
    assert torch.equal(pair.model_inputs["pixel_values"], sft.model_inputs["pixel_values"])
    with pytest.raises(DataError, match=r"p.jsonl:1: .*'images' holds 0"):
        read_pairs(_write(root, "p.jsonl", {**line, "images": []}), tok, 4096, vision=vision)
