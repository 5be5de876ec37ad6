"""Math answer checking with math-verify: runs inside the verifier workers only.

Importing this module is cheap and safe anywhere (the trainer imports `worker`, which imports this): math-verify and
sympy are imported inside the functions, so only the workers ever load them or parse model output.
"""
from __future__ import annotations

import math
from typing import Any, Optional

from megatron_rl.rewards.extract import extract_answer_with_source, has_latex, trailing_number

# An answer whose exact value needs more digits than this is no answer to a math problem, and comparing it would
# make sympy compute it (10^{10^{10}}: ten billion digits, minutes of work stuck in C where no signal reaches it).
# It scores 0 at once instead of costing a worker its timeout and the pool a restart.
_MAX_DIGITS = 10_000.0


def _digits(e: Any, depth: int = 0) -> float:
    """Upper bound on the decimal digits of a sympy tree's value (or of its reciprocal): log10 of its magnitude.

    Pow(b, x): digits(b) * |x| with |x| <= 10^digits(x); factorial(n): n log10 n; products add, sums take the max
    plus one. Symbols and constants count 0; anything else is bounded by its arguments. Pure arithmetic on the
    unevaluated tree: nothing is computed. Forms it does not size (\\prod_{n=1}^{10^7} n) still end at the worker's
    timeout.
    """
    if depth > 200:  # a tree this deep is itself pathological
        return math.inf
    if getattr(e, "is_Rational", False):  # Integer or Rational: the digits of numerator and denominator
        return math.log10(max(abs(int(e.p)), abs(int(e.q)), 1))
    if getattr(e, "is_Float", False):
        v = abs(float(e))
        return abs(math.log10(v)) if v not in (0.0, math.inf) else (0.0 if v == 0 else math.inf)
    args = getattr(e, "args", ())
    if getattr(e, "is_Pow", False):
        base, exp = _digits(e.base, depth + 1), _digits(e.exp, depth + 1)
        if base == 0:  # 0, +-1 or a symbol: only the exponent itself can be large (x^{10^{10^{10}}})
            return exp
        return math.inf if exp > 300 else max(exp, base * 10.0 ** exp)
    if getattr(e, "func", None) is not None and e.func.__name__ in ("factorial", "factorial2", "gamma"):
        n = _digits(args[0], depth + 1) if args else 0.0
        return math.inf if n > 300 else 10.0 ** n * max(n, 1.0)
    parts = [_digits(a, depth + 1) for a in args if hasattr(a, "args")]
    if not parts:
        return 0.0
    if getattr(e, "is_Mul", False):
        return sum(parts)
    return max(parts) + 1.0


def too_large(parsed: list) -> bool:
    """True if any parsed (sympy) candidate is too large to compare (see _MAX_DIGITS)."""
    return any(_digits(p) > _MAX_DIGITS for p in parsed if not isinstance(p, str))


def _parse_answer(expr: str) -> list:
    from math_verify import parse

    # as the content of \boxed{} math-verify reads LaTeX and plain expressions alike ("0.5", "\dfrac{1}{2}",
    # "x = 3"); a bare string is the fallback for forms the boxed reading rejects
    parsed = parse("\\boxed{" + expr + "}", parsing_timeout=None)
    return parsed or parse(expr, parsing_timeout=None)


def parse_free_text(text: str) -> tuple[list, Optional[str]]:
    """The final answer of a completion without tag, box or "answer is", by math-verify's own extraction.

    Its LaTeX extraction reads math environments ($...$, \\(...\\), \\[...\\]) and \\frac whole, rightmost first. Its
    plain expression/number patterns are used only when the text holds no LaTeX: inside LaTeX they read the 2 of
    2^{10} or of 2\\sqrt{2} as an answer. Returns (parsed sympy candidates, the matched text for logging).
    """
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    targets = [LatexExtractionConfig()] if has_latex(text) else [LatexExtractionConfig(), ExprExtractionConfig()]
    found = parse(text, targets, fallback_mode="first_match", parsing_timeout=None)
    return ([p for p in found if not isinstance(p, str)],
            next((p for p in found if isinstance(p, str)), None))


def _verify(gold: str, pred: list) -> bool:
    from math_verify import verify

    g = _parse_answer(gold.strip())
    if not g or not pred or too_large(pred) or too_large(g):
        return False
    return bool(verify(g, pred, timeout_seconds=None))


def math_equal(gold: str, pred: str) -> bool:
    """Equivalence of two answers via math-verify (0.5 == \\frac{1}{2}, 1,000 == 1000, x = 3 == 3)."""
    if gold.strip() == pred.strip():
        return True
    return _verify(gold, _parse_answer(pred))


def score_math(gold: str, completion: str, answer_format: str) -> tuple[float, Optional[str]]:
    """1.0 if the completion's final answer equals `gold`, else 0.0; and the answer as read (None: none found).

    Tag, box or "answer is" (per answer_format) are compared as they are. Free text (auto format, none of those): a
    number in the prose after the text's last formula is the final answer; else math-verify's extraction; only if
    that finds nothing and the text has no LaTeX does the last bare number count.
    """
    pred, source = extract_answer_with_source(completion, answer_format)
    if source == "free" and has_latex(completion):
        # the final answer is the last one in reading order: a number in the prose after the last formula beats the
        # formula (math-verify's extraction reads the LaTeX alone and would credit "$x = 5$ is wrong; we get 7" for 5)
        pred = trailing_number(completion)
        if pred is not None:
            return (1.0 if math_equal(gold, pred) else 0.0), pred
    if source == "free":
        parsed, shown = parse_free_text(completion)
        if parsed:
            return (1.0 if _verify(gold, parsed) else 0.0), (shown or "")[:200]
    if pred is None:
        return 0.0, None
    return (1.0 if math_equal(gold, pred) else 0.0), pred[:200]
