/* The compiled CPU forward (runtime/cpu_forward.py builds and calls it).

   One call runs a llama-style dense decoder stack over a step's T tokens: embedding, then per
   layer RMSNorm, the fused QKV projection (+ bias), the per-head q/k RMSNorm (Qwen3), neox RoPE,
   the K/V store into the pool slots (float32, or bfloat16 rounded to nearest even:
   Model.kv_bf16), paged attention reading K/V in place through the
   req-to-token table (causal, or a request's custom tree mask), O projection + residual,
   RMSNorm, the SiLU-gated MLP + residual; then the final RMSNorm and the LM head for the rows
   that need logits only. Gemma 3 (Model.norm_add / act, the Layer fields after down_q): norms
   by (1 + w), the attention and MLP outputs normed before their residual add, gelu(tanh),
   the embedding scaled, per-layer RoPE tables, sliding-window layers (window_views). Norm weights and biases are read in place from the torch tensors; the
   projections and the LM head from a copy packed into panels of 16 output rows, K-major
   (CpuForward packs it once), at every step size: a panel is one sequential 64-byte-a-k stream,
   and the weights the forward keeps hot are that one copy. A pass over a panel takes up to 16
   tokens (AVX-512: one zmm accumulator a token) or 6 (AVX2: two ymm), so each loaded weight
   vector feeds that many FMAs; passes of 1-3 tokens spread k over several accumulator sets to
   keep enough FMA chains in flight. Without a packed copy (past cpu_forward.PACK_BUDGET) the
   row-major dot-product tiles run (4 output rows x 1-3 tokens). GCC/clang vector extensions,
   AVX-512 / FMA intrinsics where the target has them. gemm and gemm_packed serve heads.c too
   (declared in loom_cpu.h, not exported), and so do the row blocks of blocks.h. */
#include "loom_cpu.h"

#include <sys/mman.h>

#include "blocks.h"
#if defined(__AVX2__)
#include "simd_avx2.h"
#endif

typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));

static inline v8 ld(const float* p) {
    v8 v;
    memcpy(&v, p, sizeof(v));
    return v;
}
static inline float hsum(v8 v) {
    return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}
/* c + a * b, one fused multiply-add where the target has it (GCC does not contract the
   vector expression under -std=c11) */
static inline v8 fma8(v8 a, v8 b, v8 c) {
#if defined(__AVX__) && defined(__FMA__)
    return (v8)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
    return c + a * b;
#endif
}
/* {hsum(a), hsum(b), hsum(c), hsum(d)} */
static inline v4 hsum4(v8 a, v8 b, v8 c, v8 d) {
#if defined(__AVX__)
    const __m256 ab = _mm256_hadd_ps((__m256)a, (__m256)b),
                 cd = _mm256_hadd_ps((__m256)c, (__m256)d);
    const __m256 s = _mm256_hadd_ps(ab, cd); /* a01+a23, b.., c.., d.. | the same of 4..7 */
    return (v4)_mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
#else
    return (v4){hsum(a), hsum(b), hsum(c), hsum(d)};
#endif
}

/* y[t, n] (+)= sum_k x[t, k] w[n, k] + b[n] for t < T, n < N; rows of x are ldx apart, of y ldy.
   Tiles of 4 weight rows; each tile runs over the tokens three at a time (12 accumulators: a
   loaded weight vector feeds 3 FMAs, a token vector 4), then a pair, then one token. The tile's
   rows (4 K floats) stay in L1 while the tokens pass, so the weights stream from memory once. */
void gemm(const float* x, int64_t T, int64_t K, int64_t ldx, const float* w, const float* b,
          int64_t N, float* y, int64_t ldy, int accumulate, int nthreads) {
    const int64_t K8 = K & ~(int64_t)7, tiles = (N + 3) / 4;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1)
    for (int64_t tile = 0; tile < tiles; tile++) {
        const int64_t n0 = tile * 4, nn = N - n0 < 4 ? N - n0 : 4;
        const float* wr[4];
        for (int r = 0; r < 4; r++) wr[r] = w + (n0 + (r < nn ? r : 0)) * K;
        const float *w0p = wr[0], *w1p = wr[1], *w2p = wr[2], *w3p = wr[3];
        const v4 bias =
            b ? (v4){b[n0], b[n0 + (nn > 1)], b[n0 + 2 * (nn > 2)], b[n0 + 3 * (nn > 3)]}
              : (v4){0.f, 0.f, 0.f, 0.f};
        int64_t t = 0;
        for (; t + 3 <= T; t += 3) {
            const float *x0 = x + t * ldx, *x1 = x0 + ldx, *x2 = x1 + ldx;
            v8 a00 = {0}, a01 = {0}, a02 = {0}, a10 = {0}, a11 = {0}, a12 = {0};
            v8 a20 = {0}, a21 = {0}, a22 = {0}, a30 = {0}, a31 = {0}, a32 = {0};
            for (int64_t k = 0; k < K8; k += 8) {
                if (t == 0 && !(k & 15)) { /* first token triple: the next tile's rows */
                    __builtin_prefetch(w0p + k + 4 * K);
                    __builtin_prefetch(w1p + k + 4 * K);
                    __builtin_prefetch(w2p + k + 4 * K);
                    __builtin_prefetch(w3p + k + 4 * K);
                }
                const v8 u = ld(x0 + k), v = ld(x1 + k), z = ld(x2 + k);
                v8 wv = ld(w0p + k);
                a00 = fma8(wv, u, a00);
                a01 = fma8(wv, v, a01);
                a02 = fma8(wv, z, a02);
                wv = ld(w1p + k);
                a10 = fma8(wv, u, a10);
                a11 = fma8(wv, v, a11);
                a12 = fma8(wv, z, a12);
                wv = ld(w2p + k);
                a20 = fma8(wv, u, a20);
                a21 = fma8(wv, v, a21);
                a22 = fma8(wv, z, a22);
                wv = ld(w3p + k);
                a30 = fma8(wv, u, a30);
                a31 = fma8(wv, v, a31);
                a32 = fma8(wv, z, a32);
            }
            v4 s[3] = {hsum4(a00, a10, a20, a30), hsum4(a01, a11, a21, a31),
                       hsum4(a02, a12, a22, a32)};
            for (int64_t k = K8; k < K; k++)
                for (int r = 0; r < 4; r++) {
                    s[0][r] += wr[r][k] * x0[k];
                    s[1][r] += wr[r][k] * x1[k];
                    s[2][r] += wr[r][k] * x2[k];
                }
            for (int j = 0; j < 3; j++) {
                float* o = y + (t + j) * ldy + n0;
                const v4 val = s[j] + bias;
                for (int r = 0; r < nn; r++) o[r] = accumulate ? o[r] + val[r] : val[r];
            }
        }
        for (; t + 2 <= T; t += 2) {
            const float *x0 = x + t * ldx, *x1 = x0 + ldx;
            v8 a00 = {0}, a01 = {0}, a10 = {0}, a11 = {0}, a20 = {0}, a21 = {0}, a30 = {0},
               a31 = {0};
            for (int64_t k = 0; k < K8; k += 8) {
                if (t == 0 && !(k & 15)) {
                    __builtin_prefetch(w0p + k + 4 * K);
                    __builtin_prefetch(w1p + k + 4 * K);
                    __builtin_prefetch(w2p + k + 4 * K);
                    __builtin_prefetch(w3p + k + 4 * K);
                }
                const v8 u = ld(x0 + k), v = ld(x1 + k);
                v8 wv = ld(w0p + k);
                a00 = fma8(wv, u, a00);
                a01 = fma8(wv, v, a01);
                wv = ld(w1p + k);
                a10 = fma8(wv, u, a10);
                a11 = fma8(wv, v, a11);
                wv = ld(w2p + k);
                a20 = fma8(wv, u, a20);
                a21 = fma8(wv, v, a21);
                wv = ld(w3p + k);
                a30 = fma8(wv, u, a30);
                a31 = fma8(wv, v, a31);
            }
            v4 s[2] = {hsum4(a00, a10, a20, a30), hsum4(a01, a11, a21, a31)};
            for (int64_t k = K8; k < K; k++)
                for (int r = 0; r < 4; r++) {
                    s[0][r] += wr[r][k] * x0[k];
                    s[1][r] += wr[r][k] * x1[k];
                }
            for (int j = 0; j < 2; j++) {
                float* o = y + (t + j) * ldy + n0;
                const v4 val = s[j] + bias;
                for (int r = 0; r < nn; r++) o[r] = accumulate ? o[r] + val[r] : val[r];
            }
        }
        for (; t < T; t++) {
            const float* x0 = x + t * ldx;
            /* two accumulators a row (even / odd 8-blocks): eight FMA chains in flight */
            v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, b0 = {0}, b1 = {0}, b2 = {0}, b3 = {0};
            int64_t k = 0;
            for (; k + 16 <= K8; k += 16) {
                if (t == 0) { /* the next tile's rows: 4K floats on */
                    __builtin_prefetch(w0p + k + 4 * K);
                    __builtin_prefetch(w1p + k + 4 * K);
                    __builtin_prefetch(w2p + k + 4 * K);
                    __builtin_prefetch(w3p + k + 4 * K);
                }
                const v8 u = ld(x0 + k), v = ld(x0 + k + 8);
                a0 = fma8(ld(w0p + k), u, a0);
                a1 = fma8(ld(w1p + k), u, a1);
                a2 = fma8(ld(w2p + k), u, a2);
                a3 = fma8(ld(w3p + k), u, a3);
                b0 = fma8(ld(w0p + k + 8), v, b0);
                b1 = fma8(ld(w1p + k + 8), v, b1);
                b2 = fma8(ld(w2p + k + 8), v, b2);
                b3 = fma8(ld(w3p + k + 8), v, b3);
            }
            for (; k < K8; k += 8) {
                const v8 u = ld(x0 + k);
                a0 = fma8(ld(w0p + k), u, a0);
                a1 = fma8(ld(w1p + k), u, a1);
                a2 = fma8(ld(w2p + k), u, a2);
                a3 = fma8(ld(w3p + k), u, a3);
            }
            v4 s = hsum4(a0 + b0, a1 + b1, a2 + b2, a3 + b3);
            for (int64_t k = K8; k < K; k++)
                for (int r = 0; r < 4; r++) s[r] += wr[r][k] * x0[k];
            float* o = y + t * ldy + n0;
            const v4 val = s + bias;
            for (int r = 0; r < nn; r++) o[r] = accumulate ? o[r] + val[r] : val[r];
        }
    }
}

