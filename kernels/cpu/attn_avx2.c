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
        for (int r = 0; r < AA_ROWS; r++) { /* rows past S repeat row c0 (scores dropped) */
            const int64_t idx = (cols[c0 + (r < n ? r : 0)] * Hkv + kh) * D;
            if (bf16) {
                for (int64_t i = 0; i < nv; i++)
                    _mm256_storeu_ps(kb + r * D + 8 * i, aa_ld(kc, 1, idx + 8 * i));
                kr[r] = kb + r * D;
            } else {
                kr[r] = kc + idx;
            }
        }
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
        const __m256 m = _mm256_set1_ps(mx[g]), ninf = _mm256_set1_ps(-INFINITY);
        int64_t c = 0;
        for (; c + 8 <= S; c += 8) {
            const __m256 x = _mm256_loadu_ps(s + c);
            const __m256 e = fast_exp8(_mm256_sub_ps(x, m));
            _mm256_storeu_ps(s + c, _mm256_andnot_ps(_mm256_cmp_ps(x, ninf, _CMP_EQ_OQ), e));
        }
        for (; c < S; c++) s[c] = s[c] == -INFINITY ? 0.f : fast_expf(s[c] - mx[g]);
        float sum = 0.f;
        for (c = 0; c < S; c++) sum += s[c];
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

#else

int loom_attn_one_avx2(const float* qb, int64_t S, const int64_t* cols, const float* kc,
                       const float* vc, int64_t Hkv, int64_t kh, int64_t G, int64_t D, float scale,
                       float* o, float* sc, int bf16) {
    (void)qb, (void)S, (void)cols, (void)kc, (void)vc, (void)Hkv, (void)kh, (void)G, (void)D;
    (void)scale, (void)o, (void)sc, (void)bf16;
    return 0;
}

#endif
