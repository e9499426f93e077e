"""A small C kernel for CPU decode attention that reads K/V in place from the paged pool.

The plain torch decode path gathers every request's K and V rows into a padded [B, L] copy on
every layer of every step, then runs SDPA with a padding mask (whose CPU kernel is tuned for
long queries, not one query row). This kernel walks each request's row of the req-to-token
table instead: for one (request, kv head) it scores the query heads of that group against the
K rows the table names, softmaxes, and accumulates the V rows, with no copy and no padding.

It is compiled once per machine with the system C compiler (a second or two) into
~/.cache/loom/kernels and loaded with ctypes: no torch headers, so no minutes-long extension
build. `load()` returns None where no compiler is found; callers then fall back to torch.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from loom.runtime.server_args import env_flag

logger = logging.getLogger(__name__)

STRICT_NATIVE_ENV = "LOOM_STRICT_NATIVE"

# exp(x) for x <= 0 in arithmetic that vectorizes, shared by every C source here (this
# library's softmax, cpu_forward_kernel's attention); it needs <stdint.h> and <string.h>
FAST_EXP_C = r"""
/* exp(x) for a softmax (x <= 0: a score minus its row max), in arithmetic that vectorizes
   (libm's expf does not without -ffast-math): 2^n * e^r with |r| <= ln2 / 2 and a degree-6
   Taylor polynomial, relative error ~2e-7; exactly 0 below -87 (and for -inf: masked). */
static inline float fast_expf(float x) {
    const float n = __builtin_rintf(x * 1.44269504f);
    const float r = (x - n * 0.693145752f) - n * 1.42860677e-6f;
    float p = 1.f / 720.f;
    p = p * r + 1.f / 120.f;
    p = p * r + 1.f / 24.f;
    p = p * r + 1.f / 6.f;
    p = p * r + 0.5f;
    p = p * r + 1.f;
    p = p * r + 1.f;
    const int32_t e = ((int32_t)(n < -126.f ? -126.f : n) + 127) << 23;
    float scale;
    memcpy(&scale, &e, 4);
    return x < -87.f ? 0.f : p * scale;
}
"""

SOURCE_HEAD = r"""
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* A K or V row as f32: in place for an f32 pool, else widened into `buf` (bf16 -> f32 is a
   16-bit shift, which vectorizes; an element-wise load inside the dot products does not). */
static inline const float* row_f32(const float* p, float* buf, int64_t n) {
    (void)buf;
    (void)n;
    return p;
}
static inline const float* row_bf16(const uint16_t* p, float* buf, int64_t n) {
    uint32_t* u = (uint32_t*)buf;
    _Pragma("omp simd")
    for (int64_t i = 0; i < n; i++) u[i] = (uint32_t)p[i] << 16;
    return buf;
}

"""

SOURCE = SOURCE_HEAD + FAST_EXP_C + r"""
/* q [B, H, D] f32; k [S, Hkv, D], v [S, Hkv, Dv] (T); table [R, stride] i64 slot ids;
   rows, lens [B] i64; out [B, H, Dv] f32. Query head h reads kv head h / (H / Hkv). */
#define DECODE(NAME, T, ROW)                                                               \
/* One (request, kv head): its G query heads qb [G, D] over the L rows `slots` names. Inlined \
   with D, Dv constant for the common head sizes, so the row loops unroll and stay in        \
   registers. */                                                                             \
