"""Req: one generation request, from admission to release."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from loom.runtime.sampling_params import SamplingParams

_EMPTY = np.empty(0, dtype=np.int64)  # slots are numpy int64 on the host (radix/base.py)


@dataclass
class LogprobState:
    """What the request asked for, and the (logprob, token id) pairs computed so far."""

    start_len: int = -1  # first prompt position whose logprob is returned
    top_num: int = 0
    input_token_logprobs: list[tuple[float | None, int]] = field(default_factory=list)
    input_top_logprobs: list[list[tuple[float, int]] | None] = field(default_factory=list)
    output_token_logprobs: list[tuple[float, int]] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)


class Req:
    """Invariants (checked by `check`): 0 <= len(prefix_indices) <= kv_len <= len(fill_ids),
    and positions [0, kv_len) of fill_ids have KV in row `req_pool_idx` of req_to_token.

    Life: grammar queue -> waiting -> (chunked) prefill -> running (decode steps) -> finished.
    A finished request whose last sampled token has no KV yet is `finishing`: it rides one
    more decode step (its answer already sent) so that its whole prompt + output reaches the
    prefix cache before any later prefix match, then it is released.
    """

    def __init__(
        self,
        rid: str,
        input_ids: list[int],
        sampling_params: SamplingParams,
        seed: int,
        stream: bool = False,
        return_logprob: bool = False,
        logprob_start_len: int = -1,
        top_logprobs_num: int = 0,
        eos_token_ids: frozenset[int] = frozenset(),
        extra_key: str | None = None,
        bootstrap: tuple[str, int, int] | None = None,
    ):
        self.rid = rid
        self.origin_input_ids = list(input_ids)
        self.output_ids: list[int] = []
        self.sampling_params = sampling_params
        self.seed = seed
        self.stream = stream
        self.eos_token_ids = eos_token_ids
        self.extra_key = extra_key
        # prefill/decode disaggregation (runtime/disagg/): the prefill server's bootstrap
        # host and port, and the room id that pairs the two halves of this request
        host, port, room = bootstrap or (None, None, None)
        self.bootstrap_host, self.bootstrap_port, self.bootstrap_room = host, port, room
        self.return_logprob = return_logprob
        self.logprob = LogprobState()
        if return_logprob:
            start = len(input_ids) - 1 if logprob_start_len < 0 else logprob_start_len
            self.logprob = LogprobState(
                start_len=min(start, len(input_ids)), top_num=top_logprobs_num
            )
        self.grammar: Any = None

        # KV state
        self.req_pool_idx: int | None = None
        self.prefix_indices: np.ndarray = _EMPTY
        self.last_node: Any = None
        self.kv_len = 0
        self.extend_len = 0  # positions computed in the current step (drafts included)
        self.draft_ids: list[int] = []  # proposed tokens verified in the current step
        # their tree (node i's parent; -1 = the last real token), None for a chain
        self.draft_parents: list[int] | None = None
        self.draft_probs: Any = None  # the nodes' draft distributions ([n, vocab]; None: one-hot)
        self.draft_masks: np.ndarray | None = None  # the draft positions' grammar rows (int32)
        self.draft_forced = 0  # leading draft tokens that are grammar-forced text
        # who drafted this step's tokens (head drafters: "head", "ngram" from their n-gram policy,
        # "free" when a draft costs nothing extra; None: no draft) and the tokens the drafter
        # expects accepted, which the verify-or-not cut weighs (`spec.Drafter`)
        self.draft_source: str | None = None
        self.draft_expected = 0.0
        # head drafters, constrained requests: the n-gram draft's expected accepted length at
        # this step's draft (`NgramPolicy.ngram_draft`), what a verified head draft is
        # measured against (`head_policy._net_gain`)
        self.ngram_expected = 0.0
        # head drafters: whether the head drafts for this constrained request (decided at its
        # first draft and kept; None: not decided yet)
        self.spec_head: bool | None = None
        self.spec_state: Any = None  # the drafter's incremental state for this request
        self.new_slots: np.ndarray = _EMPTY  # KV slots allocated for the current step
        self.cached_tokens = 0  # prompt tokens served from the radix cache (reported)
        self.is_chunked = False

        self.finished_reason: dict | None = None
        self.retract_count = 0
        self.spec_verify_ct = 0  # steps that verified draft tokens
        self.spec_accepted = 0  # draft tokens accepted over those steps
        self.spec_proposed = 0  # draft tokens proposed over them
        self.sent_output_len = 0  # output tokens already streamed to the detokenizer
        self.sent_input_logprobs = False
        self.jump_forward_tokens = 0
        self.pending_rewind = 0  # streamed tokens replaced by a jump-forward retokenization
        self.prompt_counted = False
        self.created_at = time.monotonic()
        # Batching, observable (meta_info): the scheduler's forward-step counter at this
        # request's first and last decode step, and the largest decode batch it was part of.
        self.first_decode_step: int | None = None
        self.last_decode_step: int | None = None
        self.decode_batch_max = 0

    @property
    def fill_ids(self) -> list[int]:
        return self.origin_input_ids + self.output_ids

    def tokens(self, begin: int, end: int) -> list[int]:
        """fill_ids[begin:end] without building fill_ids (a decode step needs one token)."""
        n = len(self.origin_input_ids)
        if begin >= n:
            return self.output_ids[begin - n : end - n]
        return self.origin_input_ids[begin:end] + self.output_ids[: max(0, end - n)]

    @property
    def seq_len(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finished_reason is not None

    @property
    def remaining_new_tokens(self) -> int:
        return self.sampling_params.max_new_tokens - len(self.output_ids)

    def samples_at(self, end: int) -> bool:
        """Whether a step computing positions up to `end` samples this request's next token."""
        return (
            end == self.seq_len
            and not self.finished
            and self.sampling_params.max_new_tokens > len(self.output_ids)
        )

    def note_decode_step(self, step: int, batch_size: int) -> None:
        if self.first_decode_step is None:
            self.first_decode_step = step
        self.last_decode_step = step
        self.decode_batch_max = max(self.decode_batch_max, batch_size)

    def reset_kv(self) -> None:
        """Forget every KV slot (after a retraction): the next admission recomputes them."""
        self.req_pool_idx = None
        self.prefix_indices = _EMPTY
        self.last_node = None
        self.kv_len = 0
        self.extend_len = 0
        self.draft_ids = []
        self.draft_parents = None
        self.draft_probs = None
        self.draft_masks = None
        self.is_chunked = False

    def check(self) -> None:
        assert 0 <= len(self.prefix_indices) <= self.kv_len <= self.seq_len, (
            f"{self.rid}: prefix {len(self.prefix_indices)} kv {self.kv_len} seq {self.seq_len}"
        )

    def __repr__(self) -> str:
        return f"Req({self.rid}, in={len(self.origin_input_ids)}, out={len(self.output_ids)}, kv={self.kv_len})"
