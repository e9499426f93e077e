"""Request normalisation: a `GenerateReqInput` checked field by field and expanded into one
`ReqState` per prompt and copy (n), before anything is sent. Bad input raises `RequestError`
naming the client's field."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Mapping

import msgspec

from loom.runtime.io_struct import GenerateReqInput, TokenizedGenerateReq
from loom.runtime.request_state import ReqState
from loom.runtime.sampling_params import make_sampling_params

NATIVE_NAMES: Mapping[str, str] = {}  # a native request names its fields as they are

MAX_TOP_LOGPROBS = 128  # top_logprobs_num bound: each one costs a top-k per token


class RequestError(ValueError):
    """Bad input; the message names the field. The HTTP layer returns it as a 400."""

    status_code = 400


class RequestNormalizer:
    """The TokenizerManager's input side (a base class of it): reads `args`, `tokenizer`,
    `context_len`, `vocab_size`, `rid_to_state` (a rid may not repeat a running one), `_rng`
    (seeds) and `off_loop` (tokenizing off the event loop)."""

    async def normalize(
        self, obj: GenerateReqInput, names: Mapping[str, str] = NATIVE_NAMES
    ) -> tuple[list[ReqState], bool]:
        """Expand a request into one state per prompt and copy (n); returns (states, is_batch).
        Every check runs before anything is sent. `names` maps native field names to the ones
        the client used (the OpenAI layer's `max_tokens`, `prompt`), so errors name its field."""

        def name(field: str) -> str:
            return names.get(field, field)

        prompt_field = name("text") if obj.text is not None else name("input_ids")
        if (obj.text is None) == (obj.input_ids is None):
            raise RequestError(f"{name('text')}, {name('input_ids')}: exactly one must be given")
        if obj.text is not None:
            is_batch = isinstance(obj.text, list)
            texts: list[str | None] = obj.text if is_batch else [obj.text]
        else:
            ids = obj.input_ids
            is_batch = bool(ids) and isinstance(ids[0], list)
            id_lists = ids if is_batch else [ids]
            for lst in id_lists:
                if not isinstance(lst, list) or not all(type(i) is int for i in lst):
                    raise RequestError(
                        f"{prompt_field}: must be a list of integers or a list of such lists"
                    )
            texts = [None] * len(id_lists)
        count = len(texts)
        if is_batch and not count:
            raise RequestError(f"{prompt_field}: the batch is empty")
        params = self._per_prompt(obj.sampling_params, "sampling_params", count, None)
        sps = []
        for raw in params:
            try:
                sps.append(make_sampling_params(raw, self.vocab_size))
            except ValueError as e:
                field, _, why = str(e).partition(": ")
                where = names.get(field) or (
                    field if field == "sampling_params" else f"sampling_params.{field}"
                )
                raise RequestError(f"{where}: {why}") from None
        total = sum(sp.n for sp in sps)
        cap = self.args.max_batch_request
        if total > cap:
            raise RequestError(
                f"{prompt_field}: this request expands to {total} generations (prompts x n); "
                f"the server's --max-batch-request is {cap}"
            )
        rids = self._rids(obj.rid, is_batch, count, name("rid"))
        return_logprob = self._per_prompt(obj.return_logprob, "return_logprob", count, False)
        starts = self._per_prompt(obj.logprob_start_len, "logprob_start_len", count, -1)
        tops = self._per_prompt(obj.top_logprobs_num, "top_logprobs_num", count, 0)
        if obj.text is not None:
            prompts = await self.off_loop(self._encode_all, texts, prompt_field)
        else:
            prompts = [list(lst) for lst in id_lists]
        bootstraps = iter(self._bootstrap(obj, [sp.n for sp in sps], names))
        extra_key = obj.extra_key
        if obj.cache_salt is not None:
            extra_key = f"{extra_key or ''}\x00{obj.cache_salt}"
        states: list[ReqState] = []
        now = time.monotonic()
        for i, (input_ids, sp, rid) in enumerate(zip(prompts, sps, rids)):
            self._check_prompt(input_ids, prompt_field)
            room = self.context_len - len(input_ids)
            if sp.min_new_tokens > room:
                raise RequestError(
                    f"{name('min_new_tokens')}: {sp.min_new_tokens} new tokens do not fit the "
                    f"context ({self.context_len}) after a {len(input_ids)}-token prompt"
                )
            if not 0 <= tops[i] <= MAX_TOP_LOGPROBS:
                raise RequestError(
                    f"{name('top_logprobs_num')}: must be in [0, {MAX_TOP_LOGPROBS}], got {tops[i]}"
                )
            start = starts[i]
            if not -1 <= start <= len(input_ids):
                raise RequestError(
                    f"{name('logprob_start_len')}: must be in [-1, {len(input_ids)}] (-1: output "
                    f"logprobs only; the prompt has {len(input_ids)} tokens), got {start}"
                )
            if start == -1:  # SGLang: no input logprobs
                start = len(input_ids)
            for j in range(sp.n):
                copy = msgspec.structs.replace(sp, n=1, max_new_tokens=min(sp.max_new_tokens, room))
                seed = (
                    sp.sampling_seed + j
                    if sp.sampling_seed is not None
                    else self._rng.getrandbits(62)
                )
                msg = TokenizedGenerateReq(
                    rid=rid if sp.n == 1 else f"{rid}-{j}",
                    input_ids=input_ids,
                    sampling_params=copy,
                    seed=seed,
                    stream=obj.stream,
                    return_logprob=return_logprob[i],
                    logprob_start_len=start,
                    top_logprobs_num=tops[i],
                    extra_key=extra_key,
                    bootstrap=next(bootstraps),
                )
                states.append(
                    ReqState(
                        msg, obj.return_text_in_logprobs, obj.log_metrics, now, asyncio.Event()
                    )
                )
        seen: set[str] = set()
        for st in states:
            rid = st.msg.rid
            if rid in seen or rid in self.rid_to_state:
                raise RequestError(f"{name('rid')}: {rid!r} is already running or repeated")
            seen.add(rid)
        return states, is_batch or len(states) > 1

    @staticmethod
    def _per_prompt(value, field: str, n: int, default) -> list:
        """One value per prompt: a list of n, or one value (None: the default) for all."""
        if value is None:
            return [default] * n
        if isinstance(value, list):
            if len(value) != n:
                raise RequestError(f"{field}: a list of {len(value)} for a batch of {n}")
            return [default if v is None else v for v in value]
        return [value] * n

    def _bootstrap(self, obj, counts: list[int], names: dict) -> list[tuple[str, int, int] | None]:
        """One (host, port, room) per generation, in expansion order (prompt-major, then copy),
        `counts` being each prompt's n. A PD-mode server needs all three fields (the router
        sets them); a plain server refuses them by name. As SGLang does, each field is one
        value or a list: one per prompt (sglang-router's batches) or one per generation (its
        chat n > 1). One room pairs one generation, so a room given once for several
        generations counts up from it (room + k for the k-th), on the prefill and the decode
        server alike, and a room listed per prompt counts up over that prompt's copies."""
        mode = self.args.disaggregation_mode
        fields = ("bootstrap_host", "bootstrap_port", "bootstrap_room")
        given = {f: getattr(obj, f) for f in fields if getattr(obj, f) is not None}
        total = sum(counts)
        if mode == "null":
            if given:
                raise RequestError(
                    f"{names.get(next(iter(given))) or next(iter(given))}: needs a server "
                    "started with --disaggregation-mode prefill|decode"
                )
            return [None] * total
        for f in fields:
            if f not in given:
                raise RequestError(
                    f"{names.get(f) or f}: required on a --disaggregation-mode {mode} server "
                    "(send requests through a PD router: sglang-router or `loom router "
                    "--pd-disaggregation`)"
                )
        per_gen = {f: _per_generation(given[f], counts, names.get(f) or f) for f in fields}
        out = []
        for (host, _), (port, _), (room, step) in zip(
            per_gen["bootstrap_host"], per_gen["bootstrap_port"], per_gen["bootstrap_room"]
        ):
            if type(room) is int:
                room += step
            if not isinstance(host, str) or not host:
                raise RequestError(
                    f"{names.get('bootstrap_host') or 'bootstrap_host'}: a host name, got {host!r}"
                )
            if type(port) is not int or not 0 < port < 65536:
                raise RequestError(
                    f"{names.get('bootstrap_port') or 'bootstrap_port'}: a port in [1, 65535], "
                    f"got {port!r}"
                )
            if type(room) is not int or not 0 <= room < 2**64:
                raise RequestError(
                    f"{names.get('bootstrap_room') or 'bootstrap_room'}: an integer in "
                    f"[0, 2**64), got {room!r}"
                )
            out.append((host, port, room))
        return out

    @staticmethod
    def _rids(rids, is_batch: bool, n: int, field: str) -> list[str]:
        if rids is None:
            return [uuid.uuid4().hex for _ in range(n)]
        if not is_batch:
            if isinstance(rids, list):
                raise RequestError(f"{field}: a single prompt takes a single rid string")
            return [rids]
        if not isinstance(rids, list) or len(rids) != n:
            raise RequestError(f"{field}: a batch needs a list of rids, one per prompt")
        return list(rids)

    def _encode_all(self, texts: list[str], field: str) -> list[list[int]]:
        if self.tokenizer is None:
            raise RequestError(
                f"{field}: this server was started with skip_tokenizer_init; send input_ids"
            )
        return [self.tokenizer.encode(t) for t in texts]

    def _check_prompt(self, ids: list[int], field: str) -> None:
        if not ids:
            raise RequestError(f"{field}: the prompt is empty")
        if len(ids) >= self.context_len:
            raise RequestError(
                f"{field}: the prompt has {len(ids)} tokens; the context length is {self.context_len}"
            )
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise RequestError(f"{field}: token id {bad[0]} is outside [0, {self.vocab_size})")


def _per_generation(value, counts: list[int], field: str) -> list[tuple]:
    """A bootstrap field as (value, offset) per generation: a scalar for all, a list of one per
    prompt (offset = the copy's index j: its room is room + j) or one per generation."""
    total = sum(counts)
    if not isinstance(value, list):
        return [(value, k) for k in range(total)]
    if len(value) == total:
        return [(v, 0) for v in value]
    if len(value) == len(counts):
        return [(v, j) for v, n in zip(value, counts) for j in range(n)]
    raise RequestError(
        f"{field}: a list of {len(value)} for {len(counts)} prompt(s) and {total} generation(s)"
    )
