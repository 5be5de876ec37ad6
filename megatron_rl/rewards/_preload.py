"""Imported once by the verifier workers' forkserver (never by the trainer): every worker forked from it starts with
math-verify, sympy and reasoning-gym loaded and warm, so replacing a killed worker takes milliseconds, not seconds."""
import logging

logging.getLogger("math_verify").setLevel(logging.ERROR)

import reasoning_gym  # noqa: E402,F401
from math_verify import parse, verify  # noqa: E402

verify(parse("\\boxed{\\frac{1}{2}}", parsing_timeout=None), parse("\\boxed{0.5}", parsing_timeout=None),
       timeout_seconds=None)
