"""The one place that knows whether we run on CPU or GPU.

Everything else asks this module for the device, the torch.distributed backend, the default dtype and which
implementation of a device-specific piece to use (logprob kernel, refit transport, layer spec). The rest of the code
never branches on `torch.cuda.is_available()` itself.

It also owns the small compatibility layer that lets unmodified megatron-core run on a CPU-only torch build (gloo).
megatron-core assumes CUDA in a handful of places (listed in `install_megatron_cpu_compat`), which redirects
exactly those to the CPU and is a no-op when CUDA is present.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

SLOT_ENV = "MEGATRON_RL_DEVICE_SLOT"  # the placement bundle Ray put this process on (set by distributed/cluster.py)



MASKED_ROW_TOKENS = 1024  # CPU: the longest training row `packing: auto` still gives an explicit mask (none)

@dataclass(frozen=True)
class Platform:
    device_type: str  # "cuda" or "cpu"
    dist_backend: str  # "nccl" or "gloo"
    default_dtype: torch.dtype  # training/params dtype when the config says "auto"
    logprob_impl: str  # "triton" (compiled kernels) or "torch" (chunked reference path)
    refit_transport_colocated: str  # "cuda_ipc" or "shared_memory"
    refit_transport_disaggregated: str  # "collective" on both: a broadcast over NCCL (GPU) or gloo (CPU)
    has_transformer_engine: bool

    @property
    def is_gpu(self) -> bool:
        return self.device_type == "cuda"

    @property
    def default_packing(self) -> str:
        """`policy.packing: auto`. GPU: varlen. With shared_prefix (the default) and packing none every group row
        carries an explicit block mask, which transformer-engine runs through its unfused O(s^2) attention; varlen
        rows stay on fused kernels (TE's THD attention, cascade rows on torch's). CPU: none, where the block-mask
        rows trained as fast as cascade rows at the demo's shape (bench/demo_ab.py --compare packing, 0.87-0.98x,
        2026-11-30, 2 cores) and are what the demo was tuned on; megatron's local spec hands them to torch's fused
        attention with the mask (models/varlen_attention.dense_attention), so they no longer hold [b, h, s, s]
        scores in every layer either."""
        return "varlen" if self.is_gpu else "none"

    def packing_for(self, row_tokens: int) -> str:
        """`policy.packing: auto` for a run whose training rows hold up to `row_tokens` tokens
        (`Config.longest_train_row`). CPU: `default_packing` (none) up to MASKED_ROW_TOKENS, varlen above: a longer
        row's explicit mask and its per-layer attention grow with its square (the tool demo's ~900-token group rows
        took a worker to 19.4 GB before configs/tool_math_cpu.yaml chose varlen, 2026-12-01)."""
        return "varlen" if self.is_gpu or row_tokens > MASKED_ROW_TOKENS else self.default_packing

    @property
    def moe_token_dispatcher(self) -> str:
        """megatron-core's MoE token dispatcher: "alltoall" on both platforms (each token travels only to the EP
        ranks of its experts, and EP ranks may hold different token counts).

        Probed on megatron-core 0.16.1 over gloo at EP=2: gloo's all_to_all_single carries uneven splits, and the
        alltoall dispatcher needs three CUDA assumptions redirected (install_megatron_cpu_compat: host split sizes,
        a completed stand-in event, the all-to-all's allocation in backward); then logits equal HF's and expert
        gradients equal HF's summed over the ranks' sequences, with 13 and 6 tokens on the two ranks
        (tests/distributed/test_models_qwen3_moe.py). "allgather" is not used on CPU even though it runs unpatched:
        it gathers equal-sized token blocks over TP x EP, so it needs the same token count on every EP rank, which
        data-parallel micro-batches of different lengths do not have."""
        return "alltoall"

    def worker_env(self) -> dict[str, str]:
        """Environment for the worker processes this platform starts (Ray actors), read by them at start-up.

        CPU: glibc serves every allocation above its mmap threshold (128 KiB, rising to at most 32 MiB) with a fresh
        mmap and returns it to the kernel on free, so each step's activations, logits and re-packed GEMM weights are
        page-faulted in again. A 1 GiB threshold keeps them in the heap, and a 1 GiB trim threshold keeps freed
        memory for the next step. Measured on SmolLM2-135M: train 143 -> 162 tok/s (bench/policy_bench.py), vLLM
        decode 261 -> 271 tok/s, GEMM re-pack 0.16 -> 0.11 s. A value already in the environment wins.
        """
        if self.is_gpu:
            return {}
        tuned = {"MALLOC_MMAP_THRESHOLD_": str(1 << 30), "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}
        return {k: os.environ.get(k, v) for k, v in tuned.items()}

    def device(self, local_rank: int = 0) -> torch.device:
        return torch.device("cuda", local_rank) if self.is_gpu else torch.device("cpu")

    def device_identity(self, device: torch.device | None = None) -> str:
        """The physical device this process computes on, comparable between processes: a GPU's UUID, or on CPU the
        placement slot (bundle) on this host. The colocated refit hands each engine worker the update of a policy
        rank with the same identity: CUDA IPC can only open buffers of the same GPU, and the CPU refuses another
        slot's update too (its shared memory could be read from anywhere), so a routing mistake fails on CPU as it
        would on a GPU. Processes placed outside Ray (benches, tests in one process) are all slot "local"."""
        if self.is_gpu:
            index = device.index if device is not None and device.index is not None else torch.cuda.current_device()
            return f"GPU-{torch.cuda.get_device_properties(index).uuid}"
        import socket

        return f"cpu:{socket.gethostname()}:slot-{os.environ.get(SLOT_ENV, 'local')}"

    # ---- memory moves of the colocated handover (policy/offload.py); the same steps run on both platforms
    def host_buffer(self, nbytes: int) -> torch.Tensor:
        """A host byte buffer for offloaded device state: pinned on GPU (asynchronous, full-bandwidth copies)."""
        return torch.empty(nbytes, dtype=torch.uint8, device="cpu", pin_memory=self.is_gpu)

    def synchronize(self) -> None:
        """Wait for queued device copies (GPU); CPU copies are synchronous."""
        if self.is_gpu:
            torch.cuda.synchronize()

    def release_cached_memory(self) -> None:
        """Return freed blocks from torch's caching allocator to the driver, so another process (the colocated vLLM
        engine) can allocate them. CPU: the storages are released (the observable effect), but the heap keeps the
        pages for the next step (`worker_env`) unless the machine is short of memory. Trimming at every handover
        returned the bf16 demo trainer's RSS from 11.3 to 3.0 GB but cost ~4 s of page faults per step (system CPU
        time 0.7 -> 4.6 s per step, 2 cores, 2026-11-30; 2 MB pages via glibc.malloc.hugetlb=1 made it worse:
        ~18 s), so it happens only when less than `HOST_MEMORY_RESERVE` of the machine's memory is available."""
        if self.is_gpu:
            torch.cuda.empty_cache()
        elif _host_memory_short():
            _malloc_trim()

    def peak_memory_bytes(self) -> int:
        """The most memory this process has held so far: on GPU torch's allocator peak on this device, on CPU the
        process's peak resident set (Linux reports ru_maxrss in KiB); the trainer logs it with each step."""
        if self.is_gpu:  # no CPU test reaches this line (no CUDA allocator); the CPU line below runs in test_grpo
            return torch.cuda.max_memory_allocated()
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def trim_host_heap(self) -> None:
        """Hand every free page of this process's C heap back to the system (glibc `malloc_trim(0)`), after work
        whose transient allocations should not stay resident: a checkpoint save's staging copies, a released
        KV cache. Without it the soak measured a trainer and a generator growing by what they had freed, as later
        allocations landed elsewhere in the fragmented heap (11 % in 25 steps). Host memory on both platforms."""
        _malloc_trim()

    def rng_state(self) -> dict:
        """Every RNG stream a resumed run must continue: the CPU generator, the CUDA generator of this device (GPU),
        and megatron's tensor-parallel RNG tracker (dropout inside TP regions)."""
        state = {"cpu": torch.get_rng_state()}
        if self.is_gpu:
            state["cuda"] = torch.cuda.get_rng_state()
        tracker = _megatron_rng_tracker()
        if tracker is not None:
            state["megatron_tracker"] = tracker.get_states()
        return state

    def set_rng_state(self, state) -> None:
        if torch.is_tensor(state):  # checkpoints written before the CUDA/tracker states were kept
            state = {"cpu": state}
        torch.set_rng_state(state["cpu"])
        if "cuda" in state:
            if not self.is_gpu:
                raise RuntimeError("this checkpoint holds a CUDA RNG state (it was written on GPU); resuming it on "
                                   "CPU would not continue the same random stream")
            torch.cuda.set_rng_state(state["cuda"])
        tracker = _megatron_rng_tracker()
        if tracker is not None and "megatron_tracker" in state:
            tracker.set_states(state["megatron_tracker"])

    def collective_device(self, backend: str, cuda_index: int | None = None) -> torch.device:
        """Where a tensor must live for a collective on a process group with this `backend`.

        NCCL moves only CUDA tensors, on this rank's current device (the worker sets it at start-up); gloo reduces
        CPU tensors (its CUDA support covers a few ops only). A per-device backend ("cpu:gloo,cuda:nccl") serves
        both: this platform's device then. `cuda_index` stands in for torch.cuda.current_device().
        """
        b = str(backend).lower()
        if "," in b or ":" in b:
            b = "nccl" if self.is_gpu and "cuda:nccl" in b else "gloo" if "cpu:gloo" in b else b
        if b == "nccl":
            return torch.device("cuda", torch.cuda.current_device() if cuda_index is None else cuda_index)
        if b == "gloo":
            return torch.device("cpu")
        raise ValueError(f"no collective device known for torch.distributed backend {backend!r}")

    def resolve_dtype(self, precision: str) -> torch.dtype:
        """Map a config precision ("auto", "fp32", "bf16", "fp16") to a dtype; "auto" is this platform's default:
        bf16 on GPU and on CPUs with bf16 instructions, else fp32 (see `get_platform`)."""
        table = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
        if precision == "auto":
            return self.default_dtype
        return table[precision]


