"""Answer extraction from a completion: <answer> tags, \\boxed{...} (nested braces), "the answer is X", last number.

Pure string work, linear-time patterns only. It still runs inside the verifier workers (never in the trainer), with
everything else that touches model output, so even a pathological string can only cost a worker its timeout.
"""
from __future__ import annotations

import re
from typing import Optional

_TAG_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
_BOX_CMDS = ("\\boxed", "\\fbox")
_ANSWER_IS_RE = re.compile(r"answer\s+is\s*:?\s*([^\n]*)", re.IGNORECASE)
_NUMBER_RE = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?(?:/\d+)?")
_MAX_ANSWER_CHARS = 1000  # answers longer than this are not answers; also bounds what reaches sympy


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
    return ans


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


def extract_last_number(text: str) -> Optional[str]:
    """The last integer/decimal/simple fraction in the text, thousands separators removed."""
    matches = _NUMBER_RE.findall(text)
    return matches[-1].replace(",", "") if matches else None


def extract_answer(text: str, answer_format: str) -> Optional[str]:
    """The model's final answer per RewardConfig.answer_format, or None when it gave none in that form.

    answer_tag: <answer>..</answer> only. boxed: \\boxed{..} only. auto: the first that finds something of
    tags, boxed, "answer is X", last number.
    """
    if answer_format == "answer_tag":
        return extract_answer_tag(text)
    if answer_format == "boxed":
        return extract_boxed(text)
    if answer_format == "auto":
        for fn in (extract_answer_tag, extract_boxed, extract_answer_is, extract_last_number):
            ans = fn(text)
            if ans is not None:
                return ans
        return None
    raise ValueError(f"unknown answer_format {answer_format!r} (expected answer_tag, boxed or auto)")


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
