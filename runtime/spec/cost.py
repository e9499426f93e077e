"""What a verify step costs beyond a decode step, per model: the table the n-gram speculator's
adaptive depth and verify-or-decode choice price drafts with (`speculator._cut`).

The cost is in decode steps of the same batch, for a batch of B requests each verifying up to
d draft tokens: a table of measured cells (B, d) read by interpolation (`CostTable`), or the
bilinear fit extra(B, d) = a + b B + c d + e B d (the form `benchmarks/bench_verify_cost.py`
fits; the bundled model's, and a file with no cells). The fit cannot describe a quantized
target: on SmolLM2's Q4_1 file a verify of up to 7 drafts at batch 1 runs the 1-8 row f32
register GEMV, whose cost grows with every row (0.25 decode steps for 1 draft, ~1.9 for 7),
while batch 3 and 6 cells run the many-row kernels; fit through both, the table charged 0.74
for 1 draft and 1.42 for 7, so the speculator drafted 7 deep where the depth it paid for was
~3 (docs/benchmarks.md, "Issue 33: speculation that does not lose on a quantized target"). It depends on the model and the machine: the bundled model's step is mostly fixed
per-step overhead (1.04 decode steps for a 7-token verify at batch 1), SmolLM2-135M's mostly
weight reads that a verify shares (0.49). So `--speculative-verify-cost`:

- `auto` (default): the bundled model and models under MEASURE_MIN_WEIGHTS weight entries
  use `BUNDLED` (it was measured on the bundled model; a step that small is per-step overhead
  either way). Larger models use the table measured for this model and these settings, kept
  under CACHE_DIR (by `bench_verify_cost --write` or an earlier start-up), else measured at
  start-up (`measure`, about 30 whole steps) and kept there.
- `measure`: measure at start-up whatever the cache holds (and keep it).
- `bundled`: the bundled model's fit.
- a path: a JSON file `{"coef": [a, b, c, e]}` (what `bench_verify_cost --write PATH` writes).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path

from loom.runtime.spec import Drafter

logger = logging.getLogger(__name__)

# the bundled model's fit (bench_verify_cost, docs/benchmarks.md "Figures moved out of module
# docstrings"): within 27% from batch 2, 0.06-0.26 decode steps dear at batch 1
BUNDLED = (0.218, 0.045, 0.083, 0.028)
# below this many weight entries read per decode step the model is the bundled model's size
# class (tests' tiny models): its step is fixed overhead and BUNDLED describes it
MEASURE_MIN_WEIGHTS = 20_000_000
CACHE_DIR = Path(os.environ.get("LOOM_CACHE", Path.home() / ".cache" / "loom")) / "spec_cost"
MODES = ("auto", "measure", "bundled")
# in the cache key: a table measured by an older `measure` (a bilinear fit over other cells)
# is measured again rather than read
TABLE_VERSION = 3
# the synthetic prompts' length of the table's cells, and of its long-context row: a verify's
# extra rows attend over the whole context (small_attention) where the decode step's one row
# does too, so what a draft costs grows with the context (SmolLM2's Q4_1 file: 1 draft 0.06
# decode steps at 96 tokens, ~0.2-0.4 at 1,024; a table priced at 96 tokens let Spec-Bench's
# long prompts verify 1-token drafts that accepted nothing, 597 of 923 verifies)
SHORT_CONTEXT = 96
LONG_CONTEXT = 1024


def _monotone(ys: list[float]) -> list[float]:
    """The least-squares non-decreasing fit of `ys` (pool adjacent violators): a verify with
    more rows never costs less, and a noisy cell (a step that met a busy core) must not make
    a deeper draft look cheaper than a shallower one."""
    blocks: list[list[float]] = []  # [mean, weight]
    for y in ys:
        blocks.append([y, 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m1, w1), (m2, w2) = blocks[-2], blocks[-1]
            blocks[-2:] = [[(m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2]]
    return [m for m, w in blocks for _ in range(int(w))]


class CostTable:
    """Measured cells (B, d, extra decode steps) read by interpolation: per batch size,
    piecewise linear in d through (0, 0) (no drafts: a decode step) and the cells, made
    non-decreasing in d (`_monotone`), the last slope carried past the deepest cell; between
    batch sizes linear in B, below the smallest its row, past the largest the last two rows'
    slope (never below the largest row)."""

    def __init__(self, cells):
        rows: dict[int, list[tuple[int, float]]] = {}
        for b, d, c in cells:
            if int(b) < 1 or int(d) < 1:
                raise ValueError(f"verify cost: a cell needs batch >= 1 and drafts >= 1: {b, d}")
            rows.setdefault(int(b), []).append((int(d), float(c)))
        if not rows:
            raise ValueError("verify cost: no cells")
        self.cells = sorted((b, d, c) for b, row in rows.items() for d, c in row)
        self.rows = {}
        for b, row in sorted(rows.items()):
            row.sort()
            ds = [0] + [d for d, _ in row]
            cs = _monotone([0.0] + [max(0.0, c) for _, c in row])
            self.rows[b] = (ds, cs)
        self.batches = sorted(self.rows)

    def _row(self, b: int, d: int) -> float:
        ds, cs = self.rows[b]
        if d <= 0:
            return 0.0
        for i in range(1, len(ds)):
            if d <= ds[i]:
                t = (d - ds[i - 1]) / (ds[i] - ds[i - 1])
                return cs[i - 1] + t * (cs[i] - cs[i - 1])
        slope = (cs[-1] - cs[-2]) / (ds[-1] - ds[-2])
        return cs[-1] + slope * (d - ds[-1])

    def __call__(self, batch_size: int, longest_draft: int) -> float:
        bs, d = self.batches, longest_draft
        if batch_size <= bs[0] or len(bs) == 1:
            return self._row(bs[0] if batch_size <= bs[0] else bs[-1], d)
        for lo, hi in zip(bs, bs[1:]):
            if batch_size <= hi:
                t = (batch_size - lo) / (hi - lo)
                return (1 - t) * self._row(lo, d) + t * self._row(hi, d)
        lo, hi = bs[-2], bs[-1]
        top = self._row(hi, d)
        return max(top, top + (top - self._row(lo, d)) / (hi - lo) * (batch_size - hi))


class VerifyCost:
    """extra(batch, longest draft) in decode steps, never below 0 (a fit's negative
    intercept must not make drafts look free): the measured cells' table where there is one,
    else the bilinear fit `coef`. extra(B, 0) is 0 with a table (no verify)."""

    prices_context = True  # takes the batch's context (`__call__`); the speculator asks

    def __init__(self, coef, source: str = "", cells=None, long_cells=None,
                 long_context: int = LONG_CONTEXT):  # fmt: skip
        self.coef = tuple(float(x) for x in coef)
        if len(self.coef) != 4:
            raise ValueError(f"verify cost: 4 coefficients (a, b, c, e), got {len(self.coef)}")
        self.source = source
        self.table = CostTable(cells) if cells else None
        # batch-1 cells measured at `long_context` tokens: the growth with the context
        self.long = CostTable(long_cells) if long_cells and self.table is not None else None
        self.long_context = int(long_context)
        if self.long is not None and self.long_context <= SHORT_CONTEXT:
            raise ValueError(f"verify cost: long_context must exceed {SHORT_CONTEXT}")

    def __call__(self, batch_size: int, longest_draft: int, context: float | None = None) -> float:
        """`context`: the batch's mean tokens per request (None: the table's own, 96); with a
        long-context row the batch-1 difference between the rows, per token, is added
        linearly in the context past 96 (attention grows linearly; below 96 nothing is taken
        off)."""
        if self.table is not None:
            base = self.table(batch_size, longest_draft)
            if self.long is None or context is None or context <= SHORT_CONTEXT:
                return base
            d = longest_draft
            per_token = max(0.0, self.long(1, d) - self.table(1, d)) / (
                self.long_context - SHORT_CONTEXT
            )
            return base + per_token * (context - SHORT_CONTEXT)
        a, b, c, e = self.coef
        B, d = batch_size, longest_draft
        return max(0.0, a + b * B + c * d + e * B * d)

    def to_json(self) -> dict:
        out = {"coef": list(self.coef), "source": self.source}
        if self.table is not None:
            out["cells"] = [list(c) for c in self.table.cells]
        if self.long is not None:
            out["long_cells"] = [list(c) for c in self.long.cells]
            out["long_context"] = self.long_context
        return out

    @classmethod
    def load(cls, path) -> VerifyCost:
        try:
            data = json.loads(Path(path).read_text())
            return cls(
                data["coef"], data.get("source", str(path)), data.get("cells"),
                data.get("long_cells"), data.get("long_context", LONG_CONTEXT),
            )  # fmt: skip
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"speculative_verify_cost: cannot read {path}: {e}") from e

    def __repr__(self) -> str:
        if self.table is not None:
            cells = " ".join(f"{b},{d}:{c:.2f}" for b, d, c in self.table.cells)
            if self.long is not None:
                cells += f"; at {self.long_context} tokens " + " ".join(
                    f"{b},{d}:{c:.2f}" for b, d, c in self.long.cells
                )
            return f"VerifyCost(cells {cells}; {self.source})"
        a, b, c, e = self.coef
        return f"VerifyCost({a:.3f} + {b:.3f} B + {c:.3f} d + {e:.3f} B d; {self.source})"


def fit(cells: list[tuple[int, int, float]]) -> tuple[float, float, float, float]:
    """Least squares a + b B + c d + e B d over (batch, drafts, cost beyond a decode step)."""
    import numpy as np

    if len({b for b, _, _ in cells}) < 2 or len({d for _, d, _ in cells}) < 2:
        raise ValueError("fit: needs two batch sizes and two draft lengths at least")
    x = np.array([[1.0, b, d, b * d] for b, d, _ in cells])
    y = np.array([c for _, _, c in cells])
    return tuple(float(v) for v in np.linalg.lstsq(x, y, rcond=None)[0])


class FixedDrafter(Drafter):
    """Drafts `n` copies of one token every step, verified whatever its expected gain (a
    drafter with no cost model): every step verifies n drafts, none accepted, so the sequence
    grows by one token a step like the decode side's."""

    def __init__(self, n: int, token: int = 7):
        self.n, self.token = n, token

    def draft(self, req, room: int, free_drafts: bool = True) -> list[int]:
        return [self.token] * min(self.n, room) if free_drafts else []