static inline __attribute__((always_inline)) void NAME##_item(                               \
    const float* qb, const T* k, const T* v, const int64_t* slots, int64_t L, int64_t Hkv,   \
    int64_t h, int64_t G, const int64_t D, const int64_t Dv, float scale, float* s,          \
    float* acc, float* buf, float* o) {                                                      \
    for (int64_t t = 0; t < L; t++) {                                                        \
        const float* kp = ROW(k + (slots[t] * Hkv + h) * D, buf, D);                         \
        for (int64_t g = 0; g < G; g++) {                                                    \
            const float* qg = qb + g * D;                                                    \
            float dot = 0.f;                                                                 \
            _Pragma("omp simd reduction(+:dot)")                                             \
            for (int64_t d = 0; d < D; d++) dot += qg[d] * kp[d];                            \
            s[g * L + t] = dot * scale;                                                      \
        }                                                                                    \
    }                                                                                        \
    for (int64_t g = 0; g < G; g++) {                                                        \
        float* sg = s + g * L;                                                               \
        float m = -INFINITY, sum = 0.f;                                                      \
        _Pragma("omp simd reduction(max:m)")                                                 \
        for (int64_t t = 0; t < L; t++) m = sg[t] > m ? sg[t] : m;                           \
        _Pragma("omp simd reduction(+:sum)")                                                 \
        for (int64_t t = 0; t < L; t++) { sg[t] = fast_expf(sg[t] - m); sum += sg[t]; }      \
        const float inv = L > 0 ? 1.f / sum : 0.f;                                           \
        _Pragma("omp simd")                                                                  \
        for (int64_t t = 0; t < L; t++) sg[t] *= inv;                                        \
    }                                                                                        \
    memset(acc, 0, sizeof(float) * G * Dv);                                                  \
    for (int64_t t = 0; t < L; t++) {                                                        \
        const float* vp = ROW(v + (slots[t] * Hkv + h) * Dv, buf, Dv);                       \
        for (int64_t g = 0; g < G; g++) {                                                    \
            const float p = s[g * L + t];                                                    \
            float* a = acc + g * Dv;                                                         \
            _Pragma("omp simd")                                                              \
            for (int64_t d = 0; d < Dv; d++) a[d] += p * vp[d];                              \
        }                                                                                    \
    }                                                                                        \
    memcpy(o, acc, sizeof(float) * G * Dv);                                                  \
}                                                                                            \
void NAME(const float* q, const T* k, const T* v, const int64_t* table, int64_t stride,     \
          const int64_t* rows, const int64_t* lens, float* out, int64_t B, int64_t H,        \
          int64_t Hkv, int64_t D, int64_t Dv, float scale, int64_t max_len,                 \
          int nthreads) {                                                                   \
    const int64_t G = H / Hkv;                                                               \
    _Pragma("omp parallel num_threads(nthreads) if(nthreads > 1)")                         \
    {                                                                                        \
        float* s = (float*)malloc(sizeof(float) * G * (max_len > 0 ? max_len : 1));          \
        float* acc = (float*)malloc(sizeof(float) * G * Dv);                                 \
        float* buf = (float*)malloc(sizeof(float) * (D > Dv ? D : Dv));                      \
        _Pragma("omp for schedule(dynamic)")                                                 \
        for (int64_t w = 0; w < B * Hkv; w++) {                                              \
            const int64_t b = w / Hkv, h = w % Hkv, L = lens[b];                             \
            const int64_t* slots = table + rows[b] * stride;                                 \
            const float* qb = q + (b * H + h * G) * D;                                       \
            float* o = out + (b * H + h * G) * Dv;                                           \
            if (D == 64 && Dv == 64)                                                         \
                NAME##_item(qb, k, v, slots, L, Hkv, h, G, 64, 64, scale, s, acc, buf, o);   \
            else if (D == 128 && Dv == 128)                                                  \
                NAME##_item(qb, k, v, slots, L, Hkv, h, G, 128, 128, scale, s, acc, buf, o); \
            else                                                                             \
                NAME##_item(qb, k, v, slots, L, Hkv, h, G, D, Dv, scale, s, acc, buf, o);    \
        }                                                                                    \
        free(s);                                                                             \
        free(acc);                                                                           \
        free(buf);                                                                           \
    }                                                                                        \
}

DECODE(loom_decode_f32, float, row_f32)
DECODE(loom_decode_bf16, uint16_t, row_bf16)

/* Several query rows per request (a short extend, a draft tree's verify step): q [T, H, D] f32
   with request b's E = exts[b] rows at q[qstart[b] ..]; they attend to the K/V rows
   table[rows[b], :lens[b]]. Row j sees column t where mask[mask_off[b] + j * L + t] != 0, or,
   with mask_off[b] < 0, causally: t <= L - E + j. out [T, H, Dv] f32. One (request, kv head)
   per work item, so each K/V row is read once for all E x G query rows. */
#define EXTEND(NAME, T, ROW)                                                               \
/* One (request, kv head): its E new rows x G query heads, inlined with D, Dv constant for    \
   the common head sizes as in DECODE. */                                                    \
