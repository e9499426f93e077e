/* Mode "bi" (quant_bi.c's canonical batch-invariant arithmetic) for Q4_K and Q6_K at 1-4 tokens
   on AVX2 + FMA builds without AVX-512 VNNI: a GEMV with lanes = values.

   Why: in such builds Q4_K / Q6_K at every token count took quant_bi_avx2.c's 8-token tiles, whose
   lanes are tokens: at one token (a decode step) 7 of a vector's 8 lanes multiply zero codes, and
   every row is first decoded to int16 codes in memory. Gemma 3's o / down projections are Q4_K /
   Q6_K (docs/benchmarks.md, helper "gemvk" of session 21, has the step's profile).

   How: a row is read one super-block (256 values) at a time with contiguous 32-byte loads; 16-bit
   shifts and masks turn its codes into int16 vectors in registers, each 32 values of a unit as
   two vectors: lane m of the first holds value 2m, of the second value 2m + 1 (a 16-bit lane
   holds two code bytes, so the even / odd split costs one shift where a widening would cost a
   cross-lane move). The token's 16-bit codes are packed once per call in the same order
   (gk_pack: per 32 values, the 16 even then the 16 odd ones), and vpmaddwd multiplies a weight
   vector by its activation vector: 16 multiply-adds, exact int32 pairs of one unit. A unit's 8
   (Q4_K) or 4 (Q6_K) int32 partials are summed by unpacks and adds (gk_pair32 / gk_pair64,
   one-uop shuffles where vphaddd measured slower: docs/benchmarks.md, helper "gemvk") that
   reduce the 8 units of a super-block (Q4_K) or of half of one (Q6_K) together into one vector
   of their 8 exact I_j, and the float steps run on that vector (lane i = unit j0 + i):
     P[j mod 16] = fma((float) I_j, s_j * dx_j, P[j mod 16])   (Q4_K: then fma(b_j, xs_j, P))
   with the 16 partials P as two vectors (c = 0..7, 8..15), then the fixed tree P[c] + P[c + 8],
   + [c + 4], (l[0] + l[2]) + (l[1] + l[3]), and ((accumulate ? y : 0) + sum) + bias: the
   canonical steps of quant_bi.c's file comment on the same values, so the outputs are bitwise
   the portable C's (tests/test_quant_kernels.py, through the knob loom_q_bi_kgemv).

   Units and offsets: Q4_K (144 bytes: f16 d, f16 dmin, 12 bytes of 6-bit scales / mins, 128 of
   nibbles; 32-byte group c holds unit 2c in its low nibbles and 2c + 1 in its high ones) has
   s_j = d * sc_j, b_j = -dmin * m_j (ggml's get_scale_min_k4, unpacked for 8 units at once
   with the 32-bit masks of llama.cpp's AVX2 kernel). Q6_K (210 bytes: 128 bytes of low nibbles,
   64 of 2-bit highs, 16 int8 scales, f16 d; units of 16) has signed codes u - 32 and s_j =
   d * sc_j; the unsigned 6-bit codes u are multiplied and the offset taken off the exact
   integer once per unit, I_j = sum u q - 32 sum q (sum q per unit from gk_pack). */

#include "loom_cpu.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && \
    !(defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__))
#define GK_ON 1
#include <immintrin.h>

#include "gemv_avx2.h" /* gv_tree: the canonical tree, shared with quant_gemv_avx2.c */
#else
#define GK_ON 0
#endif

enum { GKQ4_K = 3, GKQ6_K = 4 }; /* quant.c's block type ids */

#define GK_MAXT 4 /* tokens up to which loom_q_matmul_bi takes this GEMV (more: the tiles) */
#define GK_ROWS 4 /* rows of one pool item */

int loom_q_bi_kgemv = 1; /* loom_cpu.h */

int loom_q_bi_kgemv_type(int qtype) {
    return GK_ON && loom_q_bi_kgemv && (qtype == GKQ4_K || qtype == GKQ6_K);
}

#if GK_ON
static inline float gk_f16(const uint8_t* p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return _cvtsh_ss(v);
}

/* one token's codes q [K] -> xk [K] in the kernels' order (per 32 values: the 16 at even
   offsets, then the 16 at odd ones); Q6_K: sq [K / 16] the sum of each unit's codes */
static void gk_pack(int qtype, const int16_t* q, int64_t K, int16_t* xk, int32_t* sq) {
    for (int64_t k0 = 0; k0 < K; k0 += 32) {
        for (int m = 0; m < 16; m++) {
            xk[k0 + m] = q[k0 + 2 * m];
            xk[k0 + 16 + m] = q[k0 + 2 * m + 1];
        }
        if (qtype == GKQ6_K)
            for (int h = 0; h < 2; h++) {
                int32_t s = 0;
                for (int i = 0; i < 16; i++) s += q[k0 + 16 * h + i];
                sq[k0 / 16 + h] = s;
            }
    }
}

