"""MoE routing replay (R3): the trainer sends each token to the experts the engine sent it to.

The router's top-k is a discontinuous function of its logits: wherever the engine's kernels and the trainer's round
a near-tie differently, the two run different experts for that token, its logprobs part, and the importance ratio
corrects for a policy nobody sampled from. The engine records the experts it routed each token to
(generation/routing_capture.py, `GenerationResult.routed_experts`); the batch carries them
(`RolloutBatch.routed_experts`: per sequence [tokens, MoE layers, k], -1 where the engine ran no such token), and
here every MoE router of the trainer takes those experts instead of its own top-k, in every pass over the batch
(old logprobs, reference, training). The gate weights stay the trainer's own: its router's probabilities at the
replayed experts (normalised as that router normalises), so the router still learns through them.

A token with no record (-1: prompt tokens the engine served from its prefix cache, multi-turn observations) is routed
by the trainer as without replay ("mixed" replay). The load-balancing loss, when on, is computed from the trainer's
own top-k, as megatron-core does under its RouterReplay.

Layout: `routing_rows` lays the records out like the micro-batch's tokens ([b, s], `MicroBatchRows.source` and
`position_ids` say which token of which sequence each position holds). The Megatron backend's routers see tokens
sequence-major ([s, b] flattened; a THD row is [t, 1]), each pipeline stage its own layers; the FSDP2 backend's HF
routers see them batch-major ([b, s] flattened).
"""
from __future__ import annotations

import torch

from megatron_rl.policy.batching import MicroBatchRows


def routing_rows(routed: list[torch.Tensor], mb: MicroBatchRows) -> torch.Tensor:
    """[b, s, layers, k] long: for each position of the micro-batch the experts the engine routed its token to, -1
    where there is no record (padding, tokens the engine did not run)."""
    src, pos = mb.source, mb.position_ids
    if src is None:
        raise ValueError("routing replay needs MicroBatchRows.source (rows built by policy/batching.py)")
    shapes = {tuple(routed[i].shape[1:]) for i in mb.indices}
    if len(shapes) != 1:
        raise ValueError(f"routed_experts of one micro-batch have different [layers, k]: {sorted(shapes)}")
    out = torch.full((*src.shape, *shapes.pop()), -1, dtype=torch.long)
    for i in mb.indices:
        at = src == i
        p = pos[at]
        rec = torch.as_tensor(routed[i])
        have = p < rec.shape[0]
        vals = torch.full((p.numel(), *rec.shape[1:]), -1, dtype=torch.long)
        vals[have] = rec[p[have]].long()
        out[at] = vals
    return out


def replayed_topk(target: torch.Tensor | None, indices: torch.Tensor) -> torch.Tensor:
    """The experts to use: `target`'s for tokens it records (no -1 in their row), the router's own `indices`
    elsewhere. Both [tokens, k]."""
    if target is None:
        return indices
    if target.shape != indices.shape:
        raise RuntimeError(f"routing replay: the router routes {tuple(indices.shape)} [tokens, k] but the replayed "
                           f"record is {tuple(target.shape)} (a micro-batch laid out differently from its record)")
    target = target.to(indices.device)
    recorded = (target >= 0).all(dim=-1, keepdim=True)
    return torch.where(recorded, target, indices)


class _MegatronRouterReplay:
    """Duck-types megatron-core's RouterReplay where `topk_routing_with_score_function` calls it
    (`get_replay_topk`): the router's own top-k, then the replayed experts where recorded, with the scores there."""

    def __init__(self):
        self.target: torch.Tensor | None = None

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        values, indices = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        if self.target is None:
            return values, indices
        indices = replayed_topk(self.target, indices)
        return scores.gather(1, indices), indices


def moe_layer_pattern(tcfg) -> list[bool]:
    """Which of the model's layers (global, 0-based) are MoE, from megatron-core's `moe_layer_freq`."""
    freq, n = tcfg.moe_layer_freq, tcfg.num_layers
    if isinstance(freq, int):
        return [i % freq == 0 for i in range(n)]
    return [bool(x) for x in freq]


