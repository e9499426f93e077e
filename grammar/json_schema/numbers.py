"""Integer and number bounds as regular expressions over JSON number text.

`int_range(lo, hi)` writes the set of integers in [lo, hi] (either side may be open) as a regex
on decimal digits, the classic digit-by-digit split: same-length ranges recurse on the first
digit, different lengths are joined one length at a time. Numbers with integral bounds combine
an integer range (with an optional all-zero fraction) with integer parts of non-integers.
"""

from __future__ import annotations

import math

INTEGER = r"-?(?:0|[1-9][0-9]*)"
NUMBER = r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?"
_NONZERO_FRAC = r"\.[0-9]*[1-9][0-9]*"


def _digit_class(a: str, b: str) -> str:
    return a if a == b else f"[{a}-{b}]"


def _same_len(a: str, b: str) -> list[str]:
    """Alternatives matching the equal-length digit strings in [a, b]."""
    n = len(a)
    if n == 1:
        return [_digit_class(a, b)]
    if a[0] == b[0]:
        return [a[0] + _alt(_same_len(a[1:], b[1:]))]
    if a[1:] == "0" * (n - 1) and b[1:] == "9" * (n - 1):
        return [_digit_class(a[0], b[0]) + f"[0-9]{{{n - 1}}}"]
    out = [a[0] + _alt(_same_len(a[1:], "9" * (n - 1)))]
    if int(b[0]) - int(a[0]) > 1:
        out.append(_digit_class(str(int(a[0]) + 1), str(int(b[0]) - 1)) + f"[0-9]{{{n - 1}}}")
    out.append(b[0] + _alt(_same_len("0" * (n - 1), b[1:])))
    return out


def _alt(parts: list[str]) -> str:
    return parts[0] if len(parts) == 1 else "(?:" + "|".join(parts) + ")"


def _nonneg(a: int, b: int | None) -> str | None:
    """Regex for the integers in [a, b] with a >= 0 (b None = no upper bound)."""
    if b is not None and b < a:
        return None
    la = len(str(a))
    lb = len(str(b)) if b is not None else la
    parts: list[str] = []
    for n in range(la, lb + 1):
        lo = str(a) if n == la else "1" + "0" * (n - 1)
        hi = str(b) if (b is not None and n == lb) else "9" * n
        if int(lo) <= int(hi):
            parts += _same_len(lo, hi)
    if b is None:
        parts.append(f"[1-9][0-9]{{{la},}}")
    return _alt(parts) if parts else None


def int_range(lo: int | None, hi: int | None) -> str | None:
    """Regex for the integers in [lo, hi]; None when the range is empty."""
    if lo is None and hi is None:
        return INTEGER
    if lo is not None and hi is not None and lo > hi:
        return None
    parts = []
    if lo is None or lo < 0:  # negatives: "-" then a magnitude in [max(1, -hi), -lo]
        mag = _nonneg(max(1, -hi) if hi is not None else 1, -lo if lo is not None else None)
        if mag is not None:
            parts.append("-" + mag)
    if hi is None or hi >= 0:
        pos = _nonneg(max(0, lo) if lo is not None else 0, hi)
        if pos is not None:
            parts.append(pos)
    return _alt(parts) if parts else None


def integer_bounds(schema: dict) -> tuple[int | None, int | None]:
    """[lo, hi] of an integer schema, from minimum/maximum/exclusive* (drafts 4 and 6+)."""
    lo, hi = schema.get("minimum"), schema.get("maximum")
    xlo, xhi = schema.get("exclusiveMinimum"), schema.get("exclusiveMaximum")
    lo = None if lo is None else math.ceil(lo)
    hi = None if hi is None else math.floor(hi)
    if xlo is True and lo is not None:
        lo += 1
    elif isinstance(xlo, (int, float)) and not isinstance(xlo, bool):
        cand = math.floor(xlo) + 1
        lo = cand if lo is None else max(lo, cand)
    if xhi is True and hi is not None:
        hi -= 1
    elif isinstance(xhi, (int, float)) and not isinstance(xhi, bool):
        cand = math.ceil(xhi) - 1
        hi = cand if hi is None else min(hi, cand)
    return lo, hi


def number_range(schema: dict) -> str | None:
    """Regex for JSON numbers within integral bounds; raises ValueError for other bounds.

    Bounded numbers are written without exponents (`1e3` is not accepted where a bound applies).
    """
    lo, hi = schema.get("minimum"), schema.get("maximum")
    xlo, xhi = schema.get("exclusiveMinimum"), schema.get("exclusiveMaximum")
    lo_ex = hi_ex = False
    if isinstance(xlo, (int, float)) and not isinstance(xlo, bool):
        if lo is None or xlo >= lo:
            lo, lo_ex = xlo, True
    elif xlo is True:
        lo_ex = True
    if isinstance(xhi, (int, float)) and not isinstance(xhi, bool):
        if hi is None or xhi <= hi:
            hi, hi_ex = xhi, True
    elif xhi is True:
        hi_ex = True
    for b in (lo, hi):
        if b is not None and b != int(b):
            raise ValueError(f"non-integral bound {b}")
    lo = None if lo is None else int(lo)
    hi = None if hi is None else int(hi)
    ints = int_range(None if lo is None else lo + lo_ex, None if hi is None else hi - hi_ex)
    parts = [ints + r"(?:\.0+)?"] if ints else []
    # non-integers strictly between lo and hi, by integer part
    pos = _nonneg(max(lo, 0) if lo is not None else 0, None if hi is None else hi - 1)
    if pos is not None:
        parts.append(pos + _NONZERO_FRAC)
    if lo is None or lo < 0:
        neg = _nonneg(max(0, -hi) if hi is not None else 0, None if lo is None else -lo - 1)
        if neg is not None:
            parts.append("-" + neg + _NONZERO_FRAC)
    return _alt(parts) if parts else None


def decimal_places(m) -> int | None:
    """k when m == 10**-k (0.1, 0.01, ...), else None."""
    for k in range(1, 16):
        if abs(m - 10.0**-k) < 1e-12 * 10.0**-k:
            return k
    return None


def at_most_decimals(k: int) -> str:
    """Numbers that are multiples of 10**-k, written without an exponent."""
    return rf"-?(?:0|[1-9][0-9]*)(?:\.[0-9]{{1,{k}}}0*)?"
