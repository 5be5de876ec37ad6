"""Make a megatron-core GPTModel honour per-token `position_ids` in RoPE, and explicit attention masks.

Both are needed by group-shared prefix packing (`policy/batching.py` `row_layout`), where positions restart for every completion
and attention is block-structured. The worker installs them once after building the model (every pipeline stage).

RoPE. megatron-core's `GPTModel._preprocess` asks `rotary_pos_emb(seq_len)` for the table of positions 0..s-1 and
ignores `position_ids`. We patch that one module instance: a forward pre-hook on the GPTModel records the call's
`position_ids`, and the rotary module's forward then returns per-token frequencies [s, b, 1, d] (positions gathered
per row) instead of [s, 1, 1, d]. megatron's unfused bshd `apply_rotary_pos_emb` broadcasts either shape against
[s, b, heads, d]. The frequencies are computed from the module's *current* `inv_freq` (so the llama3-scaled one that
`build_model` installs is used) with megatron's own arithmetic (position * 1/interpolation, times inv_freq, cat or
interleave), so a row with positions 0..s-1 gets bit-identical values; such calls (all rows plain 0..s-1) go to the
stock, cached path unchanged. TE's fused RoPE takes only [s, 1, 1, d]: callers keep `apply_rope_fusion` off.

Masks. With an explicit mask the attention must use it, whatever mask type the layer spec fixed (causal). The local
spec's unfused softmax already applies a given mask, but its fused CUDA kernel (fp16/bf16) and transformer-engine
follow the mask *type* and would build a causal mask instead. A forward pre-hook on every core-attention module makes
the type `arbitrary` for calls that carry a mask and leaves mask-less calls on the spec's causal path (TE's fused
kernels stay in use for those). Under TE, `arbitrary` runs TE's unfused (PyTorch) attention backend with the
[b, 1, s, s] bool mask — correct, O(s^2) memory per head; flash/cuDNN kernels do not take arbitrary masks.
The type is decided per call from the call's own arguments, so activation recompute (which re-runs the forward
with the same arguments) sees the same type.
"""
from __future__ import annotations

import torch


def position_freqs(rope, position_ids: torch.Tensor) -> torch.Tensor:
    """[b, s] positions -> [s, b, 1, rot_dim] rotary angles, megatron's layout and arithmetic."""
    inv = rope.inv_freq.to(position_ids.device)
    seq = position_ids.to(inv.dtype)
    if rope.seq_len_interpolation_factor is not None:
        seq = seq * (1 / rope.seq_len_interpolation_factor)
    freqs = seq[..., None] * inv  # [b, s, d/2]; the same products torch.outer forms
    if getattr(rope, "rotary_interleaved", False):
        emb = torch.stack((freqs, freqs), dim=-1).flatten(-2)
    else:
        emb = torch.cat((freqs, freqs), dim=-1)
    return emb.transpose(0, 1)[:, :, None, :].contiguous()


def _plain(position_ids: torch.Tensor) -> bool:
    s = position_ids.shape[-1]
    return bool((position_ids == torch.arange(s, device=position_ids.device)).all())


def install_position_rope(gpt) -> bool:
    """Patch `gpt` (a GPTModel, any pipeline stage) so RoPE follows `position_ids`. Idempotent; False if no RoPE."""
    rope = getattr(gpt, "rotary_pos_emb", None)
    if rope is None or getattr(gpt, "_megatron_rl_position_rope", False):
        return rope is not None
    stock = rope.forward  # the class's lru-cached forward, bound to this instance
    current: dict = {"pos": None}

    def forward(max_seq_len, offset=0, packed_seq=False, cp_group=None):
        pos = current["pos"]
        if pos is None or offset:
            return stock(max_seq_len, offset, packed_seq, cp_group)
        if cp_group is not None and cp_group.size() > 1:
            raise NotImplementedError("per-token RoPE positions with context parallelism")
        if packed_seq:
            # a cascade THD row [1, t]: one angle per packed token; megatron's THD RoPE takes a table with one row
            # per packed token as exactly that ("freqs.size(0) == cu_seqlens[-1]")
            return position_freqs(rope, pos)
        if pos.shape[-1] != max_seq_len:
            raise ValueError(f"position_ids cover {pos.shape[-1]} tokens but the model runs {max_seq_len}")
        return position_freqs(rope, pos)

    def record_positions(_module, args, kwargs):
        pos = args[1] if len(args) > 1 else kwargs.get("position_ids")
        packed = kwargs.get("packed_seq_params")
        # a plain varlen row's positions restart at every segment, which megatron's THD RoPE (and TE's fused one)
        # does from cu_seqlens by itself; only cascade rows (completions continue their prompt's positions), a
        # context-parallel rank's share of a row and dense shared-prefix rows need per-token angles
        plain_thd = packed is not None and not getattr(packed, "per_token_positions", False)
        current["pos"] = None if pos is None or plain_thd or _plain(pos) else pos

    rope.forward = forward  # instance attribute: nn.Module.__call__ dispatches to it
    gpt.register_forward_pre_hook(record_positions, with_kwargs=True)
    gpt._megatron_rl_position_rope = True
    return True


