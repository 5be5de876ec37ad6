"""The one place that turns a `Config` into running parts: Ray, placement, policy ranks, generator, data, reward;
and `run`, which builds them for a training run and runs the loop on them (`megatron-rl train`, `sft`, `dpo`).
SFT and DPO (`cfg.algorithm`) start the policy ranks only (`build_supervised`): no vLLM engine.

Colocated (default): policy ranks and the generator share each device bundle (fractional resources) and take turns;
disaggregated: the generator gets bundles of its own, out of the cluster's devices (`parallel_dims.device_layout`).
Everything CPU/GPU-specific comes from the platform module.
"""
from __future__ import annotations

import os
import random
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from megatron_rl.config.loader import resolve_model_dir
from megatron_rl.config.preflight import preflight
from megatron_rl.config.schema import Config
from megatron_rl.platform import get_platform


@dataclass
class Components:
    policy: object  # PolicyGroup
    generator: object  # generation.pool.GeneratorPool: generation.dp engines as one generator
    tokenizer: object
    train_stream: object  # PromptStream
    val_items: list
    reward_fn: object
    placement: object
    model_dir: Path
    handover: object  # algorithms.handover.Handover: who holds the device
    env_pool: object = None  # environments.runner.EnvironmentPool of a multi-turn run (environment.cls), else None
    teacher: object = None  # policy.teacher_worker.TeacherGroup of a distillation run (config.distillation), else None
    reward_model: object = None  # the same group shape scoring with a value head (config reward.model), else None
    critic: object = None  # PPO's critic (algorithm ppo): a PolicyGroup of value-head ranks that trains, else None

    def shutdown(self) -> None:
        # vLLM first: Ray's shutdown otherwise leaks vLLM's /dev/shm segments (its broadcaster outlives a killed actor)
        for part in (self.generator, self.policy, self.teacher, self.reward_model, self.critic):
            try:
                if part is not None:
                    part.shutdown()
            except Exception:
                pass
        # SFT / DPO: no generator, reward or environments (None)
        for closing in (getattr(self.reward_fn, "close", lambda: None), getattr(self.env_pool, "shutdown", lambda: None)):
            try:
                closing()
            except Exception:
                pass
        from megatron_rl.distributed.cluster import shutdown_ray
        from megatron_rl.weights.shared_memory import remove_orphaned_files

        shutdown_ray()
        remove_orphaned_files()  # refit arenas of workers that died without closing them


def max_model_len(cfg: Config) -> int:
    return cfg.max_model_len()


def build_data(cfg: Config, tok):
    """The prompt stream and the validation items, tokenized with `tok` (the tokenizer the pre-flight checked)."""
    from megatron_rl.data.datasets import PromptStream, load_dataset

    train = load_dataset(cfg.data, tok, "train")
    stream = PromptStream(train, cfg.grpo.num_prompts_per_step, seed=cfg.grpo.seed)
    val_items = []
    if cfg.grpo.val_every > 0:
        val = load_dataset(cfg.data, tok, "val", size=cfg.grpo.val_num_prompts)
        if val is not None:
            val_items = [it for it in (val.item(i) for i in range(min(len(val), cfg.grpo.val_num_prompts)))
                         if it is not None]
    return tok, stream, val_items


def policy_worker_class(backend: str) -> type:
    """The per-rank policy actor of `policy.backend` (both implement policy/interface.py's PolicyWorker)."""
    if backend == "fsdp2":
        from megatron_rl.policy.fsdp2_worker import FSDP2PolicyWorker

        return FSDP2PolicyWorker
    from megatron_rl.policy.megatron_worker import MegatronPolicyWorker

    return MegatronPolicyWorker


def say(t0: float, what: str) -> None:
    """A start-up progress line: Ray, the ranks and the engines take a minute on 2 cores before the first step."""
    print(f"[megatron-rl] start-up {time.monotonic() - t0:5.1f} s: {what}", flush=True)


