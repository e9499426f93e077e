"""Running one model over several ranks: rank 0 schedules, every rank runs the forward.

Why rank 0 schedules and broadcasts each step's plan, rather than every rank running its own
copy of the scheduler on broadcast messages: the scheduler decides things from time (grammar
compiles finishing in worker processes, compile timeouts, the watchdog) and from per-process
state (the grammar engines, drafters), and any disagreement between ranks is a deadlock in the
next collective. With one scheduler there is nothing to agree on: the plan (`ModelInput`,
sampling parameters and grammar masks included) and the KV slot table rows that changed are
broadcast over gloo, every rank runs `ModelRunner.forward` on it (its share of heads, columns,
experts and KV), and the logits every rank ends with are the same all-gathered ones. Rank 0's
sampled tokens are the ones used; the other ranks sample the same rows and drop the result
(nothing reads it), which keeps the runner one code path. Only rank 0 owns ZMQ sockets and
sends outputs.
"""

from __future__ import annotations

import logging
import os
import traceback
from dataclasses import dataclass

import torch

from loom.runtime.distributed import broadcast_object, gather_objects, init_distributed

logger = logging.getLogger(__name__)


@dataclass
class Step:
    inp: object  # ModelInput, or None: report this rank's expert counts instead
    rows: list[tuple[int, int, torch.Tensor]]  # (req row, first column, new slot indices)


class BroadcastRunner:
    """Rank 0's ModelRunner: every forward first sends the step to the other ranks.

    The other ranks' req_to_token tables are kept equal to rank 0's over the rows a step
    reads: `_sent` mirrors what they hold, and a step carries each of its rows from the first
    column that differs (a whole new row at admission, one slot per decode step)."""

    def __init__(self, runner):
        self.runner = runner
        self._sent = torch.zeros_like(runner.req_to_token_pool.req_to_token)

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def forward(self, inp):
        broadcast_object(Step(inp, self._changed_rows(inp)))
        return self.runner.forward(inp)

    def expert_token_counts(self) -> dict[str, list[int]]:
        """Every rank's MoE layers' counts, summed: a rank counts its own experts' tokens only
        (pipeline stages each hold their own layers)."""
        from loom.runtime.layers.moe import expert_token_counts

        broadcast_object(Step(None, []))
        merged: dict[str, list[int]] = {}
        for counts in gather_objects(expert_token_counts(self.runner.model)):
            for layer, per_expert in counts.items():
                old = merged.get(layer, [0] * len(per_expert))
                merged[layer] = [a + b for a, b in zip(old, per_expert)]
        return dict(sorted(merged.items(), key=lambda kv: int(kv[0])))

    def _changed_rows(self, inp) -> list:
        """One comparison over the step's rows (one device sync): the first column where each
        row differs from what the other ranks hold, and the slots from there on."""
        table = self.runner.req_to_token_pool.req_to_token
        seqs = inp.seq_lens
        idx = torch.as_tensor(inp.req_pool_indices).to(table.device)
        width = max(seqs)
        now, sent = table[idx, :width], self._sent[idx, :width]
        valid = torch.arange(width, device=table.device)[None, :] < torch.tensor(
            seqs, device=table.device
        ).unsqueeze(1)
        differ = (now != sent) & valid
        first = torch.where(differ.any(1), differ.int().argmax(1), -1).tolist()
        rows = []
        for i, (row, seq, col) in enumerate(zip(inp.req_pool_indices.tolist(), seqs, first)):
            if col >= 0:
                rows.append((row, col, now[i, col:seq].cpu().clone()))
                self._sent[row, col:seq] = now[i, col:seq]
        return rows


def apply_rows(runner, rows: list) -> None:
    table = runner.req_to_token_pool.req_to_token
    for row, first, slots in rows:
        table[row, first : first + len(slots)] = slots.to(table.device)


def rank_info(runner, rank: int, extra: dict | None = None) -> dict:
    """What one rank holds: its weight bytes and KV capacity; where it runs (its process id,
    and `extra`: the Ray node and actor of a Ray-placed rank)."""
    seen, weight_bytes = set(), 0
    for p in runner.model.parameters():
        if id(p) not in seen:  # tied embeddings count once
            seen.add(id(p))
            weight_bytes += p.numel() * p.element_size()
    pool = runner.token_to_kv_pool
    kv_bytes = sum(b.numel() * b.element_size() for b in pool.k_buffers + pool.v_buffers)
    return {
        "rank": rank,
        "weight_bytes": weight_bytes,
        "kv_cache_bytes": kv_bytes,
        "max_total_tokens": runner.max_total_tokens,
        "pid": os.getpid(),
        **(extra or {}),
    }


def setup_rank(args, rank: int, addr: str, extra: dict | None = None):
    """Join the group, load this rank's shard; returns (runner, every rank's info on rank 0).
    Raises when the ranks' KV pools disagree (rank 0 allocates slots for all of them).
    `extra` (a Ray-placed rank's node and actor ids) goes into this rank's info."""
    from loom.runtime.model_runner import ModelRunner

    device = args.resolved_device
    if device.startswith("cuda"):
        # Ray shows an actor only the GPU it was given (CUDA_VISIBLE_DEVICES): device 0
        ray_placed = bool(extra and "ray_actor_id" in extra)
        torch.cuda.set_device(0 if ray_placed else list(args.node_ranks).index(rank))
    if device == "cpu" and args.cpu_threads is None:
        torch.set_num_threads(max(1, args.effective_cpu_threads // len(args.node_ranks)))
    init_distributed(args, rank, addr, device)
    runner = ModelRunner(args)
    infos = gather_objects(rank_info(runner, rank, extra))
    if rank == 0:
        sizes = {i["max_total_tokens"] for i in infos}
        if len(sizes) > 1:
            raise ValueError(
                f"max_total_tokens: the ranks' KV pools differ ({sorted(sizes)}); set it"
            )
    return runner, infos


def run_worker_process(args, rank: int, addr: str, owner_pid, ready_pipe) -> None:
    """A rank > 0: load its shard, then run every step rank 0 broadcasts until told to stop."""
    from loom.runtime.process import configure_child_process, freeze_startup_heap

    configure_child_process(args, f"scheduler-rank{rank}", owner_pid)
    try:
        runner, _ = setup_rank(args, rank, addr)
    except Exception as e:  # noqa: BLE001 - reported to the parent, which raises it
        ready_pipe.send({"error": f"rank {rank} failed to start: {e}"})
        logger.error(traceback.format_exc())
        raise SystemExit(1) from e
    freeze_startup_heap()
    ready_pipe.send({"ok": True})
    try:
        serve_steps(runner)
    except Exception:  # noqa: BLE001 - a lost peer: this rank cannot go on
        logger.error("rank %d stopped: %s", rank, traceback.format_exc())
        raise SystemExit(1) from None


def serve_steps(runner) -> None:
    """A rank > 0's loop (a process of the mp launch or a Ray actor): run every step rank 0
    broadcasts until it sends None; raises when a peer is lost."""
    with torch.inference_mode():
        while (step := broadcast_object()) is not None:
            if step.inp is None:
                from loom.runtime.layers.moe import expert_token_counts

                gather_objects(expert_token_counts(runner.model))
                continue
            apply_rows(runner, step.rows)
            runner.forward(step.inp)
