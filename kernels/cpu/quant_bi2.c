/* The canonical batch-invariant arithmetic (quant_bi.c's file comment, mode LOOM_Q_BI, which
   mode auto takes at every row count in builds without AVX-512) for 1..8 token rows on AVX2
   builds: Q8_0 / Q4_0 / Q4_1 with lanes = rows.

   Why: without AVX-512 (an AVX2 CPU such as AMD Zen 3) mode "bi" ran quant_bi.c's portable C,
   which decodes each row to int16 codes in memory and multiplies a row at a time, so a decode
   step of SmolLM2 Q4_1 cost several times an AVX2 int16 GEMV's, and a verify of k + 1 rows
   (k + 1) times its per-row work. Here a pass takes 8 rows as the 32-bit lanes of a ymm: per unit
   of 32 values the 8 rows' code bytes are gathered once (a dword of each row: 4 vpgatherdd for
   Q4_x, 8 for Q8_0), split into int16 pairs (two weights a lane) by shifts and masks, and each
   token then costs 16 vpmaddwd + 16 vpaddd a unit (its activation pair broadcast): the decode of
   the weights is paid once a call, the dot products once a token.

   Per (row, token) the steps are exactly the canonical ones, as bi_dot_c's: the unit's exact
   int32 I (pairs in any order), P[j mod 16] = fma((float) I, s_j * dx_j, P[...]) from +0 in
   increasing j (asym: then fma(b_j, xs_j, P[...])), the fixed tree (P[c] + P[c + 8], + [c + 4],
   then (l[0] + l[2]) + (l[1] + l[3])), ((accumulate ? y : 0) + sum) + bias. So the outputs are
   bitwise the portable kernel's (and every other "bi" kernel's) for every T.

   The pair order inside a unit (the activation pairs are packed to match, as quant_bi.c's
   bi_pack_pairs):
   Q4_x, dword m (bytes 4m .. 4m + 3 of qs; byte i holds values i (low nibble) and i + 16):
     (4m, 4m + 2), (4m + 16, 4m + 18), (4m + 1, 4m + 3), (4m + 17, 4m + 19);
   Q8_0, dword m (codes 4m .. 4m + 3): (4m, 4m + 2), (4m + 1, 4m + 3). */

#include "loom_cpu.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(__AVX512F__)
#include <immintrin.h>
#define B2_AVX2 1
#else
#define B2_AVX2 0
#endif

enum { B2Q8_0 = 0, B2Q4_0 = 1, B2Q4_1 = 2 };

int loom_q_bi_lanes2_type(int qtype) {
    return B2_AVX2 && loom_q_bi_lanes && (qtype == B2Q8_0 || qtype == B2Q4_0 || qtype == B2Q4_1);
}

#if B2_AVX2
/* the low 16 bits of each of 8 dwords, as f16, to f32 */
static inline __m256 b2_f16lo(__m256i v) {
    const __m256i lo = _mm256_and_si256(v, _mm256_set1_epi32(0xFFFF));
    return _mm256_cvtph_ps(_mm_packus_epi32(_mm256_castsi256_si128(lo), _mm256_extracti128_si256(lo, 1)));
}

/* Rows n0 .. n0 + 7 (lanes past R repeat row 0: computed, not stored) against T tokens (a
   constant where inlined): xp [T][nu][16] pairs, dxu / xsu [T][nu]; writes y[t * ldy + n0 + r].
   P: scratch of T x 16 vectors. next / next_bytes: the next pass's rows, prefetched a unit's
   share at a time (the 8 rows' interleaved streams leave the hardware prefetcher behind on a
   matrix read from memory, as in quant_bi.c's lanes kernel). */
