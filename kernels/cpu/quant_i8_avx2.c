/* Mode LOOM_Q_PREFILL (quant_i8.c: 8-bit activations for a prompt's rows) on AVX2 + FMA builds
   without AVX-512 VNNI, where mode 5 was mode 4 (quant_bi_avx2.c's 16-bit tiles).

   The arithmetic is quant_i8.c's file comment's, unchanged, so the outputs are bitwise the
   AVX-512 kernel's: the same activation codes (per block of 32: dx = max|x| / 127, codes
   sign(v) floor(|v| + 0.5) of v = x * (1 / dx), and where the block's rounding error is large,
   loom_q_i8_resid, a second plane at dx / 254, by the same float steps: the error energy summed
   lane by lane as in a zmm, then gcc's _mm512_reduce_add_ps order), an exact int32 I_j per unit
   (only the integer method differs, and integer sums are exact in any order), then per unit in
   increasing j from +0: P = fma((float) I_j, s_j * dx_j, P), the residual plane's
   fma((float) I2_j, s_j * dx2_j, P), asym fma(b_j, xs_j, P); y = ((accumulate ? y : 0) + P) +
   bias. ia_ref below runs the same steps in scalar C with fmaf (loom_q_i8_avx2 = 0): the tests'
   bitwise reference on this CPU, which cannot run the AVX-512 code.

   The integer dots without vpdpbusd: tokens are lanes (8 a ymm, int32 lanes of 4 codes, as
   quant_i8.c's 16), a row's 4 weight bytes are broadcast, and vpmaddubsw (unsigned weight x
   signed code, pairs summed to int16 with saturation) then vpmaddwd by ones (to int32). The
   saturation is avoided by the weight range: stored unsigned u = w + o (quant_i8.c's o) is at
   most 15 for Q4_0 / Q4_1 / Q4_K, 31 for Q5_0 / Q5_1, 63 for Q6_K, so a pair sums to at most
   2 x 63 x 127 = 16002 and M = 8 / 4 / 2 vpmaddubsw results (pairs <= 3810 / 7874 / 16002) add
   in int16 (vpaddw) below 32767 before one vpmaddwd; I = that - o * sum q. Q8_0's codes need
   all 8 bits, so the sign trick: |w| (<= 128) unsigned, q with w's sign (vpsignb) signed, pairs
   <= 2 x 128 x 127 = 32512, one vpmaddwd per vpmaddubsw; I = sum w q directly.

   How: a call quantizes its tokens once into groups of 8 (codes as int32 quads, per-unit
   scales, offsets and residual flags); rows are decoded IA_BLOCK at a time straight to bytes
   (AVX2 per type: quant.c's generic decoder, which loom_q_decode_row16 takes on this build, was
   15-20 percent of a 128-token call) and packed per pass of IA_ROWS rows as [quad][row], so a
   pass reads one weight stream; each pass (6 rows x 8 tokens: 6 int16 and 6 float
   accumulators) walks every token group. The residual plane is a second dot pass on the units
   where a token of the group has one. Rows and tokens never mix, so a row's bits do not depend
   on T, the thread count or its place in the step. */

#include "loom_cpu.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && \
    !(defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__))
#define IA_ON 1
#include <immintrin.h>
#else
#define IA_ON 0
#endif

int loom_q_i8_avx2 = 1; /* loom_cpu.h */

int loom_q_i8_avx2_built(void) { return IA_ON; }

#if IA_ON

enum { JQ8_0 = 0, JQ4_0 = 1, JQ4_1 = 2, JQ4_K = 3, JQ6_K = 4, JQ5_0 = 5, JQ5_1 = 6 };

#define IA_ROWS 6 /* rows of one pass (bench at 128 tokens, K = 576-2048: 6 x 1 group beat 4 x 1,
                     4 x 2, 3 x 2, 2 x 2, 5 x 1 and 8 x 1 by 5-30 percent) */
#define IA_MAXG 1 /* 8-token groups of one pass (the code takes 1 or 2) */
#define IA_BLOCK (8 * IA_ROWS) /* rows decoded at once, each used by every token group */

/* quant_i8.c's o: u = w + o unsigned (Q8_0: the sign trick instead, no offset) */
static int ia_offset(int qtype) { return qtype == JQ8_0 ? 0 : q_sym_offset(qtype); }
/* vpmaddubsw results summed in int16 before the widening (see the file comment) */
static int ia_m(int qtype) {
    switch (qtype) {
        case JQ8_0: return 1;
        case JQ6_K: return 2;
        case JQ5_0:
        case JQ5_1: return 4;
        default: return 8;
    }
}

/* _mm512_reduce_add_ps's order (gcc): halves, quarters, then (0 + 2) + (1 + 3) */
static inline float ia_reduce16(const float* L) {
    float t3[8], t6[4];
    for (int i = 0; i < 8; i++) t3[i] = L[8 + i] + L[i];
    for (int i = 0; i < 4; i++) t6[i] = t3[4 + i] + t3[i];
    return (t6[0] + t6[2]) + (t6[1] + t6[3]);
}

/* ia_reduce16 on lanes 0..7 (lo) and 8..15 (hi) in registers, the same additions */
static inline float ia_reduce16v(__m256 lo, __m256 hi) {
    const __m256 t3 = _mm256_add_ps(hi, lo);
    const __m128 t6 = _mm_add_ps(_mm256_extractf128_ps(t3, 1), _mm256_castps256_ps128(t3));
    const __m128 t8 = _mm_add_ps(t6, _mm_movehl_ps(t6, t6)); /* (0 + 2), (1 + 3) */
    return _mm_cvtss_f32(_mm_add_ss(t8, _mm_movehdup_ps(t8)));
}