/* y [T, N] = x [T, K] w [N, K]^T (+ b): the matmul above on its own, for tests and tuning */
void loom_linear_f32(const float* x, int64_t T, int64_t K, const float* w, const float* b,
                     int64_t N, float* y, int nthreads) {
    gemm(x, T, K, K, w, b, N, y, N, 0, nthreads);
}

/* Weights packed for the matmul: [ceil(N / 16), K, 16], panel p holding output rows 16p ..
   16p + 15 K-major (rows past N are zero), so the 16 outputs of one k are one 64-byte line:
   a panel is one sequential stream for the hardware prefetcher (the row-major tiles read four
   1 KB row streams a tile), and with every step reading only this copy a decode step's
   matmuls went from 1.22 to 0.31 CPU ms; docs/benchmarks.md "Session 6: the matmuls (K)".
   PANEL, and MT_MAX (tokens per pass), are in loom_cpu.h. */
/* Accumulator sets over k (k mod U) for a pass of MT tokens, so that eight or more FMA chains
   are in flight (an FMA's latency is 4 cycles, two issue a cycle): a single token would
   otherwise wait on its own chain(s). */
#if ISA_BITS == 512
#define USETS(MT) ((MT) == 1 ? 8 : (MT) == 2 ? 4 : (MT) == 3 ? 3 : (MT) < 8 ? 2 : 1)
#else
#define USETS(MT) ((MT) == 1 ? 4 : (MT) < 4 ? 2 : 1)
#endif

/* Weight lines (one k of a panel each) a pass prefetches ahead: none for one token (a decode
   step: the hardware prefetcher keeps up), 4 KB for 2+ (a speculative verify's 2-8 rows, a
   prefill). With the weights streamed from memory (SmolLM2's 538 MB) the hardware prefetcher
   alone left 2-7 token passes 1.22-1.51x a one-token pass and the prefetched 8-token pass
   1.15x; prefetching from 2 tokens makes them 1.03-1.22x (docs/benchmarks.md, "a speculative
   step on SmolLM2"). Cache-resident weights: 16 tokens 1.61 -> 1.25 ms with it. */
#define PF_LINES(MT) ((MT) >= 2 ? 64 : 0)

/* 1: on AVX2 a 7- or 8-token call is one pass (gemm_packed_ld); 0: the MT_MAX split */
int loom_f32_verify_tiles = 1;

/* which variant this build is: 512 (AVX-512F) or 256 (AVX2 / generic vectors) */
int loom_isa_bits(void) { return ISA_BITS; }

/* MT tokens x one panel's 16 outputs; xs the tokens' x transposed, xs[k * MT + t] (for one
   token: the x row itself). y rows ldy apart, nn <= 16 of the outputs valid. */
#if ISA_BITS == 512
static inline
    __attribute__((always_inline)) void panel_block(const float* xs, int64_t K, const float* wp,
                                                    const float* b, int64_t nn, float* y,
                                                    int64_t ldy, int accumulate, const int MT) {
    const int U = USETS(MT);
    const int64_t pf = PF_LINES(MT);
    __m512 acc[2 * MT_MAX];
#pragma GCC unroll 16
    for (int i = 0; i < U * MT; i++) acc[i] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + U <= K; k += U) {
#pragma GCC unroll 8
        for (int u = 0; u < U; u++) {
            if (pf) _mm_prefetch((const char*)(wp + (k + u + pf) * PANEL), _MM_HINT_T0);
            const __m512 w = _mm512_loadu_ps(wp + (k + u) * PANEL);
            const float* xk = xs + (k + u) * MT;
#pragma GCC unroll 16
            for (int t = 0; t < MT; t++)
                acc[u * MT + t] = _mm512_fmadd_ps(w, _mm512_set1_ps(xk[t]), acc[u * MT + t]);
        }
    }
    for (; k < K; k++) {
        const __m512 w = _mm512_loadu_ps(wp + k * PANEL);
#pragma GCC unroll 16
        for (int t = 0; t < MT; t++)
            acc[t] = _mm512_fmadd_ps(w, _mm512_set1_ps(xs[k * MT + t]), acc[t]);
    }
#pragma GCC unroll 8
    for (int u = 1; u < U; u++)
#pragma GCC unroll 16
        for (int t = 0; t < MT; t++) acc[t] = _mm512_add_ps(acc[t], acc[u * MT + t]);
    const __mmask16 m = nn >= PANEL ? (__mmask16)0xffff : (__mmask16)((1u << nn) - 1);
    const __m512 bias = b ? _mm512_maskz_loadu_ps(m, b) : _mm512_setzero_ps();
#pragma GCC unroll 16
    for (int t = 0; t < MT; t++) {
        float* o = y + t * ldy;
        __m512 v = _mm512_add_ps(acc[t], bias);
        if (accumulate) v = _mm512_add_ps(_mm512_maskz_loadu_ps(m, o), v);
        _mm512_mask_storeu_ps(o, m, v);
    }
}
#else
static inline
    __attribute__((always_inline)) void panel_block(const float* xs, int64_t K, const float* wp,
                                                    const float* b, int64_t nn, float* y,
                                                    int64_t ldy, int accumulate, const int MT) {
    const int U = USETS(MT);
    const int64_t pf = PF_LINES(MT);
    v8 acc[8][2]; /* MT_MAX passes, and the verify tiles of 7 and 8 tokens */
#pragma GCC unroll 8
    for (int i = 0; i < U * MT; i++) acc[i][0] = acc[i][1] = (v8){0};
    int64_t k = 0;
    for (; k + U <= K; k += U) {
#pragma GCC unroll 4
        for (int u = 0; u < U; u++) {
            if (pf) __builtin_prefetch(wp + (k + u + pf) * PANEL);
            const v8 w0 = ld(wp + (k + u) * PANEL), w1 = ld(wp + (k + u) * PANEL + 8);
            const float* xk = xs + (k + u) * MT;
#pragma GCC unroll 8
            for (int t = 0; t < MT; t++) {
                const float xv = xk[t];
                const v8 xb = {xv, xv, xv, xv, xv, xv, xv, xv};
                acc[u * MT + t][0] = fma8(w0, xb, acc[u * MT + t][0]);
                acc[u * MT + t][1] = fma8(w1, xb, acc[u * MT + t][1]);
            }
        }
    }
    for (; k < K; k++) {
        const v8 w0 = ld(wp + k * PANEL), w1 = ld(wp + k * PANEL + 8);
#pragma GCC unroll 8
        for (int t = 0; t < MT; t++) {
            const float xv = xs[k * MT + t];
            const v8 xb = {xv, xv, xv, xv, xv, xv, xv, xv};
            acc[t][0] = fma8(w0, xb, acc[t][0]);
            acc[t][1] = fma8(w1, xb, acc[t][1]);
        }
    }
#pragma GCC unroll 4
    for (int u = 1; u < U; u++)
#pragma GCC unroll 8
        for (int t = 0; t < MT; t++) {
            acc[t][0] += acc[u * MT + t][0];
            acc[t][1] += acc[u * MT + t][1];
        }
#pragma GCC unroll 8
    for (int t = 0; t < MT; t++) {
        float* o = y + t * ldy;
        if (nn == PANEL && !accumulate && !b) {
            memcpy(o, &acc[t][0], 32);
            memcpy(o + 8, &acc[t][1], 32);
            continue;
        }
        float s[PANEL];
        memcpy(s, &acc[t][0], 32);
        memcpy(s + 8, &acc[t][1], 32);
        for (int64_t r = 0; r < nn; r++) {
            const float val = s[r] + (b ? b[r] : 0.f);
            o[r] = accumulate ? o[r] + val : val;
        }
    }
}
#endif

/* gemm's contract with the weights packed (wp as above), panels ldp floats apart (K * PANEL,
   or more where only the first K of each panel's rows are used). The T tokens go in
   ceil(T / MT_MAX) passes of near-equal size (9 tokens on AVX2: 5 + 4, not 6 + 3; 6 + 1's
   single-token pass would run at a quarter of the FMA rate), but for the AVX2 verify tiles
   below. */
