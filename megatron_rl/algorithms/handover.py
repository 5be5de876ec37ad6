"""Who holds the device: the colocated handover between the trainer and the generator, driven by the controller.

    start:          trainer offloaded, engine awake   (vLLM sizes its KV cache from the free memory at start-up)
    to_trainer():   engine sleeps (KV cache and weights released) -> trainer onloads
    refit():        trainer offloads its gradients and optimizer state -> engine wakes its weights -> trainer
                    streams the next version -> transport buffers released
    to_generator(): trainer offloads its weights -> engine wakes its KV cache

The refit is the device's peak: the trainer's weights, the engine's weights and the transport's copy of the model
(CUDA IPC) are resident together, and nothing else (policy/residency.py). Every colocated step records what was
resident at each phase (`memory_plan`, the highest seen); the first prints it (docs: the memory plan).

The engine sleeps at `generation.sleep_level` (default 2: its weights are discarded, not copied to host and back,
since the refit rewrites every one of them). A step that trains nothing skips its refit; under level 2 the engine's
weights are then gone, so `to_generator` refits them first (the same weights as the same version) while the trainer
is still resident. With `generation.lora_refit: adapter` a refit sends the LoRA adapters alone (`_refit_adapter`) and
the engine's base weights are never sent again, so the loader requires level 1 there.

With a distillation teacher (`teacher`, policy/teacher_worker.py) a colocated step has one more holder:

    to_teacher():   engine sleeps -> teacher onloads (it scores the rollout)
    to_trainer():   teacher offloads -> trainer onloads, then as above

so the teacher's weights are resident only while it scores, alone on the device with the sleeping engine. Disaggregated,
the teacher shares the policy's bundles and stays resident.

PPO's critic (`critic`, algorithm ppo) trains, so it is a holder of the trainer's kind, with its own turn before the
policy's in each step:

    to_critic():    engine sleeps (or, from the trainer's turn, the trainer offloads) -> critic onloads; it scores
                    the rollout's values, then trains on GAE's returns (algorithms/ppo.py)
    to_trainer():   critic offloads -> trainer onloads, then as above

The critic's weights and optimizer state are resident only in its turn, alone with the sleeping engine. With the KL
in the reward (ppo.kl_in_reward) the policy's reference pass comes first (to_trainer, then to_critic, then to_trainer
again: one more trainer move per step). Checkpoints visit the critic's turn to save it (`algorithms/ppo.py`).

A reward model (`reward_model`, config reward.model) scores inside the generator's turn, after each generate call
that needs rewards (dynamic sampling draws again; validation scores too), so its turn is a round trip
(`frozen_turn`): the engine sleeps keeping its weights (level 1, whatever generation.sleep_level: it generates again
right after), the reward model onloads and scores, offloads, and the engine wakes. Its weights are resident only
while it scores, with the engine's KV cache released and its weights on the host.

The trainer's state and the engine's KV cache are never resident together; the engine's weights and the trainer
are, during the refit only. Checkpoints are written between `to_trainer` and `to_generator` (the trainer's state
must be resident to be read). Disaggregated placements skip the memory moves: each side keeps its own devices.
The workers enforce their half (a call in the wrong phase raises `LifecycleError` naming it); this class keeps
the order in one place and times the moves.
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

from megatron_rl.lifecycle import AWAKE, OFFLOADED, LifecycleError
from megatron_rl.platform import get_platform



class Handover:
    def __init__(self, policy, generator, *, colocated: bool, bucket_bytes: int, sleep_level: int,
                 lora_refit: str = "merged", teacher=None, reward_model=None, critic=None):
        self.policy, self.generator, self.teacher, self.reward_model = policy, generator, teacher, reward_model
        self.critic = critic
        self.frozen = [g for g in (teacher, reward_model) if g is not None]  # groups that only score
        self.side = self.frozen + ([critic] if critic is not None else [])  # every group beside the policy
        # generation.lora_refit: "adapter" sends the LoRA adapters only, to engines serving them on their base
        # weights (generation/lora_serving.py); "merged" streams every weight through the transport
        self.lora_refit = lora_refit
        self.teacher_holds_device = False  # colocated: between to_teacher() and to_trainer()
        self.critic_holds_device = False  # colocated: between to_critic() and to_trainer()
        self.colocated = colocated
        self.sleep_level = sleep_level
        self._engine_has_weights = True  # False between a level-2 sleep and the next refit
        self.bucket_bytes = bucket_bytes
        plat = get_platform()
        # colocated: in-band (shared memory / CUDA IPC on the same device); disaggregated: a broadcast per stage
        self.transport = plat.refit_transport_colocated if colocated else plat.refit_transport_disaggregated
        self.trainer_holds_device = not colocated  # colocated runs start with the engine holding it (build.py)
        self.seconds = 0.0  # time spent in memory moves since the last `take_seconds()`
        # weight version the engine holds: 0 = the weights it started from; +1 per refit of this process. A rollout
        # is generated with `version` or refused (StaleWeightsError), so it is never off-policy by accident.
        self.version = 0
        self.senders: list[int] | None = None  # colocated: the policy ranks that export a refit (`connect`)
        self.memory_plan: dict[str, dict] = {}  # colocated: peak bytes per device at each phase (`_record`)

    def _timed(self, fn) -> None:
        t0 = time.perf_counter()
        fn()
        self.seconds += time.perf_counter() - t0

    def take_seconds(self) -> float:
        s, self.seconds = self.seconds, 0.0
        return s

    def before_engine_start(self) -> None:
        """Colocated: the engine measures free device memory when it starts, so the trainer must be out first."""
        if self.colocated:
            self.policy.offload()
            for group in self.side:
                group.offload()

    def connect(self, host: str | None, workers_per_engine: int) -> None:
        """Colocated: route the refit by device (`weights/routing.py`: the policy rank on each engine worker's
        device exports for it). Disaggregated: open the refit groups (one per pipeline stage: its exporting rank
        and every engine worker). Both sides block until all have joined, so they join at the same time."""
        if self.colocated:
            from megatron_rl.weights.routing import plan_senders

            self.senders = plan_senders(self.policy.device_ids(), self.generator.device_ids(),
                                        [e.name for e in self.generator.engines])
            return
        endpoints = self.policy.refit_endpoints(host)
        world = 1 + workers_per_engine * len(self.generator.engines)
        with ThreadPoolExecutor(1) as pool:
            joined = pool.submit(self.policy.join_refit_group, endpoints, world)
            self.generator.join_refit_groups(endpoints, workers_per_engine)
            joined.result()

    def check_engine_started(self) -> None:
        if self.colocated and self.policy.state() != OFFLOADED:
            raise LifecycleError("the generator started while the trainer held the device")
        for group in self.side if self.colocated else ():
            if group.state() != OFFLOADED:
                raise LifecycleError(f"the generator started while the {group.role} held the device")
        if self.generator.state != AWAKE:
            raise LifecycleError(f"the generator started {self.generator.state}, expected {AWAKE}")

    @contextmanager
    def frozen_turn(self, group):
        """Colocated: `group` (the reward model) holds the device for the body, inside the generator's turn: the engine
        sleeps keeping its weights, `group` onloads; afterwards it offloads and the engine wakes (module doc).
        Disaggregated: the body runs as it is (the group stays resident on the policy's devices)."""
        if not self.colocated:
            yield
            return
        if self.trainer_holds_device or self.teacher_holds_device or self.critic_holds_device:
            raise LifecycleError(f"the {group.role} scores inside the generator's turn: the engine must hold the device")

        def out():
            self.generator.sleep(1)
            group.onload()
        self._timed(out)
        try:
            yield
        finally:
            def back():
                group.offload()
                self.generator.wake_up()
            self._timed(back)

    def to_teacher(self) -> None:
        """Colocated: the engine sleeps and the teacher's weights come back, to score a rollout. From the generator's
        turn only: a teacher turn between training and the refit would cost the trainer an extra offload."""
        if self.teacher is None:
            raise LifecycleError("to_teacher() without a distillation teacher")
        if not self.colocated or self.teacher_holds_device:
            return
        if self.trainer_holds_device:
            raise LifecycleError("the teacher scores a rollout before the trainer takes the device: to_teacher() "
                                 "after to_generator(), not after to_trainer()")

        def move():
            self.generator.sleep(self.sleep_level)
            self.teacher.onload()
        self._timed(move)
        self.teacher_holds_device = True
        self._engine_has_weights = self.sleep_level < 2

    def to_critic(self) -> None:
        """Colocated: PPO's critic takes the device (its values, its training step; module doc), from the generator's
        turn (the engine sleeps) or the trainer's (the trainer offloads everything: after a reference pass, or
        between training and the refit for a checkpoint). The same moves run on CPU: tests/integration/test_ppo.py
        checks the states inside the turn from either side (test_critic_turn_values_and_gae, test_kl_in_the_reward)
        and a colocated checkpoint save through it (test_fsdp2_ppo_step_through_the_cli: a save while offloaded is
        refused by the worker)."""
        if self.critic is None:
            raise LifecycleError("to_critic() without a critic (algorithm ppo)")
        if not self.colocated or self.critic_holds_device:
            return
        if self.teacher_holds_device:
            raise LifecycleError("to_critic() while the teacher holds the device")

        def move():
            if self.trainer_holds_device:  # the engine already sleeps
                self.policy.offload()
            else:
                self.generator.sleep(self.sleep_level)
            self.critic.onload()
        self._timed(move)
        if not self.trainer_holds_device:
            self._engine_has_weights = self.sleep_level < 2
        self.critic_holds_device, self.trainer_holds_device = True, False

    def to_trainer(self) -> None:
        if self.colocated and not self.trainer_holds_device:
            asleep = self.teacher_holds_device or self.critic_holds_device  # the engine already sleeps

            def move():
                if self.teacher_holds_device:
                    self.teacher.offload()
                elif self.critic_holds_device:
                    self.critic.offload()
                else:
                    self.generator.sleep(self.sleep_level)
                self.policy.onload()
            self._timed(move)
            if not asleep:
                self._engine_has_weights = self.sleep_level < 2
            self.trainer_holds_device, self.teacher_holds_device, self.critic_holds_device = True, False, False

    def to_generator(self) -> None:
        if self.colocated and self.critic_holds_device:  # the policy's weights restore or refit the engine's
            self.to_trainer()
        if self.colocated and self.trainer_holds_device:
            if not self._engine_has_weights:  # a step without a refit, after a level-2 sleep (module docstring)
                self.refit(restore=True)

            def move():
                self.policy.offload()
                # after a refit only the KV cache is still asleep; without one (a skipped step) the weights are too
                self.generator.wake_up()
            self._timed(move)
            self.trainer_holds_device = False
            if "refit" in self.memory_plan:
                first = "generate" not in self.memory_plan
                engines = max(1, len(getattr(self.generator, "engines", [None])))
                self._record("generate", self.policy.memory_report(),
                             engine_kv_bytes=self.generator.kv_cache_bytes() // engines)
                if first:
                    print(f"[megatron-rl] {describe_memory_plan(self.memory_plan)}", flush=True)

    def record_critic(self) -> None:
        """Colocated: what the critic's turn held per device (after its training step: weights, gradients, Adam)."""
        if self.colocated and self.critic_holds_device:
            self._record("critic", self.critic.memory_report())

    def _record(self, phase: str, reports: list[dict], **extra) -> None:
        """Device memory at `phase`, per device (the fullest rank's), the highest seen so far: Adam's state appears
        with the first optimizer step, so a refit before any training (a resume) shows less than the run needs."""
        row = {"trainer_bytes": max(r["device_bytes"] for r in reports),
               "trainer_weight_bytes": max(r.get("weight_bytes", 0) for r in reports), **extra}
        if any("device_used_bytes" in r for r in reports):  # GPU: everything on the device, the engine's included
            row["device_used_bytes"] = max(r["device_used_bytes"] for r in reports)
        seen = self.memory_plan.setdefault(phase, {})
        for k, v in row.items():
            seen[k] = max(seen.get(k, 0), v)

    def refit(self, restore: bool = False) -> float:
        """Stream the trainer's weights into the engine as the next version; the trainer must hold the device.
        `restore`: the weights have not changed since the engine's version, which a level-2 sleep discarded: send them
        again as that same version (the engine accepts it, its own version being undefined then). Returns the seconds
        it took (waking the engine's weights included)."""
        if not self.trainer_holds_device:
            raise LifecycleError("refit needs the trainer's weights resident: to_trainer() first")
        t0 = time.perf_counter()
        if self.colocated:
            self._record("train", self.policy.memory_report())
            self.policy.offload_train_state()
            self.generator.wake_up(["weights"])
        version = self.version if restore else self.version + 1
        if self.lora_refit == "adapter":
            self._refit_adapter(version)
            return time.perf_counter() - t0
        handle = self.policy.send_weights(version, self.transport, self.bucket_bytes,
                                          self.senders if self.colocated else None)
        try:
            if self.colocated:
                per_device = max(h.nbytes for h in handle.handles()) if hasattr(handle, "handles") else handle.nbytes
                self._record("refit", self.policy.memory_report(), refit_buffer_bytes=per_device)
                self.generator.receive_weights(handle.to_dict())
            else:  # the exporters broadcast while the engines receive (each side blocks until the other is done)
                with ThreadPoolExecutor(1) as pool:
                    sent = pool.submit(self.policy.broadcast_refit)
                    self.generator.receive_weights(handle.to_dict())
                    sent.result()
        finally:
            # CUDA IPC: the sender's flat copy of the model must not stay allocated through generation
            self.policy.release_refit()
        self.version = version
        self._engine_has_weights = True
        return time.perf_counter() - t0

    def _refit_adapter(self, version: int) -> None:
        """The adapters (rank 0 gathers them, a few MB) through Ray's object store to every engine; nothing is
        staged on the device, so there is no transport buffer to release."""
        update = self.policy.adapter_update()
        if self.colocated:
            nbytes = sum(t.numel() * t.element_size() for t in update["tensors"].values())
            self._record("refit", self.policy.memory_report(), refit_buffer_bytes=nbytes)
        self.generator.load_adapter(update, version)
        self.version = version
        self._engine_has_weights = True


def describe_memory_plan(plan: dict[str, dict]) -> str:
    """One line: what each phase of the colocated handover held per device (trainer, refit buffer, KV cache; on
    GPU the device's total use, which includes the engine's weights and the CUDA contexts)."""
    gib = lambda b: f"{b / 2**30:.2f} GiB"  # noqa: E731
    parts = []
    for phase in ("critic", "train", "refit", "generate"):
        r = plan.get(phase)
        if r is None:
            continue
        held = f"{'critic' if phase == 'critic' else 'trainer'} {gib(r['trainer_bytes'])}"
        if "refit_buffer_bytes" in r:
            held += f" + refit buffer {gib(r['refit_buffer_bytes'])} + the engine's weights"
        if "engine_kv_bytes" in r:
            held += f" + KV cache {gib(r['engine_kv_bytes'])} + the engine's weights"
        if "device_used_bytes" in r:
            held += f" (device in use: {gib(r['device_used_bytes'])})"
        parts.append(f"{phase}: {held}")
    return "colocated memory per device: " + "; ".join(parts)