def _megatron_rng_tracker():
    """megatron's TP RNG tracker when megatron-core is loaded in this process (policy ranks), else None."""
    import sys

    if "megatron.core" not in sys.modules:
        return None
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    return get_cuda_rng_tracker()


def _transformer_engine_importable() -> bool:
    # A half-installed TE makes `import megatron.core` crash with errors other than ImportError, so probe carefully.
    try:
        import transformer_engine.pytorch  # noqa: F401
        return True
    except Exception:
        return False


@functools.lru_cache(maxsize=1)
def get_platform() -> Platform:
    forced = os.environ.get("MEGATRON_RL_DEVICE")  # "cpu" forces the CPU path on a GPU machine (debugging)
    gpu = torch.cuda.is_available() and forced != "cpu"
    if gpu:
        return Platform("cuda", "nccl", torch.bfloat16, "triton", "cuda_ipc", "collective",
                        _transformer_engine_importable())
    # bf16 where the CPU computes it natively: there it is GPU-like numerics (the generator/trainer mismatch that
    # importance corrections exist for) at ~2.3x the fp32 matmul rate; emulated bf16 would be slower than fp32
    dtype = torch.bfloat16 if cpu_has_bf16() else torch.float32
    return Platform("cpu", "gloo", dtype, "torch", "shared_memory", "collective", False)


