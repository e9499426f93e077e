"""Counter-based randomness: the noise for request r at sequence position p over token t is a
hash (splitmix64) of (seed_r, p, t). A request's samples therefore depend only on its own seed
and position, never on what else is in the batch, and resume identically after a retraction."""

from __future__ import annotations

import torch

_M1 = 0x9E3779B97F4A7C15 - (1 << 64)
_M2 = 0xBF58476D1CE4E5B9 - (1 << 64)
_M3 = 0x94D049BB133111EB - (1 << 64)


def _srl(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def hashed_uniform(seeds: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, V] uniforms in (0, 1) from splitmix64 over (seed, step, token)."""
    token = torch.arange(vocab, device=seeds.device, dtype=torch.int64)
    return hashed_uniform_columns(seeds, steps, token)


def hashed_uniform_columns(
    seeds: torch.Tensor, steps: torch.Tensor, columns: torch.Tensor
) -> torch.Tensor:
    """[B, C] uniforms for the counter values `columns` (token ids, or the negative columns no
    token uses: the draft acceptance tests' coins)."""
    return _splitmix_uniform(seeds[:, None] * _M1 + steps[:, None] * _M3 + columns[None, :] * _M2)


def hashed_uniform_column(seeds: torch.Tensor, steps: torch.Tensor, column: int) -> torch.Tensor:
    """[B] uniforms for one counter value (a column no token uses, e.g. -1: the draft
    acceptance test's coin, independent of the token noise)."""
    return _splitmix_uniform(seeds * _M1 + steps * _M3 + column * _M2)


def _splitmix_uniform(x: torch.Tensor) -> torch.Tensor:
    x = (x ^ _srl(x, 30)) * _M2
    x = (x ^ _srl(x, 27)) * _M3
    x = x ^ _srl(x, 31)
    mantissa = _srl(x, 11).to(torch.float64)
    return ((mantissa + 0.5) / float(1 << 53)).to(torch.float32).clamp_(1e-20, 1.0 - 1e-7)
