"""Pipeline stages: which layers this rank holds, and the hidden states between stages.

With pp_size stages each rank holds a run of consecutive layers (`pp_layer_partition`: an even
split, the remainder on the stages before the last, or --pp-layer-partition); the first
also holds the embedding, the last the final norm and the LM head. Stage k receives (hidden,
residual) from stage k - 1, runs its layers and sends them on; the last stage computes the
logits and broadcasts them, so every rank samples the same rows (rank 0's tokens are used).

Micro-batches: a step's requests are split into groups (pp_max_micro_batch_size requests
each; by default pp_size groups) that go through the stages one after another. Sends are
asynchronous, so stage k runs micro-batch i + 1 while stage k + 1 runs micro-batch i; the
logits are broadcast once, after the last micro-batch. A micro-batch is whole requests, so
attention needs nothing from the other micro-batches; one request's prefill is not split.
The overlap ends at the step boundary: rank 0 (stage 0) schedules the next step only after
the last stage's logits arrive, and the other stages wait for it meanwhile.
"""

from __future__ import annotations

import dataclasses
from itertools import accumulate

import torch
import torch.distributed as dist

from loom.runtime.distributed import get_parallel_state, pp_layer_range
from loom.runtime.forward_batch import forward_context, get_forward_batch


class PipelineStage:
    def __init__(self, config):
        ps = get_parallel_state()
        self.size, self.rank = ps.pp_size, ps.pp_rank
        self.global_rank = ps.rank
        mine = pp_layer_range(config.num_hidden_layers, ps)
        self.start, self.end = mine.start, mine.stop  # may be empty: the stage passes hidden on
        # what travels between stages (models are built under the load dtype as the default)
        self.dtype = torch.get_default_dtype()
        self.is_first, self.is_last = self.rank == 0, self.rank == ps.pp_size - 1
        self.vocab_size = config.vocab_size
        self.max_micro_batch = ps.pp_max_micro_batch_size
        self._sends: list = []  # (work, tensor) of sends not yet complete

    def owns(self, layer_id: int) -> bool:
        return self.start <= layer_id < self.end

    def holds(self, name: str) -> bool:
        """Whether checkpoint tensor `name` belongs to this stage."""
        if name.startswith("model.layers."):
            return self.owns(int(name.split(".")[2]))
        if name.startswith("model.embed_tokens."):
            return self.is_first
        return self.is_last  # model.norm, lm_head

    def forward(self, model, input_ids: torch.Tensor, positions: torch.Tensor):
        """`model(input_ids, positions)` over this step's micro-batches: the last stage's
        hidden states of every token (None on the other stages)."""
        if self.size == 1:
            return model(input_ids, positions)
        outs = []
        try:
            for sub in self._micro_batches(get_forward_batch()):
                with forward_context(sub):
                    outs.append(model(sub.input_ids, sub.positions))
        finally:
            for work, _ in self._sends:
                work.wait()
            self._sends.clear()
        return torch.cat(outs) if self.is_last else None

    def _micro_batches(self, batch) -> list:
        """The step's requests in groups; each group a ForwardBatch of its own tokens."""
        n = batch.batch_size
        per = self.max_micro_batch or -(-n // self.size)
        if per >= n or getattr(batch, "custom_masks", None) is not None:
            return [batch]  # one group (draft trees are verified in one piece)
        offsets = [0, *accumulate(batch.extend_lens_cpu)]
        assert offsets[-1] == len(batch.input_ids), "tokens are not laid out request by request"
        subs = []
        for i0 in range(0, n, per):
            i1 = min(i0 + per, n)
            t0, t1 = offsets[i0], offsets[i1]
            sub = dataclasses.replace(
                batch,
                input_ids=batch.input_ids[t0:t1],
                positions=batch.positions[t0:t1],
                out_cache_loc=batch.out_cache_loc[t0:t1],
                req_pool_indices=batch.req_pool_indices[i0:i1],
                seq_lens=batch.seq_lens[i0:i1],
                seq_lens_cpu=batch.seq_lens_cpu[i0:i1],
                prefix_lens_cpu=batch.prefix_lens_cpu[i0:i1],
                logits_indices=batch.logits_indices[:0],  # logits come after every group
                attn_metadata=None,
            )
            batch.attn_backend.init_forward_metadata(sub)
            subs.append(sub)
        return subs

    def recv(self, tokens: int, hidden_size: int, dtype, device) -> tuple[torch.Tensor, ...]:
        hidden = torch.empty(tokens, hidden_size, dtype=dtype, device=device)
        residual = torch.empty_like(hidden)
        dist.recv(hidden, src=self.global_rank - 1)
        dist.recv(residual, src=self.global_rank - 1)
        return hidden, residual

    def send(self, hidden: torch.Tensor, residual: torch.Tensor) -> None:
        """Asynchronous: this stage goes on with its next micro-batch meanwhile."""
        for t in (hidden.contiguous(), residual.contiguous()):
            self._sends.append((dist.isend(t, dst=self.global_rank + 1), t))

    def share_logits(self, logits: torch.Tensor | None, rows: int, device) -> torch.Tensor:
        """The last stage's float32 logits [rows, vocab] on every stage."""
        if logits is None:
            logits = torch.empty(rows, self.vocab_size, dtype=torch.float32, device=device)
        dist.broadcast(logits, src=self.global_rank - self.rank + self.size - 1)
        return logits
