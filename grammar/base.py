"""The grammar-object contract shared by the sampler and the scheduler.

A grammar object follows one request's output. The scheduler asks it for the set of tokens
allowed next (`fill_mask`), the sampler applies that mask to the logits, and the scheduler
advances it with the sampled token (`accept_token`). Speculative verification and jump-forward
retokenisation step it back (`rollback`).

Bitmask layout (the same as xgrammar's, so masks can be shared with its kernels): int32 words
of shape [batch, ceil(vocab_size / 32)]; token t is allowed in row r when bit (t % 32) of word
(t // 32) is set. `vocab_size` is the *model's* vocabulary, which may be larger than the
tokenizer's: ids the tokenizer does not know are never allowed.

The runtime's masks are numpy arrays (`allocate_bitmask`: the scheduler and sampler of the CPU
path never import torch); a grammar fills a numpy row or a CPU tensor's row alike, through
`bitmask_row` (the same memory as a numpy view). `allocate_token_bitmask` /
`unpack_bitmask` / `apply_token_bitmask_` are the torch versions (torch imported inside them).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import numpy as np

Bitmask = Any  # int32 words [B, words]: a numpy array or a torch tensor


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def allocate_bitmask(batch_size: int, vocab_size: int) -> np.ndarray:
    """All-allowed bitmask (every bit set) for `batch_size` rows, as a numpy int32 array."""
    return np.full((batch_size, bitmask_words(vocab_size)), -1, dtype=np.int32)


def bitmask_row(bitmask: Bitmask, row: int) -> np.ndarray:
    """Row `row` of a numpy bitmask or of a CPU tensor's, as a numpy view (writes land in
    the mask)."""
    if isinstance(bitmask, np.ndarray):
        return bitmask[row]
    return bitmask[row].numpy()


def allocate_token_bitmask(batch_size: int, vocab_size: int):
    """All-allowed bitmask (every bit set) for `batch_size` rows, as a torch int32 tensor."""
    import torch

    return torch.full((batch_size, bitmask_words(vocab_size)), -1, dtype=torch.int32)


def unpack_bitmask(bitmask, vocab_size: int):
    """[B, words] int32 -> [B, vocab_size] bool (True = allowed), numpy for a numpy mask."""
    if isinstance(bitmask, np.ndarray):
        words = np.ascontiguousarray(bitmask, dtype="<i4").view(np.uint8)
        bits = np.unpackbits(words, axis=-1, bitorder="little")
        return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].astype(bool)
    import torch

    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_token_bitmask_(logits, bitmask) -> None:
    """Set disallowed logits to -inf in place. logits [B, V] tensor, bitmask [B, words]."""
    import torch

    if isinstance(bitmask, np.ndarray):
        bitmask = torch.from_numpy(bitmask)
    allowed = unpack_bitmask(bitmask.to(logits.device), logits.shape[-1])
    logits.masked_fill_(~allowed, float("-inf"))


class GrammarError(ValueError):
    """A grammar spec that cannot be compiled; the message says what and where."""


class Grammar(ABC):
    """One request's position in a compiled grammar.

    Invariants: `accept_token` is only called with a token that `fill_mask` allowed (it raises
    `GrammarError` otherwise and the state is unchanged); once `is_terminated()` is true the
    only allowed tokens are EOS ids. EOS is never passed to `accept_token` mid-grammar: the
    scheduler finishes the request instead.
    """

    @abstractmethod
    def fill_mask(self, bitmask: Bitmask, row: int) -> None:
        """Write the allowed-token bits for the next position into `bitmask[row]` (a numpy
        array or a CPU tensor: `bitmask_row` gives either row as numpy)."""

    @abstractmethod
    def accept_token(self, token_id: int) -> None:
        """Advance by one token; raise GrammarError if the token is not allowed."""

    @abstractmethod
    def rollback(self, k: int) -> None:
        """Undo the last `k` accepted tokens."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """True when the output so far is complete and nothing but EOS may follow."""

    @abstractmethod
    def jump_forward(self) -> str | None:
        """The longest string every valid continuation starts with, or None when there is none
        (or it is empty). Does not advance the state."""

    def is_forced(self) -> bool:
        """Whether every valid continuation starts with the same bytes: `jump_forward`'s text,
        or only the first bytes of a character it cannot return yet. The lazy greedy rows
        (runtime/step_grammar.py `LazyRows.resolve`) mask such a state instead
        of trusting `accept_token`, which an engine may make looser than its mask there."""
        return self.jump_forward() is not None

    def forced_token(self) -> int | None:
        """At a forced state (`is_forced`), the token the mask allows for the forced text's
        start, when the engine knows it (llguidance: its canonical tokenization's first
        token); None otherwise, and then only the mask says which tokens it allows."""
        return None

    @abstractmethod
    def copy(self) -> Grammar:
        """A fresh object at the same position, sharing the compiled tables (for n > 1)."""
