"""Answer extraction from a completion: <answer> tags, \\boxed{...} (nested braces), "the answer is X", free text.

Pure string work, linear-time patterns only. It still runs inside the verifier workers (never in the trainer), with
everything else that touches model output, so even a pathological string can only cost a worker its timeout.

Free text (no tag, no box, no "answer is") is where false credit hides: the last number of `$x = \\frac{1}{3}$` is
3, that of `$\\sqrt{2}$` is 2. Math answers in free text are read by math-verify's own LaTeX-aware extraction
(`worker.py`); the bare last number here is only a fallback for text without any LaTeX markup.
"""
from __future__ import annotations

import re
from typing import Optional

_TAG_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
_BOX_CMDS = ("\\boxed", "\\fbox")
_ANSWER_IS_RE = re.compile(r"answer\s+is\s*:?\s*([^\n]*)", re.IGNORECASE)
# thousands separators (1,000) or a decimal comma (2,74: one or two digits after it, which a thousands group never
# has); "2,740" stays two thousand seven hundred and forty
_NUMBER_RE = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+|,\d{1,2}(?!\d))?(?:/\d+)?")
_DECIMAL_COMMA_RE = re.compile(r"^-?\d+,\d{1,2}$")
_MAX_ANSWER_CHARS = 1000  # answers longer than this are not answers; also bounds what reaches sympy
# math markup whose digits must not be read as a bare number: a backslash command or delimiter, $, braces
_LATEX_RE = re.compile(r"\\[A-Za-z(\[{]|[${}]")


def _clean(ans: str) -> Optional[str]:
    ans = ans.strip()
    # "$\frac{1}{2}$." or "**17**" -> the expression itself
    ans = ans.strip("*").strip()
    if ans.endswith("."):
        ans = ans[:-1].rstrip()
    if len(ans) >= 2 and ans[0] == "$" and ans[-1] == "$":
        ans = ans.strip("$").strip()
    if not ans or len(ans) > _MAX_ANSWER_CHARS:
        return None
    return _decimal_point(ans)


def _decimal_point(number: str) -> str:
    """A number written with a decimal comma ("2,74", as in most of Europe) in the point form the verifier reads."""
    return number.replace(",", ".") if _DECIMAL_COMMA_RE.match(number) else number


def _boxed_spans(text: str) -> list[tuple[int, int]]:
    """(start, end) of the content of every \\boxed{...} / \\fbox{...}, matching nested braces."""
    spans = []
    i = 0
    while True:
        starts = [(text.find(cmd, i), cmd) for cmd in _BOX_CMDS]
        starts = [(s, c) for s, c in starts if s >= 0]
        if not starts:
            return spans
        s, cmd = min(starts)
        j = s + len(cmd)
        while j < len(text) and text[j] == " ":
            j += 1
        if j < len(text) and text[j] == "{":
            depth, k = 0, j
            while k < len(text):
                if text[k] == "{":
                    depth += 1
                elif text[k] == "}":
                    depth -= 1
                    if depth == 0:
                        spans.append((j + 1, k))
                        break
                k += 1
            else:  # unbalanced: nothing after this point can close a box either
                return spans
            i = k + 1
        elif j > s + len(cmd) and j < len(text):  # "\boxed 5": one token up to whitespace or '$'
            m = re.match(r"[^\s$]+", text[j:])
            if m:
                spans.append((j, j + m.end()))
            i = j + 1
        else:
            i = j


def extract_boxed(text: str) -> Optional[str]:
    """Content of the last \\boxed{...} (nested braces kept: \\boxed{\\frac{1}{2}} -> \\frac{1}{2})."""
    spans = _boxed_spans(text)
    return _clean(text[spans[-1][0]:spans[-1][1]]) if spans else None


def extract_answer_tag(text: str) -> Optional[str]:
    """Content of the last <answer>...</answer>; a \\boxed{} inside it is unwrapped."""
    matches = _TAG_RE.findall(text)
    if not matches:
        return None
    inner = matches[-1]
    return extract_boxed(inner) or _clean(inner)