/* lanes (a0 + a2, b0 + b2, a1 + a3, b1 + b3) of each 128-bit half */
static inline __m256i gk_pair32(__m256i a, __m256i b) {
    return _mm256_add_epi32(_mm256_unpacklo_epi32(a, b), _mm256_unpackhi_epi32(a, b));
}

/* lanes (a0 + a1, a2 + a3, b0 + b1, b2 + b3) of each 128-bit half */
static inline __m256i gk_pair64(__m256i a, __m256i b) {
    return _mm256_add_epi32(_mm256_unpacklo_epi64(a, b), _mm256_unpackhi_epi64(a, b));
}

/* a: units 0-3, b: units 4-7, each unit's two halves in the two 128-bit halves -> units 0..7 */
static inline __m256i gk_sum8(__m256i a, __m256i b) {
    return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31));
}

/* Q4_K super-block i of a row against T tokens (a constant where inlined): xk [T][K], dxu / xsu
   [T][K / 32]; P[t] the partials c = 8 (i & 1) .. + 7 of token t, which its 8 units update */
static inline __attribute__((always_inline)) void gk_sb_q4k(const uint8_t* blk, int64_t i, int64_t K,
                                                            const int T, const int16_t* xk,
                                                            const float* dxu, const float* xsu,
                                                            __m256* P) {
    const int64_t nu = K / 32;
    const __m256i m4 = _mm256_set1_epi16(0xF);
    /* 6-bit scales / mins of the 8 units: u[0..1]'s bytes the scales, u[2..3]'s the mins */
    uint32_t u[4];
    memcpy(u, blk + 4, 12);
    u[3] = ((u[2] >> 4) & 0x0f0f0f0fu) | (((u[1] >> 6) & 0x03030303u) << 4);
    const uint32_t mins_lo = u[1] & 0x3f3f3f3fu;
    u[1] = (u[2] & 0x0f0f0f0fu) | (((u[0] >> 6) & 0x03030303u) << 4);
    u[2] = mins_lo;
    u[0] &= 0x3f3f3f3fu;
    const __m128i sm = _mm_loadu_si128((const __m128i*)u);
    const __m256 sv = _mm256_mul_ps(_mm256_set1_ps(gk_f16(blk)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sm)));
    const __m256 bv = _mm256_mul_ps(_mm256_set1_ps(-gk_f16(blk + 2)),
                                    _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(sm, 8))));
    __m256i h[GK_MAXT][4];
    for (int c = 0; c < 4; c++) {
        const __m256i B = _mm256_loadu_si256((const __m256i*)(blk + 16 + 32 * c));
        const __m256i e0 = _mm256_and_si256(B, m4), e1 = _mm256_and_si256(_mm256_srli_epi16(B, 8), m4);
        const __m256i e2 = _mm256_and_si256(_mm256_srli_epi16(B, 4), m4), e3 = _mm256_srli_epi16(B, 12);
        for (int t = 0; t < T; t++) {
            const int16_t* x = xk + t * K + 256 * i + 64 * c;
            const __m256i a = _mm256_add_epi32(_mm256_madd_epi16(e0, _mm256_loadu_si256((const __m256i*)x)),
                                               _mm256_madd_epi16(e1, _mm256_loadu_si256((const __m256i*)(x + 16))));
            const __m256i b = _mm256_add_epi32(_mm256_madd_epi16(e2, _mm256_loadu_si256((const __m256i*)(x + 32))),
                                               _mm256_madd_epi16(e3, _mm256_loadu_si256((const __m256i*)(x + 48))));
            h[t][c] = gk_pair32(a, b); /* units 2c, 2c + 1: lanes 0, 2 / 1, 3 of each half */
        }
    }
    for (int t = 0; t < T; t++) {
        const __m256i I = gk_sum8(gk_pair64(h[t][0], h[t][1]), gk_pair64(h[t][2], h[t][3]));
        const __m256 sd = _mm256_mul_ps(sv, _mm256_loadu_ps(dxu + t * nu + 8 * i));
        const __m256 p = _mm256_fmadd_ps(_mm256_cvtepi32_ps(I), sd, P[t]);
        P[t] = _mm256_fmadd_ps(bv, _mm256_loadu_ps(xsu + t * nu + 8 * i), p);
    }
}

/* One Q4_K row against T tokens: out[t] = the canonical sum (tree included). Super-blocks in
   pairs, so that each partial vector is a register of its own. */
