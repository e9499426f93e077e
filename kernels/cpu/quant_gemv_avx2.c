/* The canonical batch-invariant arithmetic (quant_bi.c's file comment, mode LOOM_Q_BI) for 1..4
   token rows on AVX2 builds without AVX-512: Q8_0 / Q4_0 / Q4_1 / Q5_0 with lanes = values.

   Why: quant_bi2.c's row lanes fetch each unit's code dwords of 8 rows by vpgatherdd (4 to 8 a
   unit, plus one for the scales), and quant_bi_avx2.c's 8-token tiles waste 7 of 8 lanes at one
   token. Here a row is read in order with contiguous loads (the hardware prefetcher follows a
   single stream; a software prefetch runs a few rows ahead too), 8 units a step: per pair of
   units (p, p + 4) the two blocks' codes go to int16 in registers (gemv_avx2.h's layout: Q4_x
   nibbles as words masked / shifted, Q8_0 and Q5_0 bytes sign-extended, Q5_0's fifth bits
   spread from qh by a byte shuffle and compare), and each token costs 4 vpmaddwd + 3 vpaddd a
   pair, one hadd tree for 8 units' exact int32 dots, and the float steps on 8 units at once.

   Per (row, token) the steps are the canonical ones: the unit's exact int32 I (pairs in any
   order), P[j mod 16] = fma((float) I, s_j * dx_j, P[...]) from +0 in increasing j (asym: then
   fma(b_j, xs_j, P[...])), the fixed tree, ((accumulate ? y : 0) + sum) + bias. A row's last
   group of fewer than 8 units has zero activations, dx and scales past them: those lanes add
   fma(0, 0, P) = P (P is never -0: it starts at +0 and a sum is -0
   only of two -0), as the other kernels leave P[c] at +0 for c past the units. So the outputs
   are bitwise the portable kernel's for every T. */

#include "loom_cpu.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(__AVX512F__)
#define GV_ON 1
#include "gemv_avx2.h"
#else
#define GV_ON 0
#endif

enum { GVQ8_0 = 0, GVQ4_0 = 1, GVQ4_1 = 2, GVQ5_0 = 5 };

int loom_q_bi_gemv = 1; /* loom_cpu.h */

int loom_q_bi_gemv_type(int qtype) {
    return GV_ON && loom_q_bi_gemv &&
           (qtype == GVQ8_0 || qtype == GVQ4_0 || qtype == GVQ4_1 || qtype == GVQ5_0);
}

/* the token counts it takes: 1..4, Q5_0 1..3 (at 4 tokens its decode's constants and 16 dot
   vectors spill, and quant_bi_avx2.c's 8-token tile was faster on Gemma 3's Q5_0 matrices:
   docs/benchmarks.md, helper "gemv") */
int loom_q_bi_gemv_max_t(int qtype) {
    return !loom_q_bi_gemv_type(qtype) ? 0 : qtype == GVQ5_0 ? 3 : 4;
}

#if GV_ON
#define GV_PF 2048 /* bytes ahead of the row being read that the loop prefetches */

static inline int gv_block_bytes(int qtype) {
    return qtype == GVQ8_0 ? 34 : qtype == GVQ4_0 ? 18 : qtype == GVQ4_1 ? 20 : 22;
}

static inline __m256i gv_load2(const uint8_t* a, const uint8_t* b) {
    return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i*)a)),
                                   _mm_loadu_si128((const __m128i*)b), 1);
}

