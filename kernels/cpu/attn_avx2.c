/* The C forward's one-token attention (forward.c attn_one: a decode token, and on a bfloat16
   pool every row of a verify step or prompt, its visible columns compacted) in AVX2 builds.
   forward.c's own attn_one kernel is AVX-512 code; without it every such row took the
   per-token loop of attn_items, whose K / V rows, scores and accumulators go through memory
   one head and one row at a time (SmolLM2 at batch 32: a third of a decode step's CPU).

   Bitwise the per-token loop (tests/test_cpu_forward.py compares them through the knob
   loom_attn_avx2). The loop, as GCC 12 compiles it with -O3 -std=c11 (no FP contraction:
   every product is rounded before its add; -std=c11 is what native.py builds with), computes:
   - a score: `omp simd reduction` over D (D % 8 == 0) with 8 lanes, lane l summing
     q[8i + l] * k[8i + l] over i in order from 0, then dot = 0 + lane 0 + lane 1 + ... + lane 7
     in order, then dot * scale;
   - the softmax: fast_expf of each score minus the row max (0 for a -inf score), then the
     sum over columns in order (that loop has control flow, so it is not vectorized and its
     simd reduction is one lane), den = 1 / sum (0 if sum <= 0);
   - out = (0 + p_0 * v_0 + p_1 * v_1 + ...) * den per element, the columns in order.
   Here: a score pass of 8 K rows for one query head, 8 lane vectors transposed so that the
   8 sequential lane sums run as 8 vector adds; the exps 8 at a time (the same IEEE
   operations as fast_expf, element by element), the sums in order; a V pass per group of
   at most 3 query heads and 32 (or 8) head dims with the accumulators in registers, each V
   row's slice loaded once for the group. Rows of a bfloat16 pool are widened exactly
   (a 16-bit shift), as forward.c's kv_at does. */
#include "loom_cpu.h"

int loom_attn_avx2 = 1; /* loom_cpu.h */
int loom_attn_rows = 8;  /* loom_cpu.h: query rows of a tile (loom_attn_rows_avx2); <= 1: per row */
int loom_attn_avx2_ahead = 64; /* loom_cpu.h */
int loom_attn_avx2_slots = 1; /* loom_cpu.h */

#if ISA_BITS == 256 && defined(__AVX2__)
#include <immintrin.h>

#include "simd_avx2.h"

#define AA_ROWS 8     /* K rows of a score pass (the 8 x 8 transpose) */
#define AA_MAX_D 256  /* the widened K rows' buffer: AA_ROWS x AA_MAX_D floats */