def _prompt(i: int, vocab: int, n: int = SHORT_CONTEXT) -> list[int]:
    # distinct per request (no shared prefix), ids well inside any vocabulary
    span = max(2, min(vocab, 4000) - 20)
    return [10 + (i * 131 + k * 17) % span for k in range(n)]


def measure(sched, batches=(1, 2, 4), drafts=(1, 2, 3, 4, 5, 6, 7), steps: int = 8,
            wide=(1, 2, 3, 4, 7)):
    """The cost table of `sched`'s model, measured on `sched` itself: at the smallest batch
    size every draft length in `drafts`, at the others those in `wide` (a larger batch's step
    is dearer; the table interpolates between; the short ones are where a quantized target's
    verify leaves the 1-8 row GEMV, a cliff no line through 1 and 7 drafts shows), each
    capped at the drafter's own length. Per
    batch size B: B requests (synthetic prompts) decode, and consecutive steps alternate
    decode and each draft length (the drafter swapped for FixedDrafter cells, restored
    after), so a load that changes during the measurement weighs on every cell alike; the
    fastest time of `steps` steps a cell: this thread's CPU time with one forward thread,
    else the wall time. Not a median, not the process's CPU time with several threads: on a
    shared machine the median step met other jobs and the forward's threads spin at their
    barriers (CPU time that is not the step's cost); a medianed CPU-time table of SmolLM2's
    Q4_1 file at load 7 (two threads) read 7 drafts at batch 1 as 0.11 decode steps where
    they cost ~1.9. Batch 1 is measured at a LONG_CONTEXT-token prompt too (the long row). The requests are aborted and the
    prefix cache flushed after. Returns (VerifyCost, cells [(B, d, extra decode steps)])."""
    from loom.runtime.io_struct import TokenizedGenerateReq
    from loom.runtime.sampling_params import make_sampling_params

    saved = sched.decode.drafter
    top = getattr(saved, "num_draft", None) or max(drafts)
    per_batch = {
        b: sorted({min(d, top) for d in (drafts if b == min(batches) else wide)})
        for b in batches
    }
    # the long-context row: batch 1 at LONG_CONTEXT tokens, where the pool and the context
    # length hold it (key 0: a batch size no row has)
    room = min(sched.context_len, sched.kv.size) - (1 + top) * (steps + 2) - 16
    long_n = LONG_CONTEXT if room >= LONG_CONTEXT else 0
    runs = [(b, b, SHORT_CONTEXT) for b in batches]
    if long_n:
        per_batch[0] = per_batch[min(batches)]
        runs.append((0, 1, long_n))
    # one forward thread: the step runs on this thread alone (OpenMP's serial branch, one
    # torch thread), so its CPU time is the step's cost without the time other jobs held the
    # core (at load 5-6 on 2 cores the fastest of 8 wall steps still read 1 draft at 0.06 in
    # one start-up and 0.63 in the next); with several threads their barrier spins count as
    # CPU time, so the wall clock
    args = getattr(sched, "args", None)
    one = args is not None and args.effective_cpu_threads == 1
    clock = time.thread_time if one else time.perf_counter
    secs: dict[tuple[int, int], list[float]] = {}
    try:
        for b, n_req, n_tok in runs:
            params = {"temperature": 0, "ignore_eos": True,
                      "max_new_tokens": (1 + len(per_batch[b])) * (steps + 2) + 8}  # fmt: skip
            for i in range(n_req):
                sched.add_request(
                    TokenizedGenerateReq(
                        rid=f"verify-cost-{i}",
                        input_ids=_prompt(i, sched.vocab_size, n_tok),
                        sampling_params=make_sampling_params(params),
                        seed=0,
                    )
                )
            while sched.prefill.waiting or sched.prefill.chunked_req is not None:
                sched.step()
            for k in range(steps + 1):
                for d in (0, *per_batch[b]):
                    sched.set_drafter(FixedDrafter(d) if d else None)
                    t = clock()
                    sched.step()
                    if k:  # the first round warms each shape
                        secs.setdefault((b, d), []).append(clock() - t)
            sched.abort("")
            while not sched.is_idle:
                sched.step()
            # the aborted requests' error outputs: nobody asked for them (a caller's first
            # step would otherwise return outputs for rids it never sent)
            sched.output.drain()
    finally:
        sched.set_drafter(saved)
        sched.flush_cache()
    def extra(b, d):
        return min(secs[(b, d)]) / min(secs[(b, 0)]) - 1

    cells = [(b, d, extra(b, d)) for b in batches for d in per_batch[b]]
    long_cells = [(1, d, extra(0, d)) for d in per_batch[0]] if long_n else None
    try:
        coef = fit(cells)
    except ValueError:  # one batch size or one draft length: the table alone describes it
        coef = BUNDLED
    cost = VerifyCost(coef, "measured at start-up", cells, long_cells, long_n or LONG_CONTEXT)
    return cost, cells


