"""Tensor/expert-parallel state. Layers read it; model files never do."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ParallelState:
    tp_rank: int = 0
    tp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1


_state = ParallelState()


def get_parallel_state() -> ParallelState:
    return _state


def set_parallel_state(state: ParallelState) -> None:
    global _state
    _state = state


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    if _state.tp_size == 1:
        return x
    torch.distributed.all_reduce(x)
    return x


def tp_all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    if _state.tp_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_state.tp_size)]
    torch.distributed.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)