/* the per-unit results of quantizing one token (quant_i8.c's i8_quantize's outputs) */
typedef struct {
    float *dx, *dx2, *xs;
    int32_t *co, *co2;
    uint8_t* nz;
} IaUnits;

/* one block's scalars from its two halves' code sums */
static inline void ia_units(int64_t k0, int G, int off, float dd, float d2, int resid, const int* sum,
                            const int* sum2, const IaUnits* o) {
    for (int h = 0; h < (G == 32 ? 1 : 2); h++) {
        const int u = G == 32 ? (int)(k0 / 32) : (int)(k0 / 16) + h;
        const int s1 = G == 32 ? sum[0] + sum[1] : sum[h], s2 = G == 32 ? sum2[0] + sum2[1] : sum2[h];
        o->dx[u] = dd;
        o->dx2[u] = d2;
        o->xs[u] = dd * (float)s1 + d2 * (float)s2;
        o->co[u] = -off * s1;
        o->co2[u] = -off * s2;
        o->nz[u] = (uint8_t)resid;
    }
}

/* scalar: sign(v) floor(|v| + 0.5), at most 127 (i8_round) */
static inline int ia_round1(float v) {
    float r = floorf(fabsf(v) + 0.5f);
    r = r < 127.f ? r : 127.f;
    return v < 0 ? -(int)r : (int)r;
}

/* the scalar quantizer (ia_ref's): codes q, q2 [K] */
static void ia_quantize_c(const float* x, int64_t K, int G, int off, int8_t* q, int8_t* q2, const IaUnits* o) {
    for (int64_t k0 = 0; k0 < K; k0 += 32) {
        const float* a = x + k0;
        float amax = 0.f;
        for (int k = 0; k < 32; k++) amax = fabsf(a[k]) > amax ? fabsf(a[k]) : amax;
        const float dd = amax / 127.f;
        const float inv = dd > 0 ? 1.f / dd : 0.f;
        const float d2 = dd / 254.f;
        float e[32], ee[16], xx[16];
        int sum[2] = {0, 0}, sum2[2] = {0, 0};
        for (int k = 0; k < 32; k++) {
            const int c = ia_round1(a[k] * inv);
            q[k0 + k] = (int8_t)c;
            sum[k / 16] += c;
            e[k] = fmaf(-(float)c, dd, a[k]);
        }
        for (int i = 0; i < 16; i++) { /* lane i of the zmm: values i, then 16 + i */
            ee[i] = fmaf(e[16 + i], e[16 + i], fmaf(e[i], e[i], 0.f));
            xx[i] = fmaf(a[16 + i], a[16 + i], fmaf(a[i], a[i], 0.f));
        }
        const int resid = d2 > 0 && ia_reduce16(ee) > loom_q_i8_resid * (ia_reduce16(xx) - amax * amax);
        const float inv2 = resid ? 1.f / d2 : 0.f;
        for (int k = 0; k < 32; k++) {
            const int c = ia_round1(e[k] * inv2);
            q2[k0 + k] = (int8_t)c;
            sum2[k / 16] += c;
        }
        ia_units(k0, G, off, dd, d2, resid, sum, sum2, o);
    }
}

static inline __m256i ia_round(__m256 v) {
    const __m256 r = _mm256_min_ps(_mm256_floor_ps(_mm256_add_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.f), v),
                                                                 _mm256_set1_ps(0.5f))),
                                   _mm256_set1_ps(127.f));
    const __m256i m = _mm256_cvttps_epi32(r);
    const __m256i neg = _mm256_castps_si256(_mm256_cmp_ps(v, _mm256_setzero_ps(), _CMP_LT_OQ));
    return _mm256_blendv_epi8(m, _mm256_sub_epi32(_mm256_setzero_si256(), m), neg);
}

static inline int ia_hsum(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    return _mm_cvtsi128_si32(s);
}