def cache_path(args) -> Path:
    """The cache file of this model and the settings a step's cost depends on."""
    model = Path(args.model_path).resolve()
    probe = model / "config.json" if model.is_dir() else model
    try:
        st = probe.stat()
        stamp = (st.st_size, int(st.st_mtime))
    except OSError:
        stamp = None
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    key = json.dumps(
        [TABLE_VERSION, str(model), stamp, args.dtype, args.quantization, args.quantized_matmul,
         args.effective_cpu_threads,
         args.attention_backend, args.page_size, cpu, _kernels_digest()],
        default=str,
    )  # fmt: skip
    name = f"{model.name}-{hashlib.sha1(key.encode()).hexdigest()[:12]}.json"
    return CACHE_DIR / name


def _kernels_digest() -> str:
    """The C kernels' sources (kernels/cpu): a table measured with other kernels (a verify
    pass's prefetch, a GEMV's rows) prices other steps, so it is measured again."""
    from loom.runtime import native

    try:
        d = native.source_dir()
        files = sorted([*d.glob("*.c"), *d.glob("*.h")])
        return hashlib.sha1(b"\0".join(p.read_bytes() for p in files)).hexdigest()[:12]
    except OSError:
        return ""


def save(cost: VerifyCost, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(cost.to_json()))
    tmp.replace(path)  # atomic: two servers starting at once never read half a file