static inline __attribute__((always_inline)) void b2_core(
    const int qtype, const uint8_t* w, int64_t row_bytes, int64_t K, int R, const int T,
    const int32_t* xp, const float* dxu, const float* xsu, const float* bias, float* y,
    int64_t ldy, int accumulate, __m256* P, const uint8_t* next, int64_t next_bytes) {
    const int64_t nu = K / 32;
    const int bb = qtype == B2Q8_0 ? 34 : qtype == B2Q4_0 ? 18 : 20;
    const int asym = qtype == B2Q4_1;
    int32_t off[8];
    for (int r = 0; r < 8; r++) off[r] = (int32_t)((r < R ? r : 0) * row_bytes);
    const __m256i vidx = _mm256_loadu_si256((const __m256i*)off);
    const __m256i m4 = _mm256_set1_epi32(0x000F000F), eight = _mm256_set1_epi16(8);
    const int64_t span = (next_bytes + nu - 1) / nu;
    for (int64_t j = 0; j < nu; j++) {
        for (int64_t o = 0; o < span; o += 64)
            if (j * span + o < next_bytes) _mm_prefetch((const char*)(next + j * span + o), _MM_HINT_T0);
        const uint8_t* base = w + j * bb;
        const __m256i sg = _mm256_i32gather_epi32((const int*)base, vidx, 1);
        const __m256 sv = b2_f16lo(sg);
        const __m256 bv = asym ? b2_f16lo(_mm256_srli_epi32(sg, 16)) : _mm256_setzero_ps();
        const uint8_t* cb = base + (asym ? 4 : 2);
        __m256i e[16]; /* the unit's 16 pair vectors, in the order of xp */
        if (qtype == B2Q8_0) {
            for (int m = 0; m < 8; m++) {
                const __m256i g = _mm256_i32gather_epi32((const int*)(cb + 4 * m), vidx, 1);
                e[2 * m] = _mm256_srai_epi16(_mm256_slli_epi16(g, 8), 8);
                e[2 * m + 1] = _mm256_srai_epi16(g, 8);
            }
        } else {
            for (int m = 0; m < 4; m++) {
                const __m256i g = _mm256_i32gather_epi32((const int*)(cb + 4 * m), vidx, 1);
                e[4 * m] = _mm256_and_si256(g, m4);
                e[4 * m + 1] = _mm256_and_si256(_mm256_srli_epi32(g, 4), m4);
                e[4 * m + 2] = _mm256_and_si256(_mm256_srli_epi32(g, 8), m4);
                e[4 * m + 3] = _mm256_and_si256(_mm256_srli_epi32(g, 12), m4);
                if (qtype == B2Q4_0)
                    for (int k = 0; k < 4; k++) e[4 * m + k] = _mm256_sub_epi16(e[4 * m + k], eight);
            }
        }
        const int c = (int)(j % 16);
        for (int t = 0; t < T; t++) {
            const int32_t* xt = xp + (t * nu + j) * 16;
            __m256i a0 = _mm256_madd_epi16(e[0], _mm256_set1_epi32(xt[0]));
            __m256i a1 = _mm256_madd_epi16(e[1], _mm256_set1_epi32(xt[1]));
            for (int k = 2; k < 16; k += 2) {
                a0 = _mm256_add_epi32(a0, _mm256_madd_epi16(e[k], _mm256_set1_epi32(xt[k])));
                a1 = _mm256_add_epi32(a1, _mm256_madd_epi16(e[k + 1], _mm256_set1_epi32(xt[k + 1])));
            }
            const __m256 sd = _mm256_mul_ps(sv, _mm256_set1_ps(dxu[t * nu + j]));
            __m256 p = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(a0, a1)), sd,
                                       j < 16 ? _mm256_setzero_ps() : P[t * 16 + c]);
            if (asym) p = _mm256_fmadd_ps(bv, _mm256_set1_ps(xsu[t * nu + j]), p);
            P[t * 16 + c] = p;
        }
    }
    for (int t = 0; t < T; t++) {
        __m256* Pt = P + t * 16;
        for (int64_t c = nu; c < 16; c++) Pt[c] = _mm256_setzero_ps();
        __m256 l1[8], l2[4];
        for (int c = 0; c < 8; c++) l1[c] = _mm256_add_ps(Pt[c], Pt[c + 8]);
        for (int c = 0; c < 4; c++) l2[c] = _mm256_add_ps(l1[c], l1[c + 4]);
        float sum[8];
        _mm256_storeu_ps(sum, _mm256_add_ps(_mm256_add_ps(l2[0], l2[2]), _mm256_add_ps(l2[1], l2[3])));
        float* yo = y + t * ldy;
        for (int r = 0; r < R; r++) {
            const float bn = bias ? bias[r] : 0.f;
            yo[r] = (accumulate ? yo[r] : 0.f) + sum[r] + bn;
        }
    }
}