static inline __attribute__((always_inline)) void gk_row_q4k(const uint8_t* row, int64_t K,
                                                             const int T, const int16_t* xk,
                                                             const float* dxu, const float* xsu,
                                                             float* out) {
    const int64_t nsb = K / 256;
    __m256 P0[GK_MAXT], P1[GK_MAXT];
    for (int t = 0; t < T; t++) P0[t] = P1[t] = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 1 < nsb; i += 2) {
        gk_sb_q4k(row + 144 * i, i, K, T, xk, dxu, xsu, P0);
        gk_sb_q4k(row + 144 * (i + 1), i + 1, K, T, xk, dxu, xsu, P1);
    }
    if (i < nsb) gk_sb_q4k(row + 144 * i, i, K, T, xk, dxu, xsu, P0);
    for (int t = 0; t < T; t++) out[t] = gv_tree(P0[t], P1[t]);
}

/* One Q6_K row against T tokens: xk [T][K], dxu [T][K / 16], sq [T][K / 16] */
static inline __attribute__((always_inline)) void gk_row_q6k(const uint8_t* row, int64_t K,
                                                             const int T, const int16_t* xk,
                                                             const float* dxu, const int32_t* sq,
                                                             float* out) {
    const int64_t nu = K / 16;
    const __m256i m4 = _mm256_set1_epi16(0xF), m30 = _mm256_set1_epi16(0x30);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    __m256 P[GK_MAXT][2];
    for (int t = 0; t < T; t++) P[t][0] = P[t][1] = _mm256_setzero_ps();
    for (int64_t i = 0; i < K / 256; i++) {
        const uint8_t* blk = row + 210 * i;
        const __m256 d = _mm256_set1_ps(gk_f16(blk + 208));
        for (int n = 0; n < 2; n++) {
            const __m256i A = _mm256_loadu_si256((const __m256i*)(blk + 64 * n));
            const __m256i B = _mm256_loadu_si256((const __m256i*)(blk + 64 * n + 32));
            const __m256i H = _mm256_loadu_si256((const __m256i*)(blk + 128 + 32 * n));
            /* values 128n + 32k + l: even l in ev[k] lane l / 2, odd l in od[k] (6-bit codes) */
            const __m256i ev[4] = {
                _mm256_or_si256(_mm256_and_si256(A, m4), _mm256_and_si256(_mm256_slli_epi16(H, 4), m30)),
                _mm256_or_si256(_mm256_and_si256(B, m4), _mm256_and_si256(_mm256_slli_epi16(H, 2), m30)),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(A, 4), m4), _mm256_and_si256(H, m30)),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(B, 4), m4), _mm256_and_si256(_mm256_srli_epi16(H, 2), m30))};
            const __m256i od[4] = {
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(A, 8), m4), _mm256_and_si256(_mm256_srli_epi16(H, 4), m30)),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(B, 8), m4), _mm256_and_si256(_mm256_srli_epi16(H, 6), m30)),
                _mm256_or_si256(_mm256_srli_epi16(A, 12), _mm256_and_si256(_mm256_srli_epi16(H, 8), m30)),
                _mm256_or_si256(_mm256_srli_epi16(B, 12), _mm256_and_si256(_mm256_srli_epi16(H, 10), m30))};
            const __m256 sv = _mm256_mul_ps(
                d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(blk + 192 + 8 * n)))));
            const int64_t j0 = 16 * i + 8 * n; /* units j0 .. j0 + 7: P's c = 8n .. 8n + 7 */
            for (int t = 0; t < T; t++) {
                const int16_t* x = xk + t * K + 256 * i + 128 * n;
                __m256i v[4]; /* v[k]: lanes 0-3 unit j0 + 2k's partials, 4-7 unit j0 + 2k + 1's */
                for (int k = 0; k < 4; k++)
                    v[k] = _mm256_add_epi32(_mm256_madd_epi16(ev[k], _mm256_loadu_si256((const __m256i*)(x + 32 * k))),
                                            _mm256_madd_epi16(od[k], _mm256_loadu_si256((const __m256i*)(x + 32 * k + 16))));
                /* pair32, pair64: lanes (j0, j0 + 2, j0 + 4, j0 + 6 | j0 + 1, ...): permuted to j0 .. j0 + 7 */
                const __m256i U = _mm256_permutevar8x32_epi32(
                    gk_pair64(gk_pair32(v[0], v[1]), gk_pair32(v[2], v[3])), order);
                const __m256i I = _mm256_sub_epi32(
                    U, _mm256_slli_epi32(_mm256_loadu_si256((const __m256i*)(sq + t * nu + j0)), 5));
                const __m256 sd = _mm256_mul_ps(sv, _mm256_loadu_ps(dxu + t * nu + j0));
                P[t][n] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(I), sd, P[t][n]);
            }
        }
    }
    for (int t = 0; t < T; t++) out[t] = gv_tree(P[t][0], P[t][1]);
}

