"""The one owner of a step's grammar rows (`StepGrammar`): every place a request's grammar
object is asked something during a step goes through here, and nothing past it (the sampler,
the runner) holds a grammar object except inside `LazyRows`, which the runner calls and
which hands the sampler tensors (mask rows) only.

A constrained request's step, in order:
1. `forced`: the grammar's forced text, as token ids (a drafter's draft opens with it);
2. `walk` / `walk_tree`: a draft walked through the grammar (accept, then roll back), cut at
   the first token it refuses, with the mask row of every draft position and the one after
   (`req.draft_masks`), so an accepted token is always legal; `cut` shortens a chain and its
   rows together (the verify-or-not cut);
3. `rows`: the step's mask rows, one per sampled position (speculative positions included),
   into `SamplingInfo.vocab_mask`; greedy chains with nothing to score are left lazy
   (`LazyRows`): masked only where the unmasked argmax needs it (`LazyRows.resolve`);
4. `commit`: each token result processing appends advances the grammar;
5. `jump_forward`: after a step that verified no drafts, the forced text appended without
   sampling (the tail retokenized, rolled back and re-accepted).

The grammar advances only in `commit` and `jump_forward`; every other use rolls back to where
it started.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from typing import Any

from loom.grammar.base import allocate_bitmask
from loom.runtime.sampling.penalties import apply_vocab_mask_
from loom.runtime.sampling.verify import greedy_ids

logger = logging.getLogger(__name__)

FORCED_CACHE = 4096  # forced texts whose token ids are remembered
# jump-forward: the output tokens retokenized with the forced text (the boundary's merges)
JUMP_WINDOW = 3
# A jump costs an extend step (the new tail, window included, is recomputed); one that saves a
# single decode step gains nothing and delays the batch. Jump only when it saves this many.
JUMP_MIN_GAIN = 2


def get_parallel_state():
    """`loom.runtime.distributed`'s parallel state, or None where that module was never
    loaded (it imports torch; a process that never loaded it has set up no parallel world,
    so it runs one rank)."""
    distributed = sys.modules.get("loom.runtime.distributed")
    return None if distributed is None else distributed.get_parallel_state()


@dataclass
class LazyRows:
    """Greedy chains verified without their grammar rows (`vocab_mask` rows left unfilled, or
    no mask at all; a plain decode row is a chain with no draft tokens): per chain (its first
    row, the request's grammar, its draft tokens, its EOS ids). Built by `StepGrammar.rows`
    only where the grammar objects stay in this process (one rank)."""

    chains: list[tuple[int, Any, list[int], frozenset]]

    def resolve(self, logits, ids: list[int]) -> None:
        """`ids` (the rows' argmax after penalties) made the masked argmax, in place.

        Row j of a chain accepts draft token d_j when the masked argmax is d_j; the walk that
        drafted d_j found it legal, so when the unmasked argmax is d_j the masked one is too
        (masking only removes tokens, and no allowed token before d_j reaches its logit). The
        first row whose argmax is not its draft token decides the chain: an argmax the grammar
        accepts there is the masked argmax as well (one accept and rollback, no mask);
        otherwise that row gets its mask and its masked argmax, and the walk goes on from it
        when that is d_j after all. So the ids and acceptances are exactly those of the fully
        masked rows, with at most one mask per chain instead of one per row (each a fresh
        grammar state, the costly kind). EOS and ids past the vocabulary always take the mask
        (a grammar is not asked to accept EOS; the mask allows it only where the grammar may
        end), and so does every row whose state has forced bytes next (`is_forced()`):
        llguidance's mask then allows only the forced text's own tokenization while its
        accept (the walk's check) takes any token spelling a prefix of it (after `{"name` the
        mask allows `":` alone, accept also takes `"`). A draft token there that is that
        tokenization's first token (`grammar.forced_token()`) is allowed by the mask, so as
        the argmax it is the masked argmax too: accepted without the mask. `logits`: numpy
        float32 or a torch tensor (the sampler's two paths); the masks are numpy."""
        vocab = logits.shape[-1]
        for row, grammar, draft, stops in self.chains:
            n = 0  # draft tokens the grammar has been advanced by
            for j in range(len(draft) + 1):
                r = row + j
                forced = grammar.is_forced()
                if (
                    j < len(draft)
                    and ids[r] == draft[j]
                    and (not forced or grammar.forced_token() == draft[j])
                ):
                    grammar.accept_token(draft[j])
                    n += 1
                    continue
                if ids[r] not in stops and ids[r] < vocab and not forced:
                    try:
                        grammar.accept_token(ids[r])
                    except Exception:  # noqa: BLE001 - refused (GrammarError) or the engine's own
                        pass  # error: the mask decides; `commit` reports the latter
                    else:
                        grammar.rollback(1)
                        break
                mask = allocate_bitmask(1, vocab)
                grammar.fill_mask(mask, 0)
                apply_vocab_mask_(logits[r : r + 1], mask)
                ids[r] = greedy_ids(logits[r : r + 1])[0]
                if j < len(draft) and ids[r] == draft[j]:
                    grammar.accept_token(draft[j])
                    n += 1
                    continue
                break
            grammar.rollback(n)

    def fill(self, info, vocab_size: int) -> None:
        """Every row of every chain masked in `info.vocab_mask` (the sampling paths that read
        every row's mask: temperature, trees, logprobs)."""
        if info.vocab_mask is None:
            info.vocab_mask = allocate_bitmask(info.greedy.shape[0], vocab_size)
        for row, grammar, draft, _ in self.chains:
            fill_draft_rows(grammar, draft, info.vocab_mask, row)


def fill_draft_rows(grammar, draft: list[int], mask, row: int) -> None:
    """mask[row + j] = what the grammar allows after draft[:j], for j = 0 .. len(draft) (the
    draft legal: walked by the drafter); the grammar ends where it started."""
    for j, t in enumerate(draft):
        grammar.fill_mask(mask, row + j)
        grammar.accept_token(t)
    grammar.fill_mask(mask, row + len(draft))
    grammar.rollback(len(draft))


class StepGrammar:
    """See the module docstring. `lazy`: a greedy request's draft walk leaves its rows to
    `LazyRows` (only where no other rank receives the step's plan: the grammar objects stay
    in this process)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids=(), lazy: bool = True):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos = frozenset(eos_token_ids)
        self.lazy = lazy
        self.forced_ids: dict[str, list[int]] = {}

    # ------------------------------------------------------------ drafting
    def forced(self, req, budget: int) -> list[int]:
        """The grammar's forced text as token ids, at most `budget` (under the mask those
        tokens are the only ones allowed, so verification accepts them)."""
        if req.grammar is None or self.tokenizer is None or budget <= 0:
            return []
        text = req.grammar.jump_forward()
        if not text:
            return []
        text = text[: 8 * budget]
        ids = self.forced_ids.get(text)
        if ids is None:  # a schema's keys and punctuation recur in every request
            if len(self.forced_ids) >= FORCED_CACHE:
                self.forced_ids.clear()
            ids = self.forced_ids[text] = self.tokenizer.encode(text, add_special_tokens=False)
        return ids[:budget]

    def walk(self, req, draft: list[int]) -> list[int]:
        """The draft cut at the first token the grammar refuses, with the mask rows of its
        positions (`req.draft_masks`). A greedy request's rows are not computed here (`lazy`):
        `LazyRows.resolve` masks only the row that decides its chain, where a row per position
        cost a fresh grammar state's mask each (most of a JSON verify step's grammar time)."""
        from loom.grammar.base import GrammarError

        g = req.grammar
        lazy = self.lazy and req.sampling_params.is_greedy and not req.return_logprob
        masks = None if lazy else allocate_bitmask(len(draft) + 1, self.vocab_size)
        words = masks  # numpy: bit reads, no tensor indexing
        n = 0
        for t in draft:
            if not lazy:  # row n: the state after the n tokens accepted so far
                g.fill_mask(masks, n)
            if t in self.eos or t >= self.vocab_size:
                break
            if not lazy and not (int(words[n, t >> 5]) >> (t & 31)) & 1:
                break
            try:
                g.accept_token(t)
            except GrammarError:
                break
            n += 1
        else:
            if not lazy:
                g.fill_mask(masks, n)
        g.rollback(n)
        req.draft_masks = None if lazy else masks[: n + 1]
        return draft[:n]

    def walk_tree(self, req, tokens: list[int], parents: list[int]) -> tuple[list[int], list[int]]:
        """Each branch walked through the grammar (accept down, roll back up): a node the
        grammar refuses is cut with its subtree; mask row 0 is what may follow the last real
        token, row 1 + i what may follow node i (`req.draft_masks`, in the kept nodes' order)."""
        from loom.grammar.base import GrammarError

        g = req.grammar
        n = len(tokens)
        masks = words = allocate_bitmask(n + 1, self.vocab_size)
        children: list[list[int]] = [[] for _ in range(n + 1)]
        for i, p in enumerate(parents):
            children[p + 1].append(i)
        kept = [False] * n

        def visit(node: int) -> None:
            row = node + 1
            g.fill_mask(masks, row)
            for k in children[row]:
                t = tokens[k]
                if t in self.eos or t >= self.vocab_size:
                    continue
                if not (int(words[row, t >> 5]) >> (t & 31)) & 1:
                    continue
                try:
                    g.accept_token(t)
                except GrammarError:
                    continue
                kept[k] = True
                visit(k)
                g.rollback(1)

        visit(-1)
        index = {}
        new_tokens, new_parents, rows = [], [], [0]
        for i in range(n):
            if kept[i]:
                index[i] = len(new_tokens)
                new_tokens.append(tokens[i])
                new_parents.append(-1 if parents[i] < 0 else index[parents[i]])
                rows.append(i + 1)
        req.draft_masks = masks[rows]
        return new_tokens, new_parents

    @staticmethod
    def cut(req, draft: list[int], n: int) -> None:
        """A chain cut to its first n tokens in place, its mask rows and forced count with it."""
        del draft[n:]
        if req.draft_masks is not None:
            req.draft_masks = req.draft_masks[: n + 1]
        req.draft_forced = min(req.draft_forced, n)

    # ------------------------------------------------------------ the step's rows
    def rows(self, reqs: list, info, lazy_ok: bool = False) -> LazyRows | None:
        """One mask row per sampled position into `info.vocab_mask`: a drafted request brings
        the rows its walk filled (`req.draft_masks`: row 0 after the last real token, then one
        after each draft position), also when the step verifies none of its draft (not worth
        verifying, KV short, the first draft token refused): row 0 is then this step's row,
        not computed twice. A request without rows (`draft_masks` None: a greedy request's
        chain, or no draft, a chain of length 0) is left lazy (the returned `LazyRows`: a row
        masked only where the grammar refuses the unmasked argmax) when every row of the step
        samples greedily with nothing to score (`lazy_ok`: no tree, no logprobs) on one rank,
        else its rows are filled here."""
        if not any(r.grammar is not None for r in reqs):
            return None

        state = get_parallel_state()
        lazy_ok = lazy_ok and info.all_greedy and (state is None or state.world_size == 1)
        lazy, mask = [], None
        row = 0
        for r in reqs:
            if r.grammar is not None:
                if r.draft_masks is None and lazy_ok:
                    lazy.append((row, r.grammar, r.draft_ids, r.eos_token_ids))
                else:
                    if mask is None:
                        mask = allocate_bitmask(
                            sum(1 + len(x.draft_ids) for x in reqs), self.vocab_size
                        )
                    if r.draft_masks is not None:
                        n = 1 + len(r.draft_ids)
                        mask[row : row + n] = r.draft_masks[:n]
                    else:  # no draft: this step's row alone
                        fill_draft_rows(r.grammar, r.draft_ids, mask, row)
            row += 1 + len(r.draft_ids)
        info.vocab_mask = mask
        return LazyRows(lazy) if lazy else None

    # ------------------------------------------------------------ after the step
    @staticmethod
    def commit(req, token: int) -> Exception | None:
        """Advance `req`'s grammar by an appended token (EOS is not a grammar token); the
        grammar's error when it refuses (the mask should have made that impossible)."""
        if req.grammar is None or token in req.eos_token_ids:
            return None
        try:
            req.grammar.accept_token(token)
        except Exception as e:  # noqa: BLE001 - one request fails, not the scheduler
            return e
        return None

    def jump_forward(self, req, kv) -> bool:
        """Rewrite `req`'s output tail with the grammar's forced string, computed in one
        extend pass. True when it jumped: the request then needs an extend step (its kv_len
        is behind its seq_len).

        The string is tokenized together with the last few output tokens (the window) and
        the window is replaced by that tokenization, so the tokens are the ones the tokenizer
        itself would produce at the boundary. The last token of the retokenized text is
        dropped: it could still merge with whatever the model writes next. Only tokens the
        request owns (not shared through the radix cache) are replaced; their KV is released
        (`kv.truncate`) and recomputed."""
        if req.grammar is None or req.return_logprob or req.sampling_params.stop:
            return False
        forced = req.grammar.jump_forward()
        # every token spells at least one byte and the last one is held back, so a forced
        # string of JUMP_MIN_GAIN bytes or fewer cannot save that many steps: skip the work
        if not forced or len(forced.encode()) <= JUMP_MIN_GAIN:
            return False
        tok = self.tokenizer
        out = req.output_ids
        prompt_len = len(req.origin_input_ids)
        owned_from = max(len(req.prefix_indices), prompt_len)  # first position we may rewrite
        k = min(JUMP_WINDOW, req.seq_len - owned_from, len(out))
        while k > 0:
            # a character spans at most 4 tokens: the boundary check needs only the ones before
            head, tail = out[-k - 4 : -k], out[-k:]
            if tok.decode(head) + tok.decode(tail) == tok.decode(head + tail):
                break
            k -= 1  # the window would split a character: shrink it
        if k <= 0:
            return False
        tail_text = tok.decode(out[-k:])
        new_tail = tok.encode(tail_text + forced, add_special_tokens=False)[:-1]
        room = req.sampling_params.max_new_tokens - (len(out) - k) - 1  # leave one to sample
        new_tail = new_tail[: max(0, room)]
        if len(new_tail) - k < JUMP_MIN_GAIN or tok.decode(new_tail)[: len(tail_text)] != tail_text:
            return False
        old_tail = out[-k:]
        req.grammar.rollback(k)
        accepted = 0
        try:
            for t in new_tail:
                req.grammar.accept_token(t)
                accepted += 1
        except Exception:  # noqa: BLE001 - the grammar refused the retokenization: keep the old tail
            req.grammar.rollback(accepted)
            for t in old_tail:
                req.grammar.accept_token(t)
            return False
        kept = len(out) - k
        del out[kept:]
        out.extend(new_tail)
        kv.truncate(req, min(req.kv_len, prompt_len + kept), req.kv_len)
        if req.sent_output_len > kept:
            req.pending_rewind += req.sent_output_len - kept
            req.sent_output_len = kept
        req.jump_forward_tokens += len(new_tail) - k
        return True
