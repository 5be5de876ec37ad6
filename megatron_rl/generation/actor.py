"""The generator as a Ray actor, and a driver-side proxy with the `Generator` interface (several of them make a
`pool.GeneratorPool`).

The actor owns one engine (`VLLMGenerator`, in-process inside the actor) and receives refits by handle: the policy
ranks write the bytes through the transport, only the small manifest passes through Ray. On a shared CPU the
actor sets its own thread count per phase, so the idle trainer and the generator never compete for cores.
"""
from __future__ import annotations

import dataclasses
import os

from megatron_rl.config.schema import GenerationConfig
from megatron_rl.distributed.logs import redirect_output, tail
from megatron_rl.generation.interface import GenerationResult, StaleWeightsError


class GeneratorActor:
    def __init__(self, cfg: GenerationConfig, model_path: str, max_model_len: int | None, seed: int,
                 log_path: str | None = None, threads: int | None = None, env: dict | None = None,
                 lora: dict | None = None, *, deferred: bool = False, capture_routing: bool = False):
        """`deferred`: only import vLLM now (seconds of one core, no device memory) and build the engine when
        `start_engine` is called: `build.build` starts these processes before the policy ranks so that the imports
        overlap the ranks' set-up, while the engine still measures the device's free memory after the trainer left."""
        redirect_output(log_path)
        # the placement's variables (device slot; for TP engines, where vLLM's Ray executor puts its workers),
        # read by vLLM when it builds the engine
        os.environ.update({k: str(v) for k, v in (env or {}).items()})
        from megatron_rl.generation.vllm_generator import VLLMGenerator

        self.threads = threads
        if threads and not cfg.threads:
            # the engine decodes on `cfg.threads` (default 1); the driver decided this actor owns `threads` cores
            # while it generates (CPU phases alternate: the trainer is idle meanwhile)
            cfg = dataclasses.replace(cfg, threads=threads)
        self._make = lambda: VLLMGenerator(cfg, model_path, max_model_len=max_model_len, seed=seed, lora=lora,
                                           capture_routing=capture_routing)
        self.engine = None
        if deferred:
            import vllm.entrypoints.llm  # noqa: F401  (what VLLMGenerator's `from vllm import LLM` imports)
        else:
            self.start_engine()

    def start_engine(self) -> int:
        """Build the engine (once); its pid when it is up."""
        if self.engine is None:
            self.engine = self._make()
            if self.threads:  # the process's count: refits run on it too
                from megatron_rl.platform import set_cpu_threads

                set_cpu_threads(self.threads)
        return os.getpid()

    def pid(self) -> int:
        return os.getpid()

    def generate(self, prompts, **kw) -> GenerationResult:
        if self.threads:
            from megatron_rl.platform import set_cpu_threads

            set_cpu_threads(self.threads)
        return self.engine.generate(prompts, **kw)

    def turns(self, requests, *, sampling: dict, max_s: float = 0.5) -> dict:
        """Multi-turn rollouts: queue turns and return those that finished (VLLMGenerator.turns)."""
        if self.threads:
            from megatron_rl.platform import set_cpu_threads

            set_cpu_threads(self.threads)
        return self.engine.turns(requests, sampling=sampling, max_s=max_s)

    def clear_prefix_cache(self) -> None:
        self.engine.clear_prefix_cache()

    def abort_turns(self) -> int:
        return self.engine.abort_turns()

    def receive_weights(self, handle, expected_names=None) -> dict:
        return self.engine.receive_weights(handle, expected_names)

    def load_adapter(self, update, version: int) -> dict:
        return self.engine.load_adapter(update, version)

    def weight_version(self) -> int:
        return self.engine.weight_version

    def device_ids(self) -> list[str]:
        return self.engine.device_ids()

    def sleep(self, level: int = 1) -> None:
        self.engine.sleep(level)

    def wake_up(self, tags=None) -> None:
        self.engine.wake_up(tags)

    def state(self) -> str:
        return self.engine.state

    def join_refit_groups(self, endpoints, rank_offset: int, world_size: int) -> None:
        self.engine.join_refit_groups(endpoints, rank_offset, world_size)

    def kv_cache_bytes(self) -> int:
        return self.engine.kv_cache_bytes()

    def shutdown(self) -> None:
        self.engine.shutdown()


class RemoteGenerator:
    """Driver-side handle: every call fails fast, naming the actor, if the generator process died."""

    def __init__(self, actor, name: str = "generator", log_path: str | None = None):
        self.actor, self.name, self.log_path = actor, name, log_path

    def submit(self, method: str, *args, **kwargs):
        """Start a call without waiting (several engines work at once); `result(ref)` collects it."""
        return getattr(self.actor, method).remote(*args, **kwargs)

    def result(self, ref):
        import ray
        from ray.exceptions import RayActorError

        from megatron_rl.weights.manifest import RefitError

        try:
            return ray.get(ref)
        except RefitError as e:  # Ray raises a subclass of the actor's error: name the engine it came from
            raise RefitError(f"{self.name}: {getattr(e, 'cause', e)}") from None
        except RayActorError as e:
            from megatron_rl.distributed.worker_group import WorkerDiedError

            raise WorkerDiedError(f"{self.name} died: {str(e).splitlines()[0]}\n--- last lines of its log ---\n"
                                  f"{tail(self.log_path)}") from None

    def _call(self, method: str, *args, **kwargs):
        return self.result(self.submit(method, *args, **kwargs))

    def generate(self, prompts, *, expected_version: int, **kw) -> GenerationResult:
        res = self._call("generate", prompts, **kw)
        if res.weight_version != expected_version:
            raise StaleWeightsError(f"{self.name} generated with weight version {res.weight_version}, "
                                    f"expected {expected_version}")
        return res

    def receive_weights(self, handle, expected_names=None) -> dict:
        return self._call("receive_weights", handle, expected_names)

    def load_adapter(self, update, version: int) -> dict:
        """Adapter-only refit (generation/lora_serving.py); `update` may be a Ray object ref of the adapters."""
        return self._call("load_adapter", update, version)

    @property
    def weight_version(self) -> int:
        return self._call("weight_version")

    def pid(self) -> int:
        return self._call("pid")

    def device_ids(self) -> list[str]:
        """The device identity of each of the engine's workers (platform.device_identity)."""
        return self._call("device_ids")

    def sleep(self, level: int = 1) -> None:
        self._call("sleep", level)

    def wake_up(self, tags=None) -> None:
        self._call("wake_up", tags)

    @property
    def state(self) -> str:
        return self._call("state")

    def kv_cache_bytes(self) -> int:
        return self._call("kv_cache_bytes")

    def shutdown(self) -> None:
        try:
            self._call("shutdown")
        except Exception:
            pass
        import ray

        ray.kill(self.actor, no_restart=True)
