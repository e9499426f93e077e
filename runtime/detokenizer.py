"""Incremental, UTF-8 safe detokenization with stop-string trimming.

`Detokenizer.handle` is pure bookkeeping (usable in-process); `run_detokenizer_process` is the
process loop between the scheduler and the tokenizer manager.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from loom.runtime.io_struct import BatchStrOut, BatchTokenIDOut, ReqOutput, StrOutput

logger = logging.getLogger(__name__)


@dataclass
class _State:
    ids: list[int]
    prefix_offset: int = 0
    read_offset: int = 0
    text: str = ""  # decoded so far (complete characters only)
    sent: int = 0  # characters of the visible text already sent


def visible_text(text: str, stops: list[str] | None, finished: bool, no_stop_trim: bool) -> str:
    """The text a client may see now: cut before the first stop string; while unfinished, also
    hold back a tail that could still grow into a stop string."""
    if not stops:
        return text
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
    if cut >= 0:
        return text if no_stop_trim and finished else text[:cut]
    if finished:
        return text
    hold = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:k]):
                hold = max(hold, k)
                break
    return text[: len(text) - hold]


class Detokenizer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.states: dict[str, _State] = {}

    def _decode(self, ids: list[int], out: ReqOutput) -> str:
        return self.tokenizer.decode(
            ids,
            skip_special_tokens=out.skip_special_tokens,
            spaces_between_special_tokens=out.spaces_between_special_tokens,
        )

    def _advance(self, st: _State, out: ReqOutput, final: bool) -> None:
        prefix = self._decode(st.ids[st.prefix_offset : st.read_offset], out)
        full = self._decode(st.ids[st.prefix_offset :], out)
        if len(full) > len(prefix) and (final or not full.endswith("\ufffd")):
            st.text += full[len(prefix) :]
            st.prefix_offset, st.read_offset = st.read_offset, len(st.ids)

    def handle(self, batch: BatchTokenIDOut) -> BatchStrOut:
        outs = []
        for out in batch.outputs:
            st = self.states.get(out.rid)
            if st is None:
                st = self.states[out.rid] = _State(ids=[])
            finished = out.finished_reason is not None
            if out.rewind:  # a jump-forward replaced tokens already sent; the text is unchanged
                del st.ids[len(st.ids) - out.rewind :]
                if self.tokenizer is not None:
                    st.text = self._decode(st.ids, out)
                st.prefix_offset = st.read_offset = len(st.ids)
            if self.tokenizer is not None and out.new_ids:
                st.ids.extend(out.new_ids)
                self._advance(st, out, finished)
            text = visible_text(st.text, out.stop, finished, out.no_stop_trim)
            delta = text[st.sent :] if len(text) > st.sent else ""
            st.sent = max(st.sent, len(text))
            outs.append(StrOutput(out.rid, delta, out))
            if finished:
                del self.states[out.rid]
        return BatchStrOut(outs)


def run_detokenizer_process(args, ipc, owner_pid, ready_pipe) -> None:
    """Process entry: read BatchTokenIDOut from the scheduler, send BatchStrOut to the tokenizer
    manager (runtime/channel.py); ControlOut messages pass through unchanged, in order. Every
    message waiting is taken per wake-up: consecutive outputs leave as one BatchStrOut."""
    from loom.runtime.channel import Receiver, Sender
    from loom.runtime.io_struct import ToDetokenizer, decoder, encode
    from loom.runtime.process import (
        configure_child_process,
        freeze_startup_heap,
        yield_to_scheduler,
    )
    from loom.runtime.tokenizer import load_tokenizer

    configure_child_process(args, "detokenizer", owner_pid)
    yield_to_scheduler(args)  # woken per streamed token: never preempt the forward
    try:
        tokenizer = None if args.skip_tokenizer_init else load_tokenizer(args.tokenizer_path)
        send = Sender(ipc.tokenizer)
        recv = Receiver(ipc.detokenizer)  # waits for the scheduler to listen
    except Exception as e:  # noqa: BLE001 - reported to the parent, which raises it
        ready_pipe.send({"error": f"detokenizer failed to start: {e}"})
        raise
    freeze_startup_heap()
    ready_pipe.send({"ok": True})
    detok = Detokenizer(tokenizer)
    dec = decoder(ToDetokenizer)
    while not recv.closed:  # closed: the scheduler has gone, and so has the runtime
        outs: list[StrOutput] = []
        for raw in recv.read():
            msg = dec.decode(raw)
            if isinstance(msg, BatchTokenIDOut):
                outs.extend(detok.handle(msg).outputs)
                continue
            if outs:
                send.send(encode(BatchStrOut(outs)))
                outs = []
            send.send(encode(msg))
        if outs:
            send.send(encode(BatchStrOut(outs)))