def start_cluster(cfg: Config, out_dir: Path, n_bundles: int):
    """Ray and the placement (`n_bundles` devices): (placement, the logs folder)."""
    from megatron_rl.distributed.cluster import init_ray, reserve
    from megatron_rl.distributed.parallel_dims import layout_of

    c = cfg.cluster
    # CPU slots are logical: a disaggregated layout on a small machine still gets one bundle per process
    init_ray(c, num_cpus=None if c.ray_address else max(os.cpu_count() or 1, n_bundles))
    placement = reserve(n_bundles)
    try:  # TP groups and engines on one node each, before any actor starts (cluster.py's module doc)
        placement.check_same_node({k: v for k, v in layout_of(cfg).node_groups().items() if max(v) < n_bundles})
    except RuntimeError:
        import ray

        ray.util.remove_placement_group(placement.pg)
        raise
    logs = out_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    return placement, logs


def start_ranks(cfg: Config, placement, logs: Path, sharing: int, share: float, max_steps: int, *,
                role: str = "policy", policy_cfg=None):
    """The policy ranks on the placement's first bundles, set up: a PolicyGroup. CPU: each rank gets cores /
    `sharing` threads; `share`: the fraction of a device each rank asks Ray for (colocated with a generator: half).
    PPO's critic is the same group shape (`role` "critic", its own `policy_cfg`) on the same bundles."""
    from megatron_rl.distributed.parallel_dims import layout_of
    from megatron_rl.distributed.worker_group import WorkerGroup
    from megatron_rl.policy.group import PolicyGroup

    c = cfg.cluster
    world = layout_of(cfg).policy.world_size
    cores = os.cpu_count() or 1
    threads = None if get_platform().is_gpu else (cfg.policy.threads or max(1, cores // sharing))
    group = WorkerGroup(policy_worker_class(cfg.policy.backend), placement, name=role, world_size=world,
                        bundle_indices=list(range(world)), share=share, log_dir=str(logs), threads=threads,
                        master_addr=c.bind_host if c.num_nodes == 1 else None,
                        init_kwargs=dict(policy_cfg=policy_cfg or cfg.policy, max_steps=max_steps))
    ranks = PolicyGroup(group)
    ranks.role = role
    return ranks


def start_critic(cfg: Config, placement, logs: Path, sharing: int, share: float):
    """PPO's critic (config/ppo_rules.py): value-head ranks of the policy's backend and split on the policy's bundles,
    set up from critic.model (a checkpoint's weights loaded after set-up)."""
    from megatron_rl.config.ppo_rules import critic_checkpoint, critic_policy_config

    critic = start_ranks(cfg, placement, logs, sharing, share, cfg.grpo.max_steps, role="critic",
                         policy_cfg=critic_policy_config(cfg))
    ckpt = critic_checkpoint(cfg)
    if ckpt is not None:
        critic.group.call("load_weights", str(ckpt))
    return critic


def start_policy(cfg: Config, out_dir: Path, n_bundles: int, sharing: int, share: float, max_steps: int):
    """`start_cluster` then `start_ranks`: (placement, PolicyGroup, the logs folder)."""
    placement, logs = start_cluster(cfg, out_dir, n_bundles)
    return placement, start_ranks(cfg, placement, logs, sharing, share, max_steps), logs


def spawn_engines(cfg: Config, placement, logs: Path, gen_bundles, share: float, threads, model_dir: Path, lora):
    """One generator actor per engine, started `deferred` (GeneratorActor): each imports vLLM now and builds its
    engine at `GeneratorPool.start_engines`. RemoteGenerator handles, in engine order."""
    import ray

    from megatron_rl.generation.actor import GeneratorActor, RemoteGenerator

    engines = []
    for i, bundles in enumerate(gen_bundles):
        name = f"generator-{i}"
        log = str(logs / f"{name}.log")
        options, env = placement.engine_placement(bundles, share)
        actor = ray.remote(GeneratorActor).options(**options, max_restarts=0).remote(
            cfg.generation, str(model_dir), max_model_len(cfg), cfg.grpo.seed, log, threads, env, lora,
            deferred=True, capture_routing=records_routing(cfg, model_dir))
        engines.append(RemoteGenerator(actor, name, log))
    return engines


def records_routing(cfg: Config, model_dir: Path) -> bool:
    """Whether the engines record each token's experts for the trainer to replay (policy.moe_routing_replay)."""
    import json

    from megatron_rl.config.moe_rules import routing_replay_enabled

    hf = json.loads((Path(model_dir) / "config.json").read_text())
    return routing_replay_enabled(cfg, hf.get("num_experts") or hf.get("num_local_experts"))


def start_teacher(cfg: Config, placement, logs: Path, sharing: int, share: float):
    """The distillation teacher's ranks (policy/teacher_worker.py), one on each of the policy's bundles, set up (its
    weights resident until the handover offloads them)."""
    from megatron_rl.config.distillation import teacher_checkpoint, teacher_policy_config

    return start_frozen(cfg, "teacher", teacher_policy_config(cfg), teacher_checkpoint(cfg.distillation.teacher),
                        placement, logs, sharing, share)


def start_frozen(cfg: Config, role: str, policy_cfg, ckpt, placement, logs: Path, sharing: int, share: float):
    """A frozen group of megatron ranks that only score (`TeacherGroup`: the distillation teacher, a reward model),
    one on each of the policy's bundles, set up from `policy_cfg` (and the checkpoint `ckpt`, if not None)."""
    from megatron_rl.distributed.parallel_dims import layout_of
    from megatron_rl.distributed.worker_group import WorkerGroup
    from megatron_rl.policy.teacher_worker import TeacherGroup, TeacherWorker

    c = cfg.cluster
    world = layout_of(cfg).policy.world_size
    threads = None if get_platform().is_gpu else (cfg.policy.threads or max(1, (os.cpu_count() or 1) // sharing))
    group = WorkerGroup(TeacherWorker, placement, name=role.replace(" ", "_"), world_size=world,
                        bundle_indices=list(range(world)), share=share, log_dir=str(logs), threads=threads,
                        master_addr=c.bind_host if c.num_nodes == 1 else None,
                        init_kwargs=dict(teacher_cfg=policy_cfg, checkpoint=str(ckpt) if ckpt is not None else None))
    return TeacherGroup(group, role)


def build_supervised(cfg: Config, out_dir: Path, tok, data) -> Components:
    """SFT / DPO: the policy ranks alone, each with its device to itself; no generator, reward or environments.
    The handover is a disaggregated one without a generator: the trainer always holds the device."""
    from megatron_rl.algorithms.handover import Handover
    from megatron_rl.buffers import BUCKET_BYTES
    from megatron_rl.distributed.parallel_dims import layout_of

    world = layout_of(cfg).policy.world_size
    t0 = time.monotonic()
    say(t0, f"Ray and {world} {cfg.policy.backend} policy rank(s) ({cfg.policy.model})")
    placement, policy, _ = start_policy(cfg, out_dir, world, world, 1.0, data.max_steps)
    say(t0, "policy ready")
    # no generator: nothing sleeps, wakes, offloads or refits; the trainer holds its devices throughout, the same
    # code on CPU and GPU (tests/integration/test_sft_dpo_cli.py runs it, DPO at DP = 2 included)
    handover = Handover(policy, None, colocated=False, bucket_bytes=BUCKET_BYTES,
                        sleep_level=cfg.generation.sleep_level)
    return Components(policy, None, tok, data.stream, [], None, placement, resolve_model_dir(cfg.policy.model),
                      handover)


def build(cfg: Config, out_dir: Path) -> Components:
    t0 = time.monotonic()
    plat = get_platform()
    # model vs tokenizer vs config vs this machine: a ConfigError naming the key before anything starts
    tok = preflight(cfg)
    model_dir = resolve_model_dir(cfg.policy.model)
    tok, stream, val_items = build_data(cfg, tok)
    reward_fn, env_pool = start_scoring(cfg)
    say(t0, "config, model, data" + (f" and {cfg.environment.num_workers} environment worker(s)" if env_pool else "")
        + " checked")
    try:
        return _build(cfg, out_dir, plat, tok, model_dir, stream, val_items, reward_fn, env_pool, t0)
    except BaseException:
        _close_scoring(reward_fn, env_pool)
        raise


def start_scoring(cfg: Config):
    """(reward_fn, env_pool), before Ray and the engines start: a multi-turn run's environment worker processes (a
    class that will not load, or kwargs it rejects, are named at once), whose reward replaces the verifier, which
    then starts no pool; else the verifier's pool. Training and evaluation both assemble them here."""
    if cfg.environment.cls is not None:
        from megatron_rl.environments.runner import EnvironmentPool

        return None, EnvironmentPool.from_config(cfg.environment)
    if cfg.reward.kind == "model":  # the reward model alone: its group starts with the others (`_build`)
        return None, None
    from megatron_rl.rewards.reward_fn import RewardFn

    return RewardFn(cfg.reward, cfg.data.source), None


def _close_scoring(reward_fn, env_pool) -> None:
    if reward_fn is not None:
        reward_fn.close()
    if env_pool is not None:
        env_pool.shutdown()


def _build(cfg: Config, out_dir: Path, plat, tok, model_dir: Path, stream, val_items, reward_fn, env_pool,
           t0: float) -> Components:
    from megatron_rl.distributed.parallel_dims import layout_of
    from megatron_rl.generation.pool import GeneratorPool

    c = cfg.cluster
    layout = layout_of(cfg)  # the loader validated the same layout
    world, gen_bundles, n_bundles = layout.policy.world_size, layout.engines, layout.bundles
    # CPU: synchronous phases alternate (generate, then train), so each side may use every core while the other
    # waits; async runs generate while they train, so every process gets its own share (oversubscribing 2 cores was
    # measured ~8x slower)
    sharing = world + len(gen_bundles) if cfg.grpo.max_staleness > 0 else world
    share = layout.share
    cores = os.cpu_count() or 1
    # CPU: the engines decode at the same time on the shared cores, so they split them
    gen_sharing = world + len(gen_bundles) if cfg.grpo.max_staleness > 0 else len(gen_bundles)
    gen_threads = None if plat.is_gpu else (cfg.generation.threads or max(1, cores // gen_sharing))
    lora = None
    if cfg.generation.lora_refit == "adapter":  # the loader checked that policy.lora is set then
        from megatron_rl.generation.lora_serving import serving_spec

        lora = serving_spec(cfg.policy.lora, model_dir, cfg.policy.backend)
    say(t0, f"Ray: {n_bundles} {'GPU' if plat.is_gpu else 'CPU'} slot(s)")
    placement, logs = start_cluster(cfg, out_dir, n_bundles)
    say(t0, f"{world} {cfg.policy.backend} policy rank(s) set up while {len(gen_bundles)} vLLM engine(s) import")
    # the engines' processes import vLLM (~5 s of a core on CPU) while the policy ranks set up; each builds its
    # engine (weights, KV cache on the device) only in start_engines below, after the trainer left the device
    engines = spawn_engines(cfg, placement, logs, gen_bundles, share, gen_threads, model_dir, lora)
    policy = start_ranks(cfg, placement, logs, sharing, layout.policy_share, cfg.grpo.max_steps)
    teacher = None
    if cfg.distillation is not None:  # on the policy's bundles
        say(t0, f"teacher {cfg.distillation.teacher}")
        if c.colocated:
            # the teacher's setup loads its weights onto the policy's devices: the trainer's state leaves first, so
            # the two are never resident together (an 8B student's training state plus a 32B teacher exceed 80 GB);
            # the handover offloads the teacher in turn before the engines start
            policy.offload()
        teacher = start_teacher(cfg, placement, logs, sharing, layout.policy_share)
    reward_model = None
    if cfg.reward.model is not None:  # on the policy's bundles, as a teacher (its turn: Handover.frozen_turn)
        from megatron_rl.config.reward_model import reward_model_checkpoint, reward_model_policy_config

        say(t0, f"reward model {cfg.reward.model.path}")
        if c.colocated:  # never resident with the trainer's state (the teacher's rule above)
            policy.offload()
        reward_model = start_frozen(cfg, "reward model", reward_model_policy_config(cfg),
                                    reward_model_checkpoint(cfg.reward.model.path), placement, logs, sharing,
                                    layout.policy_share)
    critic = None
    if cfg.algorithm == "ppo":  # on the policy's bundles; trains in its own turn (Handover.to_critic)
        say(t0, f"critic {cfg.critic.model}" if cfg.critic.model else
            f"critic: the policy's model ({cfg.policy.model}) with a new value head")
        if c.colocated:  # never resident with the trainer's state (the teacher's rule above)
            policy.offload()
        critic = start_critic(cfg, placement, logs, sharing, layout.policy_share)
    from megatron_rl.algorithms.handover import Handover
    from megatron_rl.buffers import BUCKET_BYTES

    handover = Handover(policy, None, colocated=c.colocated, bucket_bytes=BUCKET_BYTES,
                        sleep_level=cfg.generation.sleep_level, lora_refit=cfg.generation.lora_refit,
                        teacher=teacher, reward_model=reward_model, critic=critic)
    # vLLM sizes its KV cache from the device memory free when it starts: a colocated trainer must be out by then
    handover.before_engine_start()
    say(t0, f"{len(gen_bundles)} vLLM engine(s) load the weights and size the KV cache")
    generator = GeneratorPool(engines)
    generator.start_engines()  # every engine up (an engine that cannot start fails here, named)
    handover.generator = generator
    handover.connect(c.bind_host if c.num_nodes == 1 else None, cfg.generation.tp)
    handover.check_engine_started()
    if reward_model is not None:  # the verifier's reward (or none: reward.kind model) plus the model's score
        from megatron_rl.rewards.model_reward import ModelReward

        reward_fn = ModelReward(reward_fn, reward_model, handover, cfg.reward.model)
    say(t0, "ready")
    return Components(policy, generator, tok, stream, val_items, reward_fn, placement, model_dir, handover, env_pool,
                      teacher, reward_model, critic)


def evaluate_model(cfg: Config, model: str, *, n: int, num_prompts: int, temperature: float | None = None,
                   split: str = "val", every_sample: bool = False) -> dict:
    """pass@1 / pass@k of the HF folder `model` on the held-out prompts of `cfg.data` (split="train": its training
    prompts), scored as training scores them (`start_scoring`), by one engine in this process: one engine needs no
    Ray cluster (`megatron-rl eval` and `megatron_rl.evaluate` both run this; `algorithms.evaluate.evaluate`)."""
    from megatron_rl.algorithms.evaluate import evaluate
    from megatron_rl.data.datasets import DataError, load_dataset
    from megatron_rl.data.tokenizer import load_tokenizer
    from megatron_rl.generation import build_engine

    if cfg.reward.kind == "model":
        from megatron_rl.config.loader import ConfigError

        raise ConfigError("megatron-rl eval scores with a verifier; reward.kind=model (a reward model's score) is "
                          "scored in training runs only: set reward.kind=auto, or validate inside the run")
    model = str(resolve_model_dir(model))  # "default": the embedded model, as in training
    tok = load_tokenizer(cfg.policy.tokenizer or model)
    ds = load_dataset(cfg.data, tok, split, size=num_prompts)
    if ds is None:
        raise DataError("data.val_path is not set: there are no held-out prompts to evaluate")
    items = [it for it in (ds.item(i) for i in range(min(num_prompts, len(ds)))) if it is not None]
    reward_fn, env_pool = start_scoring(cfg)
    t0, gen = time.time(), None
    try:
        gen = build_engine(cfg, model)
        result = evaluate(gen, items, reward_fn, tok, n=n,
                          temperature=temperature if temperature is not None else cfg.generation.temperature,
                          top_p=cfg.generation.top_p, max_tokens=cfg.generation.max_new_tokens, env_pool=env_pool,
                          cfg=cfg, every_sample=every_sample)
    finally:
        if gen is not None:
            gen.shutdown()
        _close_scoring(reward_fn, env_pool)
    result["seconds"] = round(time.time() - t0, 2)
    return result


def run(cfg: Config, config_path: str | None = None, overrides: list[str] | None = None) -> int:
    """Train `cfg` (`megatron-rl train` of one config; 0 when done or already complete, 2 on a data error): the resume
    point, then `build`, then the GRPO loop (`algorithms.grpo.train_loop`) on the parts, which are shut down however
    it ends. config_path and overrides: what the run was started from (the CLI's and the API's arguments)."""
    import torch

    from megatron_rl.algorithms.grpo import checkpoint_root, train_loop
    from megatron_rl.algorithms.resume import resume_point
    from megatron_rl.data.datasets import DataError

    t_start = time.monotonic()
    out = Path(cfg.output.dir)
    # before anything starts: the newest intact checkpoint, and a refusal if the config changed the run since
    point = resume_point(cfg, out, checkpoint_root(cfg))
    supervised = not cfg.samples_rollouts()
    data = None
    if supervised:  # SFT / DPO: every example read and checked first (their count sets the steps of an epoch)
        from megatron_rl.algorithms.supervised import load_data
        from megatron_rl.distributed.parallel_dims import layout_of

        tok = preflight(cfg, generator=False)
        try:
            data = load_data(cfg, tok, resolve_model_dir(cfg.policy.model), layout_of(cfg).policy.dp)
        except DataError as e:
            print(f"data error: {e}", file=sys.stderr, flush=True)
            return 2
    max_steps, key = (data.max_steps, f"{cfg.algorithm}.max_steps") if supervised else (cfg.grpo.max_steps,
                                                                                         "grpo.max_steps")
    if point.checkpoint is not None and point.step >= max_steps:
        print(f"[megatron-rl] already complete at step {point.step} ({point.checkpoint}); raise {key} "
              "to train further", flush=True)
        return 0
    seed = (cfg.grpo if not supervised else getattr(cfg, cfg.algorithm)).seed
    random.seed(seed)
    torch.manual_seed(seed)
    print(f"[megatron-rl] starting: output in {out.resolve()}", flush=True)
    try:
        c = build_supervised(cfg, out, tok, data) if supervised else build(cfg, out)
    except DataError as e:  # raised while reading the data, before Ray or any worker starts
        print(f"data error: {e}", file=sys.stderr, flush=True)
        return 2
    # scancel / kill send SIGTERM: turn it into an exception so the engine and Ray shut down cleanly (no leaked
    # /dev/shm segments); the last complete checkpoint is untouched either way. Installed after ray.init, which
    # replaces the handler with its own.
    signal.signal(signal.SIGTERM, _terminate)
    try:
        if supervised:
            from megatron_rl.algorithms.supervised import Supervised
            from megatron_rl.algorithms.trainer import run_loop

            return run_loop(cfg, c, point, Supervised(cfg, c, data, t_start))
        if cfg.algorithm == "ppo":
            from megatron_rl.algorithms.ppo import train_loop as ppo_loop

            return ppo_loop(cfg, c, point, t_start=t_start)
        return train_loop(cfg, c, point, t_start=t_start)
    finally:
        c.shutdown()


def _terminate(signum, _frame):
    raise SystemExit(128 + signum)