static void gemm_packed_ld(const float* x, int64_t T, int64_t K, int64_t ldx, const float* wp,
                           int64_t ldp, const float* b, int64_t N, float* y, int64_t ldy,
                           int accumulate, int nthreads) {
    /* tokens in blocks of ~128 KB of x, so that every panel re-reads them from L2 (a prefill of
       thousands of rows would stream x from memory once per panel) */
    const int64_t TB = K < 32768 / (2 * MT_MAX) ? 32768 / K / MT_MAX * MT_MAX : 2 * MT_MAX;
    if (T > TB) {
        for (int64_t t0 = 0; t0 < T; t0 += TB)
            gemm_packed_ld(x + t0 * ldx, T - t0 < TB ? T - t0 : TB, K, ldx, wp, ldp, b, N,
                           y + t0 * ldy, ldy, accumulate, nthreads);
        return;
    }
    if (T <= 0) return;
    /* AVX2 (MT_MAX 6): a call of 7 or 8 tokens (a speculative verify of 6 or 7 drafts) is one
       pass (loom_f32_verify_tiles; 0: ceil(T / MT_MAX) passes, 4 + 3 and 4 + 4, the old
       split). A 4-token pass keeps 8 FMA chains in flight and ran at ~0.6 of a 6-token pass's
       multiply-add rate on the Zen 3 CPU, so 4 + 4 was the slowest way to do 8 tokens; one
       8-token pass needs 16 accumulators and a broadcast register, one more than AVX2 has
       (the compiler spills one accumulator), and still did 8 tokens of SmolLM2's matmuls in
       0.76-0.80 of the 4 + 4 time, 7 in 0.73-0.82 of 4 + 3's (docs/benchmarks.md, "the f32
       target's verify cost on an AVX2 CPU"). Each output stays one chain over k ascending,
       the sum order of every pass of 4+ tokens. */
    const int64_t nb = ISA_BITS == 256 && loom_f32_verify_tiles && (T == 7 || T == 8)
                           ? 1
                           : (T + MT_MAX - 1) / MT_MAX,
                  q = T / nb, r = T % nb;
    /* each pass's x transposed (xs[start * K + k * mt + t]): the kernel's broadcasts then read
       one pointer at constant offsets */
    float stack_xs[8192];
    float* xs = (float*)x;
    if (T > 1) {
        xs = T * K <= 8192 ? stack_xs : malloc(sizeof(float) * T * K);
        for (int64_t j = 0; j < nb; j++) {
            const int64_t s0 = j * q + (j < r ? j : r), mt = q + (j < r);
            float* dst = xs + s0 * K;
            for (int64_t t = 0; t < mt; t++) {
                const float* src = x + (s0 + t) * ldx;
                for (int64_t k = 0; k < K; k++) dst[k * mt + t] = src[k];
            }
        }
    }
    const int64_t panels = (N + PANEL - 1) / PANEL;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1)
    for (int64_t p = 0; p < panels; p++) {
        const int64_t n0 = p * PANEL, nn = N - n0 < PANEL ? N - n0 : PANEL;
        const float* w = wp + p * ldp;
        const float* bb = b ? b + n0 : NULL;
        for (int64_t j = 0; j < nb; j++) {
            const int64_t s0 = j * q + (j < r ? j : r), mt = q + (j < r);
            const float* xj = xs + s0 * K;
            float* yj = y + s0 * ldy + n0;
            /* one case per pass size: panel_block inlines with MT a constant */
            // clang-format off
            switch (mt) {
            case 1: panel_block(xj, K, w, bb, nn, yj, ldy, accumulate, 1); break;
            case 2: panel_block(xj, K, w, bb, nn, yj, ldy, accumulate, 2); break;
            case 3: panel_block(xj, K, w, bb, nn, yj, ldy, accumulate, 3); break;
            case 4: panel_block(xj, K, w, bb, nn, yj, ldy, accumulate, 4); break;
            case 5: panel_block(xj, K, w, bb, nn, yj, ldy, accumulate, 5); break;
            case 6: panel_block(xj, K, w, bb, nn, yj, ldy, accumulate, 6); break;
            case 7: panel_block(xj, K, w, bb, nn, yj, ldy, accumulate, 7); break;
            case 8: panel_block(xj, K, w, bb, nn, yj, ldy, accumulate, 8); break;
#if MT_MAX > 8
            case 9: panel_block(xj, K, w, bb, nn, yj, ldy, accumulate, 9); break;
            case 10: panel_block(xj, K, w, bb, nn, yj, ldy, accumulate, 10); break;
            case 11: panel_block(xj, K, w, bb, nn, yj, ldy, accumulate, 11); break;
            case 12: panel_block(xj, K, w, bb, nn, yj, ldy, accumulate, 12); break;
            case 13: panel_block(xj, K, w, bb, nn, yj, ldy, accumulate, 13); break;
            case 14: panel_block(xj, K, w, bb, nn, yj, ldy, accumulate, 14); break;
            case 15: panel_block(xj, K, w, bb, nn, yj, ldy, accumulate, 15); break;
            case 16: panel_block(xj, K, w, bb, nn, yj, ldy, accumulate, 16); break;
#endif
            default: break;
            }
            // clang-format on
        }
    }
    if (xs != x && xs != stack_xs) free(xs);
}

/* the matmul over packed weights (every step size) */
void gemm_packed(const float* x, int64_t T, int64_t K, int64_t ldx, const float* wp, const float* b,
                 int64_t N, float* y, int64_t ldy, int accumulate, int nthreads) {
    gemm_packed_ld(x, T, K, ldx, wp, K * PANEL, b, N, y, ldy, accumulate, nthreads);
}

void loom_linear_packed_f32(const float* x, int64_t T, int64_t K, const float* wp, const float* b,
                            int64_t N, float* y, int nthreads) {
    gemm_packed(x, T, K, K, wp, b, N, y, N, 0, nthreads);
}

static inline double cpu_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}
/* with prof != NULL: prof[0] += the calling thread's CPU seconds in matmuls, prof[1] in
   attention (the benchmark's step split) */
#define TIMED(slot, stmt)                                                                          \
    do {                                                                                           \
        const double t0_ = prof ? cpu_seconds() : 0.;                                              \
        stmt;                                                                                      \
        if (prof) prof[slot] += cpu_seconds() - t0_;                                               \
    } while (0)

/* Elements idx .. idx + n - 1 of a layer's K or V cache as float32: in place for a float32
   pool, else (bf16: Model.kv_bf16) the bfloat16 row widened into buf. The attention below reads
   every K / V row through this or kv_row, so scores, softmax and the weighted sum stay float32
   whatever the pool stores. */
static inline const float* kv_at(const float* cache, int bf16, int64_t idx, float* buf, int64_t n) {
    return bf16 ? row_bf16((const uint16_t*)(const void*)cache + idx, buf, n) : cache + idx;
}

/* Attention of one request's n query tokens (n >= loom_block_attn_min) for kv head kh, as two
   matmuls on the packed kernel: its S K rows gathered into panels (keys as the output rows),
   scores = q K^T per query head of the group, the softmax, then out = P V with V's rows
   gathered as panels of 16 head dims. Each loaded K / V vector feeds every query row of the
   pass, where the per-token loop reads the rows once per token. Causal (mask NULL): queries go
   in chunks of ATTN_CHUNK rows, each against the keys its last row may see (the causal
   triangle's upper half is skipped, and a chunk's scores stay in cache); with a draft tree's
   mask [n, S] (row j sees column c where mask[j * S + c]) every row scores all S keys and the
   masked ones get probability 0 (a row that sees nothing: zeros). A float32 pool only: a
   bfloat16 pool's rows each take the decode kernel (loom_forward_f32). */
#define ATTN_CHUNK 64
/* tokens of one request from which its attention takes the blocked path (those of 2 ..
   loom_small_attn_max tokens take small_attention instead; a float32 pool only): tuning knobs
   the tests and benchmarks set through ctypes (c_int.in_dll) */
int loom_block_attn_min = 2;
static void block_attention(const float* qkv, int64_t QKV, int64_t n, int64_t S,
                            const int64_t* cols, const float* kc, const float* vc, int64_t Hkv,
                            int64_t kh, int64_t G, int64_t D, float scale, float* out, int64_t ldo,
                            int nthreads, const uint8_t* mask) {
    const int64_t Sp = (S + PANEL - 1) / PANEL * PANEL, Dp = (D + PANEL - 1) / PANEL * PANEL;
    float* kp = calloc((size_t)(Sp * D), sizeof(float)); /* [Sp / 16, D, 16] */
    float* vp = calloc((size_t)(Dp * S), sizeof(float)); /* [Dp / 16, S, 16] */
    float* sc = malloc(sizeof(float) * (n < ATTN_CHUNK ? n : ATTN_CHUNK) * S);
    for (int64_t c = 0; c < S; c++) {
        const float *kr = kc + (cols[c] * Hkv + kh) * D, *vr = vc + (cols[c] * Hkv + kh) * D;
        float* kd = kp + (c / PANEL) * D * PANEL + c % PANEL;
        for (int64_t d = 0; d < D; d++) kd[d * PANEL] = kr[d];
        for (int64_t d = 0; d < D; d++) vp[(d / PANEL) * S * PANEL + c * PANEL + d % PANEL] = vr[d];
    }
    for (int64_t gj = 0; gj < G * ((n + ATTN_CHUNK - 1) / ATTN_CHUNK); gj++) {
        const int64_t g = gj % G, j0 = gj / G * ATTN_CHUNK;
        const int64_t rows = n - j0 < ATTN_CHUNK ? n - j0 : ATTN_CHUNK;
        const int64_t keys = mask ? S : S - n + j0 + rows;
        const float* q = qkv + j0 * QKV + (kh * G + g) * D;
        gemm_packed(q, rows, D, QKV, kp, NULL, keys, sc, keys, 0, nthreads);
        for (int64_t j = 0; j < rows; j++) {
            float* row = sc + j * keys;
            const int64_t len = mask ? S : S - n + j0 + j + 1;
            if (mask) {
                const uint8_t* mr = mask + (j0 + j) * S;
                for (int64_t c = 0; c < S; c++) row[c] = mr[c] ? row[c] : -INFINITY;
            }
            float mx = -INFINITY;
#pragma omp simd reduction(max : mx)
            for (int64_t c = 0; c < len; c++) mx = row[c] > mx ? row[c] : mx;
            if (mx == -INFINITY) mx = 0.f; /* nothing visible: every exp below is 0 */
            float sum = 0.f;
#pragma omp simd reduction(+ : sum)
            for (int64_t c = 0; c < len; c++) {
                const float e = fast_expf((row[c] - mx) * scale);
                row[c] = e;
                sum += e;
            }
            const float inv = sum > 0.f ? 1.f / sum : 0.f;
#pragma omp simd
            for (int64_t c = 0; c < len; c++) row[c] *= inv;
            for (int64_t c = len; c < keys; c++) row[c] = 0.f;
        }
        gemm_packed_ld(sc, rows, keys, keys, vp, S * PANEL, NULL, D,
                       out + j0 * ldo + (kh * G + g) * D, ldo, 0, nthreads);
    }
    free(kp);
    free(vp);
    free(sc);
}

