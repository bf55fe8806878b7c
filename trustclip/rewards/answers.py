"""Answer parsing: the predicted answer of a completion (`extract_answer`), and the verdicts plain comparison can give
(`fast_verdict`); everything else is left to math-verify (`trustclip.rewards.verifier`)."""

from __future__ import annotations

import re
from fractions import Fraction

_BOX_RE = re.compile(r"\\(?:boxed|fbox)\s*")
_ANSWER_LINE_RE = re.compile(r"(?im)^\s*\**\s*(?:final\s+)?answer\s*\**\s*[:：]\s*(.+?)\s*$")
_NUMBER_RE = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?(?:/\d+)?")
_THOUSANDS_RE = re.compile(r"^[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")
_DECIMAL_RE = re.compile(r"^[+-]?(?:\d+(?:\.\d*)?|\.\d+)$")
_SLASH_FRAC_RE = re.compile(r"^([+-]?\d+)/(\d+)$")
# \frac{12}{5}, \frac34 (unbraced arguments are single digits in LaTeX)
_LATEX_FRAC_RE = re.compile(r"^([+-]?)\\frac(?:\{([+-]?\d+)\}|(\d))(?:\{(\d+)\}|(\d))$")


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` / `\\fbox{...}` (braces matched; `\\boxed 5` gives `5`), or None if there is
    none. An unclosed last box is skipped in favour of an earlier one."""
    for match in reversed(list(_BOX_RE.finditer(text))):
        start = match.end()
        if start < len(text) and text[start] == "{":
            depth = 0
            for i in range(start, len(text)):
                depth += {"{": 1, "}": -1}.get(text[i], 0)
                if depth == 0:
                    return text[start + 1 : i].strip()
            continue  # unclosed
        token = re.match(r"[^\s$]+", text[start:])
        if token:
            return token.group(0).rstrip(".")
    return None


def extract_answer(text: str, fallback: bool = True) -> str | None:
    """Predicted final answer: the content of the **last** `\\boxed{...}` (or `\\fbox{...}`); else (with `fallback`)
    the last `Answer: ...` line (DAPO's format), else the last number. None when nothing can be extracted (e.g. an
    empty completion: it scores 0)."""
    if not text or not text.strip():
        return None
    boxed = last_boxed(text)
    if boxed is not None or not fallback:
        return boxed or None
    lines = _ANSWER_LINE_RE.findall(text)
    if lines:
        return lines[-1].strip().rstrip(".").strip().strip("$").strip() or None
    numbers = _NUMBER_RE.findall(text)
    return numbers[-1] if numbers else None


def _normalize(ans: str) -> str:
    s = ans.strip().strip("$").strip()
    s = re.sub(r"\\[dt]frac", r"\\frac", s)
    s = re.sub(r"\\(?:left|right)\b|\\[,;:! ]|\s+", "", s)
    s = re.sub(r"^\\text\{(.*)\}$", r"\1", s)
    return s.rstrip(".")


def _as_number(s: str) -> Fraction | None:
    """The exact value of a plain number, or None (not a plain number, or too long to convert: Python refuses
    integer strings of more than sys.get_int_max_str_digits() digits; math-verify then decides)."""
    if _THOUSANDS_RE.match(s):
        s = s.replace(",", "")
    sign = 1
    if m := _LATEX_FRAC_RE.match(s):  # \frac{a}{b} -> a/b
        sign, s = (-1 if m.group(1) == "-" else 1), f"{m.group(2) or m.group(3)}/{m.group(4) or m.group(5)}"
    if not (_DECIMAL_RE.match(s) or _SLASH_FRAC_RE.match(s)):
        return None
    try:
        return sign * Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


def fast_verdict(pred: str, answer: str) -> float | None:
    """1.0 / 0.0 when plain comparison decides, None when math-verify is needed: after light normalisation (`$`,
    spaces, `\\dfrac`->`\\frac`, thousands commas like `1,450,000`, leading zeros like `025`) equal strings or equal
    numbers score 1, and two *different integers* score 0."""
    p, a = _normalize(pred), _normalize(answer)
    if p == a and p:
        return 1.0
    pn, an = _as_number(p), _as_number(a)
    if pn is None or an is None:
        return None
    if pn == an:
        return 1.0
    # Two different integers are certainly different; non-integers may still match after
    # math-verify's rounding (e.g. 0.333333 vs 1/3), so they go on.
    return 0.0 if pn.denominator == 1 and an.denominator == 1 else None