/* 4 x 8 int32 codes (values 0..31) -> 32 int8 in order */
static inline __m256i ia_pack(const __m256i* c) {
    const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
    return _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* the AVX2 quantizer: the scalar one's float steps on 8 lanes; codes as 32-byte blocks */
static void ia_quantize(const float* x, int64_t K, int G, int off, int8_t* q, int8_t* q2, const IaUnits* o) {
    for (int64_t k0 = 0; k0 < K; k0 += 32) {
        __m256 a[4], e[4];
        __m256i c[4];
        __m256 mx = _mm256_setzero_ps();
        for (int i = 0; i < 4; i++) {
            a[i] = _mm256_loadu_ps(x + k0 + 8 * i);
            mx = _mm256_max_ps(mx, _mm256_andnot_ps(_mm256_set1_ps(-0.f), a[i]));
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        const float amax = _mm_cvtss_f32(m4);
        const float dd = amax / 127.f;
        const __m256 inv = _mm256_set1_ps(dd > 0 ? 1.f / dd : 0.f), ddv = _mm256_set1_ps(dd);
        const float d2 = dd / 254.f;
        for (int i = 0; i < 4; i++) {
            c[i] = ia_round(_mm256_mul_ps(a[i], inv));
            e[i] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(c[i]), ddv, a[i]);
        }
        _mm256_storeu_si256((__m256i*)(q + k0), ia_pack(c));
        const int sum[2] = {ia_hsum(_mm256_add_epi32(c[0], c[1])), ia_hsum(_mm256_add_epi32(c[2], c[3]))};
        /* zmm lanes 0..7 (values 0..7 then 16..23) and 8..15 (8..15 then 24..31) */
        const __m256 z = _mm256_setzero_ps();
        const float ee = ia_reduce16v(_mm256_fmadd_ps(e[2], e[2], _mm256_fmadd_ps(e[0], e[0], z)),
                                      _mm256_fmadd_ps(e[3], e[3], _mm256_fmadd_ps(e[1], e[1], z)));
        const float xx = ia_reduce16v(_mm256_fmadd_ps(a[2], a[2], _mm256_fmadd_ps(a[0], a[0], z)),
                                      _mm256_fmadd_ps(a[3], a[3], _mm256_fmadd_ps(a[1], a[1], z)));
        const int resid = d2 > 0 && ee > loom_q_i8_resid * (xx - amax * amax);
        int sum2[2] = {0, 0};
        if (resid) {
            const __m256 inv2 = _mm256_set1_ps(1.f / d2);
            __m256i c2[4];
            for (int i = 0; i < 4; i++) c2[i] = ia_round(_mm256_mul_ps(e[i], inv2));
            _mm256_storeu_si256((__m256i*)(q2 + k0), ia_pack(c2));
            sum2[0] = ia_hsum(_mm256_add_epi32(c2[0], c2[1]));
            sum2[1] = ia_hsum(_mm256_add_epi32(c2[2], c2[3]));
        } else { /* inv2 = 0: every code 0 */
            _mm256_storeu_si256((__m256i*)(q2 + k0), _mm256_setzero_si256());
        }
        ia_units(k0, G, off, dd, d2, resid, sum, sum2, o);
    }
}

static inline float ia_f16(const uint8_t* p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return _cvtsh_ss(v);
}

/* Q5_0 / Q5_1 rows straight to their bytes u (the 5-bit codes: w + 16, Q5_1 w) and per unit
   bi_decode_row's scale d and offset (Q5_1 m; Q5_0's, unused, -16 d): the generic decoder
   that loom_q_decode_row16 takes for them on AVX2 cost a fifth of a 128-token call */
static void ia_decode_q5(int q51, const uint8_t* row, int64_t K, uint8_t* u, float* s, float* b) {
    const int bb = q51 ? 24 : 22;
    const __m128i low = _mm_set1_epi8(0x0F);
    /* bit j of qh -> byte j (0xFF / 0): byte j of the broadcast picks qh's byte j / 8, then
       every bit but j % 8 is set, so the byte is all ones iff bit j is */
    const __m256i pick = _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303);
    const __m256i others = _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe);
    for (int64_t i = 0; i < K / 32; i++) {
        const uint8_t* blk = row + i * bb;
        uint32_t qh;
        memcpy(&qh, blk + (q51 ? 4 : 2), 4);
        const __m128i q = _mm_loadu_si128((const __m128i*)(blk + (q51 ? 8 : 6)));
        const __m256i nib = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), low), _mm_and_si128(q, low));
        const __m256i bits = _mm256_cmpeq_epi8(_mm256_or_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int)qh), pick), others),
                                               _mm256_set1_epi8(-1));
        _mm256_storeu_si256((__m256i*)(u + 32 * i), _mm256_or_si256(nib, _mm256_and_si256(bits, _mm256_set1_epi8(16))));
        s[i] = ia_f16(blk);
        b[i] = q51 ? ia_f16(blk + 2) : -16.f * s[i];
    }
}

/* Q8_0 rows: |w| and w (the sign trick's operands), scale d per unit */
static void ia_decode_q8(const uint8_t* row, int64_t K, uint8_t* u, int8_t* sg, float* s, float* b) {
    for (int64_t i = 0; i < K / 32; i++) {
        const uint8_t* blk = row + i * 34;
        const __m256i w8 = _mm256_loadu_si256((const __m256i*)(blk + 2));
        _mm256_storeu_si256((__m256i*)(sg + 32 * i), w8);
        _mm256_storeu_si256((__m256i*)(u + 32 * i), _mm256_abs_epi8(w8)); /* -128 -> 0x80 = 128 */
        s[i] = ia_f16(blk);
        b[i] = 0.f; /* unused (Q8_0 is not asym) */
    }
}

/* Q4_0 / Q4_1 rows: the nibbles (u = w + 8, Q4_1 w), scale d, offset (Q4_1 m; Q4_0's unused) */
static void ia_decode_q4(int q41, const uint8_t* row, int64_t K, uint8_t* u, float* s, float* b) {
    const int bb = q41 ? 20 : 18;
    const __m128i low = _mm_set1_epi8(0x0F);
    for (int64_t i = 0; i < K / 32; i++) {
        const uint8_t* blk = row + i * bb;
        const __m128i q = _mm_loadu_si128((const __m128i*)(blk + (q41 ? 4 : 2)));
        _mm256_storeu_si256((__m256i*)(u + 32 * i),
                            _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), low), _mm_and_si128(q, low)));
        s[i] = ia_f16(blk);
        b[i] = q41 ? ia_f16(blk + 2) : -8.f * s[i];
    }
}

/* Q4_K rows (144 bytes a 256: f16 d, f16 dmin, 12 bytes of 6-bit scales / mins, 128 of nibbles:
   32 bytes per 64 values, low nibbles first): u the nibbles, unit j s = d sc_j, b = -dmin mn_j */