typedef struct {
    int qtype;
    const uint8_t* w;
    int64_t N, K, row_bytes;
    int T;
    const int16_t* xk;
    const float *dxu, *xsu;
    const int32_t* sq;
    const float* bias;
    float* y;
    int64_t ldy;
    int accumulate;
} GkJob;

/* rows n0 .. n1 - 1 with the type and T as constants */
static inline __attribute__((always_inline)) void gk_rows_core(const GkJob* j, int64_t n0, int64_t n1,
                                                               const int qtype, const int T) {
    for (int64_t n = n0; n < n1; n++) {
        float out[GK_MAXT];
        const uint8_t* row = j->w + n * j->row_bytes;
        if (qtype == GKQ4_K)
            gk_row_q4k(row, j->K, T, j->xk, j->dxu, j->xsu, out);
        else
            gk_row_q6k(row, j->K, T, j->xk, j->dxu, j->sq, out);
        const float bn = j->bias ? j->bias[n] : 0.f;
        for (int t = 0; t < T; t++) {
            float* yo = j->y + t * j->ldy + n;
            *yo = (j->accumulate ? *yo : 0.f) + out[t] + bn;
        }
    }
}

/* pool items i0 .. i1 - 1 of GK_ROWS rows (loom_par_for's task) */
static void gk_items(void* ctx, int64_t i0, int64_t i1, int worker) {
    (void)worker;
    const GkJob* j = ctx;
    const int64_t n0 = i0 * GK_ROWS, n1 = i1 * GK_ROWS < j->N ? i1 * GK_ROWS : j->N;
#define GK_CASE(Q, TT)                     \
    case TT:                               \
        gk_rows_core(j, n0, n1, Q, TT);    \
        break;
#define GK_CASES(Q)                                                    \
    switch (j->T) {                                                    \
        GK_CASE(Q, 1) GK_CASE(Q, 2) GK_CASE(Q, 3) GK_CASE(Q, 4) default : break; \
    }
    if (j->qtype == GKQ4_K) {
        GK_CASES(GKQ4_K)
    } else {
        GK_CASES(GKQ6_K)
    }
#undef GK_CASES
#undef GK_CASE
}
#endif

/* loom_q_matmul_bi for loom_q_bi_kgemv_type at T <= 4 (its arguments): every token quantized
   (quant_bi.c's bi_quantize) and packed once, then rows over the pool */
int loom_q_matmul_bi_kgemv(int qtype, const uint8_t* w, int64_t N, int64_t K, int64_t row_bytes,
                           const float* x, int64_t T, int64_t ldx, const float* bias, float* y,
                           int64_t ldy, int accumulate, int threads) {
#if GK_ON
    if (T < 1 || T > GK_MAXT || K % 256 || !loom_q_bi_kgemv_type(qtype)) return -1;
    const int G = qtype == GKQ6_K ? 16 : 32;
    const int64_t nu = K / G;
    int16_t* q = malloc(sizeof(int16_t) * (size_t)(K + 16));
    int16_t* xk = malloc(sizeof(int16_t) * (size_t)(T * K + 16));
    float* dxu = malloc(sizeof(float) * (size_t)(T * nu + 8));
    float* xsu = malloc(sizeof(float) * (size_t)(T * nu + 8));
    int32_t* sq = malloc(sizeof(int32_t) * (size_t)(T * (K / 16) + 8));
    if (!q || !xk || !dxu || !xsu || !sq) {
        free(q);
        free(xk);
        free(dxu);
        free(xsu);
        free(sq);
        return -2;
    }
    for (int64_t t = 0; t < T; t++) {
        loom_q_bi_quantize(x + t * ldx, K, G, q, dxu + t * nu, xsu + t * nu);
        gk_pack(qtype, q, K, xk + t * K, sq + t * (K / 16));
    }
    free(q);
    const int64_t items = (N + GK_ROWS - 1) / GK_ROWS;
    GkJob job = {qtype, w, N, K, row_bytes, (int)T, xk, dxu, xsu, sq, bias, y, ldy, accumulate};
    if (threads < 1) threads = 1;
    loom_par_for(threads, items, par_chunk(items, threads), gk_items, &job);
    free(xk);
    free(dxu);
    free(xsu);
    free(sq);
    return 0;
#else
    (void)qtype, (void)w, (void)N, (void)K, (void)row_bytes, (void)x, (void)T, (void)ldx;
    (void)bias, (void)y, (void)ldy, (void)accumulate, (void)threads;
    return -1;
#endif
}