def cpu_has_bf16() -> bool:
    """Whether this CPU has bf16 arithmetic instructions (AVX512-BF16 or AMX-BF16), from /proc/cpuinfo's flags;
    False where that file does not exist (non-Linux)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return bool(flags & {"avx512_bf16", "amx_bf16"})
    except OSError:
        pass
    return False


def set_cpu_threads(n: int) -> None:
    """Set the intra-op thread count for this process (CPU phases share 2 cores: oversubscription is ~8x slower)."""
    n = max(1, int(n))
    torch.set_num_threads(n)
    os.environ["OMP_NUM_THREADS"] = str(n)


# --------------------------------------------------------------------------------------------------------------------
# megatron-core on a CPU torch build
# --------------------------------------------------------------------------------------------------------------------

def _is_cuda_device(dev) -> bool:
    if isinstance(dev, torch.device):
        return dev.type == "cuda"
    if isinstance(dev, str):
        return dev.startswith("cuda")
    # torch.cuda.current_device() returns an int, and torch treats a bare int device as a CUDA ordinal
    return isinstance(dev, int) and not isinstance(dev, bool)


class _CudaToCpuMode(torch.overrides.TorchFunctionMode):
    """Maps CUDA device requests inside megatron-core to the CPU.

    megatron-core creates scalars and buffers with `device="cuda"` or `device=torch.cuda.current_device()`, moves
    tensors with `.cuda()`, and type-checks fp32 params/grads against the string 'torch.cuda.FloatTensor' (grad
    clipping, distributed optimizer). On a CPU build these all fail; here they land on the CPU and `Tensor.type()`
    reports the CUDA spelling of the same dtype, which is what those checks are asking about.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], "cpu") + tuple(args[2:])
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if ".cuda." not in name else name
        return func(*args, **kwargs)