static void ia_decode_q4k(const uint8_t* row, int64_t K, uint8_t* u, float* s, float* b) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    for (int64_t i = 0; i < K / 256; i++) {
        const uint8_t* blk = row + i * 144;
        const float d = ia_f16(blk), dmin = ia_f16(blk + 2);
        for (int c = 0; c < 4; c++) {
            const __m256i v = _mm256_loadu_si256((const __m256i*)(blk + 16 + 32 * c));
            _mm256_storeu_si256((__m256i*)(u + 256 * i + 64 * c), _mm256_and_si256(v, m4));
            _mm256_storeu_si256((__m256i*)(u + 256 * i + 64 * c + 32), _mm256_and_si256(_mm256_srli_epi16(v, 4), m4));
        }
        for (int j = 0; j < 8; j++) {
            uint8_t sc, mn;
            k4_scale_min(j, blk + 4, &sc, &mn);
            s[8 * i + j] = d * sc;
            b[8 * i + j] = -dmin * mn;
        }
    }
}

/* Q6_K rows (210 bytes a 256: 128 of low nibbles, 64 of 2-bit highs, 16 int8 scales, f16 d):
   u the 6-bit codes (w + 32), unit g (16 values) s = d sc_g (b unused: -32 d sc_g) */
static void ia_decode_q6k(const uint8_t* row, int64_t K, uint8_t* u, float* s, float* b) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m3 = _mm256_set1_epi8(3);
    for (int64_t i = 0; i < K / 256; i++) {
        const uint8_t* blk = row + i * 210;
        for (int n = 0; n < 2; n++) {
            const __m256i A = _mm256_loadu_si256((const __m256i*)(blk + 64 * n));
            const __m256i B = _mm256_loadu_si256((const __m256i*)(blk + 64 * n + 32));
            const __m256i H = _mm256_loadu_si256((const __m256i*)(blk + 128 + 32 * n));
            /* fields masked per byte after each 16-bit shift: no bits cross bytes */
            uint8_t* uo = u + 256 * i + 128 * n;
            _mm256_storeu_si256((__m256i*)uo,
                                _mm256_or_si256(_mm256_and_si256(A, m4), _mm256_slli_epi16(_mm256_and_si256(H, m3), 4)));
            _mm256_storeu_si256((__m256i*)(uo + 32),
                                _mm256_or_si256(_mm256_and_si256(B, m4),
                                                _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(H, 2), m3), 4)));
            _mm256_storeu_si256((__m256i*)(uo + 64),
                                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(A, 4), m4),
                                                _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(H, 4), m3), 4)));
            _mm256_storeu_si256((__m256i*)(uo + 96),
                                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(B, 4), m4),
                                                _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(H, 6), m3), 4)));
        }
        const int8_t* sc = (const int8_t*)(blk + 192);
        const float d = ia_f16(blk + 208);
        for (int g = 0; g < 16; g++) {
            s[16 * i + g] = d * sc[g];
            b[16 * i + g] = -32.f * d * sc[g];
        }
    }
}

/* row r of a pass of R rows: bytes u (and Q8_0 sg) [K] -> quads wq (sq) [K / 4][R] */
static void ia_pack_row(int qtype, const uint8_t* u, const int8_t* sg, int64_t K, int R, int r, int32_t* wq,
                        int32_t* sq) {
    for (int64_t p = 0; p < K / 4; p++) memcpy(wq + p * R + r, u + 4 * p, 4);
    if (qtype == JQ8_0)
        for (int64_t p = 0; p < K / 4; p++) memcpy(sq + p * R + r, sg + 4 * p, 4);
}

/* one plane's integer dots of a unit of NQ quads: I [TG][R] = co + sum u q (Q8_0: sum |w| (q
   sign w)); wq / sq: the unit's quads [NQ][R]; xj: its first quad of group 0 (xstride apart per
   group), co its offsets (sstride apart) */
static inline __attribute__((always_inline)) void ia_dots(const int32_t* wq, const int32_t* sq, const int NQ,
                                                          const int TG, const int R, const int M,
                                                          const int32_t* xj, int64_t xstride, const int32_t* co,
                                                          int64_t sstride, __m256i I[IA_MAXG][IA_ROWS]) {
    const __m256i ones = _mm256_set1_epi16(1);
#pragma GCC unroll 8
    for (int g = 0; g < TG; g++) {
        const __m256i c = _mm256_loadu_si256((const __m256i*)(co + g * sstride));
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) I[g][r] = c;
    }
#pragma GCC unroll 8
    for (int p0 = 0; p0 < NQ; p0 += M) {
        __m256i a[IA_MAXG][IA_ROWS];
#pragma GCC unroll 8
        for (int p = p0; p < p0 + M; p++) {
            __m256i x[IA_MAXG];
#pragma GCC unroll 8
            for (int g = 0; g < TG; g++) x[g] = _mm256_loadu_si256((const __m256i*)(xj + g * xstride + 8 * p));
#pragma GCC unroll 8
            for (int r = 0; r < R; r++) {
                const __m256i wv = _mm256_set1_epi32(wq[p * R + r]);
                const __m256i sv = M == 1 ? _mm256_set1_epi32(sq[p * R + r]) : wv; /* Q8_0: the sign trick */
#pragma GCC unroll 8
                for (int g = 0; g < TG; g++) {
                    const __m256i m = _mm256_maddubs_epi16(wv, M == 1 ? _mm256_sign_epi8(x[g], sv) : x[g]);
                    /* vpaddsw never saturates here (the bound above) and, unlike vpaddw, is not
                       reassociated by gcc into trees that keep every product live */
                    a[g][r] = p == p0 ? m : _mm256_adds_epi16(a[g][r], m);
                }
            }
        }
#pragma GCC unroll 8
        for (int g = 0; g < TG; g++)
#pragma GCC unroll 8
            for (int r = 0; r < R; r++) I[g][r] = _mm256_add_epi32(I[g][r], _mm256_madd_epi16(a[g][r], ones));
    }
}

