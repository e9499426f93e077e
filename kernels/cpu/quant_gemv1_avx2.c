/* Mode "bi" (quant_bi.c's canonical arithmetic) for ONE token of Q8_0 / Q5_0 on AVX2 builds
   without AVX-512: the decode step's LM head (Gemma 3's tied Q8_0 262144 x 640, 178 MB) and its
   Q5_0 q / k / gate / up.

   Why not quant_gemv_avx2.c's layout at one token: there a ymm holds units p and p + 4 of a
   group, so each block's bytes are split into even / odd int16 by shifts (6 per pair of units,
   plus an insert per load) and a row whose unit count is not a multiple of 8 pays a whole group
   for its last 1-4 units (K = 640: 20 units, 3 groups' work for 2.5). That kernel is
   compute-bound at one token (as fast from L2 as from memory: docs/benchmarks.md, helper
   "gemvk", session 22). Here a ymm is ONE unit's 16 values against the token's codes in natural
   order: Q8_0 by vpmovsxbw straight from the block; Q5_0 by vpmovzxbw of its 16 bytes (word k:
   low nibble = value k, high = value 16 + k) and the fifth bits as words (qh's low / high 16
   bits broadcast, a word mask per lane and a compare), no byte shuffles. 2 vpmaddwd + 1 vpaddd a
   unit give 8 int32 partials; a group's 8 units reduce by 6 vphaddd + 2 lane permutes + 1 add
   to lane k = unit 8g + k; a row's last group computes only its own units.

   Per row the float steps are quant_gemv_avx2.c's (gemv_avx2.h: gv_f16x8, gv_fstep, gv_tree;
   lane k of P[g mod 2] is the canonical P[(8g + k) mod 16]); units past the row have I = 0,
   scale 0 and dx 0: fma(0, 0, P) = P. So the bits are the portable C's. */

#include "loom_cpu.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(__AVX512F__)
#define G1_ON 1
#include "gemv_avx2.h"
#else
#define G1_ON 0
#endif

enum { G1Q8_0 = 0, G1Q5_0 = 5 };

int loom_q_bi_gemv1 = 1; /* loom_cpu.h */

/* under quant_gemv_avx2.c's knob too: loom_q_bi_gemv = 0 keeps meaning the older kernels */
int loom_q_bi_gemv1_type(int qtype) {
    return G1_ON && loom_q_bi_gemv1 && loom_q_bi_gemv && (qtype == G1Q8_0 || qtype == G1Q5_0);
}

#if G1_ON
/* bytes ahead of the group being read that the loop prefetches (4096 was as fast on an
   aligned_alloc'd copy but ~10 percent slower on the model's own LM head: docs/benchmarks.md,
   helper "gemvk", session 22) */
#define G1_PF 2048
#define G1_ROWS 4 /* rows of one loom_par_for item */

/* unit at blk (a Q8_0 or Q5_0 block) against the token's 32 codes xq -> 8 int32 partials */
static inline __attribute__((always_inline)) __m256i g1_unit(const int qtype, const uint8_t* blk,
                                                             const int16_t* xq) {
    __m256i w0, w1;
    if (qtype == G1Q8_0) {
        w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(blk + 2)));
        w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(blk + 18)));
    } else { /* Q5_0: word k of w0 (w1) is nibble k (its high one), qh's bit k (16 + k) fifth */
        const __m256i W = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)(blk + 6)));
        int16_t h0, h1;
        memcpy(&h0, blk + 2, 2);
        memcpy(&h1, blk + 4, 2);
        const __m256i mk = _mm256_setr_epi16(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048,
                                             4096, 8192, 16384, (short)0x8000);
        /* code - 16: the nibble where the bit is set, nibble - 16 (its bits | 0xFFF0) where not */
        const __m256i m16 = _mm256_set1_epi16((short)0xFFF0);
        const __m256i b0 = _mm256_and_si256(_mm256_set1_epi16(h0), mk);
        const __m256i f0 = _mm256_andnot_si256(_mm256_cmpeq_epi16(b0, mk), m16);
        const __m256i b1 = _mm256_and_si256(_mm256_set1_epi16(h1), mk);
        const __m256i f1 = _mm256_andnot_si256(_mm256_cmpeq_epi16(b1, mk), m16);
        w0 = _mm256_or_si256(_mm256_and_si256(W, _mm256_set1_epi16(0x0F)), f0);
        w1 = _mm256_or_si256(_mm256_srli_epi16(W, 4), f1);
    }
    return _mm256_add_epi32(_mm256_madd_epi16(w0, _mm256_loadu_si256((const __m256i*)xq)),
                            _mm256_madd_epi16(w1, _mm256_loadu_si256((const __m256i*)(xq + 16))));
}

/* u[k] = unit k's 8 partials -> lane k = unit k's exact sum */
static inline __m256i g1_reduce8(const __m256i* u) {
    const __m256i a = _mm256_hadd_epi32(u[0], u[1]), b = _mm256_hadd_epi32(u[2], u[3]);
    const __m256i c = _mm256_hadd_epi32(u[4], u[5]), d = _mm256_hadd_epi32(u[6], u[7]);
    const __m256i ab = _mm256_hadd_epi32(a, b), cd = _mm256_hadd_epi32(c, d);
    /* ab = [units 0-3, lanes 0-3 summed | units 0-3, lanes 4-7 summed], cd likewise 4-7 */
    return _mm256_add_epi32(_mm256_permute2x128_si256(ab, cd, 0x20),
                            _mm256_permute2x128_si256(ab, cd, 0x31));
}

