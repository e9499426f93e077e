"""Linear layers that shard themselves across tensor-parallel ranks.

Each parameter carries a `weight_loader(param, loaded, shard_id=None)` that takes the full
Hugging Face tensor and copies this rank's slice into place.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from loom.runtime.distributed import get_parallel_state, tp_all_reduce
from loom.runtime.layers.quant_linear import narrow_cols, narrow_rows, put_rows, quant_of
from loom.runtime.layers.quant_types import QuantizedTensor


def _divide(a: int, b: int, what: str) -> int:
    if a % b:
        raise ValueError(f"{what} ({a}) is not divisible by tp_size ({b})")
    return a // b


class LinearBase(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        assert tuple(param.shape) == tuple(loaded.shape), (
            f"shape {tuple(loaded.shape)} != {tuple(param.shape)}"
        )
        if isinstance(loaded, QuantizedTensor):
            put_rows(param, 0, loaded)
        else:
            param.data.copy_(loaded)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W.T + b, through the quantized kernels when the weight was loaded quantized."""
        qw = quant_of(self.weight)
        if qw is not None:
            return qw.matmul(x, self.bias)
        return F.linear(x, self.weight, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x)


class ReplicatedLinear(LinearBase):
    pass


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; the output stays sharded."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        ps = get_parallel_state()
        self.tp_rank, self.tp_size = ps.tp_rank, ps.tp_size
        super().__init__(in_features, _divide(out_features, self.tp_size, "output size"), bias)

    def weight_loader(self, param, loaded, shard_id=None):
        size = param.shape[0]
        if isinstance(loaded, QuantizedTensor):
            put_rows(param, 0, narrow_rows(loaded, self.tp_rank * size, size))
            return
        param.data.copy_(loaded.narrow(0, self.tp_rank * size, size))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs stored as one matrix (gate_proj + up_proj)."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False):
        self.output_sizes = output_sizes
        super().__init__(in_features, sum(output_sizes), bias)

    def weight_loader(self, param, loaded, shard_id=None):
        assert isinstance(shard_id, int), "merged linear needs the shard index"
        size = self.output_sizes[shard_id] // self.tp_size
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        if isinstance(loaded, QuantizedTensor):
            put_rows(param, offset, narrow_rows(loaded, self.tp_rank * size, size))
            return
        src = loaded.narrow(0, self.tp_rank * size, size)
        param.data.narrow(0, offset, size).copy_(src)


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections as one matrix; kv heads are replicated when tp_size > kv heads."""

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool):
        tp = get_parallel_state().tp_size
        self.head_dim = head_dim
        self.num_heads = _divide(num_heads, tp, "attention heads")
        self.num_kv_heads = max(1, num_kv_heads // tp)
        self.kv_replicas = max(1, tp // num_kv_heads)
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp
        super().__init__(hidden, out, bias)

    def weight_loader(self, param, loaded, shard_id=None):
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        if shard_id == "q":
            offset, size, rank = 0, q_size, self.tp_rank
        elif shard_id in ("k", "v"):
            offset = q_size + (kv_size if shard_id == "v" else 0)
            size, rank = kv_size, self.tp_rank // self.kv_replicas
        else:
            raise ValueError(f"unknown qkv shard {shard_id!r}")
        if isinstance(loaded, QuantizedTensor):
            put_rows(param, offset, narrow_rows(loaded, rank * size, size))
            return
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, rank * size, size))


class RowParallelLinear(LinearBase):
    """Input features split across ranks; outputs are summed with an all-reduce."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        ps = get_parallel_state()
        self.tp_rank, self.tp_size = ps.tp_rank, ps.tp_size
        super().__init__(_divide(in_features, self.tp_size, "input size"), out_features, bias)

    def weight_loader(self, param, loaded, shard_id=None):
        if param.dim() == 1:  # bias: added once, on rank 0
            param.data.copy_(loaded if self.tp_rank == 0 else torch.zeros_like(loaded))
            return
        size = param.shape[1]
        if isinstance(loaded, QuantizedTensor):
            put_rows(param, 0, narrow_cols(loaded, self.tp_rank * size, size))
            return
        param.data.copy_(loaded.narrow(1, self.tp_rank * size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return tp_all_reduce(self.matmul(x))