/* a pass's packed rows: quads wq / sq [K / 4][R], scales sc and offsets bo [nu][R] */
typedef struct {
    const int32_t *wq, *sq;
    const float *sc, *bo;
} IaRows;

/* the residual plane of a pass: codes xr (as xp), dx2 / co2 (as dxt / cot), fl [TG][nu]
   (fstride apart): whether a token of the group has residual codes in the unit */
typedef struct {
    const int32_t* xr;
    const float* dx2;
    const int32_t* co2;
    const uint8_t* fl;
    int64_t fstride;
} IaRes;

/* R rows against TG groups of 8 tokens: xp [TG][K / 4][8] quads (xstride apart), dxt / xst /
   cot [TG][nu][8] (sstride apart); sums [TG][R][8] */
static inline __attribute__((always_inline)) void ia_pass_core(const IaRows* rw, int asym, int64_t K, const int G,
                                                               const int TG, const int R, const int M,
                                                               const int32_t* xp, int64_t xstride, const float* dxt,
                                                               const float* xst, const int32_t* cot, int64_t sstride,
                                                               const IaRes* res, float* sums) {
    const int64_t nu = K / G;
    const int NQ = G / 4;
    __m256 P[IA_MAXG][IA_ROWS];
#pragma GCC unroll 8
    for (int g = 0; g < TG; g++)
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) P[g][r] = _mm256_setzero_ps();
    for (int64_t j = 0; j < nu; j++) {
        __m256i I[IA_MAXG][IA_ROWS];
        ia_dots(rw->wq + j * NQ * R, rw->sq + j * NQ * R, NQ, TG, R, M, xp + j * NQ * 8, xstride, cot + j * 8,
                sstride, I);
#pragma GCC unroll 8
        for (int g = 0; g < TG; g++) {
            const __m256 dx = _mm256_loadu_ps(dxt + g * sstride + j * 8);
#pragma GCC unroll 8
            for (int r = 0; r < R; r++)
                P[g][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(I[g][r]), _mm256_mul_ps(_mm256_set1_ps(rw->sc[j * R + r]), dx),
                                          P[g][r]);
        }
        /* a token without residual codes adds fma(0, ., P) = P (P is never -0): its bits do
           not depend on its neighbours */
        if (res->fl[j] || (TG == 2 && res->fl[res->fstride + j])) {
            /* the quads through pointers gcc cannot equate with the main plane's: else it keeps
               that plane's broadcasts for this rare branch, spilling them on every unit */
            const int32_t *wq2 = rw->wq, *sq2 = rw->sq;
            __asm__("" : "+r"(wq2), "+r"(sq2));
            ia_dots(wq2 + j * NQ * R, sq2 + j * NQ * R, NQ, TG, R, M, res->xr + j * NQ * 8, xstride,
                    res->co2 + j * 8, sstride, I);
#pragma GCC unroll 8
            for (int g = 0; g < TG; g++) {
                const __m256 dx2 = _mm256_loadu_ps(res->dx2 + g * sstride + j * 8);
#pragma GCC unroll 8
                for (int r = 0; r < R; r++)
                    P[g][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(I[g][r]),
                                              _mm256_mul_ps(_mm256_set1_ps(rw->sc[j * R + r]), dx2), P[g][r]);
            }
        }
        if (asym)
#pragma GCC unroll 8
            for (int g = 0; g < TG; g++) {
                const __m256 xs = _mm256_loadu_ps(xst + g * sstride + j * 8);
#pragma GCC unroll 8
                for (int r = 0; r < R; r++)
                    P[g][r] = _mm256_fmadd_ps(_mm256_set1_ps(rw->bo[j * R + r]), xs, P[g][r]);
            }
    }
#pragma GCC unroll 8
    for (int g = 0; g < TG; g++)
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) _mm256_storeu_ps(sums + 8 * (g * R + r), P[g][r]);
}

#define IA_PASS(G_, TG_, M_) \
    ia_pass_core(rw, asym, K, G_, TG_, IA_ROWS, M_, xp, xstride, dxt, xst, cot, sstride, res, sums)

/* ia_pass_core specialised per (G, M) of the types and 1 or 2 groups */
static void ia_pass(const IaRows* rw, int asym, int64_t K, int qtype, int TG, const int32_t* xp,
                    int64_t xstride, const float* dxt, const float* xst, const int32_t* cot,
                    int64_t sstride, const IaRes* res, float* sums) {
#define IA_PASS_TG(G_, M_)                    \
    if (IA_MAXG > 1 && TG == 2)               \
        IA_PASS(G_, IA_MAXG > 1 ? 2 : 1, M_); \
    else                                      \
        IA_PASS(G_, 1, M_)
    switch (ia_m(qtype)) {
        case 1: IA_PASS_TG(32, 1); return;
        case 2: IA_PASS_TG(16, 2); return;
        case 4: IA_PASS_TG(32, 4); return;
        default: IA_PASS_TG(32, 8); return;
    }
}

/* 4 rows x 8 tokens of sums [r][8] -> y [8 tokens][4 rows] (ldy apart):
   ((accumulate ? y : 0) + sum) + bias, bias NULL adding 0 */
