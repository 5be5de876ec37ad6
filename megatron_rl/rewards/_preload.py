"""Imported once by a verifier workers' forkserver (never by the trainer): every worker forked from it starts with
its reward kind's libraries loaded and warm, so replacing a killed worker takes milliseconds, not seconds. This
module loads both kinds' (`_preload_gym`: reasoning-gym; `_preload_math`: math-verify and sympy); a reward pool
preloads only its kind's (`reward_fn.PRELOAD`)."""
import megatron_rl.rewards._preload_gym  # noqa: F401
import megatron_rl.rewards._preload_math  # noqa: F401
