"""Constrained requests under a head drafter (EAGLE, EAGLE-3, Medusa): the head's draft or the
n-gram speculator's, per request step, by expected accepted length.

A schema's answer is mostly text the head guesses badly and an n-gram trie knows: keys and
punctuation (forced by the grammar, both sources get them) and, between them, the values,
copied from the prompt or recurring across answers (`"age": 3` -> `0, "city": "`). The head
drafts at most `num_steps` tokens from its own greedy context; the n-gram speculator drafts
forced text + its trie's chain (prompt and earlier answers), as long as its own measured
per-position rates say pays, with prefill drafts too. For each constrained request step both
are asked and the one with the larger expected accepted length is verified:

- n-gram: its own estimate (`state.expected`: forced + its per-request rates' products);
- head: forced + the products of the head's per-position acceptance rates on constrained
  requests (a running average of what its drafts there earned, measured here).

Either draft is cut by the grammar before verification, so the choice changes speed only.
Free (unconstrained) requests never reach this: the head drafts them.

The head is paid for every step it runs (its catch-up over the step's rows, from the prompt
on, and its draft loop), chosen or not, so a constrained request runs it only while it
earns more than the n-gram draft it displaces, by at least its cost: `uses_head` decides per
request, at its first draft, from `head_gain`, a running average per verify of such requests
of the head's tokens past the n-gram's (its realised length where its draft was verified,
its estimate where the head's was) less the tokens the n-gram alone would have earned in
the head's time (`_net_gain`), with every PROBE_EVERY-th constrained request using it anyway
to re-measure. The comparison is with the n-gram draft, not with nothing (the head's tokens
past the forced text): where the n-gram's chains earn several tokens a verify, a head that
beats nothing still loses to them. A request it
skips drafts n-gram chains only: its rows (`headless`) get no catch-up, a forward of such
requests alone keeps no features for the head, and a batch of their chains alone is cut and
judged by the n-gram speculator's own rule (`NgramSpeculator.worth_verifying`), as NGRAM's.
(What the bundled heads earn on bench_spec's JSON jobs against the n-gram chains, and their
`head_gain`: docs/benchmarks.md, "Figures moved out of module docstrings".)

`HeadGate` is the head drafters' off-switch by measured costs: server-wide acceptance rates of
the head's free drafts per position, the expected gain of each request's draft from them, the
n-gram speculator's verify cost model (`speculator.extra_cost`, or the table measured for
this model, `cost.VerifyCost`: a verify step's cost over a decode step's by batch size and
draft length) and the cost of one more level of an EAGLE head's draft loop (`per_level`:
from the weights a level reads over those a target decode step reads, then the head's
measured round time, `observe`). Before the head drafts, the chain is cut at the length
whose expected tokens less its verify cost and head levels is largest (`levels`); a batch
size where even the best cut cannot pay captures no features and runs the head not at all.
A batch of drafts verifies when its requests' expected gains pay b x extra_cost(b, longest
draft). Declined batches probe anyway (capture, draft, verify) at the first decline and then
at gaps doubling from PROBE_EVERY to PROBE_MAX while the declines last, and every
PROBE_EVERY-th round drafts every position, so rates that fell, or lie past the cut,
re-measure.

The head's fixed cost per round (the catch-up) is not in the on/off decision: a decline stops
drafting until the next probe, PROBE_EVERY steps on, and the server-wide rates swing from one
request to the next, so where drafting is near break-even (batch 1 on the bundled model)
counting it declined often and cost more than it saved (the paired rounds: docs/benchmarks.md,
"Figures moved out of module docstrings").
"""

from __future__ import annotations

from loom.runtime.spec import DraftTree, tree_depths

RATE_DECAY = 0.1  # the head's constrained-request rates: a running average over verifies
GAIN_DECAY = 0.3  # the head's net gain over the n-gram draft (`head_gain`): a faster average
PROBE_EVERY = 16  # a declined batch verifies anyway every this many (the rates re-measure)
PROBE_MAX = 256  # the longest gap between probes of a gate that keeps declining
HEAD_COST_DECAY = 0.2  # the head's measured cost per level (`HeadGate.observe`): running average


def _update(rates: list[float], drafted: int, accepted: int, forced: int) -> None:
    """Running acceptance per position past the forced text, up to the first miss."""
    if accepted < forced:
        return
    for j in range(min(drafted - forced, accepted - forced + 1, len(rates))):
        hit = 1.0 if j < accepted - forced else 0.0
        rates[j] += RATE_DECAY * (hit - rates[j])


def _chances(rates: list[float], n: int) -> list[float]:
    """The chance each of the first n draft positions is accepted: running products of the
    per-position rates (the last rate repeats past the list)."""
    gain, out = 1.0, []
    for j in range(n):
        gain *= rates[min(j, len(rates) - 1)]
        out.append(gain)
    return out