class MegatronRoutingReplay:
    """Installed on a GPTModel stage: each of its MoE routers replays its layer of the micro-batch's record."""

    def __init__(self, gpt):
        from megatron.core.transformer.moe.router import TopKRouter

        pattern = moe_layer_pattern(gpt.config)
        self.layers: list[tuple[int, _MegatronRouterReplay]] = []
        for layer in gpt.decoder.layers:
            router = getattr(getattr(layer, "mlp", None), "router", None)
            if isinstance(router, TopKRouter):
                hook = _MegatronRouterReplay()
                router.router_replay = hook
                self.layers.append((sum(pattern[:layer.layer_number - 1]), hook))  # layer_number: global, 1-based

    def set(self, routing: torch.Tensor | None) -> None:
        """Before a micro-batch's forward on this stage: its `routing_rows` (None: route every token)."""
        if routing is None:
            for _, hook in self.layers:
                hook.target = None
            return
        # [s, b, layers, k], the order of megatron's [s, b, h] activations. Whole: MoE runs at TP 1
        # (parallel_dims.check_expert_split), so no rank holds a sequence-parallel slice
        seq_major = routing.transpose(0, 1)
        flat = seq_major.reshape(-1, *seq_major.shape[2:])
        for moe_index, hook in self.layers:
            hook.target = flat[:, moe_index]


# transformers' top-k routers whose output replay rebuilds: (logits, gate weights, indices), and whether the gate
# weights are renormalised over the k experts (read from the module)
_HF_ROUTERS = {"Qwen3MoeTopKRouter": lambda m: bool(m.norm_topk_prob), "MixtralTopKRouter": lambda m: True}


class HFRoutingReplay:
    """Installed on an HF causal LM (the FSDP2 backend): each top-k router's output is rebuilt with the micro-batch's
    recorded experts, its gate weights the router's own softmax at them (renormalised as that router does)."""

    def __init__(self, lm):
        self.hooks: list[tuple[object, dict]] = []
        for m in lm.modules():
            renorm = _HF_ROUTERS.get(type(m).__name__)
            if renorm is not None:
                state = {"target": None, "renorm": renorm(m)}
                m.register_forward_hook(lambda mod, args, out, state=state: self._replay(state, out))
                self.hooks.append((m, state))
        if not self.hooks:
            moe = [type(m).__name__ for m in lm.modules() if "Router" in type(m).__name__ or "Gate" in type(m).__name__]
            raise ValueError(f"policy.moe_routing_replay: no router of {type(lm).__name__} is one replay knows "
                             f"({', '.join(_HF_ROUTERS)}; found {sorted(set(moe)) or 'none'}): set it to off")

    @staticmethod
    def _replay(state: dict, out):
        target = state["target"]
        if target is None:
            return out
        logits, weights, indices = out
        indices = replayed_topk(target, indices)
        gate = torch.softmax(logits.float(), dim=-1).gather(1, indices)
        if state["renorm"]:
            gate = gate / gate.sum(dim=-1, keepdim=True)
        return logits, gate.to(weights.dtype), indices

    def set(self, routing: torch.Tensor | None) -> None:
        """Before a micro-batch's forward: its `routing_rows` (None: route every token). HF routers see [b * s]."""
        flat = None if routing is None else routing.reshape(-1, *routing.shape[2:])
        for moe_index, (_, state) in enumerate(self.hooks):
            state["target"] = None if flat is None else flat[:, moe_index]

    @classmethod
    def install(cls, lm, option: str) -> "HFRoutingReplay | None":
        """Replay on `lm` unless `option` (policy.moe_routing_replay) is off or the model has no experts; under
        `auto` a model whose routers replay does not know routes every token itself (`on` refuses it)."""
        experts = getattr(lm.config, "num_experts", None) or getattr(lm.config, "num_local_experts", None)
        if option == "off" or not experts:
            return None
        try:
            return cls(lm)
        except ValueError:
            if option == "on":
                raise
            return None


def attach(batch, mbs: list[MicroBatchRows], replay) -> list[MicroBatchRows]:
    """The micro-batches with their `routing` when the batch carries a record and the model replays it."""
    if batch.routed_experts is not None and replay is not None:
        for mb in mbs:
            mb.routing = None if mb.filler else routing_rows(batch.routed_experts, mb)
    return mbs
