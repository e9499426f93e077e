"""Rotary position embeddings (neox layout) with the rope scalings Hugging Face configs use."""

from __future__ import annotations

import contextlib
import contextvars
import math
import weakref
from typing import Any

import torch
from torch import nn

from loom.runtime import cpu_kernels


def rope_parameters(config: Any) -> tuple[float, dict[str, Any]]:
    """(theta, scaling dict) from either the transformers<5 or >=5 config spelling."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and params:
        theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        return float(theta), dict(params)
    scaling = getattr(config, "rope_scaling", None) or {}
    return float(getattr(config, "rope_theta", 10000.0)), dict(scaling)


def _yarn(inv_freq_base, dim, base, scaling, max_pos):
    factor = scaling["factor"]
    orig = scaling.get("original_max_position_embeddings") or max_pos

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention_factor = (
            mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
        )
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations):
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    inv_freq = (inv_freq_base / factor) * (1 - extrapolation) + inv_freq_base * extrapolation
    return inv_freq, float(attention_factor)


def _llama3(inv_freq, scaling):
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    orig = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = orig / low, orig / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (orig / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


# One cos / sin table per distinct rope and device, shared by every layer that has it (SmolLM2's
# 30 layers held 30 identical 4 MB pairs: 120 MB of its resident set). Weak, so the tables go
# with the last model holding them; shared tensors are never written in place (.to() on a
# module replaces its buffers, it does not mutate them).
_TABLES: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


# The most positions a table built now needs (None: the model's max_position): set while a
# ModelRunner builds its model (`served_positions`), which knows what its KV pool can hold.
_SERVED: contextvars.ContextVar[int | None] = contextvars.ContextVar("served", default=None)


@contextlib.contextmanager
def served_positions(n: int | None):
    """RotaryEmbeddings built inside hold tables of min(max_position, n) rows (n None: all);
    the frequencies still follow max_position (yarn reads it), so every row is the row the
    full table has, bit for bit (tests/test_cpu_fused_layers.py)."""
    token = _SERVED.set(n)
    try:
        yield
    finally:
        _SERVED.reset(token)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, base: float, scaling: dict | None = None):
        super().__init__()
        scaling = dict(scaling or {})
        served = _SERVED.get()
        rows = max_position if served is None else max(1, min(max_position, served))
        key = (head_dim, max_position, rows, base, repr(sorted(scaling.items())),
               str(torch.get_default_device()))  # fmt: skip
        cos, sin = _TABLES.get((*key, "cos")), _TABLES.get((*key, "sin"))
        if cos is None or sin is None:
            cos, sin = self._tables(head_dim, max_position, base, scaling, rows)
            _TABLES[(*key, "cos")], _TABLES[(*key, "sin")] = cos, sin
        self.register_buffer("cos_cache", cos, persistent=False)
        self.register_buffer("sin_cache", sin, persistent=False)

    @staticmethod
    def _tables(
        head_dim: int, max_position: int, base: float, scaling: dict, rows: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos / sin [rows, head_dim] (rows: max_position unless given) of the rope that
        max_position and scaling define."""
        rope_type = scaling.get("rope_type", scaling.get("type", "default")) or "default"
        inv_freq = 1.0 / (
            base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
        )
        attention_factor = 1.0
        if rope_type == "linear":
            inv_freq = inv_freq / scaling["factor"]
        elif rope_type == "llama3":
            inv_freq = _llama3(inv_freq, scaling)
        elif rope_type == "yarn":
            inv_freq, attention_factor = _yarn(inv_freq, head_dim, base, scaling, max_position)
        elif rope_type != "default":
            raise ValueError(f"rope_scaling: rope_type {rope_type!r} is not supported")
        positions = torch.arange(max_position if rows is None else rows, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos() * attention_factor, emb.sin() * attention_factor

    @staticmethod
    def _rotate_half(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q [T, H, D], k [T, Hkv, D] -> rotated (same shapes and dtype). On the CPU in
        float32 each is one fused C call (cpu_kernels.rope) instead of about eight eager ops."""
        if cpu_kernels.fusable(q) and cpu_kernels.fusable(k) and positions.is_contiguous():
            if len(positions) and int(positions.max()) >= len(self.cos_cache):
                raise IndexError(f"position {int(positions.max())} is past the rotary table")
            cos, sin = self.cos_cache, self.sin_cache
            return cpu_kernels.rope(q, positions, cos, sin), cpu_kernels.rope(
                k, positions, cos, sin
            )
        return self.reference(positions, q, k)

    def reference(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        cos = self.cos_cache[positions].unsqueeze(1).to(q.dtype)
        sin = self.sin_cache[positions].unsqueeze(1).to(q.dtype)
        q = q * cos + self._rotate_half(q) * sin
        k = k * cos + self._rotate_half(k) * sin
        return q, k


def get_rope(head_dim: int, max_position: int, config: Any) -> RotaryEmbedding:
    base, scaling = rope_parameters(config)
    return RotaryEmbedding(head_dim, max_position, base, scaling)