static inline __attribute__((always_inline)) void NAME##_item(                               \
    const float* q, const T* k, const T* v, const int64_t* slots, const uint8_t* mk,         \
    int64_t L, int64_t E, int64_t q0, int64_t H, int64_t Hkv, int64_t h, int64_t G,          \
    const int64_t D, const int64_t Dv, float scale, float* s, float* acc, float* buf,        \
    float* denom, float* out) {                                                              \
    const int64_t P = L - E;                                                                 \
    for (int64_t t = 0; t < L; t++) {                                                        \
        const float* kp = ROW(k + (slots[t] * Hkv + h) * D, buf, D);                         \
        for (int64_t j = 0; j < E; j++) {                                                    \
            const int ok = mk ? mk[j * L + t] != 0 : t <= P + j;                             \
            const float* qj = q + ((q0 + j) * H + h * G) * D;                                \
            for (int64_t g = 0; g < G; g++) {                                                \
                float dot = -INFINITY;                                                       \
                if (ok) {                                                                    \
                    const float* qg = qj + g * D;                                            \
                    dot = 0.f;                                                               \
                    _Pragma("omp simd reduction(+:dot)")                                     \
                    for (int64_t d = 0; d < D; d++) dot += qg[d] * kp[d];                    \
                    dot *= scale;                                                            \
                }                                                                            \
                s[(j * G + g) * L + t] = dot;                                                \
            }                                                                                \
        }                                                                                    \
    }                                                                                        \
    for (int64_t r = 0; r < E * G; r++) {                                                    \
        float* sr = s + r * L;                                                               \
        float m = -INFINITY, sum = 0.f;                                                      \
        _Pragma("omp simd reduction(max:m)")                                                 \
        for (int64_t t = 0; t < L; t++) m = sr[t] > m ? sr[t] : m;                           \
        if (m == -INFINITY) { /* a row that sees nothing: zeros, not NaN */                  \
            for (int64_t t = 0; t < L; t++) sr[t] = 0.f;                                     \
        } else {                                                                             \
            _Pragma("omp simd reduction(+:sum)")                                             \
            for (int64_t t = 0; t < L; t++) { sr[t] = fast_expf(sr[t] - m); sum += sr[t]; }  \
        }                                                                                    \
        denom[r] = sum;                                                                      \
    }                                                                                        \
    memset(acc, 0, sizeof(float) * E * G * Dv);                                              \
    for (int64_t t = 0; t < L; t++) {                                                        \
        const float* vp = ROW(v + (slots[t] * Hkv + h) * Dv, buf, Dv);                       \
        for (int64_t r = 0; r < E * G; r++) {                                                \
            const float p = s[r * L + t];                                                    \
            if (p == 0.f) continue;                                                          \
            float* a = acc + r * Dv;                                                         \
            _Pragma("omp simd")                                                              \
            for (int64_t d = 0; d < Dv; d++) a[d] += p * vp[d];                              \
        }                                                                                    \
    }                                                                                        \
    for (int64_t j = 0; j < E; j++) {                                                        \
        for (int64_t g = 0; g < G; g++) {                                                    \
            const int64_t r = j * G + g;                                                     \
            float* o = out + ((q0 + j) * H + h * G + g) * Dv;                                \
            const float inv = denom[r] > 0.f ? 1.f / denom[r] : 0.f;                         \
            _Pragma("omp simd")                                                              \
            for (int64_t d = 0; d < Dv; d++) o[d] = acc[r * Dv + d] * inv;                   \
        }                                                                                    \
    }                                                                                        \
}                                                                                            \
void NAME(const float* q, const T* k, const T* v, const int64_t* table, int64_t stride,     \
          const int64_t* rows, const int64_t* lens, const int64_t* exts,                     \
          const int64_t* qstart, const uint8_t* mask, const int64_t* mask_off, float* out,   \
          int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t Dv, float scale,             \
          int64_t max_len, int64_t max_ext, int nthreads) {                                  \
    const int64_t G = H / Hkv;                                                               \
    const int64_t R = G * (max_ext > 0 ? max_ext : 1);                                       \
    _Pragma("omp parallel num_threads(nthreads) if(nthreads > 1)")                         \
    {                                                                                        \
        float* s = (float*)malloc(sizeof(float) * R * (max_len > 0 ? max_len : 1));          \
        float* acc = (float*)malloc(sizeof(float) * R * Dv);                                 \
        float* buf = (float*)malloc(sizeof(float) * (D > Dv ? D : Dv));                      \
        float* denom = (float*)malloc(sizeof(float) * R);                                    \
        _Pragma("omp for schedule(dynamic)")                                                 \
        for (int64_t w = 0; w < B * Hkv; w++) {                                              \
            const int64_t b = w / Hkv, h = w % Hkv;                                          \
            const int64_t* slots = table + rows[b] * stride;                                 \
            const uint8_t* mk = mask_off[b] >= 0 ? mask + mask_off[b] : NULL;                \
            if (D == 64 && Dv == 64)                                                         \
                NAME##_item(q, k, v, slots, mk, lens[b], exts[b], qstart[b], H, Hkv, h, G,   \
                            64, 64, scale, s, acc, buf, denom, out);                         \
            else if (D == 128 && Dv == 128)                                                  \
                NAME##_item(q, k, v, slots, mk, lens[b], exts[b], qstart[b], H, Hkv, h, G,   \
                            128, 128, scale, s, acc, buf, denom, out);                       \
            else                                                                             \
                NAME##_item(q, k, v, slots, mk, lens[b], exts[b], qstart[b], H, Hkv, h, G,   \
                            D, Dv, scale, s, acc, buf, denom, out);                          \
        }                                                                                    \
        free(s);                                                                             \
        free(acc);                                                                           \
        free(buf);                                                                           \
        free(denom);                                                                         \
    }                                                                                        \
}

