"""The CPU vision demo's parts (docs/vlm.md): its model is the embedded SmolLM2-135M-Instruct with a new vision tower
(models/tiny_vlm.write_vlm_from_lm), so on text alone it is that model (its logits equal transformers' SmolLM2's);
its task's images show the colour their answer names (data/synthetic_vision.py)."""
from __future__ import annotations

import io

import numpy as np
import torch

from megatron_rl.data.synthetic_vision import COLOURS, records
from megatron_rl.models.tiny_vlm import write_vlm_from_lm
from megatron_rl.paths import default_model_dir


def test_the_demo_model_is_smollm2_on_text(tmp_path):
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

    out = write_vlm_from_lm(tmp_path / "vlm")
    vlm = AutoModelForImageTextToText.from_pretrained(out, dtype=torch.float32).eval()
    lm = AutoModelForCausalLM.from_pretrained(default_model_dir(), dtype=torch.float32).eval()
    ids = torch.tensor([AutoTokenizer.from_pretrained(default_model_dir()).encode("The sky is blue and the grass")])
    with torch.no_grad():
        got, want = vlm(input_ids=ids).logits[0], lm(input_ids=ids).logits[0]
    torch.testing.assert_close(got[:, :want.shape[1]], want, atol=1e-4, rtol=0)
    assert got.shape[1] == want.shape[1] + 40  # SmolVLM's image tokens added to the vocabulary


def test_the_task_images_show_their_answer():
    from PIL import Image

    recs = records(40, seed=1)
    answers = [r["reward_model"]["ground_truth"] for r in recs]
    assert sorted(set(answers)) == sorted(COLOURS) and all(answers.count(c) == 10 for c in COLOURS)
    for r in recs:
        px = np.asarray(Image.open(io.BytesIO(r["images"][0]["bytes"])).convert("RGB")).reshape(-1, 3)
        want = np.array(COLOURS[r["reward_model"]["ground_truth"]])
        share = (np.abs(px - want).sum(1) == 0).mean()  # pixels exactly the shape's colour
        assert share > 0.05, (r["reward_model"], share)
        assert "<image>" in r["prompt"][-1]["content"] and r["prompt"][-1]["role"] == "user"


def test_the_sft_examples_answer_what_their_images_show():
    import base64

    from PIL import Image

    from megatron_rl.data.synthetic_vision import sft_lines

    lines = sft_lines(8, seed=2)
    for line in lines:
        answer = line["messages"][-1]
        assert answer["role"] == "assistant" and line["messages"][-2]["content"].startswith("<image>")
        colour = answer["content"].removeprefix("<answer>").removesuffix("</answer>")
        data = base64.b64decode(line["images"][0].split(",", 1)[1])
        px = np.asarray(Image.open(io.BytesIO(data)).convert("RGB")).reshape(-1, 3)
        assert (np.abs(px - np.array(COLOURS[colour])).sum(1) == 0).mean() > 0.05, colour
    assert sorted({x["messages"][-1]["content"] for x in lines}) == sorted(f"<answer>{c}</answer>" for c in COLOURS)