/* Decode attention: one query token, kv head kh, its G query heads, causal over all S columns
   (a request's single decode token sees them all). One pass of scores with each K row
   prefetched ONE_PF keys ahead (the rows are scattered over the pool by the req-to-token table,
   so the hardware prefetcher does not see the next one), the softmax, then one pass over the V
   rows with the G x D accumulators held in registers, so each V row is loaded once for the G
   heads and nothing is stored per row. For G * D / 16 <= 16 with D = 64 or 128, and D = 256
   one query head a pass (AVX-512); returns 0 where it does not apply and the per-token loop
   runs instead. sc: scratch [G * S]. */
#define ONE_PF 4
#if ISA_BITS == 512
/* row c of a K or V cache (pool slot cols[c], KV head kh) into r[0..DV), prefetching the row
   ONE_PF keys ahead. BF (a constant of each instance): the cache holds bfloat16, each 16
   elements (32 bytes) widened in registers (zero-extend, shift left 16): half the bytes of a
   float32 row, the same float32 values the eager path widens them to. */
static inline __attribute__((always_inline)) void kv_row(const float* cache, const int64_t* cols,
                                                         int64_t c, int64_t S, int64_t Hkv,
                                                         int64_t kh, const int DV, const int BF,
                                                         __m512* r) {
    const int64_t D = 16 * DV;
    if (BF) {
        const uint16_t* cache16 = (const uint16_t*)(const void*)cache;
        if (c + ONE_PF < S) {
            const char* p = (const char*)(cache16 + (cols[c + ONE_PF] * Hkv + kh) * D);
            for (int j = 0; j < (DV + 1) / 2; j++) _mm_prefetch(p + 64 * j, _MM_HINT_T0);
        }
        const uint16_t* row = cache16 + (cols[c] * Hkv + kh) * D;
        for (int j = 0; j < DV; j++)
            r[j] = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(row + 16 * j))), 16));
        return;
    }
    if (c + ONE_PF < S) {
        const char* p = (const char*)(cache + (cols[c + ONE_PF] * Hkv + kh) * D);
        for (int j = 0; j < DV; j++) _mm_prefetch(p + 64 * j, _MM_HINT_T0);
    }
    const float* row = cache + (cols[c] * Hkv + kh) * D;
    for (int j = 0; j < DV; j++) r[j] = _mm512_loadu_ps(row + 16 * j);
}

static inline __attribute__((always_inline)) void attn_one_t(const float* qb, int64_t S,
                                                             const int64_t* cols, const float* kc,
                                                             const float* vc, int64_t Hkv,
                                                             int64_t kh, float scale, float* o,
                                                             float* sc, const int G, const int DV,
                                                             const int BF) {
    const int64_t D = 16 * DV;
    __m512 q[16], acc[16];
    float mx[4];
    for (int g = 0; g < G; g++) {
        mx[g] = -INFINITY;
        for (int j = 0; j < DV; j++) q[g * DV + j] = _mm512_loadu_ps(qb + g * D + 16 * j);
    }
    for (int64_t c = 0; c < S; c++) {
        __m512 k[16];
        kv_row(kc, cols, c, S, Hkv, kh, DV, BF, k);
        for (int g = 0; g < G; g++) {
            __m512 a = _mm512_mul_ps(q[g * DV], k[0]);
            for (int j = 1; j < DV; j++) a = _mm512_fmadd_ps(q[g * DV + j], k[j], a);
            const float s = _mm512_reduce_add_ps(a) * scale;
            sc[g * S + c] = s;
            mx[g] = s > mx[g] ? s : mx[g];
        }
    }
    float inv[4];
    for (int g = 0; g < G; g++) {
        float* s = sc + g * S;
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t c = 0; c < S; c++) {
            const float e = fast_expf(s[c] - mx[g]);
            s[c] = e;
            sum += e;
        }
        inv[g] = sum > 0.f ? 1.f / sum : 0.f;
    }
    for (int i = 0; i < G * DV; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t c = 0; c < S; c++) {
        __m512 v[16];
        kv_row(vc, cols, c, S, Hkv, kh, DV, BF, v);
        for (int g = 0; g < G; g++) {
            const __m512 p = _mm512_set1_ps(sc[g * S + c]);
            for (int j = 0; j < DV; j++) acc[g * DV + j] = _mm512_fmadd_ps(p, v[j], acc[g * DV + j]);
        }
    }
    for (int g = 0; g < G; g++)
        for (int j = 0; j < DV; j++)
            _mm512_storeu_ps(o + g * D + 16 * j, _mm512_mul_ps(acc[g * DV + j], _mm512_set1_ps(inv[g])));
}
#endif

static int attn_one(const float* qb, int64_t S, const int64_t* cols, const float* kc,
                    const float* vc, int64_t Hkv, int64_t kh, int64_t G, int64_t D, float scale,
                    float* o, float* sc, int bf16) {
#if ISA_BITS == 512
#define ONE_CASE(GG, DD)                                                                        \
    if (G == (GG) && D == 16 * (DD)) {                                                          \
        if (bf16)                                                                               \
            attn_one_t(qb, S, cols, kc, vc, Hkv, kh, scale, o, sc, GG, DD, 1);                  \
        else                                                                                    \
            attn_one_t(qb, S, cols, kc, vc, Hkv, kh, scale, o, sc, GG, DD, 0);                  \
        return 1;                                                                               \
    }
    ONE_CASE(1, 4) ONE_CASE(2, 4) ONE_CASE(3, 4) ONE_CASE(4, 4) ONE_CASE(1, 8) ONE_CASE(2, 8)
#undef ONE_CASE
    if (D == 256) { /* Gemma 3: one query head a pass (16 q + 16 acc vectors), K / V rows
                       re-read from L1 / L2 for the group's other heads */
        for (int64_t g = 0; g < G; g++) {
            if (bf16)
                attn_one_t(qb + g * D, S, cols, kc, vc, Hkv, kh, scale, o + g * D, sc, 1, 16, 1);
            else
                attn_one_t(qb + g * D, S, cols, kc, vc, Hkv, kh, scale, o + g * D, sc, 1, 16, 0);
        }
        return 1;
    }
#else
    /* AVX2 builds: attn_avx2.c, bitwise the per-token loop of attn_items (0 where it does
       not apply or the knob loom_attn_avx2 is 0: that loop runs) */
    return loom_attn_one_avx2(qb, S, cols, kc, vc, Hkv, kh, G, D, scale, o, sc, bf16);
#endif
    (void)qb, (void)S, (void)cols, (void)kc, (void)vc, (void)Hkv, (void)kh, (void)G, (void)D;
    (void)scale, (void)o, (void)sc, (void)bf16;
    return 0;
}

/* Attention of one request's n query tokens (2 <= n <= loom_small_attn_max: a verify step's
   1 + k tokens) for kv head kh, reading each visible K and V row once and writing no copies:
   the R = n * G query rows (row r = j * G + g) are held transposed and pre-scaled, qt[d][r],
   so a K row's R scores are D broadcast multiply-adds over rows (no per-dot horizontal sums);
   scores are kept column-major, sc[c][r], so the softmax's max / exp / sum run over rows too;
   then each V row adds p * v into the R x D accumulators. Causal (mask NULL): row j sees
   c < S - n + j + 1; with a mask [n, S], where mask[j * S + c]. Invisible columns get
   probability 0 (a row that sees nothing: zeros). Scratch (per thread, RP = R rounded up to
   16): qt [D * RP], sc [(S + SMALL_COLS) * RP], acc [R * D]. A float32 pool only: a bfloat16
   pool's rows of such a request each take the decode kernel (loom_forward_f32). */
#define SMALL_LANES 16
#define SMALL_COLS 4 /* the V pass below is written out for 4 */
/* R is rounded up to SMALL_ROUND rows, a last group of 8 lanes taking the rows past the 16s
   (knob loom_small_attn_round).
   AVX2: 8 (one ymm). A verify of 6-8 tokens with SmolLM2's 3 query heads a kv head (R = 18-24)
   had RP = 32 and the attention of a 16-row one doubled at every context (512 tokens: 9-11 ms
   of CPU a step for 2-5 tokens, 19-22 ms for 6-8; docs/benchmarks.md, "the f32 target's
   verify cost on an AVX2 CPU"). AVX-512: 16, the old rounding (not measured here). Each score
   is the same chain over d whatever the grouping: no change in bits. */
#if ISA_BITS == 512
#define SMALL_ROUND 16
#else
#define SMALL_ROUND 8
#endif
/* the rounding in use: SMALL_ROUND, or 16 (the old rounding, for A/Bs; any value but 8 is 16) */
int loom_small_attn_round = SMALL_ROUND;
int loom_small_attn_max = 32;
/* whether a request of n tokens takes small_attention */
static inline int small_path(int64_t n) { return n >= 2 && n <= loom_small_attn_max; }
/* The SMALL_COLS pool rows (K or V) from column c on into cache, SMALL_PF columns ahead of the
   pass reading them: the rows sit one pool slot apart (Hkv heads between them) or anywhere (the
   req-to-token table), so the hardware prefetcher does not run ahead of the pass; without it a
   long context's verify (SmolLM2's Q4_1 at 1,536 tokens) spent ~3x a decode step's attention. */
