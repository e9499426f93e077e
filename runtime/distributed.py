"""Tensor/expert-parallel state and the torch.distributed plumbing. Layers read the state;
model files never do.

Layout: `world_size` scheduler ranks (ServerArgs.world_size), one process each. With
tp_size > 1 every rank is a TP rank (attention heads, MLP columns/rows and the vocabulary
split), and the MoE experts are split over ep_size groups of tp_size // ep_size ranks (EP =
TP x DP with dp_size 1). With tp_size 1 and ep_size > 1, attention and dense weights are
replicated and only the experts are split; when each expert is whole on one rank the MoE
layers dispatch tokens with all-to-all, else they all-reduce (`moe_all_to_all`). With pp_size
> 1 each rank is one pipeline stage. Collectives run on the default group (gloo on CPU, NCCL
on CUDA); Python objects (each step's plan) go over a gloo group.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

# Ranks other than 0 block in a broadcast while the server is idle: no collective timeout
# may end that wait (a dead peer still ends it: gloo sees the connection close).
_IDLE_TIMEOUT = datetime.timedelta(days=3650)


@dataclass(frozen=True)
class ParallelState:
    tp_rank: int = 0
    tp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1
    rank: int = 0
    world_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    moe_all_to_all: bool = False  # EP dispatch (ServerArgs.moe_all_to_all), else all-reduce
    pp_max_micro_batch_size: int | None = None  # requests per pipeline micro-batch
    pp_layer_partition: tuple[int, ...] | None = None  # layers per stage; None: the default split


_state = ParallelState()
_cpu_group = None  # gloo group for object broadcasts (the default group on CPU)


def get_parallel_state() -> ParallelState:
    return _state


def set_parallel_state(state: ParallelState) -> None:
    global _state
    _state = state


def state_for_rank(args, rank: int) -> ParallelState:
    world = args.world_size
    if args.pp_size > 1:  # one rank per stage (tp_size and ep_size are 1)
        return ParallelState(
            rank=rank,
            world_size=world,
            pp_rank=rank,
            pp_size=args.pp_size,
            pp_max_micro_batch_size=args.pp_max_micro_batch_size,
            pp_layer_partition=args.pp_layer_counts,
        )
    tp = args.tp_size
    return ParallelState(
        tp_rank=rank if tp > 1 else 0,
        tp_size=tp,
        ep_rank=rank // (world // args.ep_size),
        ep_size=args.ep_size,
        rank=rank,
        world_size=world,
        moe_all_to_all=args.moe_all_to_all,
    )


def pp_layer_partition(num_layers: int, pp_size: int, explicit=None) -> tuple[int, ...]:
    """Layers per pipeline stage: `explicit` when given (validated to sum to num_layers),
    else SGLang's / vLLM's default (get_pp_indices): num_layers // pp_size each, and the
    remainder one each to the stages counting back from the one before the last (the last
    also holds the final norm and the LM head): 30 layers over 4 stages are 7, 8, 8, 7. A
    stage may hold no layers (3 layers over 4 stages: 1, 1, 1, 0)."""
    if explicit is not None:
        return tuple(explicit)
    counts = [num_layers // pp_size] * pp_size
    for i in range(2, num_layers % pp_size + 2):
        counts[-i] += 1
    return tuple(counts)


def pp_layer_range(num_layers: int, state: ParallelState | None = None) -> range:
    """The consecutive layer ids this rank's pipeline stage holds (all of them with pp 1)."""
    ps = state or _state
    counts = pp_layer_partition(num_layers, ps.pp_size, ps.pp_layer_partition)
    start = sum(counts[: ps.pp_rank])
    return range(start, start + counts[ps.pp_rank])