/* b2_core with the type and T as constants */
static void b2_pass(int qtype, const uint8_t* w, int64_t row_bytes, int64_t K, int R, int T,
                    const int32_t* xp, const float* dxu, const float* xsu, const float* bias,
                    float* y, int64_t ldy, int accumulate, __m256* P, const uint8_t* next,
                    int64_t next_bytes) {
#define B2_CASE(Q, TT)                                                                            \
    case TT:                                                                                      \
        b2_core(Q, w, row_bytes, K, R, TT, xp, dxu, xsu, bias, y, ldy, accumulate, P, next,       \
                next_bytes);                                                                      \
        break;
#define B2_CASES(Q)                                                                               \
    switch (T) {                                                                                  \
        B2_CASE(Q, 1) B2_CASE(Q, 2) B2_CASE(Q, 3) B2_CASE(Q, 4) B2_CASE(Q, 5) B2_CASE(Q, 6)       \
        B2_CASE(Q, 7) B2_CASE(Q, 8) default: break;                                               \
    }
    if (qtype == B2Q8_0) {
        B2_CASES(B2Q8_0)
    } else if (qtype == B2Q4_1) {
        B2_CASES(B2Q4_1)
    } else {
        B2_CASES(B2Q4_0)
    }
#undef B2_CASES
#undef B2_CASE
}

typedef struct {
    int qtype;
    const uint8_t* w;
    int64_t N, K, row_bytes;
    int T;
    const int32_t* xp;
    const float *dxu, *xsu;
    const float* bias;
    float* y;
    int64_t ldy;
    int accumulate;
} B2Job;

/* passes i0 .. i1 - 1 of 8 rows (loom_par_for's task) */
static void b2_passes(void* ctx, int64_t i0, int64_t i1, int worker) {
    (void)worker;
    const B2Job* j = ctx;
    const int64_t N = j->N, rb = j->row_bytes;
    __m256 P[8 * 16];
    for (int64_t i = i0; i < i1; i++) {
        const int64_t n0 = 8 * i;
        const int R = N - n0 < 8 ? (int)(N - n0) : 8;
        const int64_t nx = N - n0 - R < 8 ? N - n0 - R : 8; /* the next pass's rows */
        b2_pass(j->qtype, j->w + n0 * rb, rb, j->K, R, j->T, j->xp, j->dxu, j->xsu,
                j->bias ? j->bias + n0 : NULL, j->y + n0, j->ldy, j->accumulate, P,
                j->w + (n0 + R) * rb, nx * rb);
    }
}
#endif

/* loom_q_matmul_bi for loom_q_bi_lanes2_type at T <= 8 (its arguments): every token quantized
   (quant_bi.c's bi_quantize) and packed once, then passes of 8 rows over the pool */
int loom_q_matmul_bi_lanes2(int qtype, const uint8_t* w, int64_t N, int64_t K, int64_t row_bytes,
                            const float* x, int64_t T, int64_t ldx, const float* bias, float* y,
                            int64_t ldy, int accumulate, int threads) {
#if B2_AVX2
    if (T < 1 || T > 8 || K % 32 || !loom_q_bi_lanes2_type(qtype)) return -1;
    const int64_t nu = K / 32;
    int16_t* q = malloc(sizeof(int16_t) * (size_t)(K + 64));
    int32_t* xp = malloc(sizeof(int32_t) * (size_t)(T * nu * 16 + 16));
    float* dxu = malloc(sizeof(float) * (size_t)(T * nu + 16));
    float* xsu = malloc(sizeof(float) * (size_t)(T * nu + 16));
    if (!q || !xp || !dxu || !xsu) {
        free(q);
        free(xp);
        free(dxu);
        free(xsu);
        return -2;
    }
    for (int64_t t = 0; t < T; t++) {
        loom_q_bi_quantize(x + t * ldx, K, 32, q, dxu + t * nu, xsu + t * nu);
        loom_q_bi_pack_pairs(qtype, q, K, xp + t * nu * 16); /* B2Q* codes are quant_bi.c's */
    }
    free(q);
    const int64_t passes = (N + 7) / 8;
    B2Job job = {qtype, w, N, K, row_bytes, (int)T, xp, dxu, xsu, bias, y, ldy, accumulate};
    if (threads < 1) threads = 1;
    loom_par_for(threads, passes, par_chunk(passes, threads), b2_passes, &job);
    free(xp);
    free(dxu);
    free(xsu);
    return 0;
#else
    (void)qtype, (void)w, (void)N, (void)K, (void)row_bytes, (void)x, (void)T, (void)ldx;
    (void)bias, (void)y, (void)ldy, (void)accumulate, (void)threads;
    return -1;
#endif
}