/* one group of m <= 8 units at blk (m a constant 8 but in a row's last group) */
static inline __attribute__((always_inline)) __m256 g1_group(const int qtype, const uint8_t* blk,
                                                             const int m, const int16_t* xq,
                                                             const float* dx, __m256 P) {
    const int bb = qtype == G1Q8_0 ? 34 : 22;
    __m256i u[8];
    for (int k = 0; k < 8; k++)
        u[k] = k < m ? g1_unit(qtype, blk + bb * k, xq + 32 * k) : _mm256_setzero_si256();
    __m256 s, b;
    gv_f16x8(blk, bb, m, &s, &b);
    return gv_fstep(P, g1_reduce8(u), s, _mm256_loadu_ps(dx), 0, b, s);
}

typedef struct {
    int qtype;
    const uint8_t* w;
    int64_t N, nu, row_bytes;
    const int16_t* xq;
    const float* dx;
    const float* bias;
    float* y;
    int accumulate;
} G1Job;

static inline __attribute__((always_inline)) void g1_rows(const G1Job* j, const int qtype,
                                                          int64_t i0, int64_t i1) {
    const int bb = qtype == G1Q8_0 ? 34 : 22;
    const int64_t n1 = i1 * G1_ROWS < j->N ? i1 * G1_ROWS : j->N, full = j->nu / 8;
    const int tail = (int)(j->nu - 8 * full);
    for (int64_t n = i0 * G1_ROWS; n < n1; n++) {
        const uint8_t* row = j->w + n * j->row_bytes;
        __m256 P[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
        for (int64_t g = 0; g < full; g++) {
            const uint8_t* blk = row + g * 8 * bb;
            for (int o = 0; o < 8 * bb; o += 64)
                _mm_prefetch((const char*)(blk + G1_PF + o), _MM_HINT_T0);
            P[g & 1] = g1_group(qtype, blk, 8, j->xq + 256 * g, j->dx + 8 * g, P[g & 1]);
        }
        if (tail) { /* the row's last nu mod 8 units, m as a constant per case */
            const uint8_t* blk = row + full * 8 * bb;
            const int16_t* xq = j->xq + 256 * full;
            const float* dx = j->dx + 8 * full;
            __m256* p = &P[full & 1];
            switch (tail) {
#define G1_TAIL(M)                                                                                 \
    case M:                                                                                        \
        *p = g1_group(qtype, blk, M, xq, dx, *p);                                                  \
        break;
                G1_TAIL(1) G1_TAIL(2) G1_TAIL(3) G1_TAIL(4) G1_TAIL(5) G1_TAIL(6) G1_TAIL(7)
#undef G1_TAIL
            default: break;
            }
        }
        float* yo = j->y + n;
        *yo = (j->accumulate ? *yo : 0.f) + gv_tree(P[0], P[1]) + (j->bias ? j->bias[n] : 0.f);
    }
}

static void g1_items(void* ctx, int64_t i0, int64_t i1, int worker) {
    (void)worker;
    const G1Job* j = ctx;
    if (j->qtype == G1Q8_0)
        g1_rows(j, G1Q8_0, i0, i1);
    else
        g1_rows(j, G1Q5_0, i0, i1);
}
#endif

/* loom_q_matmul_bi for loom_q_bi_gemv1_type at T = 1 (its arguments): the token's codes
   (gemv_avx2.h's gv_codes32: bi_quantize's) as int16 in natural order, then rows over the pool */
int loom_q_matmul_bi_gemv1(int qtype, const uint8_t* w, int64_t N, int64_t K, int64_t row_bytes,
                           const float* x, int64_t T, const float* bias, float* y, int accumulate,
                           int threads) {
#if G1_ON
    if (T != 1 || !loom_q_bi_gemv1_type(qtype) || K % 32) return -1;
    const int64_t nu = K / 32, ng = (nu + 7) / 8;
    int16_t* xq = malloc(sizeof(int16_t) * (size_t)(ng * 256));
    float* dx = malloc(sizeof(float) * (size_t)(ng * 8));
    if (!xq || !dx) {
        free(xq);
        free(dx);
        return -2;
    }
    for (int64_t u = 0; u < 8 * ng; u++) {
        if (u >= nu) { /* past the row: codes and dx 0 (never read as codes: I = 0 there) */
            memset(xq + 32 * u, 0, 64);
            dx[u] = 0.f;
            continue;
        }
        __m256i c[4];
        (void)gv_codes32(x + 32 * u, c, dx + u);
        for (int h = 0; h < 2; h++) /* packs works per 128-bit lane: restore the order */
            _mm256_storeu_si256((__m256i*)(xq + 32 * u + 16 * h),
                                _mm256_permute4x64_epi64(_mm256_packs_epi32(c[2 * h], c[2 * h + 1]),
                                                         _MM_SHUFFLE(3, 1, 2, 0)));
    }
    const int64_t items = (N + G1_ROWS - 1) / G1_ROWS;
    G1Job job = {qtype, w, N, nu, row_bytes, xq, dx, bias, y, accumulate};
    if (threads < 1) threads = 1;
    loom_par_for(threads, items, par_chunk(items, threads), g1_items, &job);
    free(xq);
    free(dx);
    return 0;
#else
    (void)qtype, (void)w, (void)N, (void)K, (void)row_bytes, (void)x, (void)T, (void)bias;
    (void)y, (void)accumulate, (void)threads;
    return -1;
#endif
}