/* blocks a (unit p) and b (unit p + 4) -> e[0..3], gemv_avx2.h's 4 weight vectors */
static inline __attribute__((always_inline)) void gv_decode(const int qtype, const uint8_t* a,
                                                            const uint8_t* b, __m256i* e) {
    if (qtype == GVQ8_0) {
        const __m256i lo = gv_load2(a + 2, b + 2), hi = gv_load2(a + 18, b + 18);
        e[0] = _mm256_srai_epi16(_mm256_slli_epi16(lo, 8), 8);
        e[1] = _mm256_srai_epi16(lo, 8);
        e[2] = _mm256_srai_epi16(_mm256_slli_epi16(hi, 8), 8);
        e[3] = _mm256_srai_epi16(hi, 8);
    } else if (qtype == GVQ5_0) {
        const __m256i X = gv_load2(a + 6, b + 6), m4 = _mm256_set1_epi8(0x0F);
        uint32_t qa, qb;
        memcpy(&qa, a + 2, 4);
        memcpy(&qb, b + 2, 4);
        const __m256i qh = _mm256_set_epi32((int)qb, (int)qb, (int)qb, (int)qb, (int)qa, (int)qa,
                                            (int)qa, (int)qa);
        /* byte k of the low (high) half: qh's byte k / 8 (2 + k / 8), then bit k mod 8 */
        const __m256i slo = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0,
                                             0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
        const __m256i shi = _mm256_add_epi8(slo, _mm256_set1_epi8(2));
        const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
        const __m256i f0 = _mm256_set1_epi8((char)0xF0);
        const __m256i blo =
            _mm256_cmpeq_epi8(_mm256_and_si256(_mm256_shuffle_epi8(qh, slo), bit), bit);
        const __m256i bhi =
            _mm256_cmpeq_epi8(_mm256_and_si256(_mm256_shuffle_epi8(qh, shi), bit), bit);
        /* code - 16 as a signed byte: the nibble where the bit is set, nibble - 16 where not */
        const __m256i lo = _mm256_or_si256(_mm256_and_si256(X, m4), _mm256_andnot_si256(blo, f0));
        const __m256i hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(X, 4), m4),
                                           _mm256_andnot_si256(bhi, f0));
        e[0] = _mm256_srai_epi16(_mm256_slli_epi16(lo, 8), 8);
        e[1] = _mm256_srai_epi16(lo, 8);
        e[2] = _mm256_srai_epi16(_mm256_slli_epi16(hi, 8), 8);
        e[3] = _mm256_srai_epi16(hi, 8);
    } else {
        const int o = qtype == GVQ4_1 ? 4 : 2;
        const __m256i X = gv_load2(a + o, b + o), m4 = _mm256_set1_epi16(0x000F);
        e[0] = _mm256_and_si256(X, m4);
        e[1] = _mm256_and_si256(_mm256_srli_epi16(X, 8), m4);
        e[2] = _mm256_and_si256(_mm256_srli_epi16(X, 4), m4);
        e[3] = _mm256_srli_epi16(X, 12);
        if (qtype == GVQ4_0)
            for (int v = 0; v < 4; v++) e[v] = _mm256_sub_epi16(e[v], _mm256_set1_epi16(8));
    }
}

/* One group of m <= 8 units at blk (blocks of bb bytes; m a constant 8 but in a row's last
   group) against T tokens: P[t][half] updated. Units past m: their pair's low unit's block
   again (codes met by zero activations: no effect on I) or no pair at all (I = 0), scale 0. */
static inline __attribute__((always_inline)) void gv_group(const int qtype, const int T,
                                                           const uint8_t* blk, const int m,
                                                           const int32_t* xg, int64_t xstride,
                                                           const float* dxg, const float* xsg,
                                                           int64_t sstride, __m256* Pt, int half) {
    const int bb = gv_block_bytes(qtype), asym = qtype == GVQ4_1;
    __m256i v[4][4]; /* [token][pair] */
    for (int p = 0; p < 4; p++) {
        if (p >= m) {
            for (int t = 0; t < T; t++) v[t][p] = _mm256_setzero_si256();
            continue;
        }
        __m256i e[4];
        gv_decode(qtype, blk + p * bb, blk + (p + 4 < m ? p + 4 : p) * bb, e);
        for (int t = 0; t < T; t++) {
            const __m256i* x = (const __m256i*)(xg + t * xstride + 32 * p);
            const __m256i a0 = _mm256_madd_epi16(e[0], _mm256_loadu_si256(x));
            const __m256i a1 = _mm256_madd_epi16(e[1], _mm256_loadu_si256(x + 1));
            const __m256i a2 = _mm256_madd_epi16(e[2], _mm256_loadu_si256(x + 2));
            const __m256i a3 = _mm256_madd_epi16(e[3], _mm256_loadu_si256(x + 3));
            v[t][p] = _mm256_add_epi32(_mm256_add_epi32(a0, a1), _mm256_add_epi32(a2, a3));
        }
    }
    __m256 s, b;
    gv_f16x8(blk, bb, m, &s, &b);
    for (int t = 0; t < T; t++) {
        const __m256i I = gv_reduce8(v[t][0], v[t][1], v[t][2], v[t][3]);
        Pt[2 * t + half] =
            gv_fstep(Pt[2 * t + half], I, s, _mm256_loadu_ps(dxg + t * sstride), asym, b,
                     asym ? _mm256_loadu_ps(xsg + t * sstride) : _mm256_setzero_ps());
    }
}

/* Row `row` (nu units) against T tokens: xp [T][ng * 128] pairs, dxu / xsu [T][8 ng] (zero
   past nu); out[t] = the row's canonical sum for token t */