/* 8 floats of a K or V cache at element idx (a bfloat16 pool widened) */
static inline __attribute__((always_inline)) __m256 aa_ld(const float* cache, int bf, int64_t idx) {
    if (bf) {
        const uint16_t* p = (const uint16_t*)(const void*)cache + idx;
        const __m128i h = _mm_loadu_si128((const __m128i*)(const void*)p);
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    return _mm256_loadu_ps(cache + idx);
}

/* kr[0 .. 7]: KV head kh's K rows of columns c0 .. c0 + n - 1 (rows past n repeat row c0;
   their scores are dropped): the cache's own rows, or on a bfloat16 pool their exact float32
   widening into kb (AA_ROWS x D floats) */
static inline __attribute__((always_inline)) void aa_krows(const float* kc, const int64_t* cols,
                                                           int64_t c0, int64_t n, int64_t Hkv,
                                                           int64_t kh, int64_t D, int bf16,
                                                           float* kb, const float** kr) {
    for (int r = 0; r < AA_ROWS; r++) {
        const int64_t idx = (cols[c0 + (r < n ? r : 0)] * Hkv + kh) * D;
        if (bf16) {
            for (int64_t i = 0; i < D / 8; i++)
                _mm256_storeu_ps(kb + r * D + 8 * i, aa_ld(kc, 1, idx + 8 * i));
            kr[r] = kb + r * D;
        } else {
            kr[r] = kc + idx;
        }
    }
}

/* s[c] = fast_expf(s[c] - mx) for c < S, 0 for a -inf score (a masked column): 8 at a time
   by fast_exp8, the same IEEE operations element by element, the tail one at a time */
static inline __attribute__((always_inline)) void aa_exp_row(float* s, int64_t S, float mx) {
    const __m256 m = _mm256_set1_ps(mx), ninf = _mm256_set1_ps(-INFINITY);
    int64_t c = 0;
    for (; c + 8 <= S; c += 8) {
        const __m256 x = _mm256_loadu_ps(s + c);
        const __m256 e = fast_exp8(_mm256_sub_ps(x, m));
        _mm256_storeu_ps(s + c, _mm256_andnot_ps(_mm256_cmp_ps(x, ninf, _CMP_EQ_OQ), e));
    }
    for (; c < S; c++) s[c] = s[c] == -INFINITY ? 0.f : fast_expf(s[c] - mx);
}

/* The scores of query head qg against K rows kr[0 .. 7] (D / 8 vectors each): 8 dots in the
   loop's order, times scale */
static inline __attribute__((always_inline)) __m256 aa_scores8(const float* qg,
                                                               const float* const* kr,
                                                               int64_t nv, float scale) {
    __m256 a[AA_ROWS];
    for (int r = 0; r < AA_ROWS; r++) a[r] = _mm256_setzero_ps();
    for (int64_t i = 0; i < nv; i++) {
        const __m256 q = _mm256_loadu_ps(qg + 8 * i);
        for (int r = 0; r < AA_ROWS; r++)
            a[r] = _mm256_add_ps(a[r], _mm256_mul_ps(q, _mm256_loadu_ps(kr[r] + 8 * i)));
    }
    transpose8_ps(a);
    __m256 s = _mm256_setzero_ps();
    for (int l = 0; l < 8; l++) s = _mm256_add_ps(s, a[l]);
    return _mm256_mul_ps(s, _mm256_set1_ps(scale));
}

/* out[g0 + j] dims d0 .. d0 + 8 NV of the GS heads g0 .. g0 + GS - 1 (GS * NV <= 12
   accumulators): sum over the S V rows in order of p * v, times den */
static inline __attribute__((always_inline)) void
aa_vpass(const float* sc, int64_t S, const int64_t* cols, const float* vc, int64_t Hkv,
         int64_t kh, int64_t D, int64_t g0, int64_t d0, const float* den, float* o, const int GS,
         const int NV, const int BF) {
    __m256 acc[12];
    for (int i = 0; i < GS * NV; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t c = 0; c < S; c++) {
        const int64_t idx = (cols[c] * Hkv + kh) * D + d0;
        __m256 v[4];
        for (int j = 0; j < NV; j++) v[j] = aa_ld(vc, BF, idx + 8 * j);
        for (int g = 0; g < GS; g++) {
            const __m256 p = _mm256_set1_ps(sc[(g0 + g) * S + c]);
            for (int j = 0; j < NV; j++)
                acc[g * NV + j] = _mm256_add_ps(acc[g * NV + j], _mm256_mul_ps(p, v[j]));
        }
    }
    for (int g = 0; g < GS; g++)
        for (int j = 0; j < NV; j++)
            _mm256_storeu_ps(o + (g0 + g) * D + d0 + 8 * j,
                             _mm256_mul_ps(acc[g * NV + j], _mm256_set1_ps(den[g0 + g])));
}

static void aa_vpass_any(const float* sc, int64_t S, const int64_t* cols, const float* vc,
                         int64_t Hkv, int64_t kh, int64_t D, int64_t g0, int64_t d0,
                         const float* den, float* o, int gs, int nv, int bf) {
#define AA_V(GS, NV)                                                                             \
    if (gs == GS && nv == NV) {                                                                  \
        if (bf)                                                                                  \
            aa_vpass(sc, S, cols, vc, Hkv, kh, D, g0, d0, den, o, GS, NV, 1);                    \
        else                                                                                     \
            aa_vpass(sc, S, cols, vc, Hkv, kh, D, g0, d0, den, o, GS, NV, 0);                    \
        return;                                                                                  \
    }
    AA_V(1, 4) AA_V(2, 4) AA_V(3, 4) AA_V(1, 1) AA_V(2, 1) AA_V(3, 1)
#undef AA_V
}

int loom_attn_one_avx2(const float* qb, int64_t S, const int64_t* cols, const float* kc,
                       const float* vc, int64_t Hkv, int64_t kh, int64_t G, int64_t D, float scale,
                       float* o, float* sc, int bf16) {
    if (!loom_attn_avx2 || S <= 0 || D < 8 || D % 8 != 0 || D > AA_MAX_D || G < 1 || G > 64)
        return 0;
    const int64_t nv = D / 8;
    float kb[AA_ROWS * AA_MAX_D]; /* a bfloat16 pool's 8 K rows, widened */
    float mx[64], den[64];
    for (int64_t g = 0; g < G; g++) mx[g] = -INFINITY;
    const int64_t row_bytes = D * (bf16 ? 2 : 4);
    /* K rows fetched `ahead` rows before the score pass reads them (a multiple of AA_ROWS, at
       least one block; the first blocks before the loop) */
    const int64_t ahead = loom_attn_avx2_ahead > AA_ROWS ? loom_attn_avx2_ahead / AA_ROWS * AA_ROWS
                                                         : AA_ROWS;
    /* kv head 0 fetches whole slots (every kv head's K and V row: one contiguous run per
       slot, the later heads' passes then read from cache) */
    const int slots = loom_attn_avx2_slots && kh == 0 && Hkv > 1;
    const int64_t pf_off = slots ? 0 : kh * row_bytes, pf_len = slots ? Hkv * row_bytes : row_bytes;
    for (int64_t c = 0; c < ahead && c < S; c++) {
        const char* p = (const char*)kc + cols[c] * Hkv * row_bytes + pf_off;
        for (int64_t o = 0; o < pf_len; o += 64) _mm_prefetch(p + o, _MM_HINT_T0);
    }
    for (int64_t c0 = 0; c0 < S; c0 += AA_ROWS) {
        const int64_t n = S - c0 < AA_ROWS ? S - c0 : AA_ROWS;
        /* the pool's rows are scattered (the req-to-token table) and a step's K / V are
           streamed from memory: the K rows `ahead` on and this block's V rows (read by the V
           passes below, from cache then) are fetched ahead. One block ahead (8 rows: the
           kernel before session 25) left its K loads waiting on memory (perf: ~a third of
           its samples on them, SmolLM2 decode at 145 tokens) */
        for (int64_t c = c0 + ahead; c < c0 + ahead + AA_ROWS && c < S; c++) {
            const char* p = (const char*)kc + cols[c] * Hkv * row_bytes + pf_off;
            for (int64_t o = 0; o < pf_len; o += 64) _mm_prefetch(p + o, _MM_HINT_T0);
        }
        for (int64_t c = c0; c < c0 + n; c++) {
            const char* p = (const char*)vc + cols[c] * Hkv * row_bytes + pf_off;
            for (int64_t o = 0; o < pf_len; o += 64) _mm_prefetch(p + o, _MM_HINT_T0);
        }
        const float* kr[AA_ROWS];
        aa_krows(kc, cols, c0, n, Hkv, kh, D, bf16, kb, kr); /* rows past S repeat row c0 */
        for (int64_t g = 0; g < G; g++) {
            float s[AA_ROWS];
            _mm256_storeu_ps(s, aa_scores8(qb + g * D, kr, nv, scale));
            for (int64_t r = 0; r < n; r++) {
                sc[g * S + c0 + r] = s[r];
                mx[g] = s[r] > mx[g] ? s[r] : mx[g];
            }
        }
    }
    for (int64_t g = 0; g < G; g++) {
        float* s = sc + g * S;
        aa_exp_row(s, S, mx[g]);
        float sum = 0.f;
        for (int64_t c = 0; c < S; c++) sum += s[c];
        den[g] = sum > 0.f ? 1.f / sum : 0.f;
    }
    const int vn = D % 32 == 0 ? 4 : 1;
    for (int64_t g0 = 0; g0 < G; g0 += 3) {
        const int gs = G - g0 < 3 ? (int)(G - g0) : 3;
        for (int64_t d0 = 0; d0 < D; d0 += 8 * vn)
            aa_vpass_any(sc, S, cols, vc, Hkv, kh, D, g0, d0, den, o, gs, vn, bf16);
    }
    return 1;
}

/* ---- Query-row tiles: R rows of one request (a prompt, a prefill chunk, a verify step) for
   KV head kh, each row's result bitwise loom_attn_one_avx2's on its own visible columns.
   Row r sees the run cols[lo[r] .. lo[r] + len[r]) (a causal prompt row: lo 0; a
   sliding-window row: its window's run). What the rows share: each block of 8 K rows is
   widened (bfloat16) and read once for the tile's R x G (row, head) pairs where the per-row
   kernel did it once per row, and a V pass carries up to 6 pairs (12 accumulators), so a V
   slice is loaded and widened once per 6 pairs (per row: 3 heads, then the 4th alone on
   Gemma). Each pair keeps the per-row order of every operation:
   - a score is the same function of (q, k) whichever block holds the column (aa_scores8);
     the row max is the same value however grouped (see the fold below);
   - the exps run over the pair's own run from its first column (the same blocking);
   - a pair's sum runs over its columns in order from its first; the tile interleaves the
     pairs' independent chains (where per row each chain waited on its own adds);
   - a pair's accumulator starts at 0 and adds p * v over its columns in increasing order;
     a column outside the pair's run is skipped, never added as 0 * v (that could turn a
     -0 into +0, or inf * 0 into NaN). */
#define AR_MAXP 64 /* (row, head) pairs of a tile */

/* pairs p0 .. p0 + GS - 1's outputs, dims d0 .. d0 + 8 NV: sum over their columns */
static inline __attribute__((always_inline)) void
ar_vpass(const float* sc, int64_t L, int64_t cmin, const int64_t* cols, const float* vc,
         int64_t Hkv, int64_t kh, int64_t D, int64_t p0, const int64_t* plo, const int64_t* phi,
         int64_t d0, const float* den, float* const* po, const int GS, const int NV,
         const int BF) {
    __m256 acc[12];
    for (int i = 0; i < GS * NV; i++) acc[i] = _mm256_setzero_ps();
    int64_t c0 = plo[p0], c1 = phi[p0];
    for (int g = 1; g < GS; g++) {
        c0 = plo[p0 + g] < c0 ? plo[p0 + g] : c0;
        c1 = phi[p0 + g] > c1 ? phi[p0 + g] : c1;
    }
    /* [a0, a1): the columns every pair of the group sees (no test per pair); the columns
       before and after it test each pair. Either way each pair's columns go in order. */
    int64_t a0 = plo[p0], a1 = phi[p0];
    for (int g = 1; g < GS; g++) {
        a0 = plo[p0 + g] > a0 ? plo[p0 + g] : a0;
        a1 = phi[p0 + g] < a1 ? phi[p0 + g] : a1;
    }
    if (a1 < a0) a1 = a0;
    const float* sp[6];
    for (int g = 0; g < GS; g++) sp[g] = sc + (p0 + g) * L - cmin;
    for (int64_t c = c0; c < c1; c++) {
        const int64_t idx = (cols[c] * Hkv + kh) * D + d0;
        __m256 v[4];
        for (int j = 0; j < NV; j++) v[j] = aa_ld(vc, BF, idx + 8 * j);
        if (c >= a0 && c < a1) {
            for (int g = 0; g < GS; g++) {
                const __m256 p = _mm256_set1_ps(sp[g][c]);
                for (int j = 0; j < NV; j++)
                    acc[g * NV + j] = _mm256_add_ps(acc[g * NV + j], _mm256_mul_ps(p, v[j]));
            }
            continue;
        }
        for (int g = 0; g < GS; g++) {
            if (c < plo[p0 + g] || c >= phi[p0 + g]) continue;
            const __m256 p = _mm256_set1_ps(sp[g][c]);
            for (int j = 0; j < NV; j++)
                acc[g * NV + j] = _mm256_add_ps(acc[g * NV + j], _mm256_mul_ps(p, v[j]));
        }
    }
    for (int g = 0; g < GS; g++)
        for (int j = 0; j < NV; j++)
            _mm256_storeu_ps(po[p0 + g] + d0 + 8 * j,
                             _mm256_mul_ps(acc[g * NV + j], _mm256_set1_ps(den[p0 + g])));
}

static void ar_vpass_any(const float* sc, int64_t L, int64_t cmin, const int64_t* cols,
                         const float* vc, int64_t Hkv, int64_t kh, int64_t D, int64_t p0,
                         const int64_t* plo, const int64_t* phi, int64_t d0, const float* den,
                         float* const* po, int gs, int nv, int bf) {
#define AR_V(GS, NV)                                                                             \
    if (gs == GS && nv == NV) {                                                                  \
        if (bf)                                                                                  \
            ar_vpass(sc, L, cmin, cols, vc, Hkv, kh, D, p0, plo, phi, d0, den, po, GS, NV, 1);   \
        else                                                                                     \
            ar_vpass(sc, L, cmin, cols, vc, Hkv, kh, D, p0, plo, phi, d0, den, po, GS, NV, 0);   \
        return;                                                                                  \
    }
    AR_V(1, 2) AR_V(2, 2) AR_V(3, 2) AR_V(4, 2) AR_V(5, 2) AR_V(6, 2)
    AR_V(1, 1) AR_V(2, 1) AR_V(3, 1) AR_V(4, 1) AR_V(5, 1) AR_V(6, 1)
#undef AR_V
}

int loom_attn_rows_avx2(const float* q, int64_t ldq, int64_t R, const int64_t* cols,
                        const int64_t* lo, const int64_t* len, const float* kc, const float* vc,
                        int64_t Hkv, int64_t kh, int64_t G, int64_t D, float scale, float* o,
                        int64_t ldo, float* sc, int bf16) {
    if (!loom_attn_avx2 || R < 1 || D < 8 || D % 8 != 0 || D > AA_MAX_D || G < 1 || G > 64 ||
        R * G > AR_MAXP)
        return 0;
    int64_t cmin = lo[0], cmax = lo[0] + len[0];
    for (int64_t r = 0; r < R; r++) {
        if (len[r] <= 0) return 0; /* the per-row path (the loop) takes such a row */
        cmin = lo[r] < cmin ? lo[r] : cmin;
        cmax = lo[r] + len[r] > cmax ? lo[r] + len[r] : cmax;
    }
    const int64_t L = cmax - cmin, P = R * G, nv = D / 8;
    float kb[AA_ROWS * AA_MAX_D]; /* a bfloat16 pool's 8 K rows, widened */
    float mx[AR_MAXP], den[AR_MAXP], sum[AR_MAXP];
    __m256 mxv[AR_MAXP];
    int64_t plo[AR_MAXP], phi[AR_MAXP];
    float* po[AR_MAXP];
    for (int64_t p = 0; p < P; p++) {
        const int64_t r = p / G;
        mx[p] = -INFINITY;
        mxv[p] = _mm256_set1_ps(-INFINITY);
        plo[p] = lo[r];
        phi[p] = lo[r] + len[r];
        po[p] = o + r * ldo + (p % G) * D;
    }
    const int64_t row_bytes = D * (bf16 ? 2 : 4);
    for (int64_t c0 = cmin; c0 < cmax; c0 += AA_ROWS) {
        const int64_t n = cmax - c0 < AA_ROWS ? cmax - c0 : AA_ROWS;
        for (int64_t c = c0 + AA_ROWS; c < c0 + 2 * AA_ROWS && c < cmax; c++) {
            const char* pf = (const char*)kc + (cols[c] * Hkv + kh) * row_bytes;
            for (int64_t b = 0; b < row_bytes; b += 64) _mm_prefetch(pf + b, _MM_HINT_T0);
        }
        const float* kr[AA_ROWS];
        aa_krows(kc, cols, c0, n, Hkv, kh, D, bf16, kb, kr); /* rows past cmax repeat row c0 */
        for (int64_t p = 0; p < P; p++) {
            if (c0 + n <= plo[p] || c0 >= phi[p]) continue; /* none of the pair's columns */
            float s[AA_ROWS];
            const __m256 s8 = aa_scores8(q + (p / G) * ldq + (p % G) * D, kr, nv, scale);
            if (n == AA_ROWS && c0 >= plo[p] && c0 + AA_ROWS <= phi[p]) {
                /* all 8 columns the pair's: lane l's running max over columns l, l + 8, ...
                   (folded in lane order below) */
                _mm256_storeu_ps(sc + p * L + c0 - cmin, s8);
                mxv[p] = _mm256_max_ps(s8, mxv[p]);
                continue;
            }
            _mm256_storeu_ps(s, s8);
            for (int64_t r = 0; r < n; r++) {
                const int64_t c = c0 + r;
                if (c < plo[p] || c >= phi[p]) continue;
                sc[p * L + c - cmin] = s[r];
                mx[p] = s[r] > mx[p] ? s[r] : mx[p];
            }
        }
    }
    /* A row max over other groupings than the per-row kernel's running max: the same value
       (max is exact; a NaN score is skipped by both), at most differing in the sign of a zero
       max, and s - (+0) and s - (-0) differ only for s = -0, where either is a zero whose
       fast_expf is 1: the exps, and all after, are the same bits */
    for (int64_t p = 0; p < P; p++) {
        float l8[8];
        _mm256_storeu_ps(l8, mxv[p]);
        for (int l = 0; l < 8; l++) mx[p] = l8[l] > mx[p] ? l8[l] : mx[p];
    }
    int64_t longest = 0;
    for (int64_t p = 0; p < P; p++) {
        float* s = sc + p * L + plo[p] - cmin;
        const int64_t S = phi[p] - plo[p];
        aa_exp_row(s, S, mx[p]);
        sum[p] = 0.f;
        longest = S > longest ? S : longest;
    }
    /* each pair's sum in its own column order; the pairs' chains interleaved (up to the
       shortest run without a test) */
    const float* ps[AR_MAXP];
    int64_t shortest = longest;
    for (int64_t p = 0; p < P; p++) {
        ps[p] = sc + p * L + plo[p] - cmin;
        shortest = phi[p] - plo[p] < shortest ? phi[p] - plo[p] : shortest;
    }
    for (int64_t c = 0; c < shortest; c++)
        for (int64_t p = 0; p < P; p++) sum[p] += ps[p][c];
    for (int64_t c = shortest; c < longest; c++)
        for (int64_t p = 0; p < P; p++)
            if (c < phi[p] - plo[p]) sum[p] += ps[p][c];
    for (int64_t p = 0; p < P; p++) den[p] = sum[p] > 0.f ? 1.f / sum[p] : 0.f;
    const int vn = D % 16 == 0 ? 2 : 1;
    for (int64_t p0 = 0; p0 < P; p0 += 6) {
        const int gs = P - p0 < 6 ? (int)(P - p0) : 6;
        for (int64_t d0 = 0; d0 < D; d0 += 8 * vn)
            ar_vpass_any(sc, L, cmin, cols, vc, Hkv, kh, D, p0, plo, phi, d0, den, po, gs, vn, bf16);
    }
    return 1;
}

/* the rows a tile takes in this build: the knob (AVX2), 1 elsewhere (per row) */
int loom_attn_tile_rows(void) { return loom_attn_rows; }

#else

int loom_attn_tile_rows(void) { return 1; }

int loom_attn_one_avx2(const float* qb, int64_t S, const int64_t* cols, const float* kc,
                       const float* vc, int64_t Hkv, int64_t kh, int64_t G, int64_t D, float scale,
                       float* o, float* sc, int bf16) {
    (void)qb, (void)S, (void)cols, (void)kc, (void)vc, (void)Hkv, (void)kh, (void)G, (void)D;
    (void)scale, (void)o, (void)sc, (void)bf16;
    return 0;
}

int loom_attn_rows_avx2(const float* q, int64_t ldq, int64_t R, const int64_t* cols,
                        const int64_t* lo, const int64_t* len, const float* kc, const float* vc,
                        int64_t Hkv, int64_t kh, int64_t G, int64_t D, float scale, float* o,
                        int64_t ldo, float* sc, int bf16) {
    (void)q, (void)ldq, (void)R, (void)cols, (void)lo, (void)len, (void)kc, (void)vc, (void)Hkv;
    (void)kh, (void)G, (void)D, (void)scale, (void)o, (void)ldo, (void)sc, (void)bf16;
    return 0;
}

#endif