#define SMALL_PF 16
static inline void small_prefetch(const float* cache, const int64_t* cols, int64_t c, int64_t S,
                                  int64_t Hkv, int64_t kh, int64_t D) {
    for (int64_t u = 0; u < SMALL_COLS && c + u < S; u++) {
        const char* p = (const char*)(cache + (cols[c + u] * Hkv + kh) * D);
        for (int64_t b = 0; b < D * (int64_t)sizeof(float); b += 64) __builtin_prefetch(p + b, 0, 3);
    }
}
/* the scores of lanes r0 .. r0 + L of SMALL_COLS keys (kr) into sc's columns c0 .. */
static inline __attribute__((always_inline)) void small_scores(const float* qt, int64_t RP,
                                                               int64_t r0, const float* const* kr,
                                                               int64_t D, float* sc, int64_t c0,
                                                               int64_t S, const int L) {
    float a[SMALL_COLS][SMALL_LANES];
    for (int64_t u = 0; u < SMALL_COLS; u++)
        for (int64_t i = 0; i < L; i++) a[u][i] = 0.f;
    for (int64_t d = 0; d < D; d++) {
        const float* qd = qt + d * RP + r0;
        for (int64_t u = 0; u < SMALL_COLS; u++) {
            const float kd = kr[u][d];
#pragma omp simd
            for (int64_t i = 0; i < L; i++) a[u][i] += qd[i] * kd;
        }
    }
    for (int64_t u = 0; u < SMALL_COLS && c0 + u < S; u++)
        memcpy(sc + (c0 + u) * RP + r0, a[u], sizeof(float) * L);
}
static void small_attention(const float* qkv, int64_t QKV, int64_t n, int64_t S,
                            const int64_t* cols, const float* kc, const float* vc, int64_t Hkv,
                            int64_t kh, int64_t G, int64_t D, float scale, float* out, int64_t ldo,
                            const uint8_t* mask, float* qt, float* sc, float* acc) {
    const int64_t rd = loom_small_attn_round == 8 ? 8 : 16;
    const int64_t R = n * G, RP = (R + rd - 1) / rd * rd;
    const int64_t first = S - n; /* columns before it are seen by every row (causal) */
    memset(qt, 0, sizeof(float) * D * RP);
    for (int64_t j = 0; j < n; j++)
        for (int64_t g = 0; g < G; g++) {
            const float* q = qkv + j * QKV + (kh * G + g) * D;
            for (int64_t d = 0; d < D; d++) qt[d * RP + j * G + g] = q[d] * scale;
        }
    float mx[RP];
    for (int64_t r = 0; r < RP; r++) mx[r] = -INFINITY;
    for (int64_t c0 = 0; c0 < S; c0 += SMALL_COLS) {
        /* SMALL_COLS keys a pass: independent multiply-add chains, and each qt vector loaded
           once for all of them (past S, the last key again, its scores not stored) */
        const float* kr[SMALL_COLS];
        for (int64_t u = 0; u < SMALL_COLS; u++)
            kr[u] = kc + (cols[c0 + u < S ? c0 + u : S - 1] * Hkv + kh) * D;
        small_prefetch(kc, cols, c0 + SMALL_PF, S, Hkv, kh, D);
        for (int64_t r0 = 0; r0 < RP; r0 += SMALL_LANES) {
            if (r0 + SMALL_LANES <= RP)
                small_scores(qt, RP, r0, kr, D, sc, c0, S, SMALL_LANES);
            else
                small_scores(qt, RP, r0, kr, D, sc, c0, S, 8);
        }
        for (int64_t c = c0; c < c0 + SMALL_COLS && c < S; c++) {
            float* s = sc + c * RP;
            if (mask) {
                for (int64_t j = 0; j < n; j++)
                    if (!mask[j * S + c])
                        for (int64_t g = 0; g < G; g++) s[j * G + g] = -INFINITY;
            } else if (c > first) { /* rows j < c - first do not see it yet */
                for (int64_t r = 0; r < (c - first) * G; r++) s[r] = -INFINITY;
            }
#pragma omp simd
            for (int64_t r = 0; r < RP; r++) mx[r] = s[r] > mx[r] ? s[r] : mx[r];
        }
    }
    float inv[RP];
    for (int64_t r = 0; r < RP; r++) {
        inv[r] = 0.f;
        if (mx[r] == -INFINITY) mx[r] = 0.f; /* nothing visible: every exp below is 0 */
    }
    for (int64_t c = 0; c < S; c++) {
        float* s = sc + c * RP;
#pragma omp simd
        for (int64_t r = 0; r < RP; r++) {
            const float e = fast_expf(s[r] - mx[r]);
            s[r] = e;
            inv[r] += e;
        }
    }
    for (int64_t r = 0; r < R; r++) inv[r] = inv[r] > 0.f ? 1.f / inv[r] : 0.f;
    memset(acc, 0, sizeof(float) * R * D);
    memset(sc + S * RP, 0, sizeof(float) * SMALL_COLS * RP); /* columns past S: p = 0 */
    for (int64_t c0 = 0; c0 < S; c0 += SMALL_COLS) {
        /* SMALL_COLS V rows a pass, so each accumulator is loaded and stored once for them
           (past S: the last row again, with probability 0) */
        const float* vr[SMALL_COLS];
        for (int64_t u = 0; u < SMALL_COLS; u++)
            vr[u] = vc + (cols[c0 + u < S ? c0 + u : S - 1] * Hkv + kh) * D;
        small_prefetch(vc, cols, c0 + SMALL_PF, S, Hkv, kh, D);
        const float* p = sc + c0 * RP;
        for (int64_t r = 0; r < R; r++) {
            const float p0 = p[r], p1 = p[RP + r], p2 = p[2 * RP + r], p3 = p[3 * RP + r];
            if (p0 == 0.f && p1 == 0.f && p2 == 0.f && p3 == 0.f) continue; /* invisible */
            float* a = acc + r * D;
#pragma omp simd
            for (int64_t d = 0; d < D; d++)
                a[d] += p0 * vr[0][d] + p1 * vr[1][d] + p2 * vr[2][d] + p3 * vr[3][d];
        }
    }
    for (int64_t j = 0; j < n; j++)
        for (int64_t g = 0; g < G; g++) {
            const int64_t r = j * G + g;
            float* o = out + j * ldo + (kh * G + g) * D;
#pragma omp simd
            for (int64_t d = 0; d < D; d++) o[d] = acc[r * D + d] * inv[r];
        }
}

/* The forward's matmul for a weight that may be block-quantized (q non-NULL: quant.c's kernel
   over each row segment, reading the blocks in place), else the float matmul mm. */
static inline void qmm(const QMat* q, int64_t mode, const float* x, int64_t T, int64_t K,
                       int64_t ldx, const float* w, const float* wp, const float* b, int64_t N,
                       float* y, int64_t ldy, int accumulate, int nthreads) {
    if (!q) {
        mm(x, T, K, ldx, w, wp, b, N, y, ldy, accumulate, nthreads);
        return;
    }
    if (q->nseg > 1) loom_q_hold_x(x, T, K, ldx); /* the segments share x's codes */
    for (int64_t i = 0; i < q->nseg; i++) {
        const QSeg* s = q->seg + i;
        loom_q_matmul((int)s->qtype, (int)mode, s->data, s->rows, K, s->row_bytes, x, T, ldx,
                      b ? b + s->row0 : NULL, y + s->row0, ldy, accumulate, nthreads);
    }
    if (q->nseg > 1) loom_q_release_x();
}

/* ---- Gemma 3 (Model.norm_add / act / embed_scale, Layer.post_*_ln / cos / sin / window;
   the Llama family leaves them 0 / NULL and runs the blocks above unchanged) ---------------- */

/* out[D] = (add + w) * (x / rms(x)): Gemma's RMSNorm (add 1: its weights are zero-centred,
   the factor HF applies is 1 + weight); out may alias x */
static void rms_add(const float* x, const float* w, float add, int64_t D, float eps, float* out) {
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int64_t d = 0; d < D; d++) ss += x[d] * x[d];
    const float inv = 1.f / sqrtf(ss / (float)D + eps);
#pragma omp simd
    for (int64_t d = 0; d < D; d++) out[d] = (add + w[d]) * (x[d] * inv);
}

/* the model's RMSNorm of one row: Llama's w * x / rms(x), or Gemma's (1 + w) * ... */
static inline void norm_row(const Model* m, const float* x, const float* w, int64_t D, float* out) {
    if (m->norm_add != 0.f)
        rms_add(x, w, m->norm_add, D, m->eps, out);
    else
        rms(x, w, D, m->eps, out);
}

/* qk_norm_rope with Gemma's norm: every query and key head RMSNormed by (1 + q_norm / k_norm),
   then neox-rotated with the layer's own tables */
static void qk_norm_rope_add(float* qkv, int64_t T, int64_t ld, int64_t H, int64_t Hkv, int64_t D,
                             const float* q_norm, const float* k_norm, float add, float eps,
                             const float* cos, const float* sin, const int64_t* pos) {
    for (int64_t t = 0; t < T; t++) {
        float* q = qkv + t * ld; /* H query heads, then the Hkv key heads */
        const float *c = cos + pos[t] * D, *s = sin + pos[t] * D;
        for (int64_t i = 0; i < H + Hkv; i++) {
            const float* w = i < H ? q_norm : k_norm;
            if (w) rms_add(q + i * D, w, add, D, eps, q + i * D);
            rope(q + i * D, c, s, D);
        }
    }
}

/* g[i] = gelu_tanh(g[i]) * u[i], with gelu_tanh(x) = 0.5 x (1 + tanh(y)) = x / (1 + exp(-2y)),
   y = sqrt(2 / pi) (x + 0.044715 x^3): fast_expf's polynomial vectorizes where tanhf does not;
   the exponent is clamped at 80 (the quotient is then 0 to float precision) */