def resolve(args, sched) -> VerifyCost | None:
    """The scheduler's verify cost table per `args.speculative_verify_cost` (None: BUNDLED
    through `speculator.extra_cost`)."""
    from loom.runtime.server_args import BUNDLED_MODEL_PATH

    mode = args.speculative_verify_cost
    if mode == "bundled":
        return None
    if mode not in MODES:
        return VerifyCost.load(mode)
    if mode == "auto":
        if Path(args.model_path).resolve() == Path(BUNDLED_MODEL_PATH).resolve():
            return None
        if _step_weights(sched.runner) < MEASURE_MIN_WEIGHTS:
            return None
    path = cache_path(args)
    if mode == "auto" and path.is_file():
        try:
            cost = VerifyCost.load(path)
            logger.info("verify cost from %s: %r", path, cost)
            return cost
        except ValueError:
            pass  # unreadable: measured again below
    if args.world_size > 1 or args.disaggregation_mode != "null":
        # ranks step in lockstep with the leader's schedule: no side measurement
        logger.info("verify cost: bundled fit (no start-up measurement with several ranks)")
        return None
    t = time.monotonic()
    batches = tuple(b for b in (1, 2, 4) if b < max(2, args.speculative_disable_by_batch_size))
    if len(batches) < 2:
        batches = (1, 2)
    cost, cells = measure(sched, batches=batches)
    logger.info(
        "verify cost measured in %.1f s: %r; cells %s", time.monotonic() - t, cost,
        [(b, d, round(c, 2)) for b, d, c in cells],
    )  # fmt: skip
    try:
        save(cost, path)
    except OSError as e:
        logger.info("verify cost not cached (%s)", e)
    return cost


def _step_weights(runner) -> int:
    from loom.runtime.spec.head_policy import matmul_numel

    model = getattr(runner, "model", None)
    if model is None:
        return 0
    # quantized weights are buffers (packed blocks) or, in a GGUF model, a parameter whose
    # float storage is released and whose blocks hang off `.quant` (rows x cols counted by
    # matmul_numel): SmolLM2's Q4_1 file counted 1.08M here and got the bundled model's fit
    seen = {id(p): p.numel() for p in (*model.parameters(), *model.buffers())}
    return max(sum(seen.values()), matmul_numel([model]))