static void ia_put4x8(const float* sums, int stride, float* y, int64_t ldy, const float* bias, int accumulate) {
    const __m256 r0 = _mm256_loadu_ps(sums), r1 = _mm256_loadu_ps(sums + stride);
    const __m256 r2 = _mm256_loadu_ps(sums + 2 * stride), r3 = _mm256_loadu_ps(sums + 3 * stride);
    const __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1);
    const __m256 t2 = _mm256_unpacklo_ps(r2, r3), t3 = _mm256_unpackhi_ps(r2, r3);
    /* token i (lane i of the rows) as 4 floats: tokens 0, 1, 4, 5 / 2, 3, 6, 7 in 128-bit halves */
    const __m256 a0 = _mm256_castpd_ps(_mm256_unpacklo_pd(_mm256_castps_pd(t0), _mm256_castps_pd(t2)));
    const __m256 a1 = _mm256_castpd_ps(_mm256_unpackhi_pd(_mm256_castps_pd(t0), _mm256_castps_pd(t2)));
    const __m256 a2 = _mm256_castpd_ps(_mm256_unpacklo_pd(_mm256_castps_pd(t1), _mm256_castps_pd(t3)));
    const __m256 a3 = _mm256_castpd_ps(_mm256_unpackhi_pd(_mm256_castps_pd(t1), _mm256_castps_pd(t3)));
    const __m128 tok[8] = {_mm256_castps256_ps128(a0), _mm256_castps256_ps128(a1), _mm256_castps256_ps128(a2),
                           _mm256_castps256_ps128(a3), _mm256_extractf128_ps(a0, 1), _mm256_extractf128_ps(a1, 1),
                           _mm256_extractf128_ps(a2, 1), _mm256_extractf128_ps(a3, 1)};
    const __m128 bv = bias ? _mm_loadu_ps(bias) : _mm_setzero_ps();
    for (int i = 0; i < 8; i++) {
        float* yo = y + i * ldy;
        const __m128 prev = accumulate ? _mm_loadu_ps(yo) : _mm_setzero_ps();
        _mm_storeu_ps(yo, _mm_add_ps(_mm_add_ps(prev, tok[i]), bv));
    }
}

/* packed activations of a call: groups of 8 tokens */
typedef struct {
    int qtype, G, asym, off;
    const uint8_t* w;
    int64_t N, K, row_bytes, T, ng, nu;
    int32_t *xp, *xr; /* [ng][K / 4][8] */
    float *dxt, *xst, *dx2t; /* [ng][nu][8] */
    int32_t *cot, *co2t;
    uint8_t* nzt; /* [T][nu] */
    uint8_t* flt; /* [ng][nu] */
    const float* x;
    int64_t ldx;
    const float* bias;
    float* y;
    int64_t ldy;
    int accumulate;
    int failed;
} IaJob;

/* tokens t0 .. t1 - 1: quantized into their group's lanes (loom_par_for's task) */
static void ia_quant_tokens(void* ctx, int64_t t0, int64_t t1, int worker) {
    (void)worker;
    IaJob* jb = ctx;
    const int64_t K = jb->K, nu = jb->nu;
    int8_t* q = malloc((size_t)(2 * K + 64));
    float* f = malloc(sizeof(float) * (size_t)(3 * nu + 3));
    int32_t* c = malloc(sizeof(int32_t) * (size_t)(2 * nu + 2));
    if (!q || !f || !c) {
        free(q);
        free(f);
        free(c);
        jb->failed = 1;
        return;
    }
    int8_t* q2 = q + K + 32;
    for (int64_t t = t0; t < t1; t++) {
        const int64_t g = t / 8, i = t % 8;
        const IaUnits o = {f, f + nu + 1, f + 2 * nu + 2, c, c + nu + 1, jb->nzt + t * nu};
        ia_quantize(jb->x + t * jb->ldx, K, jb->G, jb->off, q, q2, &o);
        int32_t* xo = jb->xp + g * (K / 4) * 8 + i;
        int32_t* xro = jb->xr + g * (K / 4) * 8 + i;
        for (int64_t p = 0; p < K / 4; p++) memcpy(xo + 8 * p, q + 4 * p, 4);
        for (int64_t j = 0; j < nu; j++) /* xr is zeroed: only units with residual codes */
            if (o.nz[j])
                for (int64_t p = j * jb->G / 4; p < (j + 1) * jb->G / 4; p++) memcpy(xro + 8 * p, q2 + 4 * p, 4);
        for (int64_t j = 0; j < nu; j++) {
            const int64_t at = (g * nu + j) * 8 + i;
            jb->dxt[at] = o.dx[j];
            jb->xst[at] = o.xs[j];
            jb->dx2t[at] = o.dx2[j];
            jb->cot[at] = o.co[j];
            jb->co2t[at] = o.co2[j];
        }
    }
    free(q);
    free(f);
    free(c);
}