static void gelu_tanh_mul(float* g, const float* u, int64_t I) {
    int64_t i0 = 0;
#if defined(__AVX2__)
    /* GCC leaves the loop below scalar where it cannot if-convert the clamps into AVX-512
       masks ("control flow in loop": a Gemma 3 batch-32 prefill spent ~0.7 s of CPU in it on
       an AVX2 build). The same operations 8 at a time, each the scalar's IEEE step (no
       contraction: the library builds with -std=c11), so the bits are the loop's. */
    const __m256 c0 = _mm256_set1_ps(0.044715f), c1 = _mm256_set1_ps(-1.5957691216057308f);
    const __m256 lim = _mm256_set1_ps(80.f), one = _mm256_set1_ps(1.f);
    for (; i0 + 8 <= I; i0 += 8) {
        const __m256 x = _mm256_loadu_ps(g + i0);
        __m256 z = _mm256_mul_ps(c1, _mm256_add_ps(x, _mm256_mul_ps(_mm256_mul_ps(_mm256_mul_ps(c0, x), x), x)));
        z = _mm256_blendv_ps(z, lim, _mm256_cmp_ps(z, lim, _CMP_GT_OQ));
        const __m256 ex = fast_exp8(z); /* fast_expf(z) */
        _mm256_storeu_ps(g + i0, _mm256_mul_ps(_mm256_div_ps(x, _mm256_add_ps(one, ex)), _mm256_loadu_ps(u + i0)));
    }
#endif
    for (int64_t i = i0; i < I; i++) {
        const float x = g[i];
        float z = -1.5957691216057308f * (x + 0.044715f * x * x * x);
        z = z > 80.f ? 80.f : z;
        g[i] = x / (1.f + fast_expf(z)) * u[i];
    }
}

/* A step's large scratch (the residual stream, the normed rows, qkv / att / gu: 69 MB at a
   4,096-token SmolLM2 prefill) is mapped and unmapped per step, not malloc'd: glibc serves a
   request from any free heap chunk big enough before its mmap threshold is consulted, and the
   heap holds hundreds of MB of freed (trimmed) holes after start-up, so a prefill's scratch
   could land in a hole and stay resident after the step (SmolLM2 batch 32: +100 MB steady in
   some runs, none in others). Below SCRATCH_MAP_BYTES (runtime/process.py's MMAP_THRESHOLD:
   decode steps, short prefills) malloc keeps serving it. */
#define SCRATCH_MAP_BYTES ((size_t)4 << 20)

static void* scratch_alloc(size_t bytes) {
    if (bytes < SCRATCH_MAP_BYTES) return malloc(bytes);
    void* p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    return p == MAP_FAILED ? NULL : p;
}

static void scratch_free(void* p, size_t bytes) {
    if (bytes < SCRATCH_MAP_BYTES)
        free(p);
    else if (p)
        munmap(p, bytes);
}

/* What one request's attention reads: its KV columns (cols[c] a pool slot), how many (S), and
   its mask [n, S] (NULL: causal, token j of n sees c < S - n + j + 1). */
typedef struct {
    const int64_t* cols;
    int64_t S;
    const uint8_t* mask;
} AttnView;

/* The views of a sliding-window layer (window W): token t sees only columns c > pos[t] - W
   (HF's sliding mask, as runtime/attention/sliding_window.py). A request no token of which is
   past the window keeps its full view; a single causal token starts its columns at its window
   (no mask: the attention paths then see a shorter causal sequence); otherwise the columns
   start at the first any token sees and a mask [n, S'] ANDs the window into the causal or tree
   mask. Returns the masks' buffer (free it; NULL when none was needed). */
static uint8_t* window_views(int64_t W, int64_t B, const int64_t* starts, const int64_t* pos,
                             const AttnView* full, AttnView* win) {
    size_t bytes = 0;
    for (int64_t pass = 0; pass < 2; pass++) {
        uint8_t* buf = NULL;
        if (pass == 1) {
            if (!bytes) return NULL;
            buf = malloc(bytes);
            bytes = 0;
        }
        for (int64_t b = 0; b < B; b++) {
            const int64_t n = starts[b + 1] - starts[b], S = full[b].S;
            int64_t first = S, last = 0; /* the smallest / largest first visible column */
            for (int64_t t = starts[b]; t < starts[b + 1]; t++) {
                const int64_t lo = pos[t] - W + 1 > 0 ? pos[t] - W + 1 : 0;
                first = lo < first ? lo : first;
                last = lo > last ? lo : last;
            }
            if (first > S) first = S;
            if (last == 0) {
                win[b] = full[b];
                continue;
            }
            if (n == 1 && !full[b].mask) {
                win[b] = (AttnView){full[b].cols + first, S - first, NULL};
                continue;
            }
            const int64_t Sw = S - first;
            if (pass == 1) {
                uint8_t* mk = buf + bytes;
                for (int64_t j = 0; j < n; j++) {
                    const int64_t p = pos[starts[b] + j], lo = p - W + 1;
                    for (int64_t c = 0; c < Sw; c++) {
                        const int64_t col = first + c;
                        const int vis = full[b].mask ? full[b].mask[j * S + col] != 0
                                                     : col < S - n + j + 1;
                        mk[j * Sw + c] = (uint8_t)(vis && col >= lo);
                    }
                }
                win[b] = (AttnView){full[b].cols + first, Sw, mk};
            }
            bytes += (size_t)(n * Sw);
        }
        if (pass == 1) return buf;
    }
    return NULL;
}

/* The per-token attention items of one layer (loom_forward_f32): item w = token w / Hkv's KV
   head w % Hkv, for the requests the blocked path did not take (decode tokens through
   attn_one, short requests through small_attention, the rest through the per-token loop).
   Each item writes only its own rows of att, so who runs it (pool.c) does not change them. */
typedef struct {
    const float* qkv;
    float* att;
    const int64_t *tok_req, *starts;
    const AttnView* view;
    const float *k_cache, *v_cache;
    int64_t QKV, H, Hkv, G, D, block_min;
    float scale;
    int bf16;
    int64_t tile; /* a bfloat16 pool's multi-row requests: rows an item takes (loom_attn_rows) */
    float **sc, **acc, **qt; /* per worker (loom_forward_f32 sizes them) */
    int64_t** row_cols;
} AttnJob;

/* A bfloat16 pool's rows t0 .. t1 - 1 of request b (KV head kh) as one query-row tile
   (attn_avx2.c loom_attn_rows_avx2: each row bitwise what attn_one gives it alone). A row's
   visible columns must be one run of its view (causal: the first S - n + j + 1; a window's
   mask: its run of ones), else 0 and the rows go one at a time. sc: the worker's scratch,
   tile x G x S floats (forward_part sizes it). */
static int attn_tile(const AttnJob* J, int64_t t0, int64_t t1, int64_t kh, int64_t b, float* sc) {
    const int64_t S = J->view[b].S, n_tok = J->starts[b + 1] - J->starts[b];
    int64_t lo[64], len[64];
    if (t1 - t0 > 64) return 0;
    for (int64_t t = t0; t < t1; t++) {
        const int64_t j = t - J->starts[b];
        const uint8_t* mrow = J->view[b].mask ? J->view[b].mask + j * S : NULL;
        if (!mrow) {
            lo[t - t0] = 0, len[t - t0] = S - n_tok + j + 1;
            continue;
        }
        int64_t a = 0;
        while (a < S && !mrow[a]) a++;
        int64_t e = a;
        while (e < S && mrow[e]) e++;
        for (int64_t c = e; c < S; c++)
            if (mrow[c]) return 0; /* not one run */
        lo[t - t0] = a, len[t - t0] = e - a;
    }
    const int64_t QKV = J->QKV, HD = J->H * J->D, GD = J->G * J->D;
    return loom_attn_rows_avx2(J->qkv + t0 * QKV + kh * GD, QKV, t1 - t0, J->view[b].cols, lo,
                               len, J->k_cache, J->v_cache, J->Hkv, kh, J->G, J->D, J->scale,
                               J->att + t0 * HD + kh * GD, HD, sc, J->bf16);
}

