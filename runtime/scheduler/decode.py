"""Decode steps: one new token per running request, retracting requests when KV runs short."""

from __future__ import annotations

import logging

import torch

from loom.runtime.forward_batch import ForwardMode
from loom.runtime.scheduler.batch import ScheduleBatch

logger = logging.getLogger(__name__)

INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY = 0.001


class DecodeMixin:
    def prepare_decode(self) -> ScheduleBatch | None:
        """Allocate one slot per running request, retracting requests while KV is short."""
        while True:
            need = (
                sum(self.allocator.pages_needed(r.kv_len, 1) for r in self.running) * self.page_size
            )
            short = need - self.allocator.available_size()
            if short > 0:
                self.tree_cache.evict(short)
                short = need - self.allocator.available_size()
            if short <= 0 or len(self.running) == 1:
                break
            self.retract_one()
        if short > 0:
            raise RuntimeError(
                f"KV cache too small: one request needs more than {self.allocator.size} tokens"
            )
        for req in self.running:
            slots = self.alloc_for_req(req, 1)
            assert slots is not None
        self.new_token_ratio = max(
            MIN_NEW_TOKEN_RATIO, self.new_token_ratio - NEW_TOKEN_RATIO_DECAY
        )
        batch = ScheduleBatch(list(self.running), ForwardMode.DECODE)
        batch.out_cache_loc = torch.cat([r.new_slots for r in self.running])
        return batch

    def retract_one(self) -> None:
        """Put back the running request with the least progress; its KV is released (into the
        radix cache when enabled) and recomputed when it is admitted again."""
        done = [r for r in self.running if r.finished]
        if done:  # only completing its KV for the cache: drop that instead of real work
            self.running.remove(done[0])
            self._release(done[0])
            return
        victim = min(self.running, key=lambda r: (len(r.output_ids), -len(r.origin_input_ids)))
        self.running.remove(victim)
        self._release(victim)
        victim.reset_kv()
        victim.retract_count += 1
        self.waiting.insert(0, victim)
        self.stats["num_retractions"] += 1
        self.new_token_ratio = min(
            1.0, INIT_NEW_TOKEN_RATIO * self.args.schedule_conservativeness * 1.5
        )
        logger.info("retracted %s (KV short); %d running", victim.rid, len(self.running))
