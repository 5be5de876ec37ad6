"""The verifier forkserver's preload for math rewards (see `_preload`): math-verify and sympy, imported and warm."""
import logging

logging.getLogger("math_verify").setLevel(logging.ERROR)

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify  # noqa: E402

verify(parse("\\boxed{\\frac{1}{2}}", parsing_timeout=None), parse("\\boxed{0.5}", parsing_timeout=None),
       timeout_seconds=None)
# free-text extraction (math_answer.parse_free_text): its regexes compile once, here, not in every worker
parse("so $x = \\frac{1}{2}$", [LatexExtractionConfig()], parsing_timeout=None)
parse("so x = 1/2", [LatexExtractionConfig(), ExprExtractionConfig()], parsing_timeout=None)
