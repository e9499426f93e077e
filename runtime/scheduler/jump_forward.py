"""Jump-forward: when the grammar admits exactly one continuation string, append it without
sampling, and compute it in one extend pass.

The string is tokenized together with the last few output tokens (the "window") and the
window is replaced by that tokenization, so the tokens are the ones the tokenizer itself would
produce at the boundary. The last token of the retokenized text is dropped: it could still
merge with whatever the model writes next. Only tokens the request owns (not shared through
the radix cache) are replaced; their KV is released and recomputed.
"""

from __future__ import annotations

import logging

from loom.runtime.req import Req
from loom.runtime.scheduler.kv import KVManager

logger = logging.getLogger(__name__)

MAX_WINDOW = 3
# A jump costs an extend step (the new tail, window included, is recomputed); one that saves a
# single decode step gains nothing and delays the batch. Jump only when it saves MIN_GAIN tokens.
MIN_GAIN = 2


def try_jump_forward(req: Req, tokenizer, kv: KVManager) -> bool:
    """Rewrite `req`'s output tail with the grammar's forced string. True when it jumped: the
    request then needs an extend step (its kv_len is behind its seq_len)."""
    if req.grammar is None or req.return_logprob or req.sampling_params.stop:
        return False
    forced = req.grammar.jump_forward()
    # every token spells at least one byte and the last one is held back, so a forced string
    # of MIN_GAIN bytes or fewer cannot save MIN_GAIN steps: skip the tokenizer work
    if not forced or len(forced.encode()) <= MIN_GAIN:
        return False
    tok = tokenizer
    out = req.output_ids
    prompt_len = len(req.origin_input_ids)
    owned_from = max(len(req.prefix_indices), prompt_len)  # first position we may rewrite
    k = min(MAX_WINDOW, req.seq_len - owned_from, len(out))
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
    if len(new_tail) - k < MIN_GAIN or tok.decode(new_tail)[: len(tail_text)] != tail_text:
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