EXTEND(loom_extend_f32, float, row_f32)
EXTEND(loom_extend_bf16, uint16_t, row_bf16)

/* RMSNorm over rows x[o * so + i * si + 0 .. D-1] (o < no, i < ni) into out [no * ni, D]. With
   res [no * ni, D]: the row is x + res, and that sum is also written to res_out. */
void loom_rms_norm_f32(const float* x, int64_t no, int64_t ni, int64_t so, int64_t si,
                       int64_t D, const float* res, float* res_out, const float* w, float eps,
                       float* out, int nthreads) {
    _Pragma("omp parallel for num_threads(nthreads) if(nthreads > 1)")
    for (int64_t r = 0; r < no * ni; r++) {
        const float* src = x + (r / ni) * so + (r % ni) * si;
        float ss = 0.f;
        if (res) {
            const float* rr = res + r * D;
            float* sum = res_out + r * D;
            _Pragma("omp simd reduction(+:ss)")
            for (int64_t d = 0; d < D; d++) { sum[d] = src[d] + rr[d]; ss += sum[d] * sum[d]; }
            src = sum;
        } else {
            _Pragma("omp simd reduction(+:ss)")
            for (int64_t d = 0; d < D; d++) ss += src[d] * src[d];
        }
        const float inv = 1.f / sqrtf(ss / (float)D + eps);
        float* o = out + r * D;
        _Pragma("omp simd")
        for (int64_t d = 0; d < D; d++) o[d] = w[d] * (src[d] * inv);
    }
}

/* Neox-layout rotary embedding of rows x[t * st + h * sh + 0 .. D-1] into out [T, H, D]:
   cos/sin [max_pos, D] (the two halves repeat), positions [T]. */
