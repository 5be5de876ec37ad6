"""The verifier forkserver's preload for reasoning-gym rewards (see `_preload`): reasoning-gym alone. Its scorers never
call math-verify, whose import and warm-up (~2.5 s of one core) this skips in every such run."""
import reasoning_gym  # noqa: F401