def matmul_numel(modules) -> int:
    """Weight entries the matmuls of `modules` read (their 2-D parameters, each once; a
    block-quantized weight counts its rows x columns: its float storage is released, and a
    GGUF target counted as 0 made the head gate divide by zero)."""
    seen = {}
    for m in modules:
        for p in m.parameters():
            q = getattr(p, "quant", None)
            if q is not None:
                seen[id(p)] = q.rows * q.cols
            elif p.dim() == 2:
                seen[id(p)] = p.numel()
    return sum(seen.values())


def target_matmul_numel(model) -> int:
    """Weight entries a target decode step reads: its layers and its LM head (the embedding
    only where it is the LM head: a step reads one row of it otherwise)."""
    return matmul_numel([model.model.layers]) + matmul_numel([model.lm_head])


class HeadGate:
    """Whether a head drafter's batch drafts, how many positions, and whether it verifies.
    `per_level`: the head's cost per draft level, in target decode steps (0: a head whose one
    call drafts every position, Medusa's)."""

    def __init__(self, positions: int, per_level: float = 0.0):
        from loom.runtime.spec.speculator import extra_cost

        self.cost = extra_cost
        self.per_level = per_level
        self.pinned = False  # True: `per_level` is the caller's, not moved by `observe`
        self._memo: dict = {}
        self.rates = [1.0] * max(1, positions)  # the head's free drafts, server-wide
        self.declined = 0
        self.rounds = 0  # drafting rounds (every PROBE_EVERY-th drafts every position)
        self.batch_size = 1
        self.probe = False  # a probe: two steps enabled, their drafts verified whatever the gain
        self.probe_left = 0
        self.next_probe, self.probe_gap = 1, PROBE_EVERY  # the first decline probes

    def set_cost(self, cost) -> None:
        """The verify cost table measured for this model (`cost.VerifyCost`)."""
        self.cost = cost
        self._memo.clear()

    @property
    def rates(self) -> list[float]:
        """Acceptance per draft position of the head's free drafts (read-only: `record` and
        the setter move them)."""
        return self._rates

    @rates.setter
    def rates(self, rates: list[float]) -> None:
        # `gains` and `_cut` are kept by argument until the rates move: a b1 step asks for
        # them ~5 times (enabled, levels, each draft's expected gain) between two verifies
        self._rates = rates
        self._memo.clear()

    def gains(self, n: int) -> tuple[float, ...]:
        """The chance each of the first n draft positions is accepted."""
        out = self._memo.get(n)
        if out is None:
            out = self._memo[n] = tuple(_chances(self._rates, n))
        return out

    def _cut(self, b: int, n: int) -> tuple[int, float]:
        """(d, value): the chain length (of n, at least 1) whose expected accepted tokens a
        request, less what the verify costs beyond a decode step at batch size b and d drafts
        and the head's d levels (shared by the batch), is largest, and that value in decode
        steps (< 0: no length pays). The verify cost is read at each length, not as a slope
        from 0: a measured table (`cost.CostTable`) prices each row of a quantized target's
        verify at what it costs."""
        out = self._memo.get((b, n))
        if out is None:
            best, best_d, total = float("-inf"), min(1, n), 0.0
            for d, g in enumerate(self.gains(n), 1):
                total += g
                value = total - self.cost(b, d) - d * self.per_level / b
                if value > best:
                    best, best_d = value, d
            out = self._memo[(b, n)] = (best_d, best)
        return out

    def enabled(self, batch_size: int, longest: int) -> bool:
        """The best cut of a `longest` draft at the measured rates pays its verify and its
        head levels at this batch size (or a probe)."""
        self.batch_size = b = batch_size
        if self.probe_left > 0:  # a probe's second step: it drafts from the first's features
            self.probe_left -= 1
            return True
        self.probe = False
        d, value = self._cut(b, longest)
        if d and value >= 0:
            self.probe_gap = PROBE_EVERY
            return True
        self.declined += 1
        if self.declined >= self.next_probe:  # this step captures, the next drafts
            self.probe, self.probe_left = True, 1
            # declines in a row probe ever less often (PROBE_EVERY, then 2x, 4x, ... up to
            # PROBE_MAX): a probe is a capture, the head's catch-up over every row since the
            # last one and a verify, and where the head never pays (SmolLM2's Q4_1 target:
            # acceptance 0.23 at position 1, the runs read 0.87-0.91x) probing every
            # PROBE_EVERY declines is a standing cost
            self.next_probe = self.declined + self.probe_gap
            self.probe_gap = min(PROBE_MAX, 2 * self.probe_gap)
        return self.probe

    def levels(self, n: int) -> int:
        """Positions (of n) the head drafts this round at the current batch size: the cut
        (`_cut`); all n in a probe and every PROBE_EVERY-th round, so that the positions past
        the cut keep being measured."""
        self.rounds += 1
        if self.probe or self.rounds % PROBE_EVERY == 0:
            return n
        return self._cut(self.batch_size, n)[0]

    def worth(self, expected: list[float], longest: int) -> bool:
        b = len(expected)
        if self.probe or sum(expected) >= b * self.cost(b, longest):
            return True
        self.declined += 1
        return self.declined % PROBE_EVERY == 1

    def record(self, drafted: int, accepted: int) -> None:
        _update(self._rates, drafted, accepted, 0)
        self._memo.clear()

    def observe(self, seconds: float, levels: int, step_seconds: float, b: int, d: int) -> None:
        """A head round took `seconds` after a target step of `step_seconds` at batch size b
        verifying up to d drafts: `per_level` becomes a running average of the round's cost
        per level (the catch-up counted as one), in decode steps of that batch (the step's
        seconds over 1 + the verify cost at (b, d)). The weight ratio it starts from is a
        floor the head's real cost can sit far above: on SmolLM2's Q4_1 file the target's
        step runs the C forward over 4-bit blocks while the head (whose C round declines a
        quantized embedding) runs eager torch."""
        if self.pinned or step_seconds <= 0 or seconds <= 0:
            return
        decode = step_seconds / (1.0 + (self.cost(b, d) if d > 0 else 0.0))
        unit = seconds / (1 + levels) / decode
        self.per_level += HEAD_COST_DECAY * (unit - self.per_level)
        self._memo.clear()