void loom_rope_f32(const float* x, int64_t T, int64_t H, int64_t st, int64_t sh, int64_t D,
                   const int64_t* pos, const float* cos, const float* sin, float* out,
                   int nthreads) {
    const int64_t half = D / 2;
    _Pragma("omp parallel for num_threads(nthreads) if(nthreads > 1)")
    for (int64_t r = 0; r < T * H; r++) {
        const int64_t t = r / H, h = r % H;
        const float* a = x + t * st + h * sh;
        const float* c = cos + pos[t] * D;
        const float* s = sin + pos[t] * D;
        float* o = out + r * D;
        _Pragma("omp simd")
        for (int64_t i = 0; i < half; i++) {
            o[i] = a[i] * c[i] + (-a[i + half]) * s[i];
            o[i + half] = a[i + half] * c[i + half] + a[i] * s[i + half];
        }
    }
}
"""

_FLAGS = ["-O3", "-march=native", "-shared", "-fPIC", "-std=c11"]
# OpenMP for the thread team where the compiler has it (clang often lacks libomp); without it
# the pragmas are ignored and every kernel runs on the calling thread
_VARIANTS = (["-fopenmp"], [])
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None


def _cache_dir() -> Path:
    return Path(os.environ.get("LOOM_CACHE_DIR", Path.home() / ".cache" / "loom")) / "kernels"


def _cpu_key() -> str:
    """-march=native code is only valid on this CPU model and flag set."""
    try:
        info = Path("/proc/cpuinfo").read_text()
        lines = [ln for ln in info.splitlines() if ln.startswith(("model name", "flags"))][:2]
    except OSError:
        lines = [platform.processor()]
    return "\n".join(lines)


def _compile(compiler: str, flags: list[str], target: Path, source: str = SOURCE) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        src = Path(tmp) / "kernel.c"
        src.write_text(source)
        out = Path(tmp) / target.name
        res = subprocess.run(
            [compiler, *flags, str(src), "-o", str(out), "-lm"],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        if res.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {res.stderr[-2000:]}")
        os.replace(out, target)  # atomic: concurrent processes never load a half-written file


def build(source: str, name: str, flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """C `source` compiled (with OpenMP where the compiler has it, and the extra `flags`) into
    the per-machine cache as `name`_<hash>.so, or found there, and loaded; None (logged)
    without a working compiler. Callers declare the functions' argtypes."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return _unavailable(name, "no C compiler found")
    errors = []
    for extra in _VARIANTS:
        all_flags = [*_FLAGS, *flags, *extra]
        key = hashlib.sha256("\0".join([source, *all_flags, _cpu_key()]).encode()).hexdigest()
        target = _cache_dir() / f"{name}_{key[:16]}.so"
        try:
            if not target.exists():
                _compile(compiler, all_flags, target, source)
            return ctypes.CDLL(str(target))
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            errors.append(str(e))
    return _unavailable(name, "; ".join(errors))


def _unavailable(name: str, why: str) -> None:
    """A library that did not build: None (callers fall back to torch), or, under
    LOOM_STRICT_NATIVE=1 (CI sets it), an error, so that a broken C edit fails its tests
    instead of turning them into skips."""
    if env_flag(STRICT_NATIVE_ENV):
        raise RuntimeError(f"{name} did not build ({STRICT_NATIVE_ENV}=1): {why}")
    logger.warning("%s unavailable (%s): falling back to torch", name, why)
    return None


_built: dict[tuple[str, tuple[str, ...]], ctypes.CDLL | None] = {}


def build_or_none(
    source: str,
    name: str,
    declare: Callable[[ctypes.CDLL], None],
    flags: tuple[str, ...] = (),
) -> ctypes.CDLL | None:
    """`build` once per process for each (name, flags), `declare(lib)` then setting the
    functions' argtypes / restypes; later calls return the same library, or None again
    without a compiler (the attempt is not repeated)."""
    key = (name, tuple(flags))
    with _lock:
        if key not in _built:
            lib = build(source, name, tuple(flags))
            if lib is not None:
                declare(lib)
            _built[key] = lib
        return _built[key]


def _declare(lib: ctypes.CDLL) -> None:
    ptr, i64, f32, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
    for fn in (lib.loom_decode_f32, lib.loom_decode_bf16):
        fn.restype = None
        # q, k, v, table, stride, rows, lens, out, B, H, Hkv, D, Dv, scale, max_len, threads
        fn.argtypes = [ptr] * 4 + [i64] + [ptr] * 3 + [i64] * 5 + [f32, i64, i32]
    for fn in (lib.loom_extend_f32, lib.loom_extend_bf16):
        fn.restype = None
        # q, k, v, table, stride, rows, lens, exts, qstart, mask, mask_off, out,
        # B, H, Hkv, D, Dv, scale, max_len, max_ext, threads
        fn.argtypes = [ptr] * 4 + [i64] + [ptr] * 7 + [i64] * 5 + [f32, i64, i64, i32]
    # x, no, ni, so, si, D, res, res_out, w, eps, out, threads
    lib.loom_rms_norm_f32.argtypes = [ptr] + [i64] * 5 + [ptr] * 3 + [f32, ptr, i32]
    # x, T, H, st, sh, D, pos, cos, sin, out, threads
    lib.loom_rope_f32.argtypes = [ptr] + [i64] * 5 + [ptr] * 4 + [i32]
    lib.loom_rms_norm_f32.restype = lib.loom_rope_f32.restype = None


