"""A layer weight kept block-quantized: what a linear, embedding or LM head holds when its
weight_loader is handed a QuantizedTensor instead of a float tensor.

The weight stays a Parameter (so loading, tying and `named_parameters` work unchanged) and
carries a `quant` attribute, a `QuantWeight`. A tied LM head shares the embedding's Parameter
object and so the same QuantWeight. The float storage the layer was built with is never
written (its pages are never touched) and is released when the first segment arrives.

A fused weight (qkv, gate+up) arrives in row segments, one per checkpoint tensor and rank; the
segments may differ in type (a Q4_K_M file keeps some v projections in Q6_K and q/k in Q4_K),
so QuantWeight keeps a list of (row offset, QuantizedTensor), merging neighbours of one type.
"""

from __future__ import annotations

import torch
from torch import nn

from loom.runtime.layers import quant_ops
from loom.runtime.layers.quant_types import BLOCKS, QuantizedTensor


def narrow_rows(qt: QuantizedTensor, start: int, length: int) -> QuantizedTensor:
    """Rows start .. start + length: rows are whole blocks, so any row range is a view."""
    return QuantizedTensor(qt.qtype, (length, qt.shape[1]), qt.data.narrow(0, start, length))


def narrow_cols(qt: QuantizedTensor, start: int, length: int) -> QuantizedTensor:
    """Columns start .. start + length, which must fall on block boundaries (a row-parallel
    shard of a quantized weight)."""
    values, nbytes = BLOCKS[qt.qtype]
    if start % values or length % values:
        raise ValueError(
            f"{qt.qtype}: a shard of columns {start}..{start + length} does not fall on "
            f"blocks of {values}"
        )
    data = qt.data[:, start // values * nbytes : (start + length) // values * nbytes]
    return QuantizedTensor(qt.qtype, (qt.shape[0], length), data.contiguous())


class QuantWeight:
    """rows x cols of output rows held as QuantizedTensor segments at row offsets."""

    def __init__(self, rows: int, cols: int, dtype: torch.dtype):
        self.rows, self.cols, self.dtype = rows, cols, dtype
        self.parts: list[tuple[int, QuantizedTensor]] = []
        self._merged = False

    def put(self, offset: int, qt: QuantizedTensor) -> None:
        n, k = qt.shape
        if k != self.cols or offset < 0 or offset + n > self.rows:
            raise ValueError(
                f"quantized weight {qt.shape} at row {offset} does not fit ({self.rows}, {self.cols})"
            )
        self.parts.append((offset, qt))
        self._merged = False

    def _merge(self) -> None:
        """Sort the segments and join neighbours of one type into one (one kernel call)."""
        parts = sorted(self.parts, key=lambda p: p[0])
        out: list[tuple[int, QuantizedTensor]] = []
        for off, qt in parts:
            if out:
                poff, prev = out[-1]
                if poff + prev.shape[0] > off:
                    raise ValueError(f"quantized segments overlap at row {off}")
                if prev.qtype == qt.qtype and poff + prev.shape[0] == off:
                    data = torch.cat([prev.data, qt.data])
                    out[-1] = (poff, QuantizedTensor(qt.qtype, (data.shape[0], self.cols), data))
                    continue
            out.append((off, qt))
        self.parts = [(o, QuantizedTensor(q.qtype, q.shape, q.data.contiguous())) for o, q in out]
        self._merged = True

    @property
    def complete(self) -> bool:
        if not self._merged:
            self._merge()
        return sum(q.shape[0] for _, q in self.parts) == self.rows

    @property
    def nbytes(self) -> int:
        return sum(q.data.numel() for _, q in self.parts)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., cols] -> [..., rows] in x's dtype (rows no segment covers are 0)."""
        if not self._merged:
            self._merge()
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.cols)
        if len(self.parts) == 1 and self.parts[0][1].shape[0] == self.rows:
            out = quant_ops.matmul(self.parts[0][1], x2, bias)
        else:
            # segments that cover every row write all of out (Gemma 3's q/k Q5_0 + v Q8_0)
            alloc = torch.empty if self.complete else torch.zeros
            out = alloc(x2.shape[0], self.rows, dtype=torch.float32)
            for off, qt in self.parts:
                b = None if bias is None else bias[off : off + qt.shape[0]]
                quant_ops.matmul(qt, x2, b, out=out[:, off : off + qt.shape[0]])
        return out.to(x.dtype).reshape(*lead, self.rows)

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` dequantized, in the layer's dtype (rows no segment covers are 0)."""
        if not self._merged:
            self._merge()
        off, qt = self.parts[0]
        if len(self.parts) == 1 and off == 0 and qt.shape[0] == self.rows:
            return quant_ops.rows(qt, ids).to(self.dtype)
        out = torch.zeros(*ids.shape, self.cols, dtype=torch.float32)
        for off, qt in self.parts:
            hit = (ids >= off) & (ids < off + qt.shape[0])
            if hit.any():
                out[hit] = quant_ops.rows(qt, ids[hit] - off)
        return out.to(self.dtype)

    def dequantize(self) -> torch.Tensor:
        """The float32 [rows, cols] matrix (for tests and paths without a quantized kernel)."""
        from loom.kernels.quant_ref import dequantize_ref

        if not self._merged:
            self._merge()
        out = torch.zeros(self.rows, self.cols, dtype=torch.float32)
        for off, qt in self.parts:
            out[off : off + qt.shape[0]] = dequantize_ref(qt.qtype, qt.data, qt.shape)
        return out


def quant_of(param: nn.Parameter | None) -> QuantWeight | None:
    """The QuantWeight a parameter holds, its float storage released (None: a float weight)."""
    qw = getattr(param, "quant", None)
    if qw is not None and param.data.numel():
        param.data = torch.empty(0, dtype=param.dtype, device=param.device)
    return qw


def put_rows(param: nn.Parameter, offset: int, qt: QuantizedTensor) -> None:
    """Place a quantized segment at output row `offset` of `param` (whose shape, before its
    first segment, is the logical (rows, cols) of the layer's weight). The first segment
    releases the float storage the layer was built with, while the model loads: released at
    the first use instead (after every weight was loaded above them), the heap's
    below-threshold storages (SmolLM2: ~200 MB of qkv / o / down, never touched) became free
    holes that later steps' buffers landed in and kept resident (docs/benchmarks.md, "Issue
    32: the model's own memory"); freed while loading, the quantized blocks fill them."""
    qw = getattr(param, "quant", None)
    if qw is None:
        if param.dim() != 2:
            raise ValueError(
                f"a quantized tensor {qt.shape} cannot load into a {param.dim()}-D parameter"
            )
        qw = QuantWeight(param.shape[0], param.shape[1], param.dtype)
        param.quant = qw
        quant_of(param)  # the float storage, never written, goes now
    qw.put(offset, qt)
