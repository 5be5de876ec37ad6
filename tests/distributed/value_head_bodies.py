"""Rank body for test_value_head.py: the megatron value head (models/value_head.py) against transformers'
LlamaForSequenceClassification on the same weights, per position, at TP=1, TP=2 and PP=2, with the gradients."""
from __future__ import annotations

import torch

from megatron_rl.platform import install_megatron_cpu_compat
from tests.distributed.models_bodies import (_forward, _import_transformers_first, _init, _positions, _tokens,
                                             pipeline_logits)


def value_head_parity(rank: int, world_size: int):
    _import_transformers_first()
    install_megatron_cpu_compat()
    from transformers import AutoModelForSequenceClassification

    from megatron_rl.models.mapping import load_hf_into_model
    from megatron_rl.models.provider import build_model
    from megatron_rl.models.tiny import make_tiny_hf_model
    from megatron_rl.models.value_head import install_value_head

    lm = make_tiny_hf_model("llama")
    cfg = lm.config.to_dict()
    torch.manual_seed(1)
    import copy

    rc = copy.deepcopy(lm.config)
    rc.num_labels = 1
    rm = AutoModelForSequenceClassification.from_config(rc, dtype=torch.float32)
    rm.model.load_state_dict(lm.model.state_dict())
    rm.eval()
    ids = _tokens(cfg["vocab_size"])
    # HF per position: its forward pools the last token; the score head itself is per position
    hidden = rm.model(ids).last_hidden_state
    ref = rm.score(hidden).detach()
    ref_grad = torch.autograd.grad(rm.score(hidden.detach()).square().sum(), rm.score.weight)[0]
    # upstream of every TP-split op: layer 0's input norm (replicated), whose gradient a TP reduction counted twice
    # (or not at all) would change
    norm0 = rm.model.layers[0].input_layernorm.weight
    ref_norm_grad = torch.autograd.grad(rm.score(rm.model(ids).last_hidden_state).square().sum(), norm0)[0]
    out = {}
    for tp in (1, 2):
        _init(tp, 1)
        m = build_model(cfg)
        load_hf_into_model(m, lm.state_dict())
        head = install_value_head(m)
        with torch.no_grad():
            head.score.weight.copy_(rm.score.weight)
        values = _forward(m, ids)
        out[f"tp{tp}"] = float((values.float() - ref).abs().max())
        m.zero_grad(set_to_none=True)
        m.train()
        v = m(ids, _positions(), None)
        v.square().sum().backward()
        out[f"tp{tp}_grad"] = float((head.score.weight.grad - ref_grad).abs().max())
        norm = dict(m.named_parameters())["decoder.layers.0.input_layernorm.weight"]
        out[f"tp{tp}_norm_grad"] = float((norm.grad - ref_norm_grad).abs().max() / ref_norm_grad.abs().max())
        out[f"tp{tp}_lm_head_frozen"] = all(not p.requires_grad for p in m.output_layer.parameters())
    # PP=2: the head is on the last stage only; the first has no output layer
    _init(1, 2)
    m = build_model(cfg)
    load_hf_into_model(m, lm.state_dict())
    head = install_value_head(m)
    if head is not None:
        with torch.no_grad():
            head.score.weight.copy_(rm.score.weight)
    values = pipeline_logits(m, ids)
    out["pp2_has_head"] = head is not None
    if values is not None:
        out["pp2"] = float((values.float() - ref).abs().max())
    return out
