"""Pipeline stages: which layers this rank holds, and the hidden states between stages.

With pp_size stages each rank holds num_hidden_layers / pp_size consecutive layers; the first
also holds the embedding, the last the final norm and the LM head. A forward runs the stages
one after another: stage k receives (hidden, residual) from stage k - 1, runs its layers and
sends them on; the last stage computes the logits and broadcasts them, so every rank samples
the same rows (rank 0's tokens are the ones used). Stages do not overlap yet: there are no
micro-batches, so a step costs the sum of the stages.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from loom.runtime.distributed import get_parallel_state


class PipelineStage:
    def __init__(self, config):
        ps = get_parallel_state()
        per = config.num_hidden_layers // ps.pp_size
        self.size, self.rank = ps.pp_size, ps.pp_rank
        self.global_rank = ps.rank
        self.start, self.end = self.rank * per, (self.rank + 1) * per
        self.is_first, self.is_last = self.rank == 0, self.rank == ps.pp_size - 1
        self.vocab_size = config.vocab_size

    def owns(self, layer_id: int) -> bool:
        return self.start <= layer_id < self.end

    def holds(self, name: str) -> bool:
        """Whether checkpoint tensor `name` belongs to this stage."""
        if name.startswith("model.layers."):
            return self.owns(int(name.split(".")[2]))
        if name.startswith("model.embed_tokens."):
            return self.is_first
        return self.is_last  # model.norm, lm_head

    def recv(self, tokens: int, hidden_size: int, dtype, device) -> tuple[torch.Tensor, ...]:
        hidden = torch.empty(tokens, hidden_size, dtype=dtype, device=device)
        residual = torch.empty_like(hidden)
        dist.recv(hidden, src=self.global_rank - 1)
        dist.recv(residual, src=self.global_rank - 1)
        return hidden, residual

    def send(self, hidden: torch.Tensor, residual: torch.Tensor) -> None:
        dist.send(hidden.contiguous(), dst=self.global_rank + 1)
        dist.send(residual.contiguous(), dst=self.global_rank + 1)

    def share_logits(self, logits: torch.Tensor | None, rows: int, device) -> torch.Tensor:
        """The last stage's float32 logits [rows, vocab] on every stage."""
        if logits is None:
            logits = torch.empty(rows, self.vocab_size, dtype=torch.float32, device=device)
        dist.broadcast(logits, src=self.global_rank - self.rank + self.size - 1)
        return logits
