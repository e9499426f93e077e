"""Counter-based randomness: the noise for request r at sequence position p over token t is a
hash (splitmix64) of (seed_r, p, t). A request's samples therefore depend only on its own seed
and position, never on what else is in the batch, and resume identically after a retraction.

Two implementations of the same integer arithmetic: torch's (int64 tensors, which wrap
modulo 2^64, with a masked shift for the logical one) and numpy's (uint64 arrays), the
uniforms bit for bit equal (the hash is exact integer arithmetic, the last steps the same
float64 / float32 roundings). Which one runs follows the type of `seeds`."""

from __future__ import annotations

import numpy as np

_M1 = 0x9E3779B97F4A7C15 - (1 << 64)
_M2 = 0xBF58476D1CE4E5B9 - (1 << 64)
_M3 = 0x94D049BB133111EB - (1 << 64)
_U1, _U2, _U3 = (np.uint64(m % (1 << 64)) for m in (_M1, _M2, _M3))
_LOW, _HIGH = np.float32(1e-20), np.float32(1.0 - 1e-7)  # torch's clamp bounds as float32


def _srl(x, k: int):
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def hashed_uniform(seeds, steps, vocab: int):
    """[B, V] uniforms in (0, 1) from splitmix64 over (seed, step, token)."""
    if isinstance(seeds, np.ndarray):
        return hashed_uniform_columns(seeds, steps, np.arange(vocab, dtype=np.int64))
    import torch

    token = torch.arange(vocab, device=seeds.device, dtype=torch.int64)
    return hashed_uniform_columns(seeds, steps, token)


def hashed_uniform_columns(seeds, steps, columns):
    """[B, C] uniforms for the counter values `columns` (token ids, or the negative columns no
    token uses: the draft acceptance tests' coins)."""
    if isinstance(seeds, np.ndarray):
        x = _np_key(seeds, steps)[:, None] + _np_u64(columns)[None, :] * _U2
        return _np_splitmix_uniform(x)
    return _splitmix_uniform(seeds[:, None] * _M1 + steps[:, None] * _M3 + columns[None, :] * _M2)


def hashed_uniform_column(seeds, steps, column: int):
    """[B] uniforms for one counter value (a column no token uses, e.g. -1: the draft
    acceptance test's coin, independent of the token noise)."""
    if isinstance(seeds, np.ndarray):
        return _np_splitmix_uniform(_np_key(seeds, steps) + _np_u64(np.int64(column)) * _U2)
    return _splitmix_uniform(seeds * _M1 + steps * _M3 + column * _M2)


def _splitmix_uniform(x):
    import torch

    x = (x ^ _srl(x, 30)) * _M2
    x = (x ^ _srl(x, 27)) * _M3
    x = x ^ _srl(x, 31)
    mantissa = _srl(x, 11).to(torch.float64)
    return ((mantissa + 0.5) / float(1 << 53)).to(torch.float32).clamp_(1e-20, 1.0 - 1e-7)


def _np_u64(x) -> np.ndarray:
    """int64 values as uint64 with the same bits (negative columns wrap as in torch)."""
    return np.asarray(x, dtype=np.int64).view(np.uint64)


def _np_key(seeds: np.ndarray, steps: np.ndarray) -> np.ndarray:
    return _np_u64(seeds) * _U1 + _np_u64(steps) * _U3


def _np_splitmix_uniform(x: np.ndarray) -> np.ndarray:
    """The torch version's arithmetic in uint64, in place over `x` (a fresh array)."""
    x ^= x >> np.uint64(30)
    x *= _U2
    x ^= x >> np.uint64(27)
    x *= _U3
    x ^= x >> np.uint64(31)
    x >>= np.uint64(11)
    mantissa = x.astype(np.float64)
    mantissa += 0.5
    mantissa /= float(1 << 53)
    out = mantissa.astype(np.float32)
    return np.clip(out, _LOW, _HIGH, out=out)
