"""The FSDP2 backend's root module (policy/fsdp2_worker.py): the HF model scoring tokens. Its forward runs the decoder
and then the project's logprob / entropy kernels on the response window, so that, being FSDP's root, it holds the
lm_head weight unsharded while the kernel reads it."""
from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch import nn

from megatron_rl.policy.fsdp2_tp import copy_to_tp, vocab_slice


class Scorer(nn.Module):
    """The HF causal LM, scoring tokens: decoder -> final hidden states of the response window -> (logprobs,
    entropy) by the project's kernels. The FSDP root, so that the lm_head is unsharded while the kernel runs."""

    def __init__(self, lm: nn.Module, fused: bool, tp_group=None, score: nn.Linear | None = None,
                 vision: bool = False):
        super().__init__()
        self.lm = lm
        # a VLM's vision tower and connector: the parameters outside its language model (names: FSDP swaps the
        # tensors, not the names)
        language = {id(p) for m in (lm.get_decoder(), lm.get_input_embeddings(), lm.get_output_embeddings())
                    for p in m.parameters()}
        self._tower = [n for n, p in lm.named_parameters() if id(p) not in language] if vision else []
        self.fused = fused
        self.tp_group = tp_group  # policy.tp > 1: the lm_head holds a vocab slice (policy/fsdp2_tp.py)
        if score is not None:  # a value model (policy.value_head): HF's name, `score.weight`, beside `lm.`
            self.score = score

    def forward(self, tokens, positions, window, targets, temperature, attention_mask=None, topk=None, vision=None):
        """(logprobs, entropy) of the window's targets; with `topk` = (resp_mask [b, w], ids [n, k]), top-k
        distillation's, also the student's differentiable logprobs [n, k] at those ids of the n response positions:
        here, while the lm_head is unsharded, from the same hidden states or logits as the sampled token's."""
        from kernels import linear_token_logprobs, token_logprobs_and_entropy

        from megatron_rl.policy.sampling_filter import as_scoring, filter_logprobs

        scoring = as_scoring(temperature)  # a float, or the engine's top-k / top-p too (ForwardPass._token_stats)
        temperature = scoring.temperature
        if vision is None:
            out = self.lm.get_decoder()(input_ids=tokens, position_ids=positions, attention_mask=attention_mask,
                                        use_cache=False)
        else:  # a VLM: its own forward merges the image features and computes positions (policy/vision_inputs.py)
            out = self.lm.model(input_ids=tokens, use_cache=False, **vision)
        last = out.last_hidden_state
        if vision is not None and not vision:
            # rows without images leave the vision tower out of the graph, and FSDP then reduce-scatters no gradient
            # for it on this rank while another rank, whose rows had images, does: a collective of another size
            # (gloo aborts). A zero term gives the tower a zero gradient here, the same reduction on every rank.
            params = dict(self.lm.named_parameters())
            last = last + 0.0 * sum(params[n].sum() for n in self._tower)
        hidden = last[:, window:] if isinstance(window, int) else last[:, window]
        if hasattr(self, "score"):  # a value model's values stand where logprobs do (megatron's ForwardPass too)
            values = self.score(hidden)[..., 0].float()
            return values, torch.zeros_like(values)
        head = self.lm.get_output_embeddings()
        weight, start, tp = head.weight, 0, dict(tp_group=self.tp_group)
        if self.tp_group is not None:
            weight, start = vocab_slice(weight)
        cap = getattr(self.lm.config, "final_logit_softcapping", None)  # Gemma-2: cap * tanh(logits / cap)
        fused = self.fused and head.bias is None and not cap
        if fused:  # no [tokens, vocab] logits in forward or backward
            lp, ent = linear_token_logprobs(hidden, weight, targets, temperature=temperature, return_entropy=True,
                                            vocab_start_index=start, **tp)
            scored = hidden
        else:
            if self.tp_group is not None:  # the kernel sums the hidden gradient over TP only when it does the matmul
                hidden = copy_to_tp(hidden, self.tp_group)
            scored = hidden @ weight.T if head.bias is None else nn.functional.linear(hidden, weight, head.bias)
            if cap:  # the fused kernel's tiles are plain matmuls: a capped model forms its logits, as HF's forward does
                scored = torch.tanh(scored / cap) * cap
            lp, ent = token_logprobs_and_entropy(scored, targets, temperature=temperature, vocab_start_index=start,
                                                 **tp)
        rows = SimpleNamespace(weight=weight, vocab_start=start) if fused else None  # topk.py's fused-head shape
        lp = filter_logprobs(lp, scored, rows, targets, scoring, self.tp_group, start)
        if topk is None:
            return lp, ent
        from megatron_rl.policy.topk import logprobs_at

        resp, ids = topk
        tp_size = 1 if self.tp_group is None else dist.get_world_size(self.tp_group)
        return lp, ent, logprobs_at(scored[resp], rows, ids, targets[resp], lp[resp], temperature, tp_size, start,
                                    tp_group=self.tp_group)
