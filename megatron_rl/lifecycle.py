"""The colocated handover's phases, shared by the policy ranks, the generator and the driver.

A colocated step moves the device between the trainer and the engine (generate -> engine sleeps -> trainer onloads ->
train -> trainer offloads its gradients and optimizer state -> engine wakes its weights -> refit -> trainer offloads
its weights -> engine wakes its KV cache). Each side
keeps its own state and refuses calls that need memory it has given away; the error names the side and the phase,
so an ordering bug fails at the call that has it, on CPU as on GPU, instead of as a crash or an out-of-memory later.
"""
from __future__ import annotations

# trainer (policy ranks)
RESIDENT = "resident"  # weights, gradients and optimizer state in device memory
WEIGHTS_RESIDENT = "weights_resident"  # only the weights (a colocated refit reads them): policy/residency.py
OFFLOADED = "offloaded"  # all of it in host memory, device storage released

# generator (vLLM engine)
AWAKE = "awake"  # weights and KV cache allocated: can generate
WEIGHTS_ONLY = "weights_only"  # weights allocated, KV cache released: can receive a refit, cannot generate
ASLEEP = "asleep"  # both released (GPU: weights in host memory): can do neither


class LifecycleError(RuntimeError):
    """A call made in the wrong phase of the colocated handover."""
