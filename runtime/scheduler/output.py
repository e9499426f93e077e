"""Turning a step's sampled tokens into request state and outputs."""

from __future__ import annotations

import torch

from loom.runtime.forward_batch import ForwardMode
from loom.runtime.io_struct import ReqOutput
from loom.runtime.req import Req
from loom.runtime.sampler import token_logprobs
from loom.runtime.scheduler.jump_forward import try_jump_forward

# Tokens decoded from the end of the output when looking for stop strings: enough to cover
# the longest stop string even when every token is a single byte of a multi-byte character.
_STOP_TAIL_SLACK = 8


class OutputMixin:
    pending_outputs: list[Req]

    def process_batch_result(self, batch, next_ids, logprob_logits, logits) -> None:
        inp = batch.model_input
        sampled = iter(next_ids or ())
        self.stats["steps"] += 1
        step = self.stats["steps"]
        if batch.mode is ForwardMode.DECODE:
            self.stats["decode_steps"] += 1
            self.stats["decode_batch_sizes"] += len(batch)
        for i, req in enumerate(batch.reqs):
            if batch.mode is ForwardMode.DECODE:
                req.kv_len += 1
                if req.finished:  # its last token's KV is now written: hand it all to the cache
                    self.running.remove(req)
                    self._release(req)
                    continue
                req.note_decode_step(step, len(batch))
            else:
                req.kv_len += req.extend_len
                if not req.prompt_counted and req.kv_len == req.seq_len:
                    req.prompt_counted = True
                    self.stats["prompt_tokens"] += len(req.origin_input_ids)
                    self.stats["cached_tokens"] += req.cached_tokens
            lp = req.logprob
            if req.return_logprob and lp.start_len == 0 and not lp.input_token_logprobs:
                lp.input_token_logprobs.append((None, req.origin_input_ids[0]))
                lp.input_top_logprobs.append(None)
            if inp.input_logprob_rows[i] is not None:
                self._add_input_logprobs(req, inp.input_logprob_rows[i], logprob_logits)
            if batch.mode is ForwardMode.EXTEND and req.is_chunked:
                self.tree_cache.cache_unfinished_req(req)
                self.chunked_req = req
                continue
            if self.chunked_req is req:
                self.chunked_req = None
            row = inp.sample_rows[i]
            if row is not None:
                token = next(sampled)
                self._append_token(req, token, logprob_logits, row)
            else:  # max_new_tokens reached before sampling (max_new_tokens == 0)
                req.finished_reason = {
                    "type": "length",
                    "length": req.sampling_params.max_new_tokens,
                }
            if req.finished:
                self.pending_outputs.append(req)
                if self._completes_kv(req):
                    if req not in self.running:
                        self.running.append(req)
                    continue
                if req in self.running:
                    self.running.remove(req)
                self._release(req)
                continue
            if batch.mode is ForwardMode.EXTEND:
                self.tree_cache.cache_unfinished_req(req)
                self.running.append(req)
            if req.stream:
                self.pending_outputs.append(req)
            if not self.args.disable_jump_forward and try_jump_forward(self, req):
                self.running.remove(req)
                self.jumped.append(req)

    def _completes_kv(self, req: Req) -> bool:
        """A finished request's last token was sampled but never fed, so it has no KV. With the
        radix cache on, the request rides one more decode step (its output is already sent) so
        a follow-up that resends prompt + output finds all of it cached."""
        return (
            not self.tree_cache.disable
            and req.finished_reason["type"] != "abort"
            and bool(req.output_ids)
            and req.kv_len == req.seq_len - 1
        )

    def _append_token(self, req: Req, token: int, logprob_logits, row: int) -> None:
        req.output_ids.append(token)
        self.stats["generated_tokens"] += 1
        if req.return_logprob and logprob_logits is not None:
            lp, top_v, top_i = token_logprobs(
                logprob_logits[row : row + 1],
                torch.tensor([token], device=logprob_logits.device),
                req.logprob.top_num,
            )
            req.logprob.output_token_logprobs.append((float(lp[0]), token))
            if req.logprob.top_num:
                req.logprob.output_top_logprobs.append(
                    list(zip(top_v[0].tolist(), top_i[0].tolist()))
                )
        if req.grammar is not None and token not in req.eos_token_ids:
            req.grammar.accept_token(token)
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
                req.finished_reason = {"type": "stop", "matched": None}
                return
            if p.stop and self.tokenizer is not None:
                tail_len = p.max_stop_str_len + _STOP_TAIL_SLACK
                tail = self.tokenizer.decode(
                    req.output_ids[-tail_len:], skip_special_tokens=p.skip_special_tokens
                )
                for stop in p.stop:
                    if stop in tail:
                        req.finished_reason = {"type": "stop", "matched": stop}
                        return
        if len(req.output_ids) >= p.max_new_tokens or req.seq_len >= self.context_len:
            req.finished_reason = {"type": "length", "length": len(req.output_ids)}

    def _add_input_logprobs(self, req: Req, span: tuple[int, int, int], logits) -> None:
        first, count, begin = span
        lp = req.logprob
        targets = torch.tensor(req.origin_input_ids[begin : begin + count], device=logits.device)
        vals, top_v, top_i = token_logprobs(logits[first : first + count], targets, lp.top_num)
        for j, (v, t) in enumerate(zip(vals.tolist(), targets.tolist())):
            lp.input_token_logprobs.append((v, t))
            if lp.top_num:
                lp.input_top_logprobs.append(list(zip(top_v[j].tolist(), top_i[j].tolist())))
            else:
                lp.input_top_logprobs.append(None)

    def drain_outputs(self) -> list[ReqOutput]:
        outs = []
        seen = set()
        for req in self.pending_outputs:
            if id(req) in seen:
                continue
            seen.add(id(req))
            outs.append(self._make_output(req))
        self.pending_outputs = []
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