/* row blocks i0 .. i1 - 1 of IA_BLOCK rows (loom_par_for's task) */
static void ia_blocks(void* ctx, int64_t i0, int64_t i1, int worker) {
    (void)worker;
    IaJob* jb = ctx;
    const int64_t K = jb->K, nu = jb->nu, T = jb->T;
    int32_t* wq = malloc(sizeof(int32_t) * (size_t)(IA_BLOCK * K / 4 + 16));
    int32_t* sq = malloc(sizeof(int32_t) * (size_t)(IA_BLOCK * K / 4 + 16));
    float* sd = malloc(sizeof(float) * (size_t)(2 * IA_BLOCK * nu + 16));
    float* sr = malloc(sizeof(float) * (size_t)(2 * nu + 16));
    uint8_t* ub = malloc((size_t)K + 64);
    int8_t* sgb = malloc((size_t)K + 64);
    void* held[] = {wq, sq, sd, sr, ub, sgb};
    const int nheld = (int)(sizeof held / sizeof *held);
    int ok = 1;
    for (int i = 0; i < nheld; i++) ok = ok && held[i];
    if (!ok) jb->failed = 1;
    for (int64_t blk = i0; ok && blk < i1; blk++) {
        const int64_t n0 = blk * IA_BLOCK;
        const int R = jb->N - n0 < IA_BLOCK ? (int)(jb->N - n0) : IA_BLOCK;
        /* pass q's rows: quads at wq + q (K / 4) IA_ROWS, scales then offsets at sd + 2 q nu
           IA_ROWS; a last pass's rows past R repeat the block's last row (computed, dropped) */
        for (int r = 0; r < (R + IA_ROWS - 1) / IA_ROWS * IA_ROWS; r++) {
            const int q = r / IA_ROWS, rr = r % IA_ROWS;
            if (r < R) { /* past R: the last row's bytes are still in ub / sgb and sr */
                const uint8_t* row = jb->w + (n0 + r) * jb->row_bytes;
                if (jb->qtype == JQ5_0 || jb->qtype == JQ5_1)
                    ia_decode_q5(jb->qtype == JQ5_1, row, K, ub, sr, sr + nu);
                else if (jb->qtype == JQ8_0)
                    ia_decode_q8(row, K, ub, sgb, sr, sr + nu);
                else if (jb->qtype == JQ4_0 || jb->qtype == JQ4_1)
                    ia_decode_q4(jb->qtype == JQ4_1, row, K, ub, sr, sr + nu);
                else if (jb->qtype == JQ4_K)
                    ia_decode_q4k(row, K, ub, sr, sr + nu);
                else
                    ia_decode_q6k(row, K, ub, sr, sr + nu);
            }
            ia_pack_row(jb->qtype, ub, sgb, K, IA_ROWS, rr, wq + (int64_t)q * (K / 4) * IA_ROWS,
                        sq + (int64_t)q * (K / 4) * IA_ROWS);
            float* sc = sd + (int64_t)q * 2 * nu * IA_ROWS;
            for (int64_t j = 0; j < nu; j++) {
                sc[j * IA_ROWS + rr] = sr[j];
                sc[nu * IA_ROWS + j * IA_ROWS + rr] = sr[nu + j];
            }
        }
        for (int64_t g0 = 0; g0 < jb->ng; g0 += IA_MAXG) {
            const int TG = jb->ng - g0 >= IA_MAXG ? IA_MAXG : (int)(jb->ng - g0);
            const IaRes res = {jb->xr + g0 * (K / 4) * 8, jb->dx2t + g0 * nu * 8, jb->co2t + g0 * nu * 8,
                               jb->flt + g0 * nu, nu};
            for (int r0 = 0; r0 < R; r0 += IA_ROWS) {
                const int RR = R - r0 < IA_ROWS ? R - r0 : IA_ROWS;
                const int q = r0 / IA_ROWS;
                const float* sc = sd + (int64_t)q * 2 * nu * IA_ROWS;
                const IaRows rw = {wq + (int64_t)q * (K / 4) * IA_ROWS, sq + (int64_t)q * (K / 4) * IA_ROWS, sc,
                                   sc + nu * IA_ROWS};
                float sums[IA_MAXG * IA_ROWS * 8];
                ia_pass(&rw, jb->asym, K, jb->qtype, TG, jb->xp + g0 * (K / 4) * 8, (K / 4) * 8, jb->dxt + g0 * nu * 8,
                        jb->xst + g0 * nu * 8, jb->cot + g0 * nu * 8, nu * 8, &res, sums);
                for (int g = 0; g < TG; g++) {
                    const int64_t t0 = (g0 + g) * 8;
                    if (IA_ROWS % 4 == 0 && RR == IA_ROWS && t0 + 8 <= T) {
                        for (int r = 0; r < IA_ROWS; r += 4)
                            ia_put4x8(sums + 8 * (g * IA_ROWS + r), 8, jb->y + t0 * jb->ldy + n0 + r0 + r, jb->ldy,
                                      jb->bias ? jb->bias + n0 + r0 + r : NULL, jb->accumulate);
                        continue;
                    }
                    for (int r = 0; r < RR; r++) {
                        const int64_t n = n0 + r0 + r;
                        const float bn = jb->bias ? jb->bias[n] : 0.f;
                        for (int i = 0; i < 8 && t0 + i < T; i++) {
                            float* yo = jb->y + (t0 + i) * jb->ldy + n;
                            *yo = (jb->accumulate ? *yo : 0.f) + sums[8 * (g * IA_ROWS + r) + i] + bn;
                        }
                    }
                }
            }
        }
    }
    for (int i = 0; i < nheld; i++) free(held[i]);
}

/* the reference (loom_q_i8_avx2 = 0): the same arithmetic in scalar C, one row and token at a
   time, I = sum w q over the int16 codes (one thread) */