def extract_answer_is(text: str) -> Optional[str]:
    """What follows the last "answer is" on its line ("The answer is $\\frac{1}{2}$." -> \\frac{1}{2})."""
    matches = _ANSWER_IS_RE.findall(text)
    if not matches:
        return None
    rest = matches[-1]
    return extract_boxed(rest) or _clean(rest)


def has_latex(text: str) -> bool:
    """True if the text holds LaTeX markup (\\frac, \\(, $, {, ...): then a bare number in it may be part of a
    larger expression (the 3 of \\frac{1}{3}, the 2 of 2^{10}) and is never taken as the answer on its own."""
    return _LATEX_RE.search(text) is not None


def extract_last_number(text: str) -> Optional[str]:
    """The last integer/decimal/simple fraction in the text, thousands separators removed, a decimal comma read as
    a point."""
    matches = _NUMBER_RE.findall(text)
    return _decimal_point(matches[-1]).replace(",", "") if matches else None


_CLOSERS_RE = re.compile(r"\\[)\]]|[$}]")


def trailing_number(text: str) -> Optional[str]:
    """The last bare number in the prose after a text's last closed piece of LaTeX ("$x = 5$ is wrong; we get 7" ->
    7), or None: no such prose, no number in it, or the text ends inside math ("so {3", an odd "$"). Free text's final
    answer is then that number, not the formula before it."""
    closers = list(_CLOSERS_RE.finditer(text))
    if not closers or text.count("$") % 2:
        return None
    tail = text[closers[-1].end():]
    return None if _LATEX_RE.search(tail) else extract_last_number(tail)


def extract_answer_with_source(text: str, answer_format: str) -> tuple[Optional[str], Optional[str]]:
    """(answer, where it came from): "tag", "boxed", "answer_is", or "free" (auto format, none of those found: the
    last number, or None when the text has LaTeX in it), or (None, None) when the format found nothing.

    "free" tells the math verifier to read the whole text with math-verify's LaTeX-aware extraction first.
    """
    if answer_format == "answer_tag":
        ans = extract_answer_tag(text)
        return ans, ("tag" if ans is not None else None)
    if answer_format == "boxed":
        ans = extract_boxed(text)
        return ans, ("boxed" if ans is not None else None)
    if answer_format == "auto":
        for source, fn in (("tag", extract_answer_tag), ("boxed", extract_boxed), ("answer_is", extract_answer_is)):
            ans = fn(text)
            if ans is not None:
                return ans, source
        return (None if has_latex(text) else extract_last_number(text)), "free"
    raise ValueError(f"unknown answer_format {answer_format!r} (expected answer_tag, boxed or auto)")


def extract_answer(text: str, answer_format: str) -> Optional[str]:
    """The model's final answer per RewardConfig.answer_format, or None when it gave none in that form.

    answer_tag: <answer>..</answer> only. boxed: \\boxed{..} only. auto: the first that finds something of
    tags, boxed, "answer is X", and the last number — that last one only in text without LaTeX markup.
    """
    return extract_answer_with_source(text, answer_format)[0]


def is_well_formed(text: str, answer_format: str) -> bool:
    """The format bonus: exactly one non-empty <answer>..</answer> pair (answer_tag), a balanced non-empty
    \\boxed{} (boxed), either of those (auto). Rewards the form even when the content is wrong."""
    tag_ok = (len(re.findall(r"<answer>", text, re.IGNORECASE)) == 1
              and len(re.findall(r"</answer>", text, re.IGNORECASE)) == 1
              and extract_answer_tag(text) is not None)
    if answer_format == "answer_tag":
        return tag_ok
    boxed_ok = extract_boxed(text) is not None
    if answer_format == "boxed":
        return boxed_ok
    return tag_ok or boxed_ok
