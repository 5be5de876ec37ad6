"""A scalar value head on a megatron GPTModel: the critic of PPO and the reward model (issue 56, work in progress).

transformers' `...ForSequenceClassification` (num_labels=1) is the decoder, its final norm, and `score`: a bias-free
linear from the hidden size to 1, applied at every position (the sequence's reward is the last token's). Here the
output layer is made to return its input (the final norm's output, TP-replicated: no sequence parallelism), and the
head maps it to one value per position, [b, s, 1] after GPTModel's transpose, like the logits it replaces.

Under TP every rank holds the whole head and the same hidden states, so each computes the same values and the same
gradients: nothing is reduced over TP (the lm_head's input gradient is a sum of vocabulary shards; this one is whole
on every rank). The head is a registered submodule of the GPTModel, so DDP, the optimizer and checkpoints see it;
the unused lm_head weight is frozen.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn


class ValueHead(nn.Module):
    def __init__(self, hidden: int, dtype: torch.dtype = torch.float32, seed: int = 0, std: float = 0.02):
        super().__init__()
        self.score = nn.Linear(hidden, 1, bias=False, dtype=dtype)
        # transformers' initialisation of a new head (normal, the config's initializer_range), from a generator of its
        # own: every rank (TP, DP) starts from the same head whatever its RNG did before
        with torch.no_grad():
            w = torch.empty(self.score.weight.shape, dtype=torch.float32)
            w.normal_(0.0, std, generator=torch.Generator().manual_seed(seed))
            self.score.weight.copy_(w)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.score(hidden)


def install_value_head(gpt, seed: int = 0, std: float = 0.02) -> ValueHead | None:
    """Give `gpt` (its last pipeline stage) a value head in place of its logits; None on stages without an output
    layer. Refused where the output layer's input is not every position's whole hidden state (sequence parallelism,
    multi-token prediction)."""
    gpt.megatron_rl_value_model = True  # every stage: checkpoints record it (models/checkpoint.py), exports read it
    layer = getattr(gpt, "output_layer", None)
    if layer is None or not getattr(gpt, "post_process", True):
        return None
    cfg = gpt.config
    if cfg.sequence_parallel or getattr(cfg, "mtp_num_layers", None):
        raise ValueError("a value head needs every position's hidden state on each rank: no sequence parallelism "
                         "or multi-token prediction")
    # a tied model has no output weight of its own
    head = ValueHead(cfg.hidden_size, dtype=cfg.params_dtype, seed=seed, std=std)
    gpt.value_head = head
    for p in layer.parameters():  # the lm_head: not part of a value model's function
        p.requires_grad_(False)

    def forward(input_, weight=None, runtime_gather_output=None, **kwargs):
        return head(input_), None

    layer.forward = forward  # instance attribute: nn.Module.__call__ (and its pre-hooks) dispatch to it
    layer.megatron_rl_returned_hidden = True  # provider.py's padded-logit hook: leave this output alone
    return head


# transformers' name of the head in ...ForSequenceClassification
HF_SCORE = "score.weight"


class ValueModelWeights(Mapping):
    """An HF folder's tensors as a value model loads them (`forward_pass.build_loaded_model`): a causal LM's, whose
    lm_head the frozen output layer takes and whose head stays as initialised, or a ...ForSequenceClassification
    export's, which has no lm_head (the frozen, unused output layer gets zeros) and whose `score` is the head."""

    def __init__(self, hf_state: Mapping, vocab_size: int, hidden: int):
        self.hf, self.vocab_size, self.hidden = hf_state, vocab_size, hidden

    def __getitem__(self, name: str) -> torch.Tensor:
        if name == "lm_head.weight" and name not in self.hf:
            return torch.zeros(self.vocab_size, self.hidden)
        return self.hf[name]

    def __iter__(self):
        return iter(self.hf)

    def __len__(self) -> int:
        return len(self.hf)


# the token a value model's scored sequences end with (`scored_sequence`): any id does, none is ever attended
SCORE_TOKEN = 0


def scored_sequence(ids: list[int], prompt_len: int, pad_id: int | None) -> list[int]:
    """`ids` (prompt + response) as a value model's worker scores it, so that the last per-token value is the score
    transformers' ForSequenceClassification gives the row: at its last token that is not the pad token (where a model
    pads with its EOS, the token before a response's final EOS). Trailing pad tokens are dropped (never into the
    prompt: a response of pad tokens only is scored at the prompt's last token) and one token appended: a value
    model's per-token outputs sit where a policy's logprobs do, at the position that predicts each response token, so
    the appended token's is the value at the scored position, which causal attention keeps blind to it."""
    end = len(ids)
    while end > prompt_len and pad_id is not None and ids[end - 1] == pad_id:
        end -= 1
    return list(ids[:end]) + [SCORE_TOKEN]


def load_value_head(gpt, hf_state: Mapping) -> bool:
    """The head's weight from an export's `score.weight` (True), or left as initialised (False, a causal LM)."""
    head = getattr(gpt, "value_head", None)
    if head is None or HF_SCORE not in hf_state:
        return False
    with torch.no_grad():
        head.score.weight.copy_(hf_state[HF_SCORE].to(head.score.weight.dtype).reshape(head.score.weight.shape))
    return True


def value_model_hf_tensors(gpt, tensors):
    """A value model's HF tensors from `mapping.iter_hf_tensors(gpt)`'s: the lm_head's left out (a ...ForSequence-
    Classification has none), the head's `score.weight` added on the stage that holds it."""
    for name, t in tensors:
        if name != "lm_head.weight":
            yield name, t
    head = getattr(gpt, "value_head", None)
    if head is not None:
        yield HF_SCORE, head.score.weight.detach().clone()


def value_model_hf_config(hf_config: dict) -> dict:
    """The HF config of a value model exported from a causal LM's: transformers' sequence-classification class of the
    same family, one label, and a pad token (it scores each row at its last non-pad token, and a batch of several
    rows needs one: the EOS where the model has no pad token)."""
    cfg = dict(hf_config)
    cfg["architectures"] = [a.replace("ForCausalLM", "ForSequenceClassification") for a in cfg.get("architectures")
                            or []]
    cfg.update(num_labels=1, id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0})
    if cfg.get("pad_token_id") is None:
        eos = cfg.get("eos_token_id")
        cfg["pad_token_id"] = eos[0] if isinstance(eos, list) else eos
    return cfg