static int ia_ref(int qtype, const uint8_t* w, int64_t N, int64_t K, int64_t row_bytes, const float* x,
                  int64_t T, int64_t ldx, const float* bias, float* y, int64_t ldy, int accumulate) {
    const int G = q_unit_len(qtype), asym = q_is_asym(qtype);
    const int64_t nu = K / G;
    int8_t* q = malloc((size_t)(T * K));
    int8_t* q2 = malloc((size_t)(T * K));
    float* f = malloc(sizeof(float) * (size_t)(T * 3 * nu + 3 * nu));
    int32_t* c = malloc(sizeof(int32_t) * (size_t)(2 * nu));
    uint8_t* nz = malloc((size_t)nu);
    int16_t* wd = malloc(sizeof(int16_t) * (size_t)K);
    uint8_t* scratch = malloc((size_t)K + 64);
    float* s16 = malloc(sizeof(float) * (size_t)(K / 16 + 1));
    float* b16 = malloc(sizeof(float) * (size_t)(K / 16 + 1));
    void* held[] = {q, q2, f, c, nz, wd, scratch, s16, b16};
    const int nheld = (int)(sizeof held / sizeof *held);
    int ok = 1;
    for (int i = 0; i < nheld; i++) ok = ok && held[i];
    float* sd = f + T * 3 * nu;
    float* bd = sd + nu;
    for (int64_t t = 0; ok && t < T; t++) {
        float* ft = f + t * 3 * nu;
        const IaUnits o = {ft, ft + nu, ft + 2 * nu, c, c + nu, nz};
        ia_quantize_c(x + t * ldx, K, G, 0, q + t * K, q2 + t * K, &o);
    }
    for (int64_t n = 0; ok && n < N; n++) {
        loom_q_decode_row16(qtype, w + n * row_bytes, K, wd, sd, bd, scratch, s16, b16);
        for (int64_t t = 0; t < T; t++) {
            const float *dx = f + t * 3 * nu, *dx2 = dx + nu, *xs = dx + 2 * nu;
            float P = 0.f;
            for (int64_t j = 0; j < nu; j++) {
                int32_t I = 0, I2 = 0;
                for (int k = 0; k < G; k++) {
                    I += (int32_t)wd[j * G + k] * q[t * K + j * G + k];
                    I2 += (int32_t)wd[j * G + k] * q2[t * K + j * G + k];
                }
                P = fmaf((float)I, sd[j] * dx[j], P);
                P = fmaf((float)I2, sd[j] * dx2[j], P);
                if (asym) P = fmaf(bd[j], xs[j], P);
            }
            float* yo = y + t * ldy + n;
            *yo = (accumulate ? *yo : 0.f) + P + (bias ? bias[n] : 0.f);
        }
    }
    for (int i = 0; i < nheld; i++) free(held[i]);
    return ok ? 0 : -2;
}

int loom_q_matmul_i8_avx2(int qtype, const uint8_t* w, int64_t N, int64_t K, int64_t row_bytes,
                          const float* x, int64_t T, int64_t ldx, const float* bias, float* y,
                          int64_t ldy, int accumulate, int threads) {
    if (qtype < JQ8_0 || qtype > JQ5_1 || K % 32 || ((qtype == JQ4_K || qtype == JQ6_K) && K % 256)) return -1;
    if (!loom_q_i8_avx2) return ia_ref(qtype, w, N, K, row_bytes, x, T, ldx, bias, y, ldy, accumulate);
    const int G = q_unit_len(qtype);
    const int64_t nu = K / G, ng = (T + 7) / 8;
    /* zeroed: the last group's lanes past T hold zero codes and scales */
    IaJob jb = {qtype, G, q_is_asym(qtype), ia_offset(qtype), w, N, K, row_bytes, T, ng, nu};
    jb.xp = calloc((size_t)(ng * (K / 4) * 8 + 8), sizeof(int32_t));
    jb.xr = calloc((size_t)(ng * (K / 4) * 8 + 8), sizeof(int32_t));
    jb.dxt = calloc((size_t)(ng * nu * 8 + 8), sizeof(float));
    jb.xst = calloc((size_t)(ng * nu * 8 + 8), sizeof(float));
    jb.dx2t = calloc((size_t)(ng * nu * 8 + 8), sizeof(float));
    jb.cot = calloc((size_t)(ng * nu * 8 + 8), sizeof(int32_t));
    jb.co2t = calloc((size_t)(ng * nu * 8 + 8), sizeof(int32_t));
    jb.nzt = calloc((size_t)(T * nu + 8), 1);
    jb.flt = calloc((size_t)(ng * nu + 8), 1);
    void* held[] = {jb.xp, jb.xr, jb.dxt, jb.xst, jb.dx2t, jb.cot, jb.co2t, jb.nzt, jb.flt};
    const int nheld = (int)(sizeof held / sizeof *held);
    int ok = 1;
    for (int i = 0; i < nheld; i++) ok = ok && held[i];
    if (threads < 1) threads = 1;
    jb.x = x;
    jb.ldx = ldx;
    jb.bias = bias;
    jb.y = y;
    jb.ldy = ldy;
    jb.accumulate = accumulate;
    if (ok) loom_par_for(threads, T, par_chunk(T, threads), ia_quant_tokens, &jb);
    if (ok && !jb.failed) {
        for (int64_t g = 0; g < ng; g++) /* a group's unit has a residual plane if a token does */
            for (int64_t t = 8 * g; t < T && t < 8 * g + 8; t++)
                for (int64_t j = 0; j < nu; j++) jb.flt[g * nu + j] |= jb.nzt[t * nu + j];
        const int64_t nblocks = (N + IA_BLOCK - 1) / IA_BLOCK;
        loom_par_for(threads, nblocks, par_chunk(nblocks, threads), ia_blocks, &jb);
    }
    for (int i = 0; i < nheld; i++) free(held[i]);
    return !ok || jb.failed ? -2 : 0;
}

#else

int loom_q_matmul_i8_avx2(int qtype, const uint8_t* w, int64_t N, int64_t K, int64_t row_bytes,
                          const float* x, int64_t T, int64_t ldx, const float* bias, float* y,
                          int64_t ldy, int accumulate, int threads) {
    (void)qtype, (void)w, (void)N, (void)K, (void)row_bytes, (void)x, (void)T, (void)ldx;
    (void)bias, (void)y, (void)ldy, (void)accumulate, (void)threads;
    return -1;
}

#endif
