"""What a verify step costs beyond a decode step, per model: the table the n-gram speculator's
adaptive depth and verify-or-decode choice price drafts with (`speculator._cut`).

The cost is in decode steps of the same batch: extra(B, d) = a + b B + c d + e B d for a batch
of B requests each verifying up to d draft tokens (the form `benchmarks/bench_verify_cost.py`
fits). It depends on the model and the machine: the bundled model's step is mostly fixed
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
import statistics
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


class VerifyCost:
    """extra(batch, longest draft) in decode steps, never below 0 (a fit's negative
    intercept must not make drafts look free)."""

    def __init__(self, coef, source: str = ""):
        self.coef = tuple(float(x) for x in coef)
        if len(self.coef) != 4:
            raise ValueError(f"verify cost: 4 coefficients (a, b, c, e), got {len(self.coef)}")
        self.source = source

    def __call__(self, batch_size: int, longest_draft: int) -> float:
        a, b, c, e = self.coef
        B, d = batch_size, longest_draft
        return max(0.0, a + b * B + c * d + e * B * d)

    def to_json(self) -> dict:
        return {"coef": list(self.coef), "source": self.source}

    @classmethod
    def load(cls, path) -> VerifyCost:
        try:
            data = json.loads(Path(path).read_text())
            return cls(data["coef"], data.get("source", str(path)))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"speculative_verify_cost: cannot read {path}: {e}") from e

    def __repr__(self) -> str:
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


def _prompt(i: int, vocab: int, n: int = 96) -> list[int]:
    # distinct per request (no shared prefix), ids well inside any vocabulary
    span = max(2, min(vocab, 4000) - 20)
    return [10 + (i * 131 + k * 17) % span for k in range(n)]


def measure(sched, batches=(1, 3, 6), drafts=(3, 7), steps: int = 10):
    """The cost table of `sched`'s model, measured on `sched` itself. Per batch size B: B
    requests (synthetic prompts) decode, and consecutive steps alternate decode and each
    draft length (the drafter swapped for FixedDrafter cells, restored after), so a load
    that changes during the measurement weighs on every cell alike; the median process CPU
    seconds of `steps` steps a cell. The requests are aborted and the prefix cache flushed
    after. Returns (VerifyCost, cells [(B, d, extra decode steps)])."""
    from loom.runtime.io_struct import TokenizedGenerateReq
    from loom.runtime.sampling_params import make_sampling_params

    saved = sched.decode.drafter
    params = {"temperature": 0, "ignore_eos": True,
              "max_new_tokens": (1 + len(drafts)) * (steps + 2) + 8}  # fmt: skip
    secs: dict[tuple[int, int], list[float]] = {}
    try:
        for b in batches:
            for i in range(b):
                sched.add_request(
                    TokenizedGenerateReq(
                        rid=f"verify-cost-{i}",
                        input_ids=_prompt(i, sched.vocab_size),
                        sampling_params=make_sampling_params(params),
                        seed=0,
                    )
                )
            while sched.prefill.waiting or sched.prefill.chunked_req is not None:
                sched.step()
            for k in range(steps + 1):
                for d in (0, *drafts):
                    sched.set_drafter(FixedDrafter(d) if d else None)
                    t = time.process_time()
                    sched.step()
                    if k:  # the first round warms each shape
                        secs.setdefault((b, d), []).append(time.process_time() - t)
            sched.abort("")
            while not sched.is_idle:
                sched.step()
            # the aborted requests' error outputs: nobody asked for them (a caller's first
            # step would otherwise return outputs for rids it never sent)
            sched.output.drain()
    finally:
        sched.set_drafter(saved)
        sched.flush_cache()
    cells = [
        (b, d, statistics.median(secs[(b, d)]) / statistics.median(secs[(b, 0)]) - 1)
        for b in batches
        for d in drafts
    ]
    return VerifyCost(fit(cells), "measured at start-up"), cells


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
        [str(model), stamp, args.dtype, args.quantization, args.quantized_matmul,
         args.effective_cpu_threads,
         args.attention_backend, args.page_size, cpu],
        default=str,
    )  # fmt: skip
    name = f"{model.name}-{hashlib.sha1(key.encode()).hexdigest()[:12]}.json"
    return CACHE_DIR / name


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
    batches = tuple(b for b in (1, 3, 6) if b < max(2, args.speculative_disable_by_batch_size))
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
    model = getattr(runner, "model", None)
    if model is None:
        return 0
    # quantized weights are buffers (packed blocks): counted too
    seen = {id(p): p.numel() for p in (*model.parameters(), *model.buffers())}
    return sum(seen.values())
