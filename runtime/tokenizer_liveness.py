"""Liveness of the runtime behind a TokenizerManager: child processes' deaths (event-driven)
and a probe for stuck runtimes and lost requests."""

from __future__ import annotations

import asyncio
import logging
import time

from loom.runtime.io_struct import AbortReq, StateReq, encode
from loom.runtime.request_state import ReqState

logger = logging.getLogger(__name__)

# Lost-request safety net: while requests wait and nothing has arrived for PROBE_QUIET_S, the
# watchdog asks the scheduler which rids it holds; a request sent before that probe, with no
# final output and missing from LOST_AFTER_PROBES replies in a row, is failed (never waited for
# forever). The pipe is ordered (TM -> scheduler -> detokenizer -> TM), so a request sent before
# a probe is either listed in its reply or its final output arrived before the reply.
PROBE_QUIET_S = 2.0
LOST_AFTER_PROBES = 2
# seconds between a watched process's exit and the runtime being declared dead, so that every
# process the same failure took down is named (the cause among them)
CAUSE_GRACE_S = 1.5


class Liveness:
    """The TokenizerManager's health side (a base class of it): watches `watched_processes`,
    probes through `_control` while `rid_to_state` holds unfinished requests and nothing has
    arrived since `_last_recv`, and fails requests (`send_sock`, `on_dead`)."""

    async def _watchdog(self) -> None:
        """Child death is event-driven (each process's sentinel fd wakes the loop the moment
        it exits, whatever the machine's load); while requests wait and nothing arrives, the
        runtime is probed: no answer within `watchdog_timeout` seconds declares it stuck, and
        an answer that does not list a request sent before it fails that request (_probe)."""
        loop = asyncio.get_running_loop()
        for proc in self.watched_processes:
            loop.add_reader(proc.sentinel, self._child_exited, proc)
        timeout = self.args.watchdog_timeout
        try:
            while self.dead_reason is None:
                await asyncio.sleep(min(1.0, timeout / 4))
                self._drain()  # a lost fd wake-up costs at most this tick
                quiet = time.monotonic() - self._last_recv
                waiting = any(s.finished_reason is None for s in self.rid_to_state.values())
                if waiting and quiet > min(PROBE_QUIET_S, timeout / 2):
                    try:
                        await self._probe(timeout)
                    except asyncio.TimeoutError:
                        self._declare_dead(
                            f"the runtime did not answer for {timeout:g}s (watchdog_timeout)"
                        )
        finally:
            for proc in self.watched_processes:
                loop.remove_reader(proc.sentinel)

    async def _probe(self, timeout: float) -> None:
        """Ask the scheduler which requests it holds; fail each unfinished request sent before
        the probe that LOST_AFTER_PROBES replies in a row did not list. A reply without 'rids'
        (a front that cannot list them) checks nothing."""
        sent_before = self._sent_count
        reply = await self._control(lambda i: StateReq(i, list_rids=True), timeout=timeout)
        listed = (reply.state or {}).get("rids")
        if listed is None:
            return
        listed = set(listed)
        for rid, state in list(self.rid_to_state.items()):
            if state.finished_reason is not None or state.sent_seq > sent_before or rid in listed:
                state.missing = 0
                continue
            state.missing += 1
            if state.missing >= LOST_AFTER_PROBES:
                self._fail_lost(state)

    def _fail_lost(self, state: ReqState) -> None:
        rid = state.msg.rid
        age = time.monotonic() - state.created
        message = (
            f"request {rid!r} was lost: the scheduler does not hold it and sent no final output "
            f"({LOST_AFTER_PROBES} probes, {age:.1f}s after it was sent); please retry"
        )
        logger.error(message)
        self.lost_requests += 1
        self.send_sock.send(encode(AbortReq(rid)))  # in case it is still somewhere after all
        state.finished_reason = {"type": "abort", "message": message, "status_code": 500}
        if state.abandoned:
            self.rid_to_state.pop(rid, None)
        state.notify()

    def _child_exited(self, proc) -> None:
        loop = asyncio.get_running_loop()
        loop.remove_reader(proc.sentinel)
        proc.join(1.0)  # reap it, so its exit code is known
        died = self._died
        died.append(f"the {proc.name} process died (exit code {proc.exitcode})")
        if len(died) == 1:
            # one rank's death takes the others down within moments (their collectives fail),
            # and the first to exit is not always the cause (rank 0 can exit before Ray reports
            # the killed actor): wait CAUSE_GRACE_S for the rest, then name every one
            loop.call_later(CAUSE_GRACE_S, lambda: self._declare_dead("; ".join(died)))

    def _declare_dead(self, reason: str) -> None:
        if self.dead_reason is not None:
            return
        self.dead_reason = reason
        logger.error(reason)
        for state in list(self.rid_to_state.values()):
            state.finished_reason = {"type": "abort", "message": reason, "status_code": 503}
            state.notify()
        if self.on_dead is not None:
            self.on_dead(reason)

    on_dead = None
