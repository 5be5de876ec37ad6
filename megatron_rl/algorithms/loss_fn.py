"""The GRPO loss as the trainer calls it: a small picklable callable shipped to the policy ranks."""
from __future__ import annotations

import dataclasses
from typing import Optional

from megatron_rl.algorithms.loss import grpo_loss
from megatron_rl.config.schema import LossConfig
from megatron_rl.policy.loss_api import LossInputs


class GRPOLossFn:
    def __init__(self, cfg: LossConfig, max_response_len: Optional[int] = None):
        """`max_response_len` (generation.max_new_tokens) fills cfg.normalizer_max_len when the constant normaliser
        is on and the config left it unset; configs from the loader already carry it."""
        if cfg.effective_normalizer() == "constant" and cfg.normalizer_max_len is None:
            if max_response_len is None:
                raise ValueError("grpo.loss.normalizer=constant needs grpo.loss.normalizer_max_len (the config loader "
                                 "sets it to generation.max_new_tokens) or max_response_len")
            cfg = dataclasses.replace(cfg, normalizer_max_len=int(max_response_len))
        self.cfg = cfg

    def __call__(self, inp: LossInputs):
        need_entropy = self.cfg.entropy_coef != 0.0
        loss, metrics = grpo_loss(
            inp.logprobs, inp.old_logprobs, inp.advantages, inp.mask, cfg=self.cfg,
            ref_logprobs=inp.ref_logprobs, gen_logprobs=inp.gen_logprobs,
            # the entropy metric is always reported; its gradient only flows when it is part of the objective
            entropy=inp.entropy if need_entropy else (inp.entropy.detach() if inp.entropy is not None else None),
            num_global_tokens=inp.num_global_tokens, seq_ids=inp.seq_ids, num_global_seqs=inp.num_global_seqs)
        return loss, metrics
