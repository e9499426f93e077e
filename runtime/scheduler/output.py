"""Result processing: a step's tokens (k >= 1 per request) into request state and outputs."""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from loom.runtime.forward_batch import ForwardOutput
from loom.runtime.io_struct import ReqOutput
from loom.runtime.req import Req
from loom.runtime.scheduler.batch import ScheduleBatch
from loom.runtime.scheduler.kv import KVManager
from loom.runtime.spec import tree_depths

if TYPE_CHECKING:
    from loom.runtime.step_grammar import StepGrammar

logger = logging.getLogger(__name__)

# Tokens decoded from the end of the output when looking for stop strings: enough to cover
# the longest stop string even when every token is a single byte of a multi-byte character.
_STOP_TAIL_SLACK = 8
# A stop_regex is searched in the decoded last tokens only (the whole output would make every
# step cost O(output)); a match must lie within this many tokens.
_STOP_REGEX_TAIL = 256


@dataclass
class Routes:
    """Where each request of a processed batch goes next."""

    running: list[Req] = field(default_factory=list)
    finishing: list[Req] = field(default_factory=list)  # finished; last token's KV to write
    requeue: list[Req] = field(default_factory=list)  # jumped forward: the next prefill
    chunked: Req | None = None


class OutputProcessor:
    """Turns a step's `ForwardOutput` into request state (tokens, logprobs, grammar, stop
    checks, KV bookkeeping through the KV manager) and keeps the outputs to stream."""

    def __init__(
        self, kv: KVManager, tokenizer, context_len: int, jump_forward: bool, stats, drafter=None,
        grammar: StepGrammar | None = None,
    ):  # fmt: skip
        self.kv = kv
        self.drafter = drafter
        self.tokenizer = tokenizer
        # the step's grammar owner: commit and jump-forward (None: one of its own)
        if grammar is None:  # built without the scheduler's owner (tests, tools)
            from loom.runtime.step_grammar import StepGrammar

            grammar = StepGrammar(tokenizer, 0)
        self.grammar = grammar
        self.context_len = context_len
        self.jump_forward = jump_forward
        self.stats = stats
        self.pending: list[Req] = []
        # prefill/decode disaggregation, prefill side: a finished request with a bootstrap
        # room goes here (KV kept, answer not sent) instead of being released
        self.hold_for_transfer = None

    def finish_with_error(self, req: Req, message: str, status_code: int | None = 400) -> None:
        req.finished_reason = {"type": "abort", "message": message}
        if status_code is not None:
            req.finished_reason["status_code"] = status_code
        self.pending.append(req)

    def process(self, batch: ScheduleBatch, out: ForwardOutput) -> Routes:
        inp = batch.model_input
        st = self.stats
        st["steps"] += 1
        if batch.is_decode:
            st["decode_steps"] += 1
            st["decode_batch_sizes"] += len(batch)
        routes = Routes()
        # with a drafter, forced text is drafted; a step that verified no drafts (prefill, a
        # batch over the size threshold or not worth verifying) jumps forward as without one
        jump = self.jump_forward and (
            self.drafter is None or not any(r.draft_ids for r in batch.reqs)
        )
        for i, req in enumerate(batch.reqs):
            # the walk's grammar rows were this step's: stale once tokens are appended
            req.draft_masks = None
            written_end = req.kv_len + req.extend_len
            req.kv_len = written_end - len(req.draft_ids)
            if req.finished:  # finishing: its last token's KV is now written
                self.kv.release(req)
                continue
            if batch.is_decode:
                req.note_decode_step(st["steps"], len(batch))
            elif not req.prompt_counted and req.kv_len == req.seq_len:
                req.prompt_counted = True
                st["prompt_tokens"] += len(req.origin_input_ids)
                st["cached_tokens"] += req.cached_tokens
            if req.draft_ids:  # a verify (a prefill forward may carry drafts too)
                req.spec_verify_ct += 1
            self._add_input_logprobs(req, inp.input_logprob_targets[i], out, i)
            if not batch.is_decode and req.is_chunked:
                self.kv.cache_unfinished(req)
                routes.chunked = req
                continue
            tokens = out.next_ids[i]
            if inp.sample_counts[i] == 0:  # max_new_tokens reached before sampling (== 0)
                req.finished_reason = {"type": "length", "length": len(req.output_ids)}
            if req.draft_ids and tokens:  # the verifier's accepted run, before any stop
                req.spec_accepted += len(tokens) - 1
                req.spec_proposed += len(req.draft_ids)
                if self.drafter is not None:
                    positions = len(req.draft_ids)
                    if req.draft_parents is not None:  # a tree drafts positions = depths
                        positions = 1 + max(tree_depths(req.draft_parents))
                    self.drafter.on_verified(req, positions, len(tokens) - 1)
            for j, token in enumerate(tokens):
                lp = top = None
                if req.return_logprob:
                    lp = out.logprobs[i][j]
                    top = out.top_logprobs[i][j] if req.logprob.top_num else None
                self.append_token(req, token, lp, top)
                if req.finished:
                    break  # the rest of a verified chunk comes after the stop: dropped
            if tokens:
                # KV is valid for the fed tokens that match the sequence: every appended
                # token but the last was an accepted draft token (or the step's last input);
                # a stop on an accepted draft token (the rest dropped) was fed too, so its
                # KV is written and the request needs no finishing step
                on_draft = j < len(tokens) - 1
                req.kv_len = min(written_end, req.seq_len - (0 if on_draft else 1))
            if req.kv_len < written_end:
                self.kv.truncate(req, req.kv_len, written_end)
            if req.draft_ids:
                req.draft_ids = []
                req.draft_parents = req.draft_probs = None
            if req.finished:
                if self.drafter is not None:
                    self.drafter.on_finished(req)
                if self.hold_for_transfer is not None and req.bootstrap_room is not None:
                    self.hold_for_transfer(req)
                    continue
                self.pending.append(req)
                if self._completes_kv(req):
                    routes.finishing.append(req)
                else:
                    self.kv.release(req)
                continue
            if not batch.is_decode:
                self.kv.cache_unfinished(req)
            if req.stream:
                self.pending.append(req)
            if jump and self.grammar.jump_forward(req, self.kv):
                routes.requeue.append(req)
            else:
                routes.running.append(req)
        return routes

    def _completes_kv(self, req: Req) -> bool:
        """A finished request's last token was sampled but never fed, so it has no KV. With the
        radix cache on, the request rides one more decode step (its output is already sent) so
        a follow-up that resends prompt + output finds all of it cached."""
        return (
            not self.kv.tree_cache.disable
            and req.finished_reason["type"] != "abort"
            and bool(req.output_ids)
            and req.kv_len == req.seq_len - 1
        )

    def append_token(self, req: Req, token: int, logprob: float | None, top) -> None:
        """One sampled token (with its logprob and top logprobs when the request asked):
        grammar, stop checks."""
        req.output_ids.append(token)
        self.stats["generated_tokens"] += 1
        if req.return_logprob:
            req.logprob.output_token_logprobs.append((logprob, token))
            if req.logprob.top_num:
                req.logprob.output_top_logprobs.append(top)
        e = self.grammar.commit(req, token)
        if e is not None:
            # the mask should have made this impossible: end this request loudly instead of
            # letting the error kill the scheduler (and every other request with it)
            logger.error("request %s: grammar refused sampled token %d: %s", req.rid, token, e)
            req.finished_reason = {
                "type": "abort",
                "message": f"internal error: the grammar refused sampled token {token}: {e}",
                "status_code": 500,
            }
            return
        self._check_finished(req, token)

    def _check_finished(self, req: Req, token: int) -> None:
        p = req.sampling_params
        if req.grammar is not None and token in req.eos_token_ids:
            req.finished_reason = {"type": "stop", "matched": token}  # EOS was allowed: it ends
            return
        if len(req.output_ids) >= p.min_new_tokens:
            if token in (p.stop_token_ids or ()) or (
                not p.ignore_eos and token in req.eos_token_ids
            ):
                req.finished_reason = {"type": "stop", "matched": token}
                return
            if req.grammar is not None and req.grammar.is_terminated():
                if getattr(req.grammar, "budget_closed", False):
                    # steered shut by the budget (grammar/closing.py): the model was cut
                    # short, so it reads as a length stop, with the document complete
                    req.finished_reason = _closed(len(req.output_ids))
                else:
                    req.finished_reason = {"type": "stop", "matched": None}
                return
            if (p.stop or getattr(p, "stop_regex", None)) and self.tokenizer is not None:
                matched = self._match_stop(req)
                if matched is not None:
                    req.finished_reason = {"type": "stop", "matched": matched}
                    return
        if len(req.output_ids) >= p.max_new_tokens or req.seq_len >= self.context_len:
            if getattr(req.grammar, "budget_closed", False):
                req.finished_reason = _closed(len(req.output_ids))
            else:
                req.finished_reason = {"type": "length", "length": len(req.output_ids)}

    def _match_stop(self, req: Req) -> str | None:
        """The stop string, or the stop_regex pattern, found in the output's decoded tail.

        As in SGLang: a stop string is trimmed from the text (unless no_stop_trim); a stop_regex
        ends the output at the token that completes its match, keeps the matched text, and
        finish_reason.matched names the pattern."""
        p = req.sampling_params
        if p.stop:
            tail_len = p.max_stop_str_len + _STOP_TAIL_SLACK
            tail = self.tokenizer.decode(
                req.output_ids[-tail_len:], skip_special_tokens=p.skip_special_tokens
            )
            for stop in p.stop:
                if stop in tail:
                    return stop
        patterns = getattr(p, "stop_regex", None)
        if patterns:
            tail = self.tokenizer.decode(
                req.output_ids[-_STOP_REGEX_TAIL:], skip_special_tokens=p.skip_special_tokens
            )
            for pattern in patterns:
                if re.search(pattern, tail) is not None:
                    return pattern
        return None

    def _add_input_logprobs(self, req: Req, targets, out: ForwardOutput, i: int) -> None:
        lp = req.logprob
        if req.return_logprob and lp.start_len == 0 and not lp.input_token_logprobs:
            lp.input_token_logprobs.append((None, req.origin_input_ids[0]))
            lp.input_top_logprobs.append(None)
        if not targets:
            return
        lp.input_token_logprobs.extend(zip(out.input_logprobs[i], targets))
        if lp.top_num:
            lp.input_top_logprobs.extend(out.input_top_logprobs[i])
        else:
            lp.input_top_logprobs.extend([None] * len(targets))

    def drain(self) -> list[ReqOutput]:
        outs = []
        seen = set()
        for req in self.pending:
            if id(req) in seen:
                continue
            seen.add(id(req))
            outs.append(self._make_output(req))
        self.pending = []
        return outs

    def _make_output(self, req: Req) -> ReqOutput:
        start = req.sent_output_len
        req.sent_output_len = len(req.output_ids)
        p = req.sampling_params
        out = ReqOutput(
            rid=req.rid,
            new_ids=req.output_ids[start:],
            finished_reason=req.finished_reason,
            prompt_tokens=len(req.origin_input_ids),
            completion_tokens=len(req.output_ids),
            cached_tokens=req.cached_tokens,
            skip_special_tokens=p.skip_special_tokens,
            spaces_between_special_tokens=p.spaces_between_special_tokens,
            stop=p.stop,
            no_stop_trim=p.no_stop_trim,
            jump_forward_tokens=req.jump_forward_tokens,
            spec_verify_ct=req.spec_verify_ct,
            spec_accepted=req.spec_accepted,
            spec_proposed=req.spec_proposed,
            rewind=req.pending_rewind,
            first_decode_step=req.first_decode_step,
            last_decode_step=req.last_decode_step,
            decode_batch_max=req.decode_batch_max,
        )
        req.pending_rewind = 0
        if req.return_logprob:
            lp = req.logprob
            if not req.sent_input_logprobs and (req.finished or len(req.output_ids) > 0):
                out.input_token_logprobs = lp.input_token_logprobs
                out.input_top_logprobs = lp.input_top_logprobs if lp.top_num else None
                req.sent_input_logprobs = True
            out.output_token_logprobs = lp.output_token_logprobs[start:]
            out.output_top_logprobs = lp.output_top_logprobs[start:] if lp.top_num else None
        return out


def _closed(length: int) -> dict:
    return {"type": "length", "length": length, "budget_closed": True}
