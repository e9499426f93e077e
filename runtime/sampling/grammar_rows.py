"""Grammar mask rows from grammar objects: a draft chain's rows (`fill_draft_rows`), and the
lazy rows of greedy chains left all-allowed until the sampler's argmax shows which one row
decides the chain (`resolve_lazy_grammars`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from loom.runtime.sampling.penalties import apply_vocab_mask_
from loom.runtime.sampling.verify import greedy_ids

if TYPE_CHECKING:
    from loom.runtime.sampling.info import SamplingInfo


def resolve_lazy_grammars(logits: torch.Tensor, ids: list[int], lazy: list) -> None:
    """Greedy chains verified without their grammar rows. Row j of a chain accepts draft
    token d_j when the masked argmax is d_j; the walk that drafted d_j found it legal, so when
    the unmasked argmax is d_j the masked one is too (masking only removes tokens, and no
    allowed token before d_j reaches its logit). The first row whose argmax is not its draft
    token decides the chain: an argmax the grammar accepts there is the masked argmax as well
    (one accept and rollback, no mask); otherwise that row gets its mask and its masked
    argmax, and the walk goes on from it when that is d_j after all. So the ids and
    acceptances are exactly those of the fully masked rows, with at most one mask per chain
    instead of one per row (each a fresh grammar state, the costly kind). A plain decode row
    is a chain with no draft: its argmax is kept when the grammar accepts it, else masked.
    EOS and ids past the vocabulary always take the mask (a grammar is not asked to accept
    EOS; the mask allows it only where the grammar may end), and so does every row whose
    state has forced bytes next (`is_forced()`): llguidance's mask then allows only the
    forced text's own tokenization while its accept (the walk's check) takes any token
    spelling a prefix of it (after `{"name` the mask allows `":` alone, accept also takes
    `"`). A draft token there that is that tokenization's first token
    (`grammar.forced_token()`) is allowed by the mask, so as the argmax it is the masked
    argmax too: accepted without the mask (a schema's keys and punctuation arrive as such
    drafts, one mask each before)."""
    from loom.grammar.base import allocate_token_bitmask

    vocab = logits.shape[-1]
    for row, grammar, draft, stops in lazy:
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
                    pass  # error: the mask decides; result processing's accept reports the latter
                else:
                    grammar.rollback(1)
                    break
            mask = allocate_token_bitmask(1, vocab)
            grammar.fill_mask(mask, 0)
            apply_vocab_mask_(logits[r : r + 1], mask)
            ids[r] = greedy_ids(logits[r : r + 1])[0]
            if j < len(draft) and ids[r] == draft[j]:
                grammar.accept_token(draft[j])
                n += 1
                continue
            break
        grammar.rollback(n)


def fill_lazy_grammars(info: SamplingInfo, vocab_size: int) -> None:
    """Every row of `info.lazy_grammars` masked in `info.vocab_mask` (the sampling paths that
    read every row's mask: temperature, trees, logprobs), and the list cleared."""
    from loom.grammar.base import allocate_token_bitmask

    if info.vocab_mask is None:
        info.vocab_mask = allocate_token_bitmask(info.greedy.shape[0], vocab_size)
    for row, grammar, draft, _ in info.lazy_grammars:
        fill_draft_rows(grammar, draft, info.vocab_mask, row)
    info.lazy_grammars = None


def fill_draft_rows(grammar, draft: list[int], mask: torch.Tensor, row: int) -> None:
    """mask[row + j] = what the grammar allows after draft[:j], for j = 0 .. len(draft) (the
    draft legal: walked by the drafter); the grammar ends where it started."""
    for j, t in enumerate(draft):
        grammar.fill_mask(mask, row + j)
        grammar.accept_token(t)
    grammar.fill_mask(mask, row + len(draft))
    grammar.rollback(len(draft))