static inline __attribute__((always_inline)) void gv_row(const int qtype, const int T,
                                                         const uint8_t* row, int64_t nu,
                                                         const int32_t* xp, const float* dxu,
                                                         const float* xsu, int64_t ng, float* out) {
    const int bb = gv_block_bytes(qtype);
    __m256 P[8];
    for (int k = 0; k < 2 * T; k++) P[k] = _mm256_setzero_ps();
    const int64_t full = nu / 8;
    for (int64_t g = 0; g < full; g++) {
        const uint8_t* blk = row + g * 8 * bb;
        for (int o = 0; o < 8 * bb; o += 64)
            _mm_prefetch((const char*)(blk + GV_PF + o), _MM_HINT_T0);
        gv_group(qtype, T, blk, 8, xp + GV_GROUP_DW * g, GV_GROUP_DW * ng, dxu + 8 * g, xsu + 8 * g,
                 8 * ng, P, (int)(g & 1));
    }
    if (full < ng) /* the row's last nu mod 8 units */
        gv_group(qtype, T, row + full * 8 * bb, (int)(nu - 8 * full), xp + GV_GROUP_DW * full,
                 GV_GROUP_DW * ng, dxu + 8 * full, xsu + 8 * full, 8 * ng, P, (int)(full & 1));
    for (int t = 0; t < T; t++) out[t] = gv_tree(P[2 * t], P[2 * t + 1]);
}

typedef struct {
    int qtype;
    const uint8_t* w;
    int64_t N, nu, ng, row_bytes;
    int T;
    const int32_t* xp;
    const float *dxu, *xsu;
    const float* bias;
    float* y;
    int64_t ldy;
    int accumulate;
} GvJob;

#define GV_ROWS 4 /* rows of one loom_par_for item */

static inline __attribute__((always_inline)) void gv_rows_t(const GvJob* j, const int qtype,
                                                            const int T, int64_t i0, int64_t i1) {
    const int64_t n1 = i1 * GV_ROWS < j->N ? i1 * GV_ROWS : j->N;
    for (int64_t n = i0 * GV_ROWS; n < n1; n++) {
        float sum[4];
        gv_row(qtype, T, j->w + n * j->row_bytes, j->nu, j->xp, j->dxu, j->xsu, j->ng, sum);
        const float bn = j->bias ? j->bias[n] : 0.f;
        for (int t = 0; t < T; t++) {
            float* yo = j->y + t * j->ldy + n;
            *yo = (j->accumulate ? *yo : 0.f) + sum[t] + bn;
        }
    }
}

/* items i0 .. i1 - 1 of GV_ROWS rows (loom_par_for's task), with the type and T as constants */
static void gv_items(void* ctx, int64_t i0, int64_t i1, int worker) {
    (void)worker;
    const GvJob* j = ctx;
#define GV_CASE(Q, TT)                                                                             \
    case TT:                                                                                       \
        gv_rows_t(j, Q, TT, i0, i1);                                                               \
        break;
#define GV_CASES(Q)                                                                                \
    switch (j->T) { GV_CASE(Q, 1) GV_CASE(Q, 2) GV_CASE(Q, 3) GV_CASE(Q, 4) default : break; }
    switch (j->qtype) {
    case GVQ8_0:
        GV_CASES(GVQ8_0) break;
    case GVQ4_0:
        GV_CASES(GVQ4_0) break;
    case GVQ4_1:
        GV_CASES(GVQ4_1) break;
    default: /* Q5_0: T <= 3 (loom_q_bi_gemv_max_t) */
        switch (j->T) { GV_CASE(GVQ5_0, 1) GV_CASE(GVQ5_0, 2) GV_CASE(GVQ5_0, 3) default : break; }
        break;
    }
#undef GV_CASES
#undef GV_CASE
}
#endif

/* loom_q_matmul_bi for loom_q_bi_gemv_type at T <= loom_q_bi_gemv_max_t (its arguments):
   every token quantized and packed once (gemv_avx2.h's gv_quantize_pack: bi_quantize's codes),
   then rows over the pool */
int loom_q_matmul_bi_gemv(int qtype, const uint8_t* w, int64_t N, int64_t K, int64_t row_bytes,
                          const float* x, int64_t T, int64_t ldx, const float* bias, float* y,
                          int64_t ldy, int accumulate, int threads) {
#if GV_ON
    if (T < 1 || T > loom_q_bi_gemv_max_t(qtype) || K % 32) return -1;
    const int64_t nu = K / 32, ng = (nu + 7) / 8;
    int32_t* xp = malloc(sizeof(int32_t) * (size_t)(T * ng * GV_GROUP_DW));
    float* dxu = malloc(sizeof(float) * (size_t)(T * ng * 8));
    float* xsu = malloc(sizeof(float) * (size_t)(T * ng * 8));
    if (!xp || !dxu || !xsu) {
        free(xp);
        free(dxu);
        free(xsu);
        return -2;
    }
    for (int64_t t = 0; t < T; t++)
        gv_quantize_pack(x + t * ldx, K, ng, xp + t * ng * GV_GROUP_DW, dxu + t * ng * 8,
                         xsu + t * ng * 8);
    const int64_t items = (N + GV_ROWS - 1) / GV_ROWS;
    GvJob job = {qtype, w, N, nu, ng, row_bytes, (int)T, xp, dxu, xsu, bias, y, ldy, accumulate};
    if (threads < 1) threads = 1;
    loom_par_for(threads, items, par_chunk(items, threads), gv_items, &job);
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