def free_local_addr() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def init_distributed(args, rank: int, addr: str, device: str) -> None:
    """Join the process group as `rank` and set this process's ParallelState."""
    import torch.distributed as dist

    global _cpu_group
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if backend == "gloo":
        # loopback unless told otherwise: gloo otherwise picks the hostname's interface
        iface = _iface_for(addr.rpartition(":")[0])
        if iface:
            os.environ.setdefault("GLOO_SOCKET_IFNAME", iface)
    dist.init_process_group(
        backend,
        init_method=f"tcp://{addr}",
        world_size=args.world_size,
        rank=rank,
        timeout=_IDLE_TIMEOUT,
    )
    _cpu_group = (
        dist.new_group(backend="gloo", timeout=_IDLE_TIMEOUT) if backend == "nccl" else None
    )
    set_parallel_state(state_for_rank(args, rank))


def _iface_for(host: str) -> str:
    """The network interface that holds `host`'s address ("lo" for loopback)."""
    if host in ("127.0.0.1", "localhost"):
        return "lo"
    try:
        import psutil

        ip = socket.gethostbyname(host)
        for name, addrs in psutil.net_if_addrs().items():
            if any(a.address == ip for a in addrs):
                return name
    except (ImportError, OSError):
        pass
    return ""


def broadcast_object(obj=None):
    """Rank 0 sends `obj`; every rank returns it."""
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=0, group=_cpu_group)
    return box[0]


def gather_objects(obj) -> list | None:
    """Every rank's `obj` on rank 0 (None elsewhere)."""
    ps = get_parallel_state()
    out = [None] * ps.world_size if ps.rank == 0 else None
    torch.distributed.gather_object(obj, out, dst=0, group=_cpu_group)
    return out


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


def check_layout(args, config) -> None:
    """Raise ValueError naming the flag when the model cannot be split as asked (before any
    rank starts); warn when TP spans nodes or ranks outnumber the CPU cores."""
    tp, ep = args.tp_size, args.ep_size

    def need(cond: bool, flag: str, what: str) -> None:
        if not cond:
            raise ValueError(f"{flag}: {what}")

    layers, counts = config.num_hidden_layers, args.pp_layer_counts
    need(
        counts is None or sum(counts) == layers,
        "pp_layer_partition",
        f"{args.pp_layer_partition} sums to {sum(counts or ())}, not num_hidden_layers ({layers})",
    )
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    need(heads % tp == 0, "tp_size", f"{tp} does not divide num_attention_heads ({heads})")
    need(
        kv % tp == 0 or tp % kv == 0,
        "tp_size",
        f"{tp} and num_key_value_heads ({kv}) must divide one another (KV heads are split, "
        "or replicated when there are fewer than ranks)",
    )
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    dense = ["shared_expert_intermediate_size"]
    if not experts or getattr(config, "moe_intermediate_size", None):
        dense.append("intermediate_size")  # Mixtral's intermediate_size is the experts'
    for name in dense:
        size = getattr(config, name, None)
        if size:
            need(size % tp == 0, "tp_size", f"{tp} does not divide {name} ({size})")
    if ep > 1:
        need(bool(experts), "ep_size", f"{ep} needs a mixture-of-experts model; this one has none")
    if experts:
        need(
            experts % ep == 0, "ep_size", f"{ep} does not divide the number of experts ({experts})"
        )
        inter = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
        moe_tp = max(1, tp // ep)
        need(
            inter % moe_tp == 0,
            "tp_size",
            f"tp_size // ep_size ({moe_tp}) does not divide the experts' intermediate size ({inter})",
        )
    if args.nnodes > 1 and tp > args.world_size // args.nnodes:
        logger.warning(
            "tp_size %d spans %d nodes: tensor parallelism all-reduces every layer and belongs "
            "inside a node (put pipeline or data parallelism across nodes)",
            tp,
            args.nnodes,
        )
    local = len(args.node_ranks)
    if args.resolved_device == "cpu" and local > (os.cpu_count() or 1):
        logger.warning("%d ranks on %d CPU cores: expect them to wait on one another",
                       local, os.cpu_count())  # fmt: skip
