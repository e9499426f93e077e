"""Integer and number bounds as regular expressions over JSON number text.

`int_range(lo, hi)` writes the set of integers in [lo, hi] (either side may be open) as a regex
on decimal digits, the classic digit-by-digit split: same-length ranges recurse on the first
digit, different lengths are joined one length at a time. Numbers with integral bounds combine
an integer range (with an optional all-zero fraction) with integer parts of non-integers.
"""

from __future__ import annotations

import math
from decimal import Decimal

INTEGER = r"-?(?:0|[1-9][0-9]*)"
NUMBER = r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?"


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


def number_range(schema: dict, decimals: int | None = None) -> str | None:
    """Regex for the JSON numbers within the schema's bounds (any finite decimal bounds,
    inclusive or exclusive, drafts 4 and 6+), with at most `decimals` significant fraction
    digits when given (multipleOf 10**-k); None when the range is empty.

    Bounded numbers are written without exponents (`1e3` is not accepted where a bound applies).
    """
    lo, hi = schema.get("minimum"), schema.get("maximum")
    xlo, xhi = schema.get("exclusiveMinimum"), schema.get("exclusiveMaximum")
    lo_ex = hi_ex = False
    if _is_number(xlo):
        if lo is None or xlo >= lo:
            lo, lo_ex = xlo, True
    elif xlo is True:
        lo_ex = True
    if _is_number(xhi):
        if hi is None or xhi <= hi:
            hi, hi_ex = xhi, True
    elif xhi is True:
        hi_ex = True
    lo, hi = _decimal(lo), _decimal(hi)
    if lo is not None and hi is not None and (lo > hi or (lo == hi and (lo_ex or hi_ex))):
        return None
    parts = []
    if hi is None or hi >= 0:  # x >= 0: x in [max(lo, 0), hi]
        low, low_ex = (lo, lo_ex) if lo is not None and lo >= 0 else (Decimal(0), False)
        part = _magnitudes(low, low_ex, hi, hi_ex, decimals)
        if part:
            parts.append(part)
    if lo is None or lo < 0:  # x = -m < 0: m in (0 or -hi, -lo]
        low, low_ex = (-hi, hi_ex) if hi is not None and hi < 0 else (Decimal(0), True)
        part = _magnitudes(low, low_ex, None if lo is None else -lo, lo_ex, decimals)
        if part:
            parts.append("-" + part)
    return _alt(parts) if parts else None


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _decimal(v) -> Decimal | None:
    """A JSON bound as an exact decimal: the float's shortest repr (0.1 is 0.1, not 0.1000..)."""
    if v is None:
        return None
    if isinstance(v, float) and not math.isfinite(v):
        raise ValueError(f"bound {v} is not a finite number")
    return Decimal(repr(v)) if isinstance(v, float) else Decimal(v)


def _split(d: Decimal) -> tuple[int, str]:
    """(integer part, fraction digits without trailing zeros) of a non-negative decimal."""
    whole = int(d)
    frac = format(d - whole, "f").partition(".")[2].rstrip("0")
    return whole, frac


def _magnitudes(lo: Decimal, lo_ex: bool, hi: Decimal | None, hi_ex: bool, k) -> str | None:
    """Non-negative numbers `I(.F)?` in [lo, hi] (hi None: unbounded), each side inclusive or
    exclusive, F holding at most k significant digits (k None: any). By integer part: the
    bounds' own integer parts constrain the fraction, the ones strictly between do not."""
    if hi is not None and (lo > hi or (lo == hi and (lo_ex or hi_ex))):
        return None
    a, alpha = _split(lo)
    if hi is not None:
        b, beta = _split(hi)
        if a == b:
            tail = _tail(_between(alpha, lo_ex, beta, hi_ex, k))
            return None if tail is None else str(a) + tail
    parts = []
    tail = _tail(_at_least(alpha, lo_ex, k))
    if tail is not None:
        parts.append(str(a) + tail)
    middle = _nonneg(a + 1, None if hi is None else b - 1)
    if middle is not None:
        parts.append(middle + _tail(_any(k)))
    if hi is not None:
        tail = _tail(_at_most(beta, hi_ex, k))
        if tail is not None:
            parts.append(str(b) + tail)
    return _alt(parts) if parts else None