static void attn_items(void* ctx, int64_t w0, int64_t w1, int worker) {
    const AttnJob* J = ctx;
    const float* qkv = J->qkv;
    float* att = J->att;
    const int64_t QKV = J->QKV, H = J->H, Hkv = J->Hkv, G = J->G, D = J->D;
    const int64_t block_min = J->block_min;
    const int bf16 = J->bf16;
    float *sc = J->sc[worker], *acc = J->acc[worker], *qt = J->qt[worker];
    int64_t* row_cols = J->row_cols[worker];
    for (int64_t w = w0; w < w1; w++) {
        const int64_t t0 = w / Hkv, kh = w % Hkv, b = J->tok_req[t0];
        const int64_t S = J->view[b].S, n_tok = J->starts[b + 1] - J->starts[b];
        int64_t t1 = t0 + 1; /* the rows this item runs */
        if (bf16 && n_tok > 1 && J->tile > 1) {
            /* a tile of rows j .. j + tile - 1 (attn_tile); the item of its first row runs it */
            const int64_t j0 = t0 - J->starts[b];
            if (j0 % J->tile) continue;
            t1 = t0 + (n_tok - j0 < J->tile ? n_tok - j0 : J->tile);
            if (attn_tile(J, t0, t1, kh, b, sc)) continue;
        }
        for (int64_t t = t0; t < t1; t++) {
            const int64_t j = t - J->starts[b];
            const int64_t* cols = J->view[b].cols;
            if (small_path(n_tok) && !bf16) { /* the request's kv head kh at once */
                if (j == 0)
                    small_attention(qkv + t * QKV, QKV, n_tok, S, cols, J->k_cache, J->v_cache,
                                    Hkv, kh, G, D, J->scale, att + t * H * D, H * D,
                                    J->view[b].mask, qt, sc, acc);
                continue;
            }
            if (!bf16 && n_tok >= block_min && !small_path(n_tok)) continue; /* done above */
            const uint8_t* mrow = J->view[b].mask ? J->view[b].mask + j * S : NULL;
            int64_t len = mrow ? S : S - n_tok + j + 1;
            if (bf16) {
                /* A bfloat16 pool: each row of a multi-token request (a verify step's
                   1 + drafts, a whole prompt, a prefill chunk, an extend after a cached
                   prefix) is attended as the one-token decode step of the same token
                   would be: its visible columns in order (a tree's or window's mask
                   compacted away), the same kernel, so the same float32 sums bit for bit
                   however a prompt is split. Rounding each K / V to bfloat16 turns the
                   last-bit differences between two summation orders into whole bf16
                   steps of the next layer's K / V: greedy speculation left plain
                   decoding, and a prompt after a radix-cached prefix decoded otherwise
                   than prefilled whole (docs/architecture.md, "A 16-bit pool in the C
                   forward"). */
                if (mrow) {
                    int64_t k = 0;
                    for (int64_t c = 0; c < S; c++)
                        if (mrow[c]) row_cols[k++] = cols[c];
                    cols = row_cols, len = k, mrow = NULL;
                }
            }
            if ((n_tok == 1 || bf16) && !mrow &&
                attn_one(qkv + t * QKV + kh * G * D, len, cols, J->k_cache, J->v_cache, Hkv,
                         kh, G, D, J->scale, att + t * H * D + kh * G * D, sc, bf16))
                continue;
            const float* qb = qkv + t * QKV + kh * G * D;
            float mx[G], den[G], rb[D]; /* rb: a bfloat16 pool's row, widened */
            for (int64_t g = 0; g < G; g++) mx[g] = -INFINITY;
            for (int64_t c = 0; c < len; c++) {
                if (mrow && !mrow[c]) {
                    for (int64_t g = 0; g < G; g++) sc[g * len + c] = -INFINITY;
                    continue;
                }
                const float* kp = kv_at(J->k_cache, bf16, (cols[c] * Hkv + kh) * D, rb, D);
                for (int64_t g = 0; g < G; g++) {
                    const float* qg = qb + g * D;
                    float dot = 0.f;
    #pragma omp simd reduction(+ : dot)
                    for (int64_t d = 0; d < D; d++) dot += qg[d] * kp[d];
                    dot *= J->scale;
                    sc[g * len + c] = dot;
                    mx[g] = dot > mx[g] ? dot : mx[g];
                }
            }
            for (int64_t g = 0; g < G; g++) {
                float sum = 0.f;
    #pragma omp simd reduction(+ : sum)
                for (int64_t c = 0; c < len; c++) {
                    const float e =
                        sc[g * len + c] == -INFINITY ? 0.f : fast_expf(sc[g * len + c] - mx[g]);
                    sc[g * len + c] = e;
                    sum += e;
                }
                den[g] = sum > 0.f ? 1.f / sum : 0.f;
            }
            memset(acc, 0, sizeof(float) * G * D);
            for (int64_t c = 0; c < len; c++) {
                if (mrow && !mrow[c]) continue;
                const float* vp = kv_at(J->v_cache, bf16, (cols[c] * Hkv + kh) * D, rb, D);
                for (int64_t g = 0; g < G; g++) {
                    const float p = sc[g * len + c];
                    float* a = acc + g * D;
    #pragma omp simd
                    for (int64_t d = 0; d < D; d++) a[d] += p * vp[d];
                }
            }
            float* o = att + t * H * D + kh * G * D;
            for (int64_t g = 0; g < G; g++)
                for (int64_t d = 0; d < D; d++) o[g * D + d] = acc[g * D + d] * den[g];
        }
    }
}

/* The layers of one part of a step (every token of it, or one run of rows: loom_forward_f32),
   then the final norm of its rows fin_rows[0 .. N-1] into fin's rows fin_at[r] (fin_at NULL:
   r). Arguments as loom_forward_f32's. */
static void forward_part(const Model* m, int64_t T, const int64_t* ids, const int64_t* pos,
                         const int64_t* slots, int64_t B, const int64_t* starts, const int64_t* rows,
                         const int64_t* seq_lens, const int64_t* table, int64_t stride,
                         const uint8_t* masks, const int64_t* mask_offs, int64_t N,
                         const int64_t* fin_rows, const int64_t* fin_at, float* fin, int nthreads,
                         double* prof, float* hidden_out, int64_t n_aux, const int64_t* aux_layers,
                         float* aux_out) {
    const int64_t Hd = m->hidden, H = m->heads, Hkv = m->kv_heads, D = m->head_dim;
    const int64_t G = H / Hkv, I = m->inter, QKV = (H + 2 * Hkv) * D;
    const int bf16 = m->kv_bf16 != 0;
    int64_t max_len = 1;
    for (int64_t b = 0; b < B; b++) max_len = seq_lens[b] > max_len ? seq_lens[b] : max_len;
    int64_t* tok_req = malloc(sizeof(int64_t) * (T > 0 ? T : 1));
    for (int64_t b = 0; b < B; b++)
        for (int64_t t = starts[b]; t < starts[b + 1]; t++) tok_req[t] = b;
    const size_t row_bytes = sizeof(float) * T * Hd;
    float* x = scratch_alloc(row_bytes); /* residual stream */
    float* h = scratch_alloc(row_bytes); /* normed input of a block */
    /* qkv and att are dead once a layer's O projection has read att, before its MLP writes
       gu: the three share one buffer (gu over both), so a step's scratch is T x (2 Hd +
       max(QKV + H D, 2 I)) floats, not T x (2 Hd + QKV + H D + 2 I): a 4,096-token SmolLM2
       prefill's peak 94 MB -> 69 MB */
    const int64_t attn_cols = QKV + H * D, mid_cols = attn_cols > 2 * I ? attn_cols : 2 * I;
    const size_t mid_bytes = sizeof(float) * T * mid_cols;
    float* qkv = scratch_alloc(mid_bytes);
    float* att = qkv + T * QKV;
    float* gu = qkv;
    if (m->embed_q) {
        for (int64_t t = 0; t < T; t++) {
            const QSeg* s = m->embed_q->seg; /* one segment: the whole table (cpu_forward) */
            loom_q_rows((int)s->qtype, s->data, s->rows, Hd, s->row_bytes, ids + t, 1, x + t * Hd, 1);
        }
    } else {
        for (int64_t t = 0; t < T; t++) memcpy(x + t * Hd, m->embed + ids[t] * Hd, sizeof(float) * Hd);
    }
    if (m->embed_scale != 1.f) /* Gemma: the rows times sqrt(hidden) */
        for (int64_t i = 0; i < T * Hd; i++) x[i] *= m->embed_scale;
    const int attn_threads = nthreads > 1 && T * Hkv * max_len * H * D > (1 << 17) ? nthreads : 1;
    const int64_t block_min = loom_block_attn_min > 1 ? loom_block_attn_min : 1;
    const int64_t tile = loom_attn_tile_rows() > 1 ? (loom_attn_tile_rows() < 64 ? loom_attn_tile_rows() : 64) : 1;
    /* a float32 pool: a request of 2 .. loom_small_attn_max tokens takes small_attention
       (small_path), else one of block_min or more tokens block_attention, else the per-token
       loop; a bfloat16 pool: every row the decode kernel (below); small_rp: small_attention's
       widest scratch row */
    int64_t small_rp = 0;
    for (int64_t b = 0; b < B; b++) {
        const int64_t n = starts[b + 1] - starts[b];
        if (small_path(n) && n * G > small_rp) small_rp = n * G;
    }
    small_rp = (small_rp + SMALL_LANES - 1) / SMALL_LANES * SMALL_LANES;
    /* each request's attention view: full (every layer of Llama, Gemma's global layers), and
       windowed for sliding-window layers (cpu_forward checks they share one window) */
    AttnView* full = malloc(sizeof(AttnView) * 2 * (B > 0 ? B : 1));
    AttnView* win = full + B;
    int64_t window = 0;
    for (int64_t l = 0; l < m->layers; l++) window = m->layer[l].window ? m->layer[l].window : window;
    for (int64_t b = 0; b < B; b++)
        full[b] = (AttnView){table + rows[b] * stride, seq_lens[b],
                             mask_offs[b] >= 0 ? masks + mask_offs[b] : NULL};
    uint8_t* win_masks = window ? window_views(window, B, starts, pos, full, win) : NULL;

    for (int64_t l = 0; l < m->layers; l++) {
        const Layer* L = m->layer + l;
        const AttnView* view = L->window ? win : full;
        for (int64_t t = 0; t < T; t++) norm_row(m, x + t * Hd, L->ln1, Hd, h + t * Hd);
        TIMED(0, qmm(L->qkv_q, m->q_mode, h, T, Hd, Hd, L->qkv_w, L->qkv_p, L->qkv_b, QKV, qkv, QKV, 0, nthreads));
        if (m->norm_add != 0.f)
            qk_norm_rope_add(qkv, T, QKV, H, Hkv, D, L->q_norm, L->k_norm, m->norm_add, m->eps,
                             L->cos ? L->cos : m->cos, L->sin ? L->sin : m->sin, pos);
        else
            qk_norm_rope(qkv, T, QKV, H, Hkv, D, L->q_norm, L->k_norm, m->eps, m->cos, m->sin, pos);
        for (int64_t t = 0; t < T; t++) {
            const float* k = qkv + t * QKV + H * D;
            if (bf16) {
                store_bf16((uint16_t*)(void*)L->k_cache + slots[t] * Hkv * D, k, Hkv * D);
                store_bf16((uint16_t*)(void*)L->v_cache + slots[t] * Hkv * D, k + Hkv * D, Hkv * D);
            } else {
                memcpy(L->k_cache + slots[t] * Hkv * D, k, sizeof(float) * Hkv * D);
                memcpy(L->v_cache + slots[t] * Hkv * D, k + Hkv * D, sizeof(float) * Hkv * D);
            }
        }
        const double att0 = prof ? cpu_seconds() : 0.;
        /* long multi-token requests: the blocked path (a float32 pool's only) */
        for (int64_t b = 0; b < B && !bf16; b++) {
            const int64_t n = starts[b + 1] - starts[b];
            if (n >= block_min && !small_path(n))
                for (int64_t kh = 0; kh < Hkv; kh++)
                    block_attention(qkv + starts[b] * QKV, QKV, starts[b + 1] - starts[b],
                                    view[b].S, view[b].cols, L->k_cache, L->v_cache,
                                    Hkv, kh, G, D, m->scale, att + starts[b] * H * D, H * D,
                                    nthreads, view[b].mask);
        }
{
            const int nw = attn_threads;
            int64_t rowsc = G > small_rp ? G : small_rp;
            if (bf16 && tile > 1 && G * tile > rowsc) rowsc = G * tile;
            float *sc[nw], *acc[nw], *qt[nw];
            int64_t* row_cols[nw];
            for (int i = 0; i < nw; i++) {
                sc[i] = malloc(sizeof(float) * rowsc * (max_len + SMALL_COLS));
                acc[i] = malloc(sizeof(float) * rowsc * D);
                qt[i] = small_rp && !bf16 ? malloc(sizeof(float) * small_rp * D) : NULL;
                row_cols[i] = bf16 ? malloc(sizeof(int64_t) * max_len) : NULL;
            }
            AttnJob job = {qkv, att, tok_req, starts, view, L->k_cache, L->v_cache, QKV, H, Hkv,
                           G, D, block_min, m->scale, bf16, tile, sc, acc, qt, row_cols};
            /* one item a chunk (items differ in cost), over the pool (pool.c) */
            loom_par_for(nw, T * Hkv, 1, attn_items, &job);
            for (int i = 0; i < nw; i++) {
                free(sc[i]);
                free(acc[i]);
                free(qt[i]);
                free(row_cols[i]);
            }
        }
        if (prof) prof[1] += cpu_seconds() - att0;
        if (L->post_attn_ln) { /* Gemma: x += norm(o_proj(att)) */
            TIMED(0, qmm(L->o_q, m->q_mode, att, T, H * D, H * D, L->o_w, L->o_p, L->o_b, Hd, h, Hd, 0, nthreads));
            for (int64_t t = 0; t < T; t++) {
                norm_row(m, h + t * Hd, L->post_attn_ln, Hd, h + t * Hd);
                for (int64_t i = 0; i < Hd; i++) x[t * Hd + i] += h[t * Hd + i];
            }
        } else {
            TIMED(0, qmm(L->o_q, m->q_mode, att, T, H * D, H * D, L->o_w, L->o_p, L->o_b, Hd, x, Hd, 1, nthreads));
        }
        for (int64_t t = 0; t < T; t++) norm_row(m, x + t * Hd, L->ln2, Hd, h + t * Hd);
        TIMED(0, qmm(L->gu_q, m->q_mode, h, T, Hd, Hd, L->gu_w, L->gu_p, L->gu_b, 2 * I, gu, 2 * I, 0, nthreads));
        for (int64_t t = 0; t < T; t++) {
            float* g = gu + t * 2 * I;
            const float* u = g + I;
            if (m->act == 1)
                gelu_tanh_mul(g, u, I);
            else
                silu_mul(g, u, I);
        }
        if (L->post_ff_ln) { /* Gemma: x += norm(down(...)) */
            TIMED(0, qmm(L->down_q, m->q_mode, gu, T, I, 2 * I, L->down_w, L->down_p, L->down_b, Hd, h, Hd, 0, nthreads));
            for (int64_t t = 0; t < T; t++) {
                norm_row(m, h + t * Hd, L->post_ff_ln, Hd, h + t * Hd);
                for (int64_t i = 0; i < Hd; i++) x[t * Hd + i] += h[t * Hd + i];
            }
        } else {
            TIMED(0, qmm(L->down_q, m->q_mode, gu, T, I, 2 * I, L->down_w, L->down_p, L->down_b, Hd, x, Hd, 1, nthreads));
        }
        /* an EAGLE-3 drafter's aux features: the residual stream after layer l (the eager
           model's hidden + residual), [n_aux, T, Hd] in capture_layers order */
        for (int64_t a = 0; a < n_aux; a++)
            if (aux_layers[a] == l) memcpy(aux_out + a * T * Hd, x, sizeof(float) * T * Hd);
    }
    /* a drafter reading the final hidden states (capture_layers not None): every row, normed */
    if (hidden_out)
        for (int64_t t = 0; t < T; t++) norm_row(m, x + t * Hd, m->norm, Hd, hidden_out + t * Hd);
    for (int64_t r = 0; r < N; r++)
        norm_row(m, x + fin_rows[r] * Hd, m->norm, Hd, fin + (fin_at ? fin_at[r] : r) * Hd);
    free(tok_req);
    free(full);
    free(win_masks);
    scratch_free(x, row_bytes);
    scratch_free(h, row_bytes);
    scratch_free(qkv, mid_bytes); /* att and gu too */
}

