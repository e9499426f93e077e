"""A request's state in the TokenizerManager's registry (rid -> state), from normalisation
until its caller has read its final output."""

from __future__ import annotations

import asyncio
import dataclasses

from loom.runtime.io_struct import TokenizedGenerateReq


@dataclasses.dataclass
class ReqState:
    msg: TokenizedGenerateReq
    with_text: bool  # return_text_in_logprobs
    log_metrics: bool
    created: float
    event: asyncio.Event
    text: str = ""
    output_ids: list[int] = dataclasses.field(default_factory=list)
    finished_reason: dict | None = None
    meta: dict = dataclasses.field(default_factory=dict)
    input_token_logprobs: list = dataclasses.field(default_factory=list)
    input_top_logprobs: list = dataclasses.field(default_factory=list)
    output_token_logprobs: list = dataclasses.field(default_factory=list)
    output_top_logprobs: list = dataclasses.field(default_factory=list)
    first_token_time: float | None = None
    streamed_text: int = 0  # chars / ids already sent (incremental streaming, stream_interval)
    streamed_ids: int = 0
    streamed_lps: int = 0  # output / prompt logprob entries already sent (incremental)
    streamed_input: int = 0
    sent_seq: int = 0  # TokenizerManager._sent_count once this request was sent
    missing: int = 0  # consecutive probe replies that did not list this unfinished request
    abandoned: bool = False  # its caller left; dropped from rid_to_state once it finishes
    # a streaming call's one wake-up event, shared by its requests (set with `event`)
    wake: asyncio.Event | None = None

    def notify(self) -> None:
        self.event.set()
        if self.wake is not None:
            self.wake.set()