def install_explicit_mask_attention(gpt) -> int:
    """Core attention follows an explicit mask when one is passed (type `arbitrary`). Returns modules hooked."""
    from megatron.core.transformer.enums import AttnMaskType

    if getattr(gpt, "_megatron_rl_explicit_mask", False):
        return 0
    n = 0
    for name, module in gpt.named_modules():
        if not name.endswith("self_attention.core_attention"):
            continue
        softmax = getattr(module, "scale_mask_softmax", None)  # local spec: the type lives here
        spec_type = softmax.attn_mask_type if softmax is not None else None

        def choose_type(_module, args, kwargs, softmax=softmax, spec_type=spec_type):
            mask = args[3] if len(args) > 3 else kwargs.get("attention_mask")
            kind = AttnMaskType.arbitrary if mask is not None else None
            if softmax is not None:
                softmax.attn_mask_type = kind or spec_type
            if kind is None:
                return None
            if len(args) > 4:
                args = args[:4] + (kind,) + args[5:]
            else:
                kwargs["attn_mask_type"] = kind
            return args, kwargs

        module.register_forward_pre_hook(choose_type, with_kwargs=True)
        n += 1
    gpt._megatron_rl_explicit_mask = True
    return n


class LogitWindow:
    """Where the output layer runs along the sequence for the current forward: from column `start` on (0:
    everywhere), or, for a packed row, only at the columns of a LongTensor `start`."""

    def __init__(self):
        self.start: "int | torch.Tensor" = 0


def install_logit_window(gpt) -> LogitWindow | None:
    """Run the output layer (the lm_head) only on the columns from `window.start` on.

    Only positions that predict a response token need logits, and in a micro-batch those form a tail: every column
    before the first response prediction of any row is prompt. Skipping the lm_head and the vocabulary-wide
    log-softmax there saves most of a prompt's share of both (with shared-prefix packing about half of a demo row is
    prompt; the lm_head is ~20 % of SmolLM2's FLOPs per token). A forward pre-hook narrows the output layer's input
    [s, b, h] to [s - start, b, h]; logits come back as [b, s - start, V], and the caller narrows its targets the same
    way (`batching.response_window`). The decoder and its hidden states are untouched, so gradients are exact.

    Not installed (None) where the narrowing would be wrong or absent: stages without an output layer, sequence
    parallelism (the output layer's input is then a sequence shard), context parallelism, multi-token prediction.
    """
    layer = getattr(gpt, "output_layer", None)
    cfg = gpt.config
    if (layer is None or not getattr(gpt, "post_process", True) or cfg.sequence_parallel
            or (cfg.context_parallel_size or 1) > 1 or getattr(cfg, "mtp_num_layers", None)):
        return None
    window = LogitWindow()

    def narrow(_module, args, kwargs):
        start = window.start
        if torch.is_tensor(start):  # a packed row: gather its response-predicting columns
            return (args[0].index_select(0, start.to(args[0].device)),) + tuple(args[1:]), kwargs
        if start <= 0:
            return None
        return (args[0][start:],) + tuple(args[1:]), kwargs

    layer.register_forward_pre_hook(narrow, with_kwargs=True)
    return window


class FusedHead:
    """What the output layer's last forward would have multiplied by, for `kernels.linear_token_logprobs`.

    ``weight``: this rank's real vocabulary rows [n_real, h] of the weight used by that forward (the tied
    embedding's copy or the output layer's own; None before the first). ``vocab_start``: the global id of its first
    row. The unfused path is a worker built with `policy.fused_lm_head: false` (no head installed)."""

    def __init__(self, vocab_start: int, n_real: int):
        self.vocab_start, self.n_real = vocab_start, n_real
        self.weight: torch.Tensor | None = None


def install_fused_head(gpt, tp_rank: int = 0) -> FusedHead | None:
    """Make the output layer hand back its (TP-replicated) input instead of logits.

    The caller then computes logprobs and entropy from hidden states and weight tile by tile (kernels/linear.py),
    so no [tokens, vocab] tensor exists in the forward or the backward. GPTModel still transposes the output to
    [b, s, h]; the logit window's pre-hook (`install_logit_window`) narrows the input as before. The layer's own
    backward all-reduces the hidden gradient over TP (each rank's vocabulary shard contributes part of it); here the
    kernel does (``reduce_hidden_grad``). Not megatron's copy-to-TP-region: its backward all-reduces a contiguous
    copy of the gradient and returns the original, and the gradient arriving through GPTModel's transpose is not
    contiguous, so the sum was lost (measured: every decoder gradient ~15 % short at TP=2).

    Padded vocabulary rows (models/provider.py masks their logits with a forward hook) are left out of the weight
    handed on instead, and that hook skips a forward that returned hidden states.

    Not installed (None): stages without an output layer, sequence parallelism (the layer's input is then a
    sequence shard it all-gathers), multi-token prediction, an output bias, or an output layer gathering logits.
    """
    layer = getattr(gpt, "output_layer", None)
    cfg = gpt.config
    if (layer is None or not getattr(gpt, "post_process", True) or cfg.sequence_parallel
            or getattr(cfg, "mtp_num_layers", None) or getattr(layer, "bias", None) is not None
            or getattr(layer, "gather_output", False)):
        return None
    spec = gpt.megatron_rl_spec
    tp = cfg.tensor_model_parallel_size or 1
    local = spec.padded_vocab // tp
    start = tp_rank * local
    head = FusedHead(start, max(0, min(local, spec.vocab_size - start)))

    def forward(input_, weight=None, runtime_gather_output=None, **kwargs):
        w = layer.weight if weight is None else weight
        head.weight = w[:head.n_real]
        return input_, None

    layer.forward = forward  # instance attribute: nn.Module.__call__ (and its pre-hooks) dispatch to it
    layer.megatron_rl_returned_hidden = True  # provider.py's padded-logit hook: leave this output alone
    return head