def load() -> ctypes.CDLL | None:
    """The compiled kernel library, building it on first use; None without a C compiler."""
    global _lib
    _lib = build_or_none(SOURCE, "loom_cpu", _declare)
    return _lib


# multiply-adds per thread below which another thread costs more (team start-up and the
# barrier, which on a loaded machine waits for a descheduled thread) than it saves
_GRAIN = 1 << 17


def _threads(items: int, work: int) -> int:
    return max(1, min(torch.get_num_threads(), items, work // _GRAIN))


_KERNELS = {torch.float32: "loom_decode_f32", torch.bfloat16: "loom_decode_bf16"}


def supports(dtype: torch.dtype) -> bool:
    return dtype in _KERNELS


def decode_attention(
    lib: ctypes.CDLL,
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    table: torch.Tensor,
    rows: torch.Tensor,
    lens: torch.Tensor,
    max_len: int,
    scale: float,
    total_len: int | None = None,
) -> torch.Tensor:
    """q [B, H, D] over the K/V rows table[rows[b], :lens[b]] -> [B, H, Dv] in q's dtype.
    `total_len` (sum of lens, default B * max_len) sizes the thread team."""
    b, h, d = q.shape
    hkv, dv = k_buf.shape[1], v_buf.shape[2]
    assert k_buf.is_contiguous() and v_buf.is_contiguous() and table.is_contiguous()
    assert table.dtype == rows.dtype == lens.dtype == torch.int64
    qf = q.to(torch.float32).contiguous()
    out = torch.empty((b, h, dv), dtype=torch.float32)
    getattr(lib, _KERNELS[k_buf.dtype])(
        qf.data_ptr(), k_buf.data_ptr(), v_buf.data_ptr(), table.data_ptr(), table.stride(0),
        rows.data_ptr(), lens.data_ptr(), out.data_ptr(), b, h, hkv, d, dv, scale, max_len,
        _threads(b * hkv, (total_len or b * max_len) * h * (d + dv)),
    )  # fmt: skip
    return out if q.dtype == torch.float32 else out.to(q.dtype)


_EXTEND_KERNELS = {torch.float32: "loom_extend_f32", torch.bfloat16: "loom_extend_bf16"}


@dataclass
class ExtendPlan:
    """One step's per-request layout for `extend_attention`, built once and read by every
    layer: request b's new tokens are q rows qstart[b] .. qstart[b] + exts[b] - 1 and attend to
    its first lens[b] KV positions, causally or through its mask (packed at mask_off[b])."""

    lens: torch.Tensor  # [B] int64
    exts: torch.Tensor  # [B] int64
    qstart: torch.Tensor  # [B] int64
    mask: torch.Tensor  # [sum of masked E * L] uint8 (one zero byte when no request has one)
    mask_off: torch.Tensor  # [B] int64, -1: causal
    max_len: int
    max_ext: int
    total_len: int  # sum over requests of exts * lens: the score count, which sizes the team

    @classmethod
    def build(
        cls, seq_lens: list[int], ext_lens: list[int], masks: list[torch.Tensor | None] | None
    ) -> ExtendPlan:
        masks = masks or [None] * len(seq_lens)
        offs, parts, off, start, starts = [], [], 0, 0, []
        for seq, ext, m in zip(seq_lens, ext_lens, masks):
            starts.append(start)
            start += ext
            if m is None:
                offs.append(-1)
                continue
            if tuple(m.shape) != (ext, seq):
                raise ValueError(f"custom mask of shape {tuple(m.shape)}, expected {(ext, seq)}")
            parts.append(m.reshape(-1).to(device="cpu", dtype=torch.uint8))
            offs.append(off)
            off += ext * seq
        i64 = torch.int64
        return cls(
            lens=torch.tensor(seq_lens, dtype=i64),
            exts=torch.tensor(ext_lens, dtype=i64),
            qstart=torch.tensor(starts, dtype=i64),
            mask=torch.cat(parts) if parts else torch.zeros(1, dtype=torch.uint8),
            mask_off=torch.tensor(offs, dtype=i64),
            max_len=max(seq_lens, default=0),
            max_ext=max(ext_lens, default=0),
            total_len=sum(e * s for e, s in zip(ext_lens, seq_lens)),
        )


def extend_attention(
    lib: ctypes.CDLL,
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    table: torch.Tensor,
    rows: torch.Tensor,
    plan: ExtendPlan,
    scale: float,
) -> torch.Tensor:
    """q [T, H, D] (every request's new tokens, in order) over the K/V rows
    table[rows[b], :plan.lens[b]], masked per `plan` -> [T, H, Dv] in q's dtype. The new
    tokens' K/V must already be in the pool."""
    t, h, d = q.shape
    hkv, dv = k_buf.shape[1], v_buf.shape[2]
    assert k_buf.is_contiguous() and v_buf.is_contiguous() and table.is_contiguous()
    assert table.dtype == rows.dtype == torch.int64 and t == int(plan.exts.sum())
    qf = q.to(torch.float32).contiguous()
    out = torch.empty((t, h, dv), dtype=torch.float32)
    b = len(plan.lens)
    getattr(lib, _EXTEND_KERNELS[k_buf.dtype])(
        qf.data_ptr(), k_buf.data_ptr(), v_buf.data_ptr(), table.data_ptr(), table.stride(0),
        rows.data_ptr(), plan.lens.data_ptr(), plan.exts.data_ptr(), plan.qstart.data_ptr(),
        plan.mask.data_ptr(), plan.mask_off.data_ptr(), out.data_ptr(), b, h, hkv, d, dv,
        scale, plan.max_len, plan.max_ext, _threads(b * hkv, plan.total_len * h * (d + dv)),
    )  # fmt: skip
    return out if q.dtype == torch.float32 else out.to(q.dtype)


def fusable(x: torch.Tensor) -> bool:
    """Whether the fused norm / RoPE kernels can take x: float32 on the CPU, rows contiguous,
    no autograd (the kernels have no backward), and the library built."""
    return (
        x.dtype == torch.float32
        and x.device.type == "cpu"
        and x.stride(-1) == 1
        and not (torch.is_grad_enabled() and x.requires_grad)
        and (_lib is not None or load() is not None)
    )


def _rows(x: torch.Tensor) -> tuple[int, int, int, int]:
    """x [N, D] or [T, H, D] (last dim contiguous) as (outer count, inner count, outer
    stride, inner stride) of its D-long rows."""
    if x.dim() == 2:
        return x.shape[0], 1, x.stride(0), 0
    return x.shape[0], x.shape[1], x.stride(0), x.stride(1)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
):
    """RMSNorm of x's last dimension (float32); with `residual`, of x + residual, returning
    (normed, x + residual) as RMSNorm.forward does. Outputs are contiguous."""
    shape, d = x.shape, x.shape[-1]
    if x.dim() == 1 or x.dim() > 3:
        x = x.reshape(-1, d)
    no, ni, so, si = _rows(x)
    out = torch.empty(shape, dtype=torch.float32)
    res_out = None
    if residual is not None:
        assert residual.shape == shape and residual.dtype == torch.float32
        residual = residual.contiguous()
        res_out = torch.empty(shape, dtype=torch.float32)
    w = weight.contiguous()
    _lib.loom_rms_norm_f32(
        x.data_ptr(), no, ni, so, si, d,
        residual.data_ptr() if residual is not None else None,
        res_out.data_ptr() if res_out is not None else None,
        w.data_ptr(), eps, out.data_ptr(), _threads(no * ni, no * ni * d * 4),
    )  # fmt: skip
    return out if residual is None else (out, res_out)


def rope(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Neox rotary embedding of x [T, H, D] (float32) at positions [T] with the float32
    tables cos/sin [max_pos, D]; a new contiguous tensor."""
    t, h, d = x.shape
    assert cos.dtype == sin.dtype == torch.float32 and cos.is_contiguous() and sin.is_contiguous()
    assert positions.dtype == torch.int64 and positions.is_contiguous()
    out = torch.empty((t, h, d), dtype=torch.float32)
    _lib.loom_rope_f32(
        x.data_ptr(), t, h, x.stride(0), x.stride(1), d, positions.data_ptr(),
        cos.data_ptr(), sin.data_ptr(), out.data_ptr(), _threads(t * h, t * h * d * 4),
    )  # fmt: skip
    return out
