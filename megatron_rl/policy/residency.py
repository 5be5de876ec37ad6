"""What of the trainer is on the device: the policy rank's half of the colocated handover (a `MegatronPolicyWorker`
mixin, which provides `model` (megatron DDP), `gpt` and `optimizer`).

Three states (`megatron_rl/lifecycle.py`), in the order a colocated step passes through them:

    RESIDENT           weights, gradients and optimizer state on the device: train, save, export
    WEIGHTS_RESIDENT   only the model's weights: export (the refit); gradients and optimizer state in host memory
    OFFLOADED          nothing: the engine generates

The refit goes through WEIGHTS_RESIDENT because its peak is the device's highest: the engine's weights wake while the
trainer's are read and the transport holds a copy of the whole model (CUDA IPC). Dropping the gradients (fp32, 4
bytes a parameter) and the Adam state first keeps that peak at about three copies of the bf16 weights instead of
the whole training state plus two (docs: the memory plan). Each state's tensors move through their own
`offload.DeviceStateOffloader`, so the two halves come back independently.
"""
from __future__ import annotations

import torch

from megatron_rl.lifecycle import OFFLOADED, RESIDENT, WEIGHTS_RESIDENT, LifecycleError
from megatron_rl.platform import get_platform
from megatron_rl.policy.grad_ops import torch_optimizers
from megatron_rl.policy.offload import DeviceStateOffloader, resident_bytes


class Residency:
    def _init_residency(self) -> None:
        self.lifecycle_state = RESIDENT
        self._weights_offloader = DeviceStateOffloader()  # the model's weights
        self._train_offloader = DeviceStateOffloader()  # gradients, optimizer parameters and state

    # ---- which tensors
    def _weight_tensors(self) -> list[torch.Tensor]:
        """The model's parameters: with the distributed optimizer they are views into DDP's contiguous parameter
        buffers (listed first, so a buffer moves whole and its views add nothing); without it DDP keeps no
        parameter buffer (`param_data` None) and each parameter is a tensor of its own."""
        buffers = self.model.buffers + self.model.expert_parallel_buffers
        return [b.param_data for b in buffers if b.param_data is not None] + list(self.gpt.parameters())

    def _train_state(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(contents kept, contents discarded) of the training state: the optimizer's own parameters (fp32 main
        weights, shards) and Adam state, except storages the weights own (fp32 without the distributed optimizer:
        the optimizer's parameters are the model's); DDP's gradient buffers (a step zeroes them first anyway)."""
        weight_storages = {t.untyped_storage().data_ptr() for t in self._weight_tensors()
                           if t.untyped_storage().nbytes()}
        buffers = self.model.buffers + self.model.expert_parallel_buffers
        keep = []
        for inner in torch_optimizers(self.optimizer):
            keep += [p for g in inner.param_groups for p in g["params"]]
            keep += [v for st in inner.state.values() for v in st.values() if torch.is_tensor(v)]
        keep = [t for t in keep if t.untyped_storage().data_ptr() not in weight_storages]
        return keep, [b.grad_data for b in buffers if b.grad_data is not None]

    def _device_state(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(kept, discarded): every tensor of the trainer's device state."""
        keep, drop = self._train_state()
        return self._weight_tensors() + keep, drop

    # ---- moves
    def offload_train_state(self) -> dict:
        """RESIDENT -> WEIGHTS_RESIDENT before a colocated refit (module docstring). Idempotent."""
        if self.lifecycle_state == RESIDENT:
            self._train_offloader.offload(*self._train_state())
            self.lifecycle_state = WEIGHTS_RESIDENT
        return self.memory_report()

    def offload(self) -> dict:
        """Give the device to the colocated generator: everything leaves device memory (host copies kept, see
        policy/offload.py). The same steps on CPU, where the released storage makes any use of offloaded state fail
        loudly. Idempotent."""
        self.offload_train_state()
        if self.lifecycle_state == WEIGHTS_RESIDENT:
            self._weights_offloader.offload(self._weight_tensors(), [])
            self.lifecycle_state = OFFLOADED
        return self.memory_report()

    def onload(self) -> dict:
        if self.lifecycle_state == OFFLOADED:
            self._weights_offloader.restore()
            self.lifecycle_state = WEIGHTS_RESIDENT
        if self.lifecycle_state == WEIGHTS_RESIDENT:
            self._train_offloader.restore()
            self.lifecycle_state = RESIDENT
        return self.memory_report()

    def memory_report(self) -> dict:
        """Bytes of trainer state in device storage (all of it, and the weights' share) and in host copies (CPU: the
        "device" is host memory too, but the accounting is the same); on GPU also what torch's allocator holds and
        what the whole device has in use (every process on it: the colocated engine too)."""
        keep, drop = self._device_state()
        out = {"state": self.lifecycle_state, "device_bytes": resident_bytes(keep + drop),
               "weight_bytes": resident_bytes(self._weight_tensors()),
               "host_bytes": self._weights_offloader.host_bytes() + self._train_offloader.host_bytes()}
        if get_platform().is_gpu:
            free, total = torch.cuda.mem_get_info()
            out.update(allocated_bytes=torch.cuda.memory_allocated(), device_used_bytes=total - free)
        return out

    def _require_resident(self, what: str, *, weights_enough: bool = False) -> None:
        if self.lifecycle_state == RESIDENT or (weights_enough and self.lifecycle_state == WEIGHTS_RESIDENT):
            return
        raise LifecycleError(f"cannot {what} while the trainer state is {self.lifecycle_state} (the colocated "
                             "handover gave the device to the generator; onload() first)")
