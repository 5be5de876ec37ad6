"""models/hf_masks.py: a masked packed row (`batching.masked_row`: two groups sharing their prompts plus a single
sequence, back to back) fed to transformers' own models gives, at every response position, the logits of each
sequence's separate forward — on Gemma-2 (sliding-window layers beside full ones, window 16, sequences longer than
it) and on a full-attention model, sdpa and eager."""
import random

import pytest
import torch

from megatron_rl.models.hf_masks import hf_attention_mask, layer_mask_kinds
from megatron_rl.models.tiny import make_tiny_hf_model
from megatron_rl.policy import batching, packing
from megatron_rl.policy.interface import RolloutBatch


def grouped_batch(vocab: int) -> RolloutBatch:
    rng = random.Random(0)
    tok = lambda n: [rng.randrange(vocab) for _ in range(n)]  # noqa: E731
    p1, p2 = tok(20), tok(3)
    ids = [p1 + tok(12), tok(25), p2 + tok(18), p1 + tok(9), p2 + tok(2)]
    return RolloutBatch(input_ids=ids, prompt_lens=[20, 6, 3, 20, 3], advantages=[0.0] * 5, group_ids=[0, 1, 2, 0, 2])


def packed_vs_separate(model, kinds) -> float:
    batch = grouped_batch(model.config.vocab_size)
    units = packing.plan_units(batch, shared=True, max_tokens=4096, multiple=1)
    assert sum(len(u.members) > 1 for u in units) == 2  # both groups share their prompt
    mb = batching.rows(batch, units, varlen=True, thd=False)
    with torch.no_grad():
        mask = hf_attention_mask(mb.attention_mask, mb.position_ids, kinds, torch.float32)
        packed = model(input_ids=mb.tokens, position_ids=mb.position_ids, attention_mask=mask).logits[0]
        err = 0.0
        for i, (_, c), n in zip(mb.indices, mb.spans, mb.resp_lens):
            ids, p = batch.input_ids[i], batch.prompt_lens[i]
            alone = model(input_ids=torch.tensor([ids[:-1]])).logits[0, p - 1:]
            err = max(err, float((packed[c:c + n] - alone).abs().max()))
    return err


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_sliding_window_layers_get_their_window(attn):
    model = make_tiny_hf_model("gemma2", seed=1)
    model.config._attn_implementation = attn
    model.eval()
    kinds = layer_mask_kinds(model.config)
    assert kinds == ("per_layer", model.config.sliding_window) and model.config.sliding_window < 25
    assert packed_vs_separate(model, kinds) < 1e-4
    # the same row with the full mask in every layer is another function: the window is what makes it exact
    assert packed_vs_separate(model, ("full", None)) > 1e-2


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_full_attention_model(attn):
    model = make_tiny_hf_model("qwen2", seed=1)
    model.config._attn_implementation = attn
    model.eval()
    assert layer_mask_kinds(model.config) == ("full", None)
    assert packed_vs_separate(model, ("full", None)) < 1e-4


def test_a_window_on_every_layer_is_one_mask():
    blocked = ~torch.ones(4, 4, dtype=torch.bool).tril()[None, None]  # causal
    m = hf_attention_mask(blocked, torch.arange(4)[None], ("sliding", 2), torch.float32)
    assert not isinstance(m, dict) and m.dtype == torch.float32
    seen = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]]).bool()  # HF's rule: q - k < 2
    assert torch.equal(m[0, 0] == 0, seen) and bool((m[0, 0][~seen] == torch.finfo(torch.float32).min).all())


def test_layer_types_a_mask_cannot_express_are_refused():
    class Cfg:
        layer_types = ["full_attention", "chunked_attention"]
        sliding_window = None

    with pytest.raises(ValueError, match=r"chunked_attention.*policy\.packing=none"):
        layer_mask_kinds(Cfg())