def _net_gain(source, accepted: int, ngram_expected: float, spent: float, step: float) -> float:
    """What the head earned a constrained request's verify over the n-gram draft it displaced,
    net of its cost, in tokens. The n-gram's tokens at this step: its realised accepted length
    where its draft was verified, its own estimate (`ngram_expected`) where the head's was.
    Earned: the head's accepted length past that (0 where the n-gram draft was verified).
    Cost: the tokens the n-gram alone would have earned in the head's time since the last
    verify (`spent`, its prefill catch-up included): spent / step x (its tokens + the bonus
    token), `step` the verify step's target forward (the step's other costs, sampling and
    scheduling, left out: this prices the head's time high, never low)."""
    ngram = accepted if source != "head" else ngram_expected
    earned = accepted - ngram if source == "head" else 0.0
    cost = spent / step * (ngram + 1) if step > 0 else 0.0
    return earned - cost


class NgramPolicy:
    """The head drafters' policy for constrained requests: the n-gram speculator's draft or
    the head's, per request step (the module docstring). The head drafters call its public
    methods only; `ngram` (the `NgramSpeculator`) is its own. `grammar`: the step's grammar
    owner, shared with the speculator (None: the speculator's own)."""

    def __init__(
        self, args, tokenizer, vocab_size: int, eos_token_ids, positions: int, grammar=None
    ):
        from loom.runtime.spec.speculator import NgramSpeculator

        self.ngram = NgramSpeculator(args, tokenizer, vocab_size, eos_token_ids, grammar=grammar)
        self.grammar = self.ngram.grammar
        self.num_draft = self.ngram.num_draft
        self.head_rates = [1.0] * max(1, positions)
        self.chosen = {"head": 0, "ngram": 0}
        # request rows whose live request the head drafts for / skips (no features kept for
        # it, no catch-up, no draft loop)
        self.headed: set[int] = set()
        self.headless: set[int] = set()
        # what the head earns constrained requests that use it over the n-gram draft it
        # displaces, net of its cost, a running average per verify (`_net_gain`; optimistic
        # until measured: a fresh server tries the head)
        self.head_gain = float(positions)
        self.requests = 0  # constrained requests seen (every PROBE_EVERY-th uses the head)
        # rows of constrained requests that use the head (`priced`) and, per such row, the
        # head's seconds spent on the steps since the request's last verify (its prefill's
        # catch-up included), each step's whole time charged to every row it ran for
        # (`charge`; free requests, which the head drafts whatever it costs, pay nothing)
        self.priced: set[int] = set()
        self.head_seconds: dict[int, float] = {}
        # True: the head's time is not charged (`charge` keeps nothing), so `head_gain` moves
        # by accepted lengths alone and the choice no longer depends on timing (the head
        # tests pin it, as `HeadGate.pinned`, to compare verify counts run to run)
        self.free = False

    def enabled_for(self, batch_size: int) -> None:
        """The step's batch size: the n-gram speculator's learning budget is shared by it."""
        self.ngram.enabled_for(batch_size)

    def set_verify_cost(self, cost) -> None:
        self.ngram.set_verify_cost(cost)

    def worth_verifying(self, reqs: list, drafts: list) -> bool:
        """A batch of n-gram chains only (constrained requests the head skips): cut and
        judged by the n-gram speculator's own rule, as NGRAM's."""
        return self.ngram.worth_verifying(reqs, drafts)

    def uses_head(self, req) -> bool:
        """Whether the head runs for `req`: always for a free request; for a constrained one,
        decided at its first draft (`spec_head`) and kept, since the head's KV of a request is
        built by catch-ups from its prompt on (`_head_pays`)."""
        use = req.spec_head
        if use is None:
            use = req.spec_head = req.grammar is None or self._head_pays()
        row = req.req_pool_idx
        if row is not None:
            (self.headed if use else self.headless).add(row)
            (self.headless if use else self.headed).discard(row)
            if use and req.grammar is not None:
                self.priced.add(row)
            else:
                self.priced.discard(row)
        return use

    def _head_pays(self) -> bool:
        """A constrained request uses the head while the head earns such requests more than
        the n-gram draft it displaces, net of its cost (`head_gain` >= 0), and every
        PROBE_EVERY-th request anyway, to re-measure."""
        self.requests += 1
        return self.head_gain >= 0.0 or self.requests % PROBE_EVERY == 1

    def charge(self, rows: list[int], seconds: float) -> None:
        """The head ran `seconds` after a step over request rows `rows`: each constrained
        request among them that uses the head pays the whole of it (`_net_gain` prices it at
        the row's own rate)."""
        if self.free:
            return
        for row in rows:
            if row in self.priced:
                self.head_seconds[row] = self.head_seconds.get(row, 0.0) + seconds

    def head_expected(self, forced: int, tokens: list[int], parents: list[int]) -> float:
        """forced + sum over the head's draft depths past the forced text of the products of
        its constrained-request rates."""
        depth = 1 + max(tree_depths(parents), default=-1) if tokens else 0
        return float(forced) + sum(_chances(self.head_rates, max(0, depth - forced)))

    def ngram_draft(self, req, room: int) -> tuple[list[int], float]:
        """The n-gram speculator's draft for `req` (walked by the grammar: `req.draft_masks`
        and `draft_forced` are its) and its expected accepted length."""
        draft = self.ngram.draft(req, room)
        if isinstance(draft, DraftTree):  # breadth > 1: keep its deepest chain's estimate
            draft = list(draft.tokens) if draft.is_chain else []
        expected = req.spec_state.expected if draft else 0.0
        req.ngram_expected = expected  # what the head's draft must beat (`_net_gain`)
        return list(draft), expected

    def take_ngram(self, req, ngram: list[int], expected: float, forced: int) -> list[int]:
        """`req` verifies the n-gram speculator's draft (`ngram_draft`'s, with its expected
        accepted length and forced-token count): the bookkeeping that routes its outcome."""
        self.chosen["ngram"] += 1
        req.draft_source, req.draft_forced, req.draft_expected = "ngram", forced, expected
        return ngram

    def draft_prefill(self, req, room: int) -> list[int]:
        if req.grammar is None:
            return []
        req.draft_source = "ngram"
        return self.ngram.draft_prefill(req, room)

    def on_verified(self, req, drafted: int, accepted: int, step_seconds: float = 0.0) -> None:
        """Route a verify's outcome to the source that drafted it; `step_seconds`: the
        target's forward time of the verify step (prices the head's time, `_net_gain`)."""
        source = req.draft_source
        req.draft_source = None
        if source == "ngram":
            self.ngram.on_verified(req, drafted, accepted)
        elif source == "head":
            _update(self.head_rates, drafted, accepted, req.draft_forced)
        spent = self.head_seconds.pop(req.req_pool_idx, 0.0)
        if req.grammar is not None and req.spec_head:
            net = _net_gain(source, accepted, req.ngram_expected, spent, step_seconds)
            self.head_gain += GAIN_DECAY * (net - self.head_gain)

    def on_finished(self, req) -> None:
        self.ngram.on_finished(req)  # a request that drafted through the trie teaches it
        # its row leaves both: a stale `headless` row would keep the next request there out
        # of the catch-up until its first draft (a prompt chunk before its last, a prefill with
        # logprobs). The finishing step that writes a skipped request's last KV may keep
        # features then, but runs no catch-up (it samples nothing)
        self.headed.discard(req.req_pool_idx)
        self.headless.discard(req.req_pool_idx)
        self.priced.discard(req.req_pool_idx)
        self.head_seconds.pop(req.req_pool_idx, None)

    def summary(self) -> dict:
        return {
            "spec_constrained_head": self.chosen["head"],
            "spec_constrained_ngram": self.chosen["ngram"],
        }
