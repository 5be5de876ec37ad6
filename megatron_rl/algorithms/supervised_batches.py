"""SFT and DPO examples as training batches: the epoch order (`ExampleStream`, resumable exactly) and the
`RolloutBatch` of a step (`sft_batch`, `pair_batch`).

The worker trains any `RolloutBatch`; what makes these ones SFT or DPO is only their fields:
- SFT: one sequence per example, `loss_mask` marking the assistant tokens (the other turns are context);
- DPO: each pair is a group of two sequences sharing the prompt (`group_ids`), chosen first (`seq_roles` 1, then
  0), and `keep_groups` so both are in one micro-batch: with shared-prefix packing the prompt is one row segment that
  both responses attend (computed once), and the pairwise loss sees both sums;
- RM: DPO's pairs with one token more at each sequence's end (`rm_pair_batch`).
"""
from __future__ import annotations

import random

import torch

from megatron_rl.data.supervised import PairExample, SFTExample
from megatron_rl.models.value_head import scored_sequence
from megatron_rl.policy.interface import RolloutBatch


class ExampleStream:
    """Batches of example indices, epoch after epoch, each epoch in its own seeded order; the state is (epoch,
    position), so a resumed run takes exactly the batches the uninterrupted run would have. An epoch's tail shorter
    than `min_batch` (the data-parallel size: every rank needs an example) is dropped."""

    def __init__(self, size: int, batch_size: int, *, seed: int, shuffle: bool, min_batch: int = 1):
        if batch_size < min_batch:
            raise ValueError(f"batch size {batch_size} is smaller than the {min_batch} data-parallel ranks")
        self.size, self.batch_size, self.seed, self.shuffle, self.min_batch = size, batch_size, seed, shuffle, min_batch
        self.epoch, self.position = 0, 0

    def steps_per_epoch(self) -> int:
        full, tail = divmod(self.size, self.batch_size)
        return full + (1 if tail >= self.min_batch else 0)

    def order(self, epoch: int) -> list[int]:
        idx = list(range(self.size))
        if self.shuffle:  # a string seed: stable across Python versions (random hashes it with SHA-512)
            random.Random(f"examples:{self.seed}:{epoch}").shuffle(idx)
        return idx

    def next_batch(self) -> list[int]:
        if self.size - self.position < self.min_batch:
            self.epoch, self.position = self.epoch + 1, 0
        take = self.order(self.epoch)[self.position:self.position + self.batch_size]
        self.position += len(take)
        return take

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "dataset_size": self.size}

    def load_state_dict(self, state: dict) -> None:
        if state.get("seed", self.seed) != self.seed or state.get("dataset_size", self.size) != self.size:
            raise ValueError(f"example stream state (seed {state.get('seed')}, {state.get('dataset_size')} examples) "
                             f"does not match this run's (seed {self.seed}, {self.size} examples)")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])


def steps_for(epochs: int, stream: ExampleStream) -> int:
    return max(1, epochs * stream.steps_per_epoch())


def sft_batch(examples: list[SFTExample]) -> RolloutBatch:
    batch = RolloutBatch(input_ids=[list(e.ids) for e in examples], prompt_lens=[e.prompt_len for e in examples],
                         loss_mask=[torch.tensor(e.loss_mask, dtype=torch.bool) for e in examples])
    batch.add_model_inputs([e.model_inputs for e in examples])  # a vision-language example's images
    return batch


def pair_batch(pairs: list[PairExample]) -> RolloutBatch:
    ids, plens, groups, roles = [], [], [], []
    for k, p in enumerate(pairs):
        for resp, role in ((p.chosen, 1.0), (p.rejected, 0.0)):
            ids.append(list(p.prompt) + list(resp))
            plens.append(len(p.prompt))
            groups.append(k)
            roles.append(role)
    batch = RolloutBatch(input_ids=ids, prompt_lens=plens, group_ids=groups, seq_roles=roles, keep_groups=True)
    batch.add_model_inputs([p.model_inputs for p in pairs for _ in (0, 1)])  # both responses read the prompt's images
    return batch


def rm_pair_batch(pairs: list[PairExample], pad_id: int | None = None) -> RolloutBatch:
    """`pair_batch` scored where transformers' ForSequenceClassification scores a row (`value_head.scored_sequence`:
    at its last token that is not `pad_id`, the exported config's pad_token_id)."""
    batch = pair_batch(pairs)
    batch.input_ids = [scored_sequence(seq, p, pad_id) for seq, p in zip(batch.input_ids, batch.prompt_lens)]
    if any(p.margin is not None for p in pairs):  # the pair's margin on both its sequences (a line without: 0)
        batch.fields["margin"] = [p.margin or 0.0 for p in pairs for _ in range(2)]
    return batch
