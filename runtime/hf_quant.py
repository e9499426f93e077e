"""Hugging Face weight-only quantized checkpoints (GPTQ and AWQ `quantization_config`) read into
the ggml block types loom's quantized layers keep (runtime/layers/quant_linear.py).

A quantized linear `p` is stored as p.qweight (int32-packed codes), p.qzeros (int32-packed zero
points), p.scales (f16, one per group of `group_size` input columns and output row) and, for
GPTQ, p.g_idx; the weight is w[n, k] = scales[g, n] * (q[n, k] - zero[g, n]), g = k // group.
  GPTQ  qweight [K / (32 / bits), N]: code k of column n in word k // (32 / bits) at bit
        bits * (k % (32 / bits)); qzeros [K / group, N / (32 / bits)] packed along N the same
        way, stored minus one ("gptq" v1 format; "gptq_v2" stores the zero itself).
  AWQ   qweight [K, N / 8], qzeros [K / group, N / 8]: 4-bit, packed along N in the order
        0, 2, 4, 6, 1, 3, 5, 7 (nibble i of a word holds column _AWQ_ORDER[i] of its eight).
Mapped per block of 32 (the group size must be a multiple of 32), no requantization:
  8-bit, every zero 128         -> Q8_0, d = scale, code - 128: exact;
  4-bit, every zero 8 (sym)     -> Q4_0, d = scale, the codes: exact;
  4-bit with zero points (AWQ)  -> Q4_1, d = scale, m = -scale * zero rounded to f16 (the one
                                   inexact step: at most half an f16 ulp of m).
An activation-order GPTQ checkpoint (g_idx not k // group) and 8-bit zero points other than
128 are refused with the field named.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from loom.runtime.layers.quant_types import QuantizedTensor

_PARTS = ("qweight", "qzeros", "scales", "g_idx")
_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def quant_method(config) -> dict | None:
    """The checkpoint's quantization_config when it is GPTQ or AWQ, else None."""
    qc = getattr(config, "quantization_config", None)
    if qc is None:
        return None
    qc = qc if isinstance(qc, dict) else qc.to_dict()
    method = str(qc.get("quant_method", "")).lower()
    if method in ("gptq", "awq"):
        return qc
    raise ValueError(
        f"quantization_config: quant_method {method!r} is not supported (gptq, awq)"
    )


def _unpack_rows(words: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [R, C] -> int64 codes [R * (32 / bits), C], packed along rows (GPTQ qweight)."""
    per = 32 // bits
    shifts = torch.arange(per, dtype=torch.int64) * bits
    codes = (words.to(torch.int64).unsqueeze(1) >> shifts.view(1, per, 1)) & ((1 << bits) - 1)
    return codes.reshape(-1, words.shape[1])


def _unpack_cols(words: torch.Tensor, bits: int, order: tuple[int, ...] | None) -> torch.Tensor:
    """int32 [R, C] -> int64 codes [R, C * (32 / bits)], packed along columns."""
    per = 32 // bits
    shifts = torch.arange(per, dtype=torch.int64) * bits
    codes = (words.to(torch.int64).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [R, C, per]
    if order is not None:  # nibble i holds column order[i]
        codes = codes[..., torch.argsort(torch.tensor(order))]
    return codes.reshape(words.shape[0], -1)


def unpack(parts: dict[str, torch.Tensor], qc: dict) -> tuple[torch.Tensor, ...]:
    """(codes int64 [N, K], zeros int64 [N, K / group], scales float32 [N, K / group])."""
    method, bits = qc["quant_method"].lower(), int(qc.get("bits", qc.get("w_bit", 4)))
    group = int(qc.get("group_size", qc.get("q_group_size", 128)))
    if method == "awq":
        if bits != 4:
            raise ValueError(f"quantization_config: AWQ bits {bits} (4 only)")
        codes = _unpack_cols(parts["qweight"], 4, _AWQ_ORDER).T
        zeros = _unpack_cols(parts["qzeros"], 4, _AWQ_ORDER).T
    else:
        if bits not in (4, 8):
            raise ValueError(f"quantization_config: GPTQ bits {bits} (4 or 8)")
        codes = _unpack_rows(parts["qweight"], bits).T
        zeros = _unpack_cols(parts["qzeros"], bits, None).T
        if qc.get("checkpoint_format", "gptq") != "gptq_v2":
            zeros = zeros + 1
        k = codes.shape[1]
        g_idx = parts.get("g_idx")
        if g_idx is not None and not torch.equal(g_idx.long(), torch.arange(k) // group):
            raise ValueError(
                "quantization_config: desc_act (g_idx not k // group_size) is not supported"
            )
    scales = parts["scales"].float().T.contiguous()
    n, k = codes.shape
    if group == -1:
        group = k
    if group % 32 or k % group or scales.shape != (n, k // group):
        raise ValueError(
            f"quantization_config: group_size {group} must be a multiple of 32 dividing {k}"
        )
    return codes.contiguous(), zeros[:n].contiguous(), scales, bits, group


def to_blocks(codes, zeros, scales, bits: int, group: int) -> QuantizedTensor:
    """The weight as ggml blocks of 32 (see the module docstring for which type)."""
    n, k = codes.shape
    rep = group // 32
    d = scales.repeat_interleave(rep, dim=1).reshape(-1).to(torch.float16)  # per block of 32
    z = zeros.repeat_interleave(rep, dim=1).reshape(-1)
    c = codes.reshape(-1, 32)
    f16 = lambda t: t.to(torch.float16).view(torch.uint8).view(-1, 2)  # noqa: E731
    if bits == 8:
        if not bool((z == 128).all()):
            raise ValueError("quantization_config: 8-bit zero points other than 128")
        q = (c - 128).to(torch.int8).view(torch.uint8)
        data = torch.cat([f16(d), q], 1)
        qtype = "Q8_0"
    else:
        nib = (c[:, :16] | (c[:, 16:] << 4)).to(torch.uint8)
        if bool((z == 8).all()):
            data, qtype = torch.cat([f16(d), nib], 1), "Q4_0"
        else:
            m = -(d.float() * z.float())
            data, qtype = torch.cat([f16(d), f16(m), nib], 1), "Q4_1"
    return QuantizedTensor(qtype, (n, k), data.reshape(n, -1).contiguous())


def dequantize(codes, zeros, scales, group: int) -> torch.Tensor:
    """float32 [N, K]: the checkpoint's own formula (the reference the blocks are held to)."""
    z = zeros.repeat_interleave(group, dim=1).float()
    s = scales.to(torch.float16).float().repeat_interleave(group, dim=1)
    return s * (codes.float() - z)


def hf_quantized_weights(
    weights: Iterable[tuple[str, torch.Tensor]], qc: dict
) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
    """The checkpoint's tensors with every packed linear (prefix.qweight / qzeros / scales /
    g_idx) replaced by one `prefix.weight` QuantizedTensor; other tensors pass through."""
    packed: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in weights:
        prefix, _, leaf = name.rpartition(".")
        if leaf in _PARTS:
            packed.setdefault(prefix, {})[leaf] = t
        else:
            yield name, t
    for prefix, parts in packed.items():
        missing = {"qweight", "qzeros", "scales"} - set(parts)
        if missing:
            raise ValueError(f"model_path: {prefix} lacks {sorted(missing)}")
        codes, zeros, scales, bits, group = unpack(parts, qc)
        yield f"{prefix}.weight", to_blocks(codes, zeros, scales, bits, group)