class _NullStream:
    """Stand-in for a CUDA stream on CPU: work is synchronous, so waits and events are no-ops."""

    def __init__(self, *_a, **_k):
        pass

    def wait_stream(self, *_):
        pass

    def record_event(self, *_a, **_k):
        # an event that has already completed (megatron's alltoall MoE dispatcher synchronises on one)
        return _NullStream()

    def synchronize(self):
        pass

    def query(self) -> bool:  # as an event: complete
        return True

    def __enter__(self):
        return self

    def __exit__(self, *_):
        return False


_COMPAT_MODE: _CudaToCpuMode | None = None


def _define_te_general_gemm() -> None:
    """megatron-core 0.16's moe_utils imports `te_general_gemm` only when transformer-engine imports, but its MoE
    router (`RouterGatingLinearFunction`) reads the name unguarded: without TE (CPU, or a GPU host without TE) every
    MoE forward raises NameError. Defining it as None selects the plain torch.mm path that the code already has."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def install_megatron_cpu_compat() -> None:
    """Make megatron-core's CUDA assumptions hold on a CPU build. Idempotent; does nothing when CUDA is present.

    Call before building megatron-core models in a process (policy workers and tests do this through
    `megatron_rl.models`). The function mode is pushed on the calling thread, which is the thread that runs
    megatron's forward/backward and optimizer.
    """
    global _COMPAT_MODE
    _define_te_general_gemm()
    if get_platform().is_gpu or _COMPAT_MODE is not None:
        return
    cuda = torch.cuda
    cuda.current_device = lambda: 0
    cuda.synchronize = lambda *a, **k: None
    cuda.current_stream = lambda *a, **k: _NullStream()
    cuda.default_stream = lambda *a, **k: _NullStream()
    cuda.Stream = _NullStream  # a class, so annotations like `torch.cuda.Stream | None` keep working
    cuda.stream = lambda *a, **k: _NullStream()
    cuda.empty_cache = lambda: None
    # The "CUDA" RNG becomes the CPU default generator. Seed it directly: torch.manual_seed itself calls
    # torch.cuda.manual_seed_all, so redirecting to torch.manual_seed would recurse forever.
    cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    cuda.manual_seed_all = lambda seed: torch.default_generator.manual_seed(int(seed))
    cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    cuda.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    cuda.random.get_rng_state = cuda.get_rng_state
    cuda.random.set_rng_state = cuda.set_rng_state

    # megatron's RNG tracker (dropout fork, activation recompute) reads and writes the CUDA generator through its own
    # helpers; point them at the CPU generator. Patched on the module before any model is built, and the modules that
    # use them look them up on that module at call time.
    from megatron.core.tensor_parallel import random as mrandom

    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)

    # megatron's alltoall MoE dispatcher hands its split sizes to all_to_all_single as host arrays made by
    # `maybe_move_tensor_to_cpu(..., as_numpy=True)`, which converts only CUDA tensors: on CPU the sizes would stay
    # tensors (TypeError). Here every tensor is already on the host, so only the conversion is left to do.
    from megatron.core.transformer.moe import token_dispatcher

    def _to_host(tensor, as_numpy: bool = False, record_stream: bool = False):
        return tensor.numpy() if as_numpy and torch.is_tensor(tensor) else tensor

    token_dispatcher.maybe_move_tensor_to_cpu = _to_host
    # Its all-to-all (`_AllToAll.forward`) allocates on torch.cuda.current_device(), and runs again inside the
    # backward pass, where the function mode pushed below is not active (autograd runs backward outside it): run it
    # under the mode explicitly.
    from megatron.core.tensor_parallel import mappings

    forward = mappings._AllToAll.forward

    def _all_to_all_on_cpu(ctx, *args, **kwargs):
        with _CudaToCpuMode():
            return forward(ctx, *args, **kwargs)

    mappings._AllToAll.forward = staticmethod(_all_to_all_on_cpu)
    # Activation recompute: megatron's CheckpointFunction re-runs the layers' forward inside autograd's backward,
    # outside the mode as well, where the re-run builds its causal mask with device="cuda" (and the MoE router moves
    # tensors to torch.cuda.current_device()): run the whole recompute under the mode.
    recompute = mrandom.CheckpointFunction.backward

    def _recompute_on_cpu(ctx, *args):
        with _CudaToCpuMode():
            return recompute(ctx, *args)

    mrandom.CheckpointFunction.backward = staticmethod(_recompute_on_cpu)

    _COMPAT_MODE = _CudaToCpuMode()
    _COMPAT_MODE.__enter__()


# --------------------------------------------------------------------------------------------------------------------
# Device telemetry (nvidia-ml-py), for `megatron-rl info` and per-step metrics
# --------------------------------------------------------------------------------------------------------------------

def visible_devices() -> list[dict] | str:
    """NVIDIA devices as dicts (name, memory), or a one-line reason when there are none."""
    try:
        import pynvml
    except ImportError:
        return "nvidia-ml-py is not installed"
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:  # NVMLError_LibraryNotFound on machines without a driver
        return f"no NVIDIA driver ({e.__class__.__name__})"
    try:
        out = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            name = pynvml.nvmlDeviceGetName(h)
            out.append({"index": i, "name": name.decode() if isinstance(name, bytes) else name,
                        "memory_total_gb": round(mem.total / 2**30, 1)})
        return out
    finally:
        pynvml.nvmlShutdown()


def device_telemetry() -> dict:
    """Per-step GPU metrics, one set per device this process may use: `gpu{i}_util` (% of NVML's last sample
    period), `gpu{i}_mem_used_gb` (GiB in use on the device, by any process) and `gpu{i}_power_w` (board power draw,
    W), read when the step ends. `i` is the CUDA ordinal (the position in CUDA_VISIBLE_DEVICES when set). On CPU the
    keys are absent, not zero."""
    if not get_platform().is_gpu:
        return {}
    return nvml_readings()


def _visible_handles(pynvml) -> list:
    """NVML handles in CUDA ordinal order: CUDA_VISIBLE_DEVICES (indices or GPU-UUIDs) when set, else every device.
    GPU-only: NVML needs the NVIDIA driver, so no CPU test reaches past nvmlInit (tests/unit/test_telemetry.py runs
    the CPU branch, and its GPU test compares these keys with torch.cuda's device list where a GPU exists)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
    out = []
    for item in (v.strip() for v in visible.split(",") if v.strip()):
        out.append(pynvml.nvmlDeviceGetHandleByUUID(item) if item.startswith(("GPU-", "MIG-"))
                   else pynvml.nvmlDeviceGetHandleByIndex(int(item)))
    return out


def nvml_per_device(read) -> list:
    """`read(pynvml, handle)` for every device this process may use, in CUDA ordinal order; [] when nvidia-ml-py
    or the NVIDIA driver is missing (CPU hosts), a device is gone, or a CUDA_VISIBLE_DEVICES entry is unknown."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # ImportError, or NVMLError_LibraryNotFound / DriverNotLoaded on machines without a driver
        return []
    try:
        return [read(pynvml, h) for h in _visible_handles(pynvml)]
    except (pynvml.NVMLError, ValueError):
        return []
    finally:
        pynvml.nvmlShutdown()


def _telemetry_of(pynvml, h) -> dict:
    out = {"util": float(pynvml.nvmlDeviceGetUtilizationRates(h).gpu),
           "mem_used_gb": pynvml.nvmlDeviceGetMemoryInfo(h).used / 2**30}
    try:
        out["power_w"] = pynvml.nvmlDeviceGetPowerUsage(h) / 1000.0  # NVML reports milliwatts
    except pynvml.NVMLError:  # not every board reports its power draw
        pass
    return out


def nvml_readings() -> dict:
    """`device_telemetry`'s readings through nvidia-ml-py; {} on CPU hosts."""
    return {f"gpu{i}_{k}": v for i, dev in enumerate(nvml_per_device(_telemetry_of)) for k, v in dev.items()}


HOST_MEMORY_RESERVE = 0.2  # fraction of the machine's memory below which a CPU handover returns freed heap pages


def _host_memory_short() -> bool:
    import psutil

    vm = psutil.virtual_memory()
    return vm.available < HOST_MEMORY_RESERVE * vm.total


def _malloc_trim() -> None:
    """glibc's malloc_trim(0); a no-op where the C library has none (musl, macOS)."""
    global _LIBC
    if _LIBC is None:
        import ctypes
        import ctypes.util

        try:
            _LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        except OSError:
            _LIBC = False
    if _LIBC and hasattr(_LIBC, "malloc_trim"):
        _LIBC.malloc_trim(0)


_LIBC = None
