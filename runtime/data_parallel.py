"""`Engine(dp_size=N)`: N whole replicas (scheduler ranks, detokenizer, TokenizerManager each,
own KV pool and radix cache) behind one in-process front.

The front speaks the TokenizerManager's interface (generate, generate_stream, flush_cache,
get_internal_state, abort_request, close), so the Engine drives one replica or N the same way.
Each prompt of a request goes to the replica the `--load-balance-method` policy picks (the
router's policies, runtime/router/policy.py: round_robin, shortest_queue, cache_aware on the
prompt); a batch becomes one sub-batch per replica and its results come back in the caller's
order (a prompt's n copies together, as on one replica). A request that is not a batch goes
whole to one replica. `loom serve --dp-size N` (runtime/router/dp.py) runs the replicas as
servers behind the HTTP router instead.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator

import msgspec

from loom.runtime.io_struct import GenerateReqInput
from loom.runtime.request_normalizer import RequestError
from loom.runtime.router.policy import make_policy
from loom.runtime.router.tree import ids_key

# GenerateReqInput fields that may hold one value per prompt (the rest apply to the whole batch)
PER_PROMPT = ("sampling_params", "rid", "return_logprob", "logprob_start_len", "top_logprobs_num")


@dataclasses.dataclass(eq=False)
class _Replica:
    """What a policy sees: a name and the requests in flight (the router's Worker shape)."""

    url: str
    tm: object
    assigned: int = 0  # prompts given to it by the request being split

    @property
    def in_flight(self) -> int:
        return len(self.tm.rid_to_state) + self.assigned


class DataParallelFront:
    def __init__(self, tokenizer_managers: list, policy: str):
        self.replicas = [_Replica(f"dp{i}", tm) for i, tm in enumerate(tokenizer_managers)]
        self.policy = make_policy(policy)

    @property
    def dead_reason(self) -> str | None:
        return next((r.tm.dead_reason for r in self.replicas if r.tm.dead_reason), None)

    async def start(self) -> None:
        for r in self.replicas:
            await r.tm.start()

    async def close(self) -> None:
        for r in self.replicas:
            await r.tm.close()

    # ------------------------------------------------------------------ dispatch
    def _split(self, obj: GenerateReqInput) -> list[tuple[_Replica, list[int]]] | None:
        """(replica, prompt indices) per replica that gets part of a batch; None: not a batch."""
        prompts = obj.text if obj.text is not None else obj.input_ids
        batch = isinstance(prompts, list) and bool(prompts)
        if obj.text is None:
            batch = batch and isinstance(prompts[0], list)
        if not batch:
            return None
        n = len(prompts)
        for field in PER_PROMPT:  # the replica checks the rest; a bad length must not be sliced
            value = getattr(obj, field)
            if isinstance(value, list) and len(value) != n:
                raise RequestError(f"{field}: a list of {len(value)} for a batch of {n}")
        groups: dict[int, list[int]] = {}
        try:
            for i, prompt in enumerate(prompts):
                key = prompt if isinstance(prompt, str) else ids_key(prompt)
                chosen = self.policy.select(self.replicas, key)
                chosen.assigned += 1
                groups.setdefault(self.replicas.index(chosen), []).append(i)
        finally:
            for r in self.replicas:
                r.assigned = 0
        return [(self.replicas[k], idx) for k, idx in sorted(groups.items())]

    def _one(self, obj: GenerateReqInput) -> _Replica:
        prompt = obj.text if obj.text is not None else obj.input_ids
        key = prompt if isinstance(prompt, str) else ids_key(prompt or [])
        return self.policy.select(self.replicas, key)

    @staticmethod
    def _pick(obj: GenerateReqInput, idx: list[int]) -> GenerateReqInput:
        """The sub-batch of prompts `idx`, with their per-prompt values."""
        changes = {}
        for field in ("text", "input_ids", *PER_PROMPT):
            value = getattr(obj, field)
            if isinstance(value, list):
                changes[field] = [value[i] for i in idx]
        return msgspec.structs.replace(obj, **changes)

    @staticmethod
    def _copies(obj: GenerateReqInput, i: int) -> int:
        sp = obj.sampling_params
        sp = sp[i] if isinstance(sp, list) else sp
        return int((sp or {}).get("n", 1) or 1)

    async def generate(self, obj: GenerateReqInput, *args) -> dict | list[dict]:
        parts = self._split(obj)
        if parts is None:
            return await self._one(obj).tm.generate(obj, *args)
        results = await asyncio.gather(
            *(r.tm.generate(self._pick(obj, idx), *args) for r, idx in parts)
        )
        by_prompt: dict[int, list[dict]] = {}
        for (_, idx), got in zip(parts, results):
            got = got if isinstance(got, list) else [got]
            at = 0
            for i in idx:
                k = self._copies(obj, i)
                by_prompt[i], at = got[at : at + k], at + k
        return [out for i in sorted(by_prompt) for out in by_prompt[i]]

    async def generate_stream(self, obj: GenerateReqInput, *args) -> AsyncIterator[dict]:
        """Chunks as each replica yields them; a batch's 'index' is the caller's (prompt i's
        copies numbered as one replica numbers them)."""
        parts = self._split(obj)
        if parts is None:
            async for out in self._one(obj).tm.generate_stream(obj, *args):
                yield out
            return
        starts, at = [], 0  # the caller's first state index of each prompt
        for i in range(len(obj.text if obj.text is not None else obj.input_ids)):
            starts.append(at)
            at += self._copies(obj, i)
        queue: asyncio.Queue = asyncio.Queue()
        done = object()

        async def pump(replica: _Replica, idx: list[int]) -> None:
            local = [starts[i] + j for i in idx for j in range(self._copies(obj, i))]
            try:
                async for out in replica.tm.generate_stream(self._pick(obj, idx), *args):
                    if "index" in out:
                        out["index"] = local[out["index"]]
                    else:  # one state on this replica: index it for the caller's batch
                        out["index"] = local[0]
                    await queue.put(out)
            except BaseException as e:  # noqa: BLE001 - re-raised to the caller below
                await queue.put(e)
            await queue.put(done)

        tasks = [asyncio.ensure_future(pump(r, idx)) for r, idx in parts]
        try:
            left = len(tasks)
            while left:
                item = await queue.get()
                if item is done:
                    left -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            for t in tasks:
                t.cancel()

    # ------------------------------------------------------------------ control
    async def flush_cache(self):
        """Every replica's cache; the first refusal if any refused."""
        outs = await asyncio.gather(*(r.tm.flush_cache() for r in self.replicas))
        return next((o for o in outs if not o.ok), outs[0])

    async def get_internal_state(self) -> dict:
        """Replica 0's state at the top level (as one replica reports it), every replica's
        under 'dp_replicas'."""
        states = await asyncio.gather(*(r.tm.get_internal_state() for r in self.replicas))
        return {**states[0], "dp_replicas": list(states)}

    def abort_request(self, rid: str) -> None:
        for r in self.replicas:
            r.tm.abort_request(rid)