/* A step's scratch grows with its rows (SmolLM2: 17 KB a row, Gemma 3 270M: 21 KB, beside the
   matmuls' activation copies): bench_real's batch-32 prefill of 4,096 rows held ~100 MB for
   the step. On a bfloat16 pool a step of more than loom_step_rows rows runs as consecutive
   parts of equal size (at most loom_step_rows rows each; a request may span parts), each
   through every layer before the next: every row attends its visible columns in order through
   the decode kernel, whose K / V the earlier parts have written, so the rows, K / V bits and
   logits are those of the whole step (the same invariant as --chunked-prefill-size:
   tests/test_cpu_forward.py). The LM head runs once, over every logit row, as before. A
   float32 pool's long requests take block_attention, whose sums depend on the rows in the
   call, so its steps stay whole, as do steps with masks (verify trees: few rows) and EAGLE-3
   captures ([n_aux, T, hidden] in step order). 0: never split. */
int loom_step_rows = 512;

/* One step. Requests b < B own tokens starts[b] .. starts[b+1]-1 (the last extend tokens of a
   sequence of seq_lens[b] KV columns, read through table[rows[b] * stride + column]); token j
   of request b sees columns 0 .. prefix + j (prefix = seq_lens[b] - its token count), or with
   mask_offs[b] >= 0 the columns c < seq_lens[b] where masks[mask_offs[b] + j * seq_lens[b] + c]
   is nonzero. Rows logit_rows[0 .. N-1] get float32 logits [N, vocab]. With hidden_out, every
   row's final-norm hidden state [T, hidden]; with n_aux > 0, aux_out [n_aux, T, hidden] gets the
   residual stream after layer aux_layers[a] (both what LlamaModel.forward captures).
   Returns 0, or -1 for a position past the rotary table, -2 for a token id past the vocab. */
int loom_forward_f32(const Model* m, int64_t T, const int64_t* ids, const int64_t* pos,
                     const int64_t* slots, int64_t B, const int64_t* starts, const int64_t* rows,
                     const int64_t* seq_lens, const int64_t* table, int64_t stride,
                     const uint8_t* masks, const int64_t* mask_offs, int64_t N,
                     const int64_t* logit_rows, float* logits, int nthreads, double* prof,
                     float* hidden_out, int64_t n_aux, const int64_t* aux_layers, float* aux_out) {
    const int64_t Hd = m->hidden, P = loom_step_rows;
    for (int64_t t = 0; t < T; t++) {
        if (pos[t] < 0 || pos[t] >= m->max_pos) return -1;
        if (ids[t] < 0 || ids[t] >= m->vocab) return -2;
    }
    int split = m->kv_bf16 != 0 && n_aux == 0 && P > 0 && T > P;
    for (int64_t b = 0; b < B && split; b++) split = mask_offs[b] < 0;
    const size_t fin_bytes = sizeof(float) * (N > 0 ? N : 1) * Hd;
    float* fin = scratch_alloc(fin_bytes); /* the logit rows, final-normed */
    if (!split) {
        forward_part(m, T, ids, pos, slots, B, starts, rows, seq_lens, table, stride, masks,
                     mask_offs, N, logit_rows, NULL, fin, nthreads, prof, hidden_out, n_aux,
                     aux_layers, aux_out);
    } else {
        const int64_t parts = (T + P - 1) / P, per = (T + parts - 1) / parts;
        /* one part's requests (starts, rows, seq_lens, mask_offs) and logit rows (own, fin's) */
        int64_t* buf = malloc(sizeof(int64_t) * (size_t)(4 * B + 1 + 2 * (N > 0 ? N : 1)));
        int64_t *p_starts = buf, *p_rows = buf + B + 1, *p_lens = p_rows + B, *p_offs = p_lens + B;
        int64_t *p_fin = p_offs + B, *p_at = p_fin + (N > 0 ? N : 1);
        for (int64_t t0 = 0; t0 < T; t0 += per) {
            const int64_t t1 = t0 + per < T ? t0 + per : T;
            int64_t nb = 0, nf = 0;
            p_starts[0] = 0;
            for (int64_t b = 0; b < B; b++) {
                const int64_t s = starts[b] > t0 ? starts[b] : t0;
                const int64_t e = starts[b + 1] < t1 ? starts[b + 1] : t1;
                if (s >= e) continue;
                /* the part's tokens of request b end (starts[b+1] - e) tokens before its last */
                p_rows[nb] = rows[b];
                p_lens[nb] = seq_lens[b] - (starts[b + 1] - e);
                p_offs[nb] = -1;
                p_starts[++nb] = e - t0;
            }
            for (int64_t r = 0; r < N; r++)
                if (logit_rows[r] >= t0 && logit_rows[r] < t1) {
                    p_fin[nf] = logit_rows[r] - t0;
                    p_at[nf++] = r;
                }
            forward_part(m, t1 - t0, ids + t0, pos + t0, slots + t0, nb, p_starts, p_rows, p_lens,
                         table, stride, NULL, p_offs, nf, p_fin, p_at, fin, nthreads, prof,
                         hidden_out ? hidden_out + t0 * Hd : NULL, 0, NULL, NULL);
        }
        free(buf);
    }
    TIMED(0, qmm(m->lm_head_q, m->q_mode, fin, N, Hd, Hd, m->lm_head, m->lm_head_p, NULL, m->vocab,
                 logits, m->vocab, 0, nthreads));
    scratch_free(fin, fin_bytes);
    return 0;
}
