"""Final-answer extraction and number normalisation for GSM8K-style math tasks.

Hand-written on purpose: the rules are three regular expressions and `decimal.Decimal`; the libraries
that do this (math-verify, latex2sympy) parse LaTeX and pull in sympy, far more than `#### 42` needs.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

# 1,000 only with proper thousands groups (so "1,2,3" is three numbers), then an optional decimal part
NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|[-+]?\.\d+")
HASHES = re.compile(r"####\s*([^\n]*)")
ANSWER = re.compile(r"answer\s*(?:is)?\s*[:=]?\s*([^\n]*)", re.IGNORECASE)


def _number_or_text(text: str) -> str | None:
    """The first number in `text`, else `text` stripped (for non-numeric answers), else None."""
    m = NUMBER.search(text)
    if m:
        return m.group(0)
    text = text.strip().rstrip(".").strip()
    return text or None


def extract_answer(response: str) -> str | None:
    """The final answer of a response, by the first rule that applies:
    1. the text after the last `####` (GSM8K's solution format);
    2. the text after the last `answer:` / `answer is` / `answer =`;
    3. the last number anywhere in the response;
    4. the whole response, stripped (a non-numeric answer).
    In 1 and 2 a number in that text is preferred to the text. None when the response is empty."""
    for pattern in (HASHES, ANSWER):
        found = pattern.findall(response)
        if found and found[-1].strip():
            return _number_or_text(found[-1])
    numbers = NUMBER.findall(response)
    if numbers:
        return numbers[-1]
    text = response.strip()
    return text or None


def normalize_number(text: str | None) -> str | None:
    """A canonical string for a number ('42.0', '+42', '42', '1,000.00' -> '42', '42', '42', '1000'); None
    when `text` is not a number. Decimal, not float: '0.1' + '0.2' style rounding never decides a reward."""
    if text is None:
        return None
    s = text.strip().replace(",", "").removeprefix("$").rstrip(".")
    if not NUMBER.fullmatch(s):
        return None
    try:
        d = Decimal(s)
    except InvalidOperation:
        return None
    if d == d.to_integral_value():
        return str(int(d))
    return format(d.normalize(), "f")


def answer_reward(gold: str, response: str) -> float:
    """1.0 when the response's final answer equals `gold` (numbers after normalisation, else as text); else 0.0."""
    got = extract_answer(response)
    if got is None:
        return 0.0
    want_n, got_n = normalize_number(gold), normalize_number(got)
    if want_n is not None:
        return 1.0 if got_n == want_n else 0.0
    return 1.0 if got == gold else 0.0
