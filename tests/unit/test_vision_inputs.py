"""policy/vision_inputs.collate against the processor's own batching: the per-sequence pixel tensors of several
prompts (one image, two, none) put together equal what the model's processor returns for those prompts as one
batch, zero-padded images and masks included; a row of several sequences is refused."""
from __future__ import annotations

import pytest
import torch
from PIL import Image

from megatron_rl.policy.batching import MicroBatchRows
from megatron_rl.policy.vision_inputs import collate, row_sequences


@pytest.fixture(scope="module")
def processor(tmp_path_factory):
    from transformers import AutoProcessor

    from megatron_rl.models.tiny_vlm import write_tiny_vlm

    return AutoProcessor.from_pretrained(write_tiny_vlm(tmp_path_factory.mktemp("vlm") / "m"))


def test_collate_equals_the_processors_batch(processor):
    images = [[Image.new("RGB", (40, 30), (200, 0, 0))],
              [Image.new("RGB", (20, 60), (0, 200, 0)), Image.new("RGB", (56, 56), (0, 0, 200))]]
    texts = ["<image>one?", "<image><image>two?"]
    single = [processor(text=t, images=im, return_tensors="pt") for t, im in zip(texts, images)]
    batch = processor(text=texts, images=images, return_tensors="pt", padding=True)
    for key in ("pixel_values", "pixel_attention_mask"):
        got = collate([s[key] for s in single] + [None])  # a text-only row adds nothing
        assert got.shape == batch[key].shape, key
        torch.testing.assert_close(got, batch[key], atol=0, rtol=0)
    assert collate([None, None]) is None


def test_flat_inputs_concatenate():  # Qwen2-VL's layout: patches of every image, one after another
    a, b = torch.randn(16, 1176), torch.randn(64, 1176)
    torch.testing.assert_close(collate([a, None, b]), torch.cat([a, b]))
    torch.testing.assert_close(collate([torch.tensor([[1, 4, 4]]), torch.tensor([[1, 8, 8], [1, 4, 4]])]),
                               torch.tensor([[1, 4, 4], [1, 8, 8], [1, 4, 4]]))


def test_a_row_of_several_sequences_is_refused():
    src = torch.tensor([[0, 0, 1, 1], [2, 2, 2, -1]])
    mb = MicroBatchRows([0, 1, 2], torch.zeros(2, 4, dtype=torch.long), torch.zeros(2, 4, dtype=torch.long),
                        torch.zeros(2, 4, dtype=torch.long), torch.zeros(2, 4, dtype=torch.bool), [1, 1, 1], [],
                        source=src)
    with pytest.raises(ValueError, match="row holds one sequence, this one 2"):
        row_sequences(mb)
    mb.source = torch.tensor([[0, 0, -1, -1], [-1, -1, -1, -1]])
    assert row_sequences(mb) == [0, None]
