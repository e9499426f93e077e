"""Per-row sampling parameter arrays (temperature, top-p, min-p, top-k, seed, greedy), numpy on
the host, reused across steps with the same values (no torch: the scheduler builds them)."""

from __future__ import annotations

import numpy as np

# Recent steps' per-row parameter arrays, keyed by the values they hold: decode steps of the
# same requests reuse them instead of building eleven small arrays a step. Several entries:
# a verify step has one row per draft position, so a request's steps alternate between row
# counts (its draft length varies); one entry missed on most verify steps at batch 1.
_ROW_PARAMS: dict = {}
ROW_PARAMS_KEPT = 32


def row_params(
    reqs, params, greedy: list[bool], counts: list[int], vocab_size: int, dev, shared: bool
) -> tuple:
    """(temperatures [N, 1], top_ps, min_ps, top_ks, seeds, greedy) numpy arrays for the rows:
    request i's values on its `counts[i]` rows. With `shared`, the arrays may be the ones an
    earlier call with the same values returned, so they are read-only (the sampler never
    writes them; `SamplingInfo.to` views them as tensors); a draft tree's info gets its own.
    `dev` is unused (kept for the callers' signature): the arrays live on the host."""
    values = tuple(
        (1.0 if g else p.temperature, p.top_p, p.min_p,
         vocab_size if p.top_k < 0 else min(p.top_k, vocab_size), r.seed, g, c)
        for r, p, g, c in zip(reqs, params, greedy, counts)
    )  # fmt: skip
    key = values
    if shared:
        hit = _ROW_PARAMS.get(key)  # one read: another thread may clear the dict meanwhile
        if hit is not None:
            return hit
    n = sum(counts)
    floats = np.array([v[:3] for v in values for _ in range(v[6])], np.float32).reshape(n, 3)
    ints = np.array([v[3:5] for v in values for _ in range(v[6])], np.int64).reshape(n, 2)
    flags = np.array([v[5] for v in values for _ in range(v[6])], np.bool_).reshape(n)
    out = (floats[:, 0:1], floats[:, 1], floats[:, 2], ints[:, 0], ints[:, 1], flags)
    if shared:
        if len(_ROW_PARAMS) >= ROW_PARAMS_KEPT:
            _ROW_PARAMS.clear()
        _ROW_PARAMS[key] = out
    return out
