"""The frozen distillation teacher: Megatron ranks (their own TP x PP x DP world) that only score tokens.

`TeacherWorker` is built by the policy's own code (`forward_pass.init_rank` / `build_loaded_model`, the same hooks
and logprob kernels, vocab-parallel at TP > 1), from an HF folder or a megatron-rl checkpoint, with no DDP, no
optimizer, no gradient anywhere (every parameter `requires_grad=False`). Its `logprobs(batch)` is the policy's
`ForwardPass.logprobs`: {batch index: logprobs of the sampled response tokens} from its output ranks.

Colocated, the teacher takes its turn on the devices (`algorithms/handover.Handover.to_teacher`): its weights live in
host memory while the engine generates and the trainer trains, and come back only to score a rollout. The same
`Residency` moves as the trainer's (policy/residency.py), with weights as the only state: RESIDENT and OFFLOADED
(WEIGHTS_RESIDENT is passed through, there being no training state to drop first).

`TeacherGroup` is the driver's side: the ranks as one object, results in batch order.
"""
from __future__ import annotations

import torch

from megatron_rl.config.schema import PolicyConfig
from megatron_rl.distributed.worker_group import RankWorker
from megatron_rl.policy.forward_pass import ForwardPass, build_loaded_model, init_rank
from megatron_rl.policy.group_calls import LifecycleCalls
from megatron_rl.policy.interface import RolloutBatch
from megatron_rl.policy.residency import Residency


class TeacherWorker(ForwardPass, Residency, RankWorker):
    def __init__(self, rank: int, world_size: int, log_path: str | None = None, threads: int | None = None,
                 env: dict | None = None, teacher_cfg: PolicyConfig | None = None, checkpoint: str | None = None):
        super().__init__(rank, world_size, log_path, threads, env)
        self.cfg = teacher_cfg or PolicyConfig()
        self.checkpoint = checkpoint  # a megatron-rl checkpoint's weights instead of the HF folder's
        self._init_residency()

    def setup(self) -> dict:
        from megatron.core import parallel_state as ps

        self.device = init_rank(self.cfg, self._local_rank(self.rank))
        gpt, self.model_dir, _, self.dtype = build_loaded_model(self.cfg, self.device, checkpoint=self.checkpoint)
        gpt.requires_grad_(False)  # frozen: no autograd graph is ever kept for it
        self._setup_forward(gpt)
        self.model = gpt  # the schedule runs the bare model: nothing to reduce, no gradient buffers
        gpt.eval()
        return {"rank": self.rank, "tp_rank": ps.get_tensor_model_parallel_rank(), "dp_rank": self.dp_rank,
                "pp_rank": ps.get_pipeline_model_parallel_rank(), "dp_size": self.dp_size,
                "num_params": sum(p.numel() for p in gpt.parameters())}

    @torch.no_grad()
    def topk_logprobs(self, batch: RolloutBatch, k: int, temperature: float = 1.0):
        """{batch index: (ids [n, k], logprobs [n, k])} of the k most likely next tokens at each response position,
        over the whole vocabulary (policy/topk.py; vocab-parallel at TP > 1), from output ranks; None elsewhere."""
        from megatron.core import parallel_state as ps

        from megatron_rl.policy import batching
        from megatron_rl.policy.topk import vocab_topk

        self._require_resident("compute top-k logprobs")
        if self.cp.size > 1:  # the config loader refuses it first (config/distillation.py)
            raise ValueError("top-k distillation (distillation.topk) with a context-parallel teacher")
        mbs = self._micro_batches(batch)
        out: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        tp = self.tp_size > 1

        def step(data_iter, model):
            output, mb = self._forward(model, next(data_iter))

            def loss_func(output):
                if not mb.filler:
                    ids, lps = vocab_topk(output, self._fused_head, k, temperature, self.tp_group if tp else None,
                                          ps.get_tensor_model_parallel_rank() * output.shape[-1] if tp else 0)
                    for i, a, b in zip(mb.indices, batching.split_rows(ids, mb), batching.split_rows(lps, mb)):
                        out[i] = (a.cpu().clone(), b.cpu().clone())  # not views of the whole row
                return output.sum() * 0.0, {}

            return output, loss_func

        self._schedule(mbs, step, forward_only=True)
        return out if self.is_output_rank else None

    # Residency's two halves: the weights, and no training state
    def _weight_tensors(self) -> list[torch.Tensor]:
        return list(self.gpt.parameters())

    def _train_state(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        return [], []

    def set_threads(self, n: int) -> None:
        from megatron_rl.platform import set_cpu_threads

        set_cpu_threads(n)


class TeacherGroup(LifecycleCalls):
    """Driver side of the teacher ranks (as `policy.group.PolicyGroup` is of the policy's); a reward model's ranks are
    the same group with a value head (their "logprobs" are per-token values)."""

    role = "teacher"

    def __init__(self, group, role: str = "teacher"):
        self.role = role
        super().__init__(group)

    def logprobs(self, batch: RolloutBatch, temperature: float = 1.0) -> list[torch.Tensor]:
        import ray

        from megatron_rl.policy.group import _merge

        return _merge(self.group.call("logprobs", ray.put(batch), temperature), len(batch), f"{self.role} logprobs")

    def topk_logprobs(self, batch: RolloutBatch, k: int, temperature: float = 1.0):
        """(ids, logprobs) per sequence, each [response tokens, k] (`TeacherWorker.topk_logprobs`)."""
        import ray

        from megatron_rl.policy.group import _merge

        pairs = _merge(self.group.call("topk_logprobs", ray.put(batch), k, temperature), len(batch),
                       "teacher top-k logprobs")
        return [p[0] for p in pairs], [p[1] for p in pairs]

    def shutdown(self) -> None:
        self.group.shutdown()
