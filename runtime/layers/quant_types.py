"""A weight kept in a block-quantized layout, as GGUF files (and loom's own quantizer) store it.

This is the one type the model loader hands to layers for a quantized weight: the GGUF reader
produces it from the file's bytes, `--quantization` produces it from float weights, and the
quantized linear / embedding layers consume it. The logical shape is torch's `(out, in)`; each
of the `out` rows is `in / block_size` blocks laid end to end, byte for byte as ggml lays them,
so a file's tensor is used without a copy into another layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# qtype -> (values per block, bytes per block): ggml's block layouts
BLOCKS: dict[str, tuple[int, int]] = {
    "Q8_0": (32, 34),  # f16 scale, 32 x int8
    "Q4_0": (32, 18),  # f16 scale, 32 x 4-bit (value - 8)
    "Q4_1": (32, 20),  # f16 scale, f16 min, 32 x 4-bit
    "Q4_K": (256, 144),  # f16 d, f16 dmin, 12 bytes of 6-bit sub-block scales/mins, 128 bytes of 4-bit
    "Q6_K": (256, 210),  # 128 bytes low 4 bits, 64 bytes high 2 bits, 16 x int8 scales, f16 d
    "Q5_0": (32, 22),  # f16 scale, 32 high bits, 32 x 4-bit low bits (value - 16)
    "Q5_1": (32, 24),  # f16 scale, f16 min, 32 high bits, 32 x 4-bit low bits
}


@dataclass(frozen=True)
class QuantizedTensor:
    qtype: str
    shape: tuple[int, int]  # (rows, cols) = (out_features, in_features)
    data: torch.Tensor  # uint8 [rows, cols // block_values * block_bytes], contiguous

    def __post_init__(self) -> None:
        if self.qtype not in BLOCKS:
            raise ValueError(f"quantization type {self.qtype!r} is not one of {sorted(BLOCKS)}")
        values, nbytes = BLOCKS[self.qtype]
        rows, cols = self.shape
        if cols % values:
            raise ValueError(f"{self.qtype}: {cols} columns are not whole blocks of {values}")
        want = (rows, cols // values * nbytes)
        if self.data.dtype != torch.uint8 or tuple(self.data.shape) != want:
            raise ValueError(
                f"{self.qtype} {self.shape}: data must be uint8 {want}, "
                f"got {self.data.dtype} {tuple(self.data.shape)}"
            )

    @property
    def row_bytes(self) -> int:
        return self.data.shape[1]
