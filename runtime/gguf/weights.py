"""A GGUF file's tensors under loom's (HF) names: dequantized to float32, or kept quantized.

`keep_quantized=True` yields a `QuantizedTensor` (the file's block rows, unchanged but for the
q/k row order) for every tensor in one of its block types, for the quantized layers to take;
the default dequantizes every tensor with the `gguf` package's own dequantizer, the reference
the quantized kernels are measured against.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from loom.runtime.gguf.file import metadata, open_reader
from loom.runtime.gguf.names import fix_float, fix_values, hf_name
from loom.runtime.layers.quant_types import BLOCKS, QuantizedTensor

_FLOAT_TYPES = ("F32", "F16", "BF16")


def iterate_gguf_weights(
    path: str, keep_quantized: bool = False
) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
    from gguf.quants import dequantize

    meta = metadata(path)
    arch = meta["general.architecture"]
    heads = meta[f"{arch}.attention.head_count"]
    kv_heads = meta.get(f"{arch}.attention.head_count_kv", heads)
    reader = open_reader(path)
    for tensor in reader.tensors:
        name = hf_name(arch, tensor.name)
        qtype = tensor.tensor_type.name
        shape = tuple(int(n) for n in reversed(tensor.shape))  # ggml lists the fastest dim first
        if keep_quantized and qtype in BLOCKS:
            # read(2) into the tensor's own memory, past the map: the file's pages never join
            # this process's resident set beside the copy (reader.read_into)
            raw = np.empty(tensor.data.shape, dtype=np.uint8)
            reader.read_into(tensor, raw)
            rows = fix_values(arch, name, raw, heads, kv_heads)  # q/k: a permuted copy
            data = torch.from_numpy(np.ascontiguousarray(rows))
            del raw, rows
            yield name, QuantizedTensor(qtype, (shape[0], shape[-1]), data)
            continue
        rows = fix_values(arch, name, np.asarray(tensor.data), heads, kv_heads)
        if qtype in _FLOAT_TYPES and qtype != "BF16":
            values = rows.astype(np.float32)
        else:
            values = dequantize(rows, tensor.tensor_type)
        values = fix_float(arch, name, values.reshape(shape))
        reader.drop_pages(tensor)
        yield name, torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))
    # whatever else of the map was read (the header, the tokenizer's vocabulary, page ends
    # drop_pages kept for a neighbour) leaves the resident set: SmolLM2 held 8-9 MB of it
    reader.drop_all()