# Fraction digit strings F (the digits after ".", possibly none: value 0), compared as values:
# each helper returns (alternatives for a non-empty F, whether an empty F qualifies), with `k`
# the number of digits still free to be non-zero (None: unlimited; past it only zeros).


def _tail(frac: tuple[list[str], bool]) -> str | None:
    """The optional `.F` after an integer part, or None when no fraction qualifies."""
    alts, empty = frac
    if not alts:
        return "" if empty else None
    return rf"(?:\.{_alt(alts)})" + ("?" if empty else "")


def _rest(frac: tuple[list[str], bool]) -> str | None:
    """The digits after a fixed one: possibly none."""
    alts, empty = frac
    if not alts:
        return "" if empty else None
    return "(?:" + "|".join(alts) + ")?" if empty else _alt(alts)


def _free(k) -> str:
    """Any digits (only zeros past the k free positions)."""
    return "[0-9]*" if k is None else (f"[0-9]{{0,{k}}}0*" if k else "0*")


def _any(k) -> tuple[list[str], bool]:
    if k is None:
        return ["[0-9]+"], True
    return ([f"[0-9]{{1,{k}}}0*"] if k else ["0+"]), True


def _digit(lo: int, hi: int) -> str:
    return str(lo) if lo == hi else f"[{lo}-{hi}]"


def _at_least(alpha: str, strict: bool, k) -> tuple[list[str], bool]:
    """F > .alpha (strict) or F >= .alpha."""
    if not alpha:
        if not strict:
            return _any(k)
        if k is None:
            return ["0*[1-9][0-9]*"], False
        # a non-zero digit at one of the k free positions
        return ["0" * j + "[1-9]" + _free(k - j - 1) for j in range(k)], False
    if k == 0:
        return [], False  # only zeros remain: value 0 < .alpha
    d, sub = int(alpha[0]), _at_least(alpha[1:], strict, None if k is None else k - 1)
    alts = [] if d == 9 else [_digit(d + 1, 9) + _free(None if k is None else k - 1)]
    rest = _rest(sub)
    if rest is not None:
        alts.append(str(d) + rest)
    return alts, False


def _at_most(beta: str, strict: bool, k) -> tuple[list[str], bool]:
    """F < .beta (strict) or F <= .beta."""
    if not beta:
        return ([], False) if strict else (["0+"], True)
    if k == 0:
        return ["0+"], True  # only zeros remain: value 0 < .beta
    k1 = None if k is None else k - 1
    d = int(beta[0])
    alts = [] if d == 0 else [_digit(0, d - 1) + _free(k1)]
    rest = _rest(_at_most(beta[1:], strict, k1))
    if rest is not None:
        alts.append(str(d) + rest)
    return alts, True


def _between(alpha: str, lo_ex: bool, beta: str, hi_ex: bool, k) -> tuple[list[str], bool]:
    """.alpha <= F <= .beta (either side strict), with .alpha <= .beta."""
    if not alpha:
        if not lo_ex:
            return _at_most(beta, hi_ex, k)
        if not beta:
            return [], False
    if k == 0:
        return [], False  # only zeros remain, and 0 is below .alpha (or excluded)
    k1 = None if k is None else k - 1
    a0, b0 = int((alpha or "0")[0]), int(beta[0])
    if a0 == b0:
        rest = _rest(_between(alpha[1:], lo_ex, beta[1:], hi_ex, k1))
        return ([str(a0) + rest] if rest is not None else []), False
    alts = []
    rest = _rest(_at_least(alpha[1:], lo_ex, k1))
    if rest is not None:
        alts.append(str(a0) + rest)
    if b0 - a0 > 1:
        alts.append(_digit(a0 + 1, b0 - 1) + _free(k1))
    rest = _rest(_at_most(beta[1:], hi_ex, k1))
    if rest is not None:
        alts.append(str(b0) + rest)
    return alts, not alpha and not lo_ex


def decimal_places(m) -> int | None:
    """k when m == 10**-k (0.1, 0.01, ...), else None."""
    for k in range(1, 16):
        if abs(m - 10.0**-k) < 1e-12 * 10.0**-k:
            return k
    return None


def at_most_decimals(k: int) -> str:
    """Numbers that are multiples of 10**-k, written without an exponent."""
    return rf"-?(?:0|[1-9][0-9]*)(?:\.[0-9]{{1,{k}}}0*)?"
