"""Decode: the running requests (one new token each per step, or a verified draft), the
finishing ones (writing their last token's KV), and retraction when KV runs short."""

from __future__ import annotations

import logging

from loom.runtime.req import Req
from loom.runtime.scheduler.batch import ScheduleBatch
from loom.runtime.scheduler.kv import KVManager
from loom.runtime.spec import DraftTree

logger = logging.getLogger(__name__)

INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY = 0.001


class DecodeManager:
    """`running`: requests between prefill and finish. `finishing`: finished requests whose
    last sampled token has no KV yet; the next decode step writes it (sampling nothing) and
    releases them, so a follow-up turn finds prompt + output cached. `drafter` (optional, a
    `loom.runtime.spec.Drafter`) proposes tokens that the step verifies."""

    def __init__(self, kv: KVManager, conservativeness: float, context_len: int, drafter=None):
        self.kv = kv
        self.conservativeness = conservativeness
        self.context_len = context_len
        self.drafter = drafter
        # the most tokens a verify step should feed (the compiled CPU forward's limit; None:
        # any): drafts are cut to share it
        self.step_token_cap: int | None = None
        self.running: list[Req] = []
        self.finishing: list[Req] = []
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO * conservativeness

    def __len__(self) -> int:
        return len(self.running) + len(self.finishing)

    def schedule(self) -> tuple[ScheduleBatch | None, list[Req]]:
        """(the decode batch, the requests retracted to make room for it)."""
        retracted = []
        use_drafts = True
        while True:
            reqs = self.finishing + self.running
            if not reqs:
                return None, retracted
            free = self.drafter is not None and self.drafter.enabled_for(len(reqs))
            cap = None
            if self.step_token_cap is not None:
                cap = (self.step_token_cap - len(reqs)) // len(reqs)
            if free:
                drafts = [self._draft(r, True, cap) if use_drafts else [] for r in reqs]
            else:
                drafts = [[] for _ in reqs]
                self._skip_drafts(reqs)
            if any(drafts) and not self.drafter.worth_verifying(reqs, drafts):
                drafts = [[] for _ in reqs]
            short = self.kv.pages_short(reqs, [1 + len(d) for d in drafts])
            if short <= 0:
                break
            if any(drafts):  # drafts are optional: drop them before retracting anyone
                use_drafts = False
                continue
            if len(reqs) == 1:
                raise RuntimeError(
                    f"KV cache too small: one request needs more than {self.kv.size} tokens"
                )
            victim = self._retract_one()
            if victim is not None:
                retracted.append(victim)
        batch = ScheduleBatch(reqs, is_decode=True)
        if any(drafts):
            for req, draft in zip(reqs, drafts):
                if isinstance(draft, DraftTree):
                    req.draft_ids = draft.tokens
                    if not draft.is_chain or draft.probs is not None:
                        req.draft_parents, req.draft_probs = draft.parents, draft.probs
                else:
                    req.draft_ids = draft
                req.extend_len = 1 + len(draft)
                # a statement, not an assert: under `python -O` an assert and the allocation
                # inside it do not run. The loop above made room (pages_short <= 0): None is a bug
                if self.kv.alloc(req, req.extend_len) is None:
                    raise RuntimeError(f"{req.rid}: no KV for its drafts though the pool had room")
        else:
            for req in reqs:
                req.extend_len = 1
            batch.out_cache_loc = self.kv.alloc_decode(reqs)
        self.new_token_ratio = max(
            MIN_NEW_TOKEN_RATIO, self.new_token_ratio - NEW_TOKEN_RATIO_DECAY
        )
        return batch, retracted

    def _skip_drafts(self, reqs: list[Req]) -> None:
        """No drafts this step (no drafter, or a batch too large to draft)."""
        for req in reqs:
            req.draft_ids, req.draft_masks = [], None
            req.draft_parents = req.draft_probs = None
        if self.drafter is not None:
            self.drafter.skip([r for r in reqs if not r.finished])

    def _draft(self, req: Req, free_drafts: bool, cap: int | None = None) -> list[int] | DraftTree:
        req.draft_ids, req.draft_masks = [], None
        req.draft_parents = req.draft_probs = None
        if self.drafter is None or req.finished:
            return []
        # bounded by the context only: tokens past max_new_tokens or a stop are dropped when
        # the result is processed, like any chunk that ends mid-way
        room = self.context_len - req.seq_len - 1
        if cap is not None:
            room = min(room, cap)
        if room <= 0:
            return []
        draft = self.drafter.draft(req, room, free_drafts)
        if isinstance(draft, DraftTree):
            if len(draft) > room:
                raise ValueError(f"drafter proposed {len(draft)} tree nodes, room for {room}")
            return draft if len(draft) else []
        return list(draft)[:room]

    def _retract_one(self) -> Req | None:
        """Free KV: drop a finishing request's last-token write first (its answer is out),
        else put back the running request with the least progress; its KV goes to the cache
        and is recomputed when it is admitted again."""
        if self.finishing:
            self.kv.release(self.finishing.pop(0))
            return None
        victim = min(self.running, key=lambda r: (len(r.output_ids), -len(r.origin_input_ids)))
        self.running.remove(victim)
        self.kv.retract(victim)
        self.new_token_ratio = min(1.0, INIT_NEW_TOKEN_RATIO * self.conservativeness * 1.5)
        logger.info("retracted %s (KV short); %d running", victim.rid, len(self.running))
        return victim

    def after_step(self, batch: ScheduleBatch, running: list[Req], finishing: list[Req]) -> None:
        """The batch's requests are replaced by those still running / now finishing."""
        if batch.is_decode:
            self.running, self.finishing = [], []
        self.running.extend(running)
        self.finishing.extend(finishing)

    def remove(self, rid: str) -> tuple[list[Req], list[Req]]:
        """Take out the requests with this rid ("" = all): (running ones, finishing ones)."""
        run = [r for r in self.running if rid in ("", r.rid)]
        fin = [r for r in self.finishing if rid in ("", r.rid)]
        self.running = [r for r in self.running if r not in run]
        self.finishing = [r for r in self.finishing if r not in fin]
        return run, fin
