"""Mixture-of-experts: top-k routing and the experts stored as stacked tensors.

`FusedMoE` holds this rank's experts as two stacked weights, w13 [E_local, 2*I, H] (gate rows,
then up rows) and w2 [E_local, H, I]. Experts are split across the `ep_size` expert-parallel
ranks; when tp_size > ep_size, each expert's intermediate dimension is split across the
remaining tp_size // ep_size ranks as in a column/row-parallel MLP.

Every rank enters the block with the same tokens (attention is replicated or all-reduced).
Two ways to combine the experts' outputs (--moe-a2a-backend):
- all-reduce (the default, and the only way when an expert is split over ranks): every rank
  routes every token, computes its experts' (or expert slices') share, one all-reduce sums it.
- all-to-all (ParallelState.moe_all_to_all, when each expert is whole on one rank): each rank
  routes a 1/ep slice of the tokens, sends every (token, expert) pair to the expert's owner
  (`all_to_all_single`), the owner runs it, the results come back the same way and are
  weighted and summed at the token's rank; an all-gather restores every token on every rank.
While every rank holds every token (dp_size 1) both compute each pair once, on its owner;
all-to-all moves more and pays only once ranks hold different tokens (docs/architecture.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from loom.runtime.distributed import get_parallel_state
from loom.runtime.layers.linear import ReplicatedLinear


def select_experts(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (float32 weights [T, k], expert ids [T, k]), as HF routes."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def fused_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    first_expert: int = 0,
) -> torch.Tensor:
    """Plain-torch grouped MoE: sort the (token, slot) pairs by expert, one matmul per expert.

    Experts outside [first_expert, first_expert + E_local) contribute nothing (another rank
    owns them). Products are weighted in the routing weights' dtype, then summed in x's dtype,
    in ascending expert order (the HF reference's order), so float results match HF bitwise.
    Reading the per-expert counts syncs with the device once per call; a grouped-GEMM kernel
    that takes the counts on the device replaces this function on GPUs (and under graphs).
    """
    num_local, top_k = w13.shape[0], topk_ids.shape[1]
    local_ids = topk_ids.flatten() - first_expert
    local_ids = torch.where((local_ids >= 0) & (local_ids < num_local), local_ids, num_local)
    order = torch.argsort(local_ids, stable=True)
    counts = torch.bincount(local_ids, minlength=num_local + 1)[:num_local].tolist()
    token_of = order // top_k
    sorted_x = x.index_select(0, token_of)
    sorted_weights = topk_weights.flatten().index_select(0, order)
    out = torch.zeros_like(x)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        rows = slice(start, start + n)
        gate, up = F.linear(sorted_x[rows], w13[e]).chunk(2, dim=-1)
        h = F.linear(F.silu(gate) * up, w2[e])
        h = h * sorted_weights[rows, None].to(torch.promote_types(h.dtype, topk_weights.dtype))
        out.index_add_(0, token_of[rows], h.to(out.dtype))
        start += n
    return out


def expert_rows(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, local_ids: torch.Tensor):
    """Row i of x through local expert local_ids[i] (unweighted): the all-to-all owner's side."""
    order = torch.argsort(local_ids, stable=True)
    counts = torch.bincount(local_ids, minlength=w13.shape[0]).tolist()
    out = torch.empty_like(x)
    start = 0
    for e, n in enumerate(counts):
        if n:
            rows = order[start : start + n]
            gate, up = F.linear(x.index_select(0, rows), w13[e]).chunk(2, dim=-1)
            out[rows] = F.linear(F.silu(gate) * up, w2[e])
            start += n
    return out


class FusedMoE(nn.Module):
    """The experts of one sparse MLP block; the router lives in the block (HF's `gate`).

    `fp32_routing_weights`: keep the routing weights in float32 when weighting each expert's
    output (Mixtral's reference does); otherwise they are cast to the activations' dtype first
    (Qwen MoE's reference does).
    """

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        renormalize: bool,
        fp32_routing_weights: bool = False,
    ):
        super().__init__()
        ps = get_parallel_state()
        if num_experts % ps.ep_size:
            raise ValueError(
                f"num_experts ({num_experts}) is not divisible by ep_size ({ps.ep_size})"
            )
        self.moe_tp_size = max(1, ps.tp_size // ps.ep_size)
        self.moe_tp_rank = ps.tp_rank % self.moe_tp_size
        if intermediate_size % self.moe_tp_size:
            raise ValueError(
                f"moe intermediate size ({intermediate_size}) is not divisible by "
                f"tp_size // ep_size ({self.moe_tp_size})"
            )
        self.reduce = ps.tp_size > 1 or ps.ep_size > 1
        self.all_to_all = ps.moe_all_to_all and ps.ep_size > 1 and self.moe_tp_size == 1
        self.ep_size, self.ep_rank = ps.ep_size, ps.ep_rank
        self.num_experts, self.top_k = num_experts, top_k
        self.num_local = num_experts // ps.ep_size
        self.first_expert = ps.ep_rank * self.num_local
        self.intermediate = intermediate_size // self.moe_tp_size
        self.renormalize, self.fp32_routing_weights = renormalize, fp32_routing_weights
        self.w13_weight = nn.Parameter(
            torch.empty(self.num_local, 2 * self.intermediate, hidden_size), requires_grad=False
        )
        self.w2_weight = nn.Parameter(
            torch.empty(self.num_local, hidden_size, self.intermediate), requires_grad=False
        )
        self.w13_weight.weight_loader = self.weight_loader
        self.w2_weight.weight_loader = self.weight_loader
        # tokens routed to each (global) expert since start: the input to expert load
        # balancing. A rank counts only its own experts' tokens (the first of an expert's TP
        # slices), so the counts of all ranks sum to the whole picture.
        self.register_buffer(
            "token_counts", torch.zeros(num_experts, dtype=torch.int64), persistent=False
        )
        mask = torch.zeros(num_experts, dtype=torch.int64)
        if self.moe_tp_rank == 0:
            mask[self.first_expert : self.first_expert + self.num_local] = 1
        self.register_buffer("count_mask", mask, persistent=False)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id) -> None:
        """shard_id = (expert, "w1" | "w3" | "w2") for one HF expert's gate/up/down matrix, or
        (None, "w13" | "w2") for the transformers-v5 stacked `gate_up_proj` / `down_proj`."""
        expert, which = shard_id
        if expert is None:
            loaded = loaded.narrow(0, self.first_expert, self.num_local)
            if which == "w13":
                gate, up = loaded.chunk(2, dim=1)
                for local in range(self.num_local):
                    self._load_one(param, local, gate[local], "w1")
                    self._load_one(param, local, up[local], "w3")
            else:
                for local in range(self.num_local):
                    self._load_one(param, local, loaded[local], "w2")
            return
        local = expert - self.first_expert
        if 0 <= local < self.num_local:
            self._load_one(param, local, loaded, which)

    def _load_one(self, param: nn.Parameter, local: int, loaded: torch.Tensor, which: str):
        size, rank = self.intermediate, self.moe_tp_rank
        if which == "w2":  # [H, I]: this rank's input columns
            param.data[local].copy_(loaded.narrow(1, rank * size, size))
            return
        offset = {"w1": 0, "w3": size}[which]  # [I, H]: this rank's output rows
        param.data[local].narrow(0, offset, size).copy_(loaded.narrow(0, rank * size, size))

    def _route(self, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weights, ids = select_experts(router_logits, self.top_k, self.renormalize)
        if not self.fp32_routing_weights:
            weights = weights.to(router_logits.dtype)
        return weights, ids

    def _count(self, ids: torch.Tensor) -> None:
        self.token_counts += torch.bincount(ids, minlength=self.num_experts) * self.count_mask

    def forward(self, hidden: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        if self.all_to_all:
            return self._forward_all_to_all(hidden, router_logits)
        weights, ids = self._route(router_logits)
        self._count(ids.flatten())
        out = fused_experts(
            hidden, self.w13_weight, self.w2_weight, weights, ids, self.first_expert
        )
        if self.reduce:
            torch.distributed.all_reduce(out)
        return out

    def _forward_all_to_all(self, hidden: torch.Tensor, router_logits: torch.Tensor):
        """Dispatch this rank's slice of the tokens to the experts' ranks, combine, gather."""
        dist = torch.distributed
        tokens, per = hidden.shape[0], -(-hidden.shape[0] // self.ep_size)
        start, end = min(self.ep_rank * per, tokens), min((self.ep_rank + 1) * per, tokens)
        x = hidden[start:end]
        weights, ids = self._route(router_logits[start:end])
        # (token, slot) pairs in ascending expert order: grouped by owner rank, and each
        # token's outputs are summed in the reference's (ascending expert) order
        order = torch.argsort(ids.flatten(), stable=True)
        pair_ids = ids.flatten()[order]
        send = torch.bincount(pair_ids // self.num_local, minlength=self.ep_size)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send)
        send_n, recv_n = send.tolist(), recv.tolist()
        token_of = order // self.top_k
        recv_x = x.new_empty(sum(recv_n), x.shape[1])
        dist.all_to_all_single(recv_x, x.index_select(0, token_of), recv_n, send_n)
        recv_ids = pair_ids.new_empty(sum(recv_n))
        dist.all_to_all_single(recv_ids, pair_ids, recv_n, send_n)
        self._count(recv_ids)
        h = expert_rows(recv_x, self.w13_weight, self.w2_weight, recv_ids - self.first_expert)
        back = x.new_empty(len(pair_ids), x.shape[1])
        dist.all_to_all_single(back, h, send_n, recv_n)
        w = weights.flatten()[order]
        back = back * w[:, None].to(torch.promote_types(back.dtype, w.dtype))
        mine = hidden.new_zeros(per, hidden.shape[1])
        mine.index_add_(0, token_of, back.to(hidden.dtype))
        parts = [torch.empty_like(mine) for _ in range(self.ep_size)]
        dist.all_gather(parts, mine)
        return torch.cat(parts)[:tokens]


class SparseMoeBlock(nn.Module):
    """Router (`gate`, replicated) + experts, named as in the HF Qwen MoE / Mixtral blocks."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        intermediate_size: int,
        renormalize: bool,
        fp32_routing_weights: bool = False,
    ):
        super().__init__()
        self.gate = ReplicatedLinear(hidden_size, num_experts, bias=False)
        self.experts = FusedMoE(
            num_experts, top_k, hidden_size, intermediate_size, renormalize, fp32_routing_weights
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.experts(hidden, self.gate(hidden))


def expert_token_counts(model: nn.Module) -> dict[str, list[int]]:
    """{layer index: tokens routed to each expert} for every MoE layer of `model`."""
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, FusedMoE):
            layer = next((p for p in name.split(".") if p.isdigit()), name)
            out[layer] = module.token_counts.tolist()
    return out


def map_expert_weight(name: str) -> tuple[str, object] | None:
    """HF expert tensor name -> (FusedMoE parameter name, shard id); None if not an expert's.

    `...experts.3.gate_proj.weight` / `...experts.3.w1.weight` (one expert) and the
    transformers-v5 stacked `...experts.gate_up_proj` / `...experts.down_proj`.
    """
    head, sep, tail = name.partition(".experts.")
    if not sep:
        return None
    parts = tail.split(".")
    if parts[0].isdigit():
        which = _EXPERT_PARTS.get(parts[1])
        if which is None:
            return None
        param = "w2_weight" if which == "w2" else "w13_weight"
        return f"{head}.experts.{param}", (int(parts[0]), which)
    if tail == "gate_up_proj":
        return f"{head}.experts.w13_weight", (None, "w13")
    if tail == "down_proj":
        return f"{head}.experts.w2_weight", (None, "w2")
    return None


_EXPERT_PARTS = {
    "gate_proj": "w1",
    "up_proj": "w3",
    "down_proj": "w2",
    "w1": "w1",
    "w3": "w3",
    "w2": "w2",
}
