/* Batch-invariant matmul on ggml block-quantized weights: quant.c's mode LOOM_Q_BI (3).

   Why: the other modes switch arithmetic by token count (16-bit integer dots up to 8 tokens, an
   f32 GEMM above), so one token's logits depended on how many tokens shared its forward, and
   greedy speculation on a quantized target could differ from speculation off. Here every token
   gets one arithmetic, defined per (row n, token t) below, whatever T, the thread count or the
   kernel that runs it: a single-token GEMV (T <= BI_GEMV_MAX, lanes = units of one row) and a
   multi-token tile (lanes = 16 tokens, 4 rows a pass, each weight unit decoded once per call and
   used by every token) compute it bit for bit.

   The arithmetic ("canonical"):
   - activations: per block of 32 values, dx = max|x| / 32512 and codes q = round(x / dx) in
     [-32512, 32512] (int16; quant.c's quantize_act16 codes: the accuracy of its 16-bit mode);
   - weights: a row decodes to int16 codes w and per unit (G = 32 values, Q6_K: 16) a scale s and,
     for the types with a free minimum (Q4_1, Q5_1, Q4_K), an offset b; the other types' offset is
     folded into signed codes (w = u - 128 / 8 / 16 / 32 for Q8_0 / Q4_0 / Q5_0 / Q6_K);
   - unit j: I_j = sum w q, an exact int32 (|I| <= 32 * 128 * 32512 < 2^31), in any order;
   - 16 f32 partials P[c] (c = j mod 16), each over its units in increasing j, from +0:
       P[c] = fma((float) I_j, s_j * dx_j, P[c]);   asym: P[c] = fma(b_j, xs_j, P[c])
     with xs_j = dx_j * (float) (sum of the unit's q);
   - a fixed tree: P[c] + P[c + 8], then + [c + 4], then + [c + 2], then the two halves;
   - y = (accumulate ? y : 0) + sum + bias.
   Integer sums are exact, so only the float steps above fix the bits; the GEMV runs them on a
   zmm of 16 units (lane c = P[c]), the tile on 16 vectors of 16 tokens, the portable C on
   scalars with fmaf, each the same operations on the same values. */

#include "loom_cpu.h"

#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define BI_AVX512 1
#else
#define BI_AVX512 0
#endif

enum { BQ8_0 = 0, BQ4_0 = 1, BQ4_1 = 2, BQ4_K = 3, BQ6_K = 4, BQ5_0 = 5, BQ5_1 = 6 };

#define BI_GEMV_MAX 4 /* tokens up to which the GEMV runs (more: the tile, whose 16 lanes at 5-8 tokens are
                        still faster: bench_quant_tile.py) */
#define BI_ROWS 4 /* rows of one tile pass */
#define BI_ROWS8 8 /* rows of one pass of the 8-token tile */
#define BI_TOK 16 /* tokens of one tile pass (the lanes of a zmm) */
#define BI_BLOCK 32 /* rows decoded at once for the 16-token tile: each pair of token groups
                       (32 tokens' codes, <= 98 KB at K = 1536) is read from L1 / L2 by all of
                       the block's row passes, so a long prefill streams its activations once
                       per block, not once per 4 rows */
#define BI_Q 32512


/* a block's f16 scale: F16C's conversion inlined where the build has it (exact either way, so
   the same value as quant.c's loom_q_f16, which is a call into another unit per block) */
static inline float bi_f16(const uint8_t* p) {
#if defined(__F16C__)
    uint16_t v;
    memcpy(&v, p, 2);
    return _cvtsh_ss(v);
#else
    return loom_q_f16(p);
#endif
}

/* One row -> int16 codes w [K], scale s and offset b per unit (b unused for symmetric types).
   u, s16, b16: scratch of K bytes and K / 16 floats for quant.c's generic decoder. */
static void bi_decode_row(int qtype, const uint8_t* row, int64_t K, int16_t* w, float* s,
                          float* b, uint8_t* u, float* s16, float* b16) {
    const int G = q_unit_len(qtype);
    const int64_t nu = K / G;
    if (qtype == BQ4_0 || qtype == BQ4_1 || qtype == BQ8_0) {
        const int bb = qtype == BQ8_0 ? 34 : qtype == BQ4_0 ? 18 : 20;
        for (int64_t i = 0; i < nu; i++) {
            const uint8_t* blk = row + i * bb;
            const float d = bi_f16(blk);
            s[i] = d;
            int16_t* wo = w + 32 * i;
            if (qtype == BQ8_0) {
#if BI_AVX512
                _mm512_storeu_si512((void*)wo, _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(blk + 2))));
#else
                for (int j = 0; j < 32; j++) wo[j] = (int8_t)blk[2 + j];
#endif
                b[i] = 0.f;
            } else {
                const uint8_t* qs = blk + (qtype == BQ4_1 ? 4 : 2);
                const int c = qtype == BQ4_0 ? 8 : 0;
#if BI_AVX512
                const __m128i q = _mm_loadu_si128((const __m128i*)qs), low = _mm_set1_epi8(0x0F);
                const __m256i nib = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), low),
                                                     _mm_and_si128(q, low));
                _mm512_storeu_si512((void*)wo, _mm512_sub_epi16(_mm512_cvtepu8_epi16(nib), _mm512_set1_epi16((short)c)));
#else
                for (int j = 0; j < 16; j++) {
                    wo[j] = (int16_t)((qs[j] & 0xF) - c);
                    wo[j + 16] = (int16_t)((qs[j] >> 4) - c);
                }
#endif
                b[i] = qtype == BQ4_1 ? bi_f16(blk + 2) : 0.f;
            }
        }
        return;
    }
#if BI_AVX512
    /* Q5_x / Q4_K / Q6_K in registers: the same codes, scales and offsets as quant.c's generic
       decoder (below, the portable build's path), which costs ~4x more per value and is paid
       once per row per call by the tiles (T > 8: prefill, batch 32) */
    if (qtype == BQ5_0 || qtype == BQ5_1) {
        const int q51 = qtype == BQ5_1, bb = q51 ? 24 : 22;
        const __m128i low = _mm_set1_epi8(0x0F);
        const __m512i sixteen = _mm512_set1_epi16(16), off = _mm512_set1_epi16(q51 ? 0 : 16);
        for (int64_t i = 0; i < nu; i++) {
            const uint8_t* blk = row + i * bb;
            const float d = bi_f16(blk);
            uint32_t qh;
            memcpy(&qh, blk + (q51 ? 4 : 2), 4);
            const __m128i q = _mm_loadu_si128((const __m128i*)(blk + (q51 ? 8 : 6)));
            const __m256i nib = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), low), _mm_and_si128(q, low));
            __m512i v = _mm512_cvtepu8_epi16(nib); /* value j: bit j of qh adds 16 */
            v = _mm512_mask_add_epi16(v, (__mmask32)qh, v, sixteen);
            _mm512_storeu_si512((void*)(w + 32 * i), _mm512_sub_epi16(v, off));
            s[i] = d;
            b[i] = q51 ? bi_f16(blk + 2) : -16.f * d;
        }
        return;
    }
    if (qtype == BQ4_K) { /* 144 bytes: f16 d, f16 dmin, 12 bytes of 6-bit scales / mins, 128 of codes */
        const __m512i m4 = _mm512_set1_epi16(0xF);
        for (int64_t i = 0; i < K / 256; i++) {
            const uint8_t* blk = row + i * 144;
            const float d = bi_f16(blk), dmin = bi_f16(blk + 2);
            const uint8_t* q = blk + 4;
            for (int c = 0; c < 4; c++) { /* 32 bytes: sub-block 2c low nibbles, 2c + 1 high */
                const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(blk + 16 + 32 * c)));
                _mm512_storeu_si512((void*)(w + 256 * i + 64 * c), _mm512_and_si512(v, m4));
                _mm512_storeu_si512((void*)(w + 256 * i + 64 * c + 32), _mm512_srli_epi16(v, 4));
            }
            for (int j = 0; j < 8; j++) {
                uint8_t sc, mn;
                k4_scale_min(j, q, &sc, &mn);
                s[8 * i + j] = d * sc;
                b[8 * i + j] = -dmin * mn;
            }
        }
        return;
    }
    if (qtype == BQ6_K) { /* 210 bytes: 128 low nibbles, 64 bytes of 2-bit highs, 16 int8 scales, f16 d */
        const __m256i m4 = _mm256_set1_epi8(0xF), m3 = _mm256_set1_epi8(3);
        const __m512i c32 = _mm512_set1_epi16(32);
        for (int64_t i = 0; i < K / 256; i++) {
            const uint8_t* blk = row + i * 210;
            for (int n = 0; n < 2; n++) {
                const __m256i A = _mm256_loadu_si256((const __m256i*)(blk + 64 * n));
                const __m256i B = _mm256_loadu_si256((const __m256i*)(blk + 64 * n + 32));
                const __m256i H = _mm256_loadu_si256((const __m256i*)(blk + 128 + 32 * n));
                /* 2-bit fields are masked per byte before the 16-bit shifts, so no bits cross bytes */
                const __m256i v[4] = {
                    _mm256_or_si256(_mm256_and_si256(A, m4), _mm256_slli_epi16(_mm256_and_si256(H, m3), 4)),
                    _mm256_or_si256(_mm256_and_si256(B, m4), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(H, 2), m3), 4)),
                    _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(A, 4), m4), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(H, 4), m3), 4)),
                    _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(B, 4), m4), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(H, 6), m3), 4))};
                for (int k = 0; k < 4; k++)
                    _mm512_storeu_si512((void*)(w + 256 * i + 128 * n + 32 * k), _mm512_sub_epi16(_mm512_cvtepu8_epi16(v[k]), c32));
            }
            const int8_t* sc = (const int8_t*)(blk + 192);
            const float d = bi_f16(blk + 208);
            for (int g = 0; g < 16; g++) {
                s[16 * i + g] = d * sc[g];
                b[16 * i + g] = -32.f * d * sc[g];
            }
        }
        return;
    }
#endif
    loom_q_decode_row(qtype, row, K, u, s16, b16);
    const int c = q_sym_offset(qtype);
    for (int64_t k = 0; k < K; k++) w[k] = (int16_t)((int)u[k] - c);
    for (int64_t j = 0; j < nu; j++) {
        s[j] = s16[j * G / 16];
        b[j] = b16[j * G / 16];
    }
}

/* bi_decode_row for quant_i8.c (its arguments) */
void loom_q_decode_row16(int qtype, const uint8_t* row, int64_t K, int16_t* w, float* s, float* b,
                         uint8_t* u, float* s16, float* b16) {
    bi_decode_row(qtype, row, K, w, s, b, u, s16, b16);
}

/* Token x [K] -> codes q [K], and per unit dx (its block's scale) and xs = dx * sum of q.
   Rounding: sign(v) * floor(|v| + 0.5) in f32, v = x * (1 / dx) (quant_ref.quantize_act16_ref's
   steps), the same in the AVX-512 and the portable code. */
static void bi_quantize(const float* x, int64_t K, int G, int16_t* q, float* dxu, float* xsu) {
    for (int64_t k0 = 0; k0 < K; k0 += 32) {
        const float* xb = x + k0;
        int sum[2] = {0, 0};
        float dd;
#if BI_AVX512
        const __m512 a0 = _mm512_loadu_ps(xb), a1 = _mm512_loadu_ps(xb + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a0), _mm512_abs_ps(a1)));
        dd = amax / (float)BI_Q;
        const __m512 inv = _mm512_set1_ps(dd > 0 ? 1.f / dd : 0.f), half = _mm512_set1_ps(0.5f);
        const __m512 lim = _mm512_set1_ps((float)BI_Q);
        __m512i qi[2];
        for (int h = 0; h < 2; h++) {
            const __m512 v = _mm512_mul_ps(h ? a1 : a0, inv);
            const __m512 r = _mm512_min_ps(_mm512_roundscale_ps(_mm512_add_ps(_mm512_abs_ps(v), half),
                                                                _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC),
                                           lim);
            const __m512i m = _mm512_cvttps_epi32(r);
            const __mmask16 neg = _mm512_cmplt_ps_mask(v, _mm512_setzero_ps());
            qi[h] = _mm512_mask_sub_epi32(m, neg, _mm512_setzero_si512(), m);
            _mm256_storeu_si256((__m256i*)(q + k0 + 16 * h), _mm512_cvtepi32_epi16(qi[h]));
            sum[h] = _mm512_reduce_add_epi32(qi[h]);
        }
#else
        float amax = 0.f;
        for (int j = 0; j < 32; j++) {
            const float a = xb[j] < 0 ? -xb[j] : xb[j];
            amax = a > amax ? a : amax;
        }
        dd = amax / (float)BI_Q;
        const float inv = dd > 0 ? 1.f / dd : 0.f;
        for (int j = 0; j < 32; j++) {
            const float v = xb[j] * inv;
            float r = floorf((v < 0 ? -v : v) + 0.5f);
            r = r < (float)BI_Q ? r : (float)BI_Q;
            const int c = v < 0 ? -(int)r : (int)r;
            q[k0 + j] = (int16_t)c;
            sum[j / 16] += c;
        }
#endif
        if (G == 32) {
            dxu[k0 / 32] = dd;
            xsu[k0 / 32] = dd * (float)(sum[0] + sum[1]);
        } else {
            dxu[k0 / 16] = dxu[k0 / 16 + 1] = dd;
            xsu[k0 / 16] = dd * (float)sum[0];
            xsu[k0 / 16 + 1] = dd * (float)sum[1];
        }
    }
}

/* bi_quantize for quant_bi2.c's AVX2 lanes kernel (its arguments) */
void loom_q_bi_quantize(const float* x, int64_t K, int G, int16_t* q, float* dxu, float* xsu) {
    bi_quantize(x, K, G, q, dxu, xsu);
}

static inline int32_t bi_pair(const int16_t* q, int a, int b) {
    return (int32_t)((uint32_t)(uint16_t)q[a] | (uint32_t)(uint16_t)q[b] << 16);
}

/* one token's codes q [K] -> xp [K / 32][16] pairs in the order of the lanes kernels (below,
   "The pair order inside a unit"; quant_bi2.c's AVX2 lanes use the same) */
static void bi_pack_pairs(int qtype, const int16_t* q, int64_t K, int32_t* xp) {
    for (int64_t j = 0; j < K / 32; j++) {
        const int16_t* qj = q + 32 * j;
        int32_t* o = xp + 16 * j;
        if (qtype == BQ8_0) {
            for (int m = 0; m < 8; m++) {
                o[2 * m] = bi_pair(qj, 4 * m, 4 * m + 2);
                o[2 * m + 1] = bi_pair(qj, 4 * m + 1, 4 * m + 3);
            }
        } else {
            for (int m = 0; m < 4; m++) {
                o[4 * m] = bi_pair(qj, 4 * m, 4 * m + 2);
                o[4 * m + 1] = bi_pair(qj, 4 * m + 16, 4 * m + 18);
                o[4 * m + 2] = bi_pair(qj, 4 * m + 1, 4 * m + 3);
                o[4 * m + 3] = bi_pair(qj, 4 * m + 17, 4 * m + 19);
            }
        }
    }
}

/* bi_pack_pairs for quant_bi2.c (its arguments) */
void loom_q_bi_pack_pairs(int qtype, const int16_t* q, int64_t K, int32_t* xp) {
    bi_pack_pairs(qtype, q, K, xp);
}

#if !BI_AVX512
/* the canonical tree over 16 partials (scalar form) */
static inline float bi_tree(const float* P) {
    float l1[8], l2[4];
    for (int c = 0; c < 8; c++) l1[c] = P[c] + P[c + 8];
    for (int c = 0; c < 4; c++) l2[c] = l1[c] + l1[c + 4];
    return (l2[0] + l2[2]) + (l2[1] + l2[3]);
}
#endif

#if BI_AVX512
/* 16 vectors of 16 int32 -> one vector whose lane c is the sum of v[c]'s lanes */
static inline __m512i bi_reduce16(const __m512i* v) {
    __m512i a[8], u[4], z[2];
    for (int k = 0; k < 8; k++)
        a[k] = _mm512_add_epi32(_mm512_unpacklo_epi32(v[2 * k], v[2 * k + 1]),
                                _mm512_unpackhi_epi32(v[2 * k], v[2 * k + 1]));
    for (int k = 0; k < 4; k++)
        u[k] = _mm512_add_epi32(_mm512_unpacklo_epi64(a[2 * k], a[2 * k + 1]),
                                _mm512_unpackhi_epi64(a[2 * k], a[2 * k + 1]));
    /* u[m], 128-bit chunk h, lane i: chunk h's sum of v[4m + i] */
    for (int k = 0; k < 2; k++)
        z[k] = _mm512_add_epi32(_mm512_shuffle_i32x4(u[2 * k], u[2 * k + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                                _mm512_shuffle_i32x4(u[2 * k], u[2 * k + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_epi32(_mm512_shuffle_i32x4(z[0], z[1], _MM_SHUFFLE(2, 0, 2, 0)),
                            _mm512_shuffle_i32x4(z[0], z[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

/* the canonical tree over the 16 lanes of P */
static inline float bi_tree512(__m512 P) {
    const __m256 l1 = _mm256_add_ps(_mm512_castps512_ps256(P), _mm512_extractf32x8_ps(P, 1));
    const __m128 l2 = _mm_add_ps(_mm256_castps256_ps128(l1), _mm256_extractf128_ps(l1, 1));
    const __m128 l3 = _mm_add_ps(l2, _mm_movehl_ps(l2, l2));
    return _mm_cvtss_f32(_mm_add_ss(l3, _mm_shuffle_ps(l3, l3, 1)));
}

/* one decoded row against T <= BI_GEMV_MAX tokens (codes q [T, K], dxu / xsu [T, nu]) */
static void bi_gemv(const int16_t* w, const float* s, const float* b, int asym, int64_t K, int G,
                    int64_t T, const int16_t* q, const float* dxu, const float* xsu, float* out) {
    const int64_t nu = K / G;
    const __mmask32 wm = G == 32 ? 0xFFFFFFFFu : 0xFFFFu;
    __m512 P[BI_GEMV_MAX];
    for (int64_t t = 0; t < T; t++) P[t] = _mm512_setzero_ps();
    for (int64_t j0 = 0; j0 < nu; j0 += 16) {
        const int n = nu - j0 < 16 ? (int)(nu - j0) : 16;
        const __mmask16 m = (__mmask16)((1u << n) - 1);
        __m512i wv[16];
        for (int c = 0; c < 16; c++)
            wv[c] = c < n ? _mm512_maskz_loadu_epi16(wm, w + (j0 + c) * G) : _mm512_setzero_si512();
        const __m512 sv = _mm512_maskz_loadu_ps(m, s + j0);
        const __m512 bv = asym ? _mm512_maskz_loadu_ps(m, b + j0) : _mm512_setzero_ps();
        for (int64_t t = 0; t < T; t++) {
            const int16_t* qt = q + t * K + j0 * G;
            __m512i v[16];
            for (int c = 0; c < 16; c++)
                v[c] = c < n ? _mm512_dpwssd_epi32(_mm512_setzero_si512(), wv[c],
                                                   _mm512_maskz_loadu_epi16(wm, qt + c * G))
                             : _mm512_setzero_si512();
            const __m512i I = bi_reduce16(v);
            const __m512 sd = _mm512_mul_ps(sv, _mm512_maskz_loadu_ps(m, dxu + t * nu + j0));
            P[t] = _mm512_mask3_fmadd_ps(_mm512_cvtepi32_ps(I), sd, P[t], m);
            if (asym)
                P[t] = _mm512_mask3_fmadd_ps(bv, _mm512_maskz_loadu_ps(m, xsu + t * nu + j0), P[t], m);
        }
    }
    for (int64_t t = 0; t < T; t++) out[t] = bi_tree512(P[t]);
}

/* BI_ROWS decoded rows against TG groups of 16 tokens (G values a unit, TG: compile-time
   constants where inlined): xp [TG][K / 2][16] int16 pairs, xstride apart; dxt / xst [TG][nu][16],
   sstride apart; sums [TG][BI_ROWS][16]. Each pair of a unit: TG activation loads, BI_ROWS
   weight broadcasts, TG * BI_ROWS vpdpwssd. */
static inline __attribute__((always_inline)) void bi_tile_core(
    const int16_t* const* w, const float* const* s, const float* const* b, int asym, int64_t K,
    const int G, const int TG, const int32_t* xp, int64_t xstride, const float* dxt,
    const float* xst, int64_t sstride, float* sums) {
    const int64_t nu = K / G;
    __m512 Pb[2][BI_ROWS][16];
    for (int c = 0; c < 16; c++) {
        __m512 Pc[2][BI_ROWS];
        for (int g = 0; g < TG; g++)
            for (int r = 0; r < BI_ROWS; r++) Pc[g][r] = _mm512_setzero_ps();
        for (int64_t j = c; j < nu; j += 16) {
            /* two accumulator sets (even / odd pairs): 16 independent vpdpwssd chains */
            __m512i acc[2][BI_ROWS], acc2[2][BI_ROWS];
            for (int g = 0; g < TG; g++)
                for (int r = 0; r < BI_ROWS; r++) acc[g][r] = acc2[g][r] = _mm512_setzero_si512();
            const int32_t* xj = xp + j * G / 2 * 16;
            const int16_t* wj[BI_ROWS];
            for (int r = 0; r < BI_ROWS; r++) wj[r] = w[r] + j * G;
#pragma GCC unroll 8
            for (int p = 0; p < G / 2; p += 2) {
                __m512i x[2], x2[2];
                for (int g = 0; g < TG; g++) {
                    x[g] = _mm512_loadu_si512((const void*)(xj + g * xstride + 16 * p));
                    x2[g] = _mm512_loadu_si512((const void*)(xj + g * xstride + 16 * p + 16));
                }
                for (int r = 0; r < BI_ROWS; r++) {
                    int32_t pair, pair2;
                    memcpy(&pair, wj[r] + 2 * p, 4);
                    memcpy(&pair2, wj[r] + 2 * p + 2, 4);
                    const __m512i wv = _mm512_set1_epi32(pair), wv2 = _mm512_set1_epi32(pair2);
                    for (int g = 0; g < TG; g++) {
                        acc[g][r] = _mm512_dpwssd_epi32(acc[g][r], wv, x[g]);
                        acc2[g][r] = _mm512_dpwssd_epi32(acc2[g][r], wv2, x2[g]);
                    }
                }
            }
            for (int g = 0; g < TG; g++)
                for (int r = 0; r < BI_ROWS; r++) acc[g][r] = _mm512_add_epi32(acc[g][r], acc2[g][r]);
            for (int g = 0; g < TG; g++) {
                const __m512 dx = _mm512_loadu_ps(dxt + g * sstride + j * 16);
                const __m512 xs = asym ? _mm512_loadu_ps(xst + g * sstride + j * 16) : _mm512_setzero_ps();
                for (int r = 0; r < BI_ROWS; r++) {
                    const __m512 sd = _mm512_mul_ps(_mm512_set1_ps(s[r][j]), dx);
                    Pc[g][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[g][r]), sd, Pc[g][r]);
                    if (asym) Pc[g][r] = _mm512_fmadd_ps(_mm512_set1_ps(b[r][j]), xs, Pc[g][r]);
                }
            }
        }
        for (int g = 0; g < TG; g++)
            for (int r = 0; r < BI_ROWS; r++) Pb[g][r][c] = Pc[g][r];
    }
    for (int g = 0; g < TG; g++)
        for (int r = 0; r < BI_ROWS; r++) {
            __m512 l1[8], l2[4];
            for (int c = 0; c < 8; c++) l1[c] = _mm512_add_ps(Pb[g][r][c], Pb[g][r][c + 8]);
            for (int c = 0; c < 4; c++) l2[c] = _mm512_add_ps(l1[c], l1[c + 4]);
            _mm512_storeu_ps(sums + 16 * (g * BI_ROWS + r),
                             _mm512_add_ps(_mm512_add_ps(l2[0], l2[2]), _mm512_add_ps(l2[1], l2[3])));
        }
}

/* 5..8 tokens: BI_ROWS8 rows against 8 token lanes (ymm), so no lane idles: xp [K / 2][8]
   int16 pairs, dxt / xst [nu][8]; sums [BI_ROWS8][8]. The same per-lane steps as the tile. */
static inline __attribute__((always_inline)) void bi_tile8_core(
    const int16_t* const* w, const float* const* s, const float* const* b, int asym, int64_t K,
    const int G, const int32_t* xp, const float* dxt, const float* xst, float* sums) {
    const int64_t nu = K / G;
    __m256 Pb[BI_ROWS8][16];
    for (int c = 0; c < 16; c++) {
        __m256 Pc[BI_ROWS8];
        for (int r = 0; r < BI_ROWS8; r++) Pc[r] = _mm256_setzero_ps();
        for (int64_t j = c; j < nu; j += 16) {
            __m256i acc[BI_ROWS8], acc2[BI_ROWS8];
            for (int r = 0; r < BI_ROWS8; r++) acc[r] = acc2[r] = _mm256_setzero_si256();
            const int32_t* xj = xp + j * G / 2 * 8;
#pragma GCC unroll 8
            for (int p = 0; p < G / 2; p += 2) {
                const __m256i x = _mm256_loadu_si256((const __m256i*)(xj + 8 * p));
                const __m256i x2 = _mm256_loadu_si256((const __m256i*)(xj + 8 * p + 8));
                for (int r = 0; r < BI_ROWS8; r++) {
                    int32_t pair, pair2;
                    memcpy(&pair, w[r] + j * G + 2 * p, 4);
                    memcpy(&pair2, w[r] + j * G + 2 * p + 2, 4);
                    acc[r] = _mm256_dpwssd_epi32(acc[r], _mm256_set1_epi32(pair), x);
                    acc2[r] = _mm256_dpwssd_epi32(acc2[r], _mm256_set1_epi32(pair2), x2);
                }
            }
            const __m256 dx = _mm256_loadu_ps(dxt + j * 8);
            const __m256 xs = asym ? _mm256_loadu_ps(xst + j * 8) : _mm256_setzero_ps();
            for (int r = 0; r < BI_ROWS8; r++) {
                const __m256 sd = _mm256_mul_ps(_mm256_set1_ps(s[r][j]), dx);
                Pc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(acc[r], acc2[r])), sd, Pc[r]);
                if (asym) Pc[r] = _mm256_fmadd_ps(_mm256_set1_ps(b[r][j]), xs, Pc[r]);
            }
        }
        for (int r = 0; r < BI_ROWS8; r++) Pb[r][c] = Pc[r];
    }
    for (int r = 0; r < BI_ROWS8; r++) {
        __m256 l1[8], l2[4];
        for (int c = 0; c < 8; c++) l1[c] = _mm256_add_ps(Pb[r][c], Pb[r][c + 8]);
        for (int c = 0; c < 4; c++) l2[c] = _mm256_add_ps(l1[c], l1[c + 4]);
        _mm256_storeu_ps(sums + 8 * r, _mm256_add_ps(_mm256_add_ps(l2[0], l2[2]), _mm256_add_ps(l2[1], l2[3])));
    }
}

static void bi_tile8(const int16_t* const* w, const float* const* s, const float* const* b,
                     int asym, int64_t K, int G, const int32_t* xp, const float* dxt,
                     const float* xst, float* sums) {
    if (G == 32)
        bi_tile8_core(w, s, b, asym, K, 32, xp, dxt, xst, sums);
    else
        bi_tile8_core(w, s, b, asym, K, 16, xp, dxt, xst, sums);
}

/* A tile's 4 rows x 16 tokens of sums ([4][16]) into y: token i's four outputs y[i * ldy ..
   + 3] = ((accumulate ? y : 0) + sum) + bias, the float steps of the scalar store below, as
   one 4-wide store per token (a 4 x 16 transpose in registers). */
static inline void bi_put4x16(const float* sums, float* y, int64_t ldy, const float* bias,
                              int accumulate) {
    const __m512 r0 = _mm512_loadu_ps(sums), r1 = _mm512_loadu_ps(sums + 16);
    const __m512 r2 = _mm512_loadu_ps(sums + 32), r3 = _mm512_loadu_ps(sums + 48);
    const __m512 t0 = _mm512_unpacklo_ps(r0, r1), t1 = _mm512_unpackhi_ps(r0, r1);
    const __m512 t2 = _mm512_unpacklo_ps(r2, r3), t3 = _mm512_unpackhi_ps(r2, r3);
    float tok[4][16]; /* tok[m][4 k .. 4 k + 3]: token 4 k + m's four rows */
    _mm512_storeu_ps(tok[0], _mm512_shuffle_ps(t0, t2, _MM_SHUFFLE(1, 0, 1, 0)));
    _mm512_storeu_ps(tok[1], _mm512_shuffle_ps(t0, t2, _MM_SHUFFLE(3, 2, 3, 2)));
    _mm512_storeu_ps(tok[2], _mm512_shuffle_ps(t1, t3, _MM_SHUFFLE(1, 0, 1, 0)));
    _mm512_storeu_ps(tok[3], _mm512_shuffle_ps(t1, t3, _MM_SHUFFLE(3, 2, 3, 2)));
    const __m128 bv = bias ? _mm_loadu_ps(bias) : _mm_setzero_ps();
    for (int i = 0; i < 16; i++) {
        float* yo = y + i * ldy;
        const __m128 prev = accumulate ? _mm_loadu_ps(yo) : _mm_setzero_ps();
        _mm_storeu_ps(yo, _mm_add_ps(_mm_add_ps(prev, _mm_loadu_ps(tok[i % 4] + 4 * (i / 4))), bv));
    }
}

/* quant_i8.c's tile stores through the same 4 x 16 transpose */
void loom_q_put4x16(const float* sums, float* y, int64_t ldy, const float* bias, int accumulate) {
    bi_put4x16(sums, y, ldy, bias, accumulate);
}

/* bi_tile_core specialised: G 32 or 16, one or two token groups */
static void bi_tile(const int16_t* const* w, const float* const* s, const float* const* b,
                    int asym, int64_t K, int G, int TG, const int32_t* xp, int64_t xstride,
                    const float* dxt, const float* xst, int64_t sstride, float* sums) {
    if (G == 32 && TG == 2)
        bi_tile_core(w, s, b, asym, K, 32, 2, xp, xstride, dxt, xst, sstride, sums);
    else if (G == 32)
        bi_tile_core(w, s, b, asym, K, 32, 1, xp, xstride, dxt, xst, sstride, sums);
    else if (TG == 2)
        bi_tile_core(w, s, b, asym, K, 16, 2, xp, xstride, dxt, xst, sstride, sums);
    else
        bi_tile_core(w, s, b, asym, K, 16, 1, xp, xstride, dxt, xst, sstride, sums);
}
#endif

#if !BI_AVX512
/* portable C: the canonical steps on scalars (any T) */
static void bi_dot_c(const int16_t* w, const float* s, const float* b, int asym, int64_t K, int G,
                     int64_t T, const int16_t* q, const float* dxu, const float* xsu, float* out) {
    const int64_t nu = K / G;
    for (int64_t t = 0; t < T; t++) {
        float P[16] = {0};
        for (int64_t j = 0; j < nu; j++) {
            const int16_t* qj = q + t * K + j * G;
            int32_t I = 0;
            for (int k = 0; k < G; k++) I += (int32_t)w[j * G + k] * qj[k];
            const float sd = s[j] * dxu[t * nu + j];
            P[j % 16] = fmaf((float)I, sd, P[j % 16]);
            if (asym) P[j % 16] = fmaf(b[j], xsu[t * nu + j], P[j % 16]);
        }
        out[t] = bi_tree(P);
    }
}
#endif

#if BI_AVX512
/* the first n decoded rows of a tile (rows past the R real ones repeat row 0: their sums are
   computed and dropped) */
static void bi_row_ptrs(int n, int R, const int16_t* wd, const float* sd, const float* bd,
                        int64_t K, int64_t nu, const int16_t** wr, const float** sr,
                        const float** br) {
    for (int r = 0; r < n; r++) {
        const int rr = r < R ? r : 0;
        wr[r] = wd + rr * K;
        sr[r] = sd + rr * nu;
        br[r] = bd + rr * nu;
    }
}
#endif

#if BI_AVX512
/* ---- The canonical arithmetic for 1..BI_LANE_T tokens with lanes = rows (Q8_0, Q4_x, Q5_x; Q4_K / Q6_K in bi_lanes_kcore) ----

   Why: bi_gemv (lanes = units) and bi_tile8 (lanes = tokens) first decode each row to int16 codes
   in memory and spend a vpdpwssd on 8-16 multiply-adds; at 1..8 tokens (decode and a
   speculative verify) that made "bi" 2.4x slower than the f32 GEMV. Here a pass takes 16 rows at
   once, lane r = row n0 + r: for each unit j masked gathers fetch the 16 rows' code bytes
   (bi_gather8: 8 bytes of 8 rows a gather, then a vector of each row's 4 bytes), a few 16-bit
   shifts and masks turn them into int16 code pairs (two weights a
   32-bit lane), and vpdpwssd multiplies a pair vector by one token's broadcast activation pair:
   32 multiply-adds an instruction, the codes expanded once per call for every token.
   Per (row, token) the steps are exactly the canonical ones (file comment): the unit's exact int32
   I (pairs summed in any order), P[j mod 16] = fma((float) I, s_j * dx_j, P[...]) (asym: then
   fma(b_j, xs_j, P[...])), the fixed tree, ((accumulate ? y : 0) + sum) + bias. So a row's outputs
   are bitwise bi_gemv's, bi_tile8's, the 16-token tile's and the portable C's, for every T.

   The pair order inside a unit (the activation pairs are packed to match, bi_pack_pairs):
   Q4_x, vector m (bytes 4m .. 4m + 3 of qs; byte i holds values i (low nibble) and i + 16):
     (4m, 4m + 2), (4m + 16, 4m + 18), (4m + 1, 4m + 3), (4m + 17, 4m + 19);
   Q8_0, vector m (codes 4m .. 4m + 3): (4m, 4m + 2), (4m + 1, 4m + 3).
   Q5_x: the Q4 pairs, each with its two values' high bits (qh bits a and a + 2, gathered once per
   unit) moved to bits 4 and 20 of the lane and or'ed in (two shifts, an and, an or, a ternlog). */
#define BI_LANE_T 8 /* tokens up to which loom_q_matmul_bi takes bi_lanes */
#endif
int loom_q_bi_lanes = 1; /* loom_cpu.h */
int loom_q_auto_bi(int qtype) {
    return BI_AVX512 && loom_q_bi_lanes &&
           (qtype == BQ8_0 || qtype == BQ4_0 || qtype == BQ4_1 || qtype == BQ5_0 ||
            qtype == BQ5_1 || qtype == BQ4_K || qtype == BQ6_K);
}
#if BI_AVX512

static int bi_lanes_type(int qtype) {
    return qtype == BQ8_0 || qtype == BQ4_0 || qtype == BQ4_1 || qtype == BQ5_0 || qtype == BQ5_1 ||
           qtype == BQ4_K || qtype == BQ6_K;
}

/* v >> s for s >= 0, v << -s below (s a constant where inlined) */
static inline __attribute__((always_inline)) __m512i bi_shr(__m512i v, const int s) {
    return s >= 0 ? _mm512_srli_epi32(v, (unsigned)s) : _mm512_slli_epi32(v, (unsigned)-s);
}

/* 8 bytes at p of each of 16 rows (offsets vidx8a: rows 0-7, vidx8b: 8-15; masked rows read
   nothing) as two vectors of the rows' dwords: g[0] lane r = bytes 0-3 of row r, g[1] = 4-7.
   Two qword gathers load 16 elements where two dword gathers load 32 (bench_quant_gemv: ~1.25x
   at one token on SmolLM2's cache-resident matrices). */
static inline __attribute__((always_inline)) void bi_gather8(const uint8_t* p, __m256i vidx8a,
                                                             __m256i vidx8b, __mmask8 lm8a,
                                                             __mmask8 lm8b, __m512i ieven,
                                                             __m512i iodd, __m512i* g) {
    const __m512i a = _mm512_mask_i32gather_epi64(_mm512_setzero_si512(), lm8a, vidx8a, (const void*)p, 1);
    const __m512i b = _mm512_mask_i32gather_epi64(_mm512_setzero_si512(), lm8b, vidx8b, (const void*)p, 1);
    g[0] = _mm512_permutex2var_epi32(a, ieven, b);
    g[1] = _mm512_permutex2var_epi32(a, iodd, b);
}

/* The lanes kernels' last step: per token, the 16 per-unit partial sums (units past nu
   zeroed) added as a fixed tree (the canonical order of the file comment), then the previous
   output (accumulate) and the bias added, the R live lanes stored. */
static inline __attribute__((always_inline)) void lanes_store(
    __m512 P[][16], const int T, int64_t nu, __mmask16 lm, const float* bias, float* y,
    int64_t ldy, int accumulate) {
    for (int t = 0; t < T; t++) {
        for (int64_t c = nu; c < 16; c++) P[t][c] = _mm512_setzero_ps();
        __m512 l1[8], l2[4];
        for (int c = 0; c < 8; c++) l1[c] = _mm512_add_ps(P[t][c], P[t][c + 8]);
        for (int c = 0; c < 4; c++) l2[c] = _mm512_add_ps(l1[c], l1[c + 4]);
        const __m512 sum = _mm512_add_ps(_mm512_add_ps(l2[0], l2[2]), _mm512_add_ps(l2[1], l2[3]));
        float* yo = y + t * ldy;
        const __m512 prev = accumulate ? _mm512_maskz_loadu_ps(lm, yo) : _mm512_setzero_ps();
        const __m512 bn = bias ? _mm512_maskz_loadu_ps(lm, bias) : _mm512_setzero_ps();
        _mm512_mask_storeu_ps(yo, lm, _mm512_add_ps(_mm512_add_ps(prev, sum), bn));
    }
}

/* Rows n0 .. n0 + 15 (lanes past R masked off) against T tokens (a compile-time constant where
   inlined): xp [T][nu][16] pairs, dxu / xsu [T][nu]; writes y[t * ldy + n0 + r]. */
static inline __attribute__((always_inline)) void bi_lanes_core(
    const int qtype, const uint8_t* w, int64_t row_bytes, int64_t K, int R, const int T,
    const int32_t* xp, const float* dxu, const float* xsu, const float* bias, float* y,
    int64_t ldy, int accumulate, const uint8_t* next, int64_t next_bytes) {
    const int64_t nu = K / 32;
    const int bb = qtype == BQ8_0 ? 34 : qtype == BQ4_0 ? 18 : qtype == BQ4_1 ? 20 : qtype == BQ5_0 ? 22 : 24;
    const int asym = qtype == BQ4_1 || qtype == BQ5_1;
    const int q5 = qtype == BQ5_0 || qtype == BQ5_1;
    /* Q5_x: the byte offset of qh (32 high bits, value i's at bit i) and of the nibbles */
    const int qho = qtype == BQ5_1 ? 4 : 2;
    /* independent int32 chains per token (vpdpwssd's latency over its throughput) */
    const int NA = T == 1 ? 8 : T == 2 ? 4 : T <= 4 ? 3 : 2;
    const __mmask16 lm = R >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << R) - 1);
    const __m512i vidx = _mm512_mullo_epi32(
        _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
        _mm512_set1_epi32((int)row_bytes));
    const __m512i m4 = _mm512_set1_epi16(0xF), eight = _mm512_set1_epi16(8);
    const __m512i sixteen = _mm512_set1_epi16(16), b4 = _mm512_set1_epi32(0x10),
                  b20 = _mm512_set1_epi32(0x100000);
    const __m256i vidx8a = _mm512_castsi512_si256(vidx), vidx8b = _mm512_extracti64x4_epi64(vidx, 1);
    const __mmask8 lm8a = (__mmask8)lm, lm8b = (__mmask8)(lm >> 8);
    const __m512i ieven = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i iodd = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
    __m512 P[BI_LANE_T][16];
    const int64_t span = (next_bytes + nu - 1) / nu; /* the next pass's bytes, a unit's share */
    for (int64_t j = 0; j < nu; j++) {
        for (int64_t o = 0; o < span; o += 64)
            if (j * span + o < next_bytes) _mm_prefetch((const char*)(next + j * span + o), _MM_HINT_T0);
        const uint8_t* base = w + j * bb;
        const __m512i sg = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), lm, vidx, (const void*)base, 1);
        const __m512 sv = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(sg));
        const __m512 bv = asym ? _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(sg, 16)))
                               : _mm512_setzero_ps();
        __m512i acc[BI_LANE_T][8];
        for (int t = 0; t < T; t++)
            for (int a = 0; a < NA; a++) acc[t][a] = _mm512_setzero_si512();
        const int32_t* xj = xp + 16 * j;
        const int64_t xstride = 16 * nu;
        /* the unit's codes 8 bytes at a time: two gathers of 8 rows' qwords, split into two
           vectors of the 16 rows' dwords (g[0] lane r = bytes 8h .. 8h + 3, g[1] the next 4) */
        const __m512i qh = q5 ? _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), lm, vidx, (const void*)(base + qho), 1)
                              : _mm512_setzero_si512();
        const uint8_t* cb = base + (q5 ? qho + 4 : qtype == BQ4_1 ? 4 : 2);
        if (qtype == BQ8_0) {
#pragma GCC unroll 4
            for (int h = 0; h < 4; h++) {
                __m512i g[2];
                bi_gather8(cb + 8 * h, vidx8a, vidx8b, lm8a, lm8b, ieven, iodd, g);
                for (int o = 0; o < 2; o++) {
                    const int m = 2 * h + o; /* codes 4m .. 4m + 3 */
                    const __m512i e = _mm512_srai_epi16(_mm512_slli_epi16(g[o], 8), 8);
                    const __m512i od = _mm512_srai_epi16(g[o], 8);
                    for (int t = 0; t < T; t++) {
                        const int32_t* xt = xj + t * xstride + 2 * m;
                        acc[t][(2 * m) % NA] = _mm512_dpwssd_epi32(acc[t][(2 * m) % NA], e, _mm512_set1_epi32(xt[0]));
                        acc[t][(2 * m + 1) % NA] = _mm512_dpwssd_epi32(acc[t][(2 * m + 1) % NA], od, _mm512_set1_epi32(xt[1]));
                    }
                }
            }
        } else {
#pragma GCC unroll 2
            for (int h = 0; h < 2; h++) {
                __m512i g[2];
                bi_gather8(cb + 8 * h, vidx8a, vidx8b, lm8a, lm8b, ieven, iodd, g);
                for (int o = 0; o < 2; o++) {
                    const int m = 2 * h + o; /* bytes 4m .. 4m + 3 of qs */
                    __m512i e[4] = {_mm512_and_si512(g[o], m4), _mm512_and_si512(_mm512_srli_epi16(g[o], 4), m4),
                                    _mm512_and_si512(_mm512_srli_epi16(g[o], 8), m4), _mm512_srli_epi16(g[o], 12)};
                    if (qtype == BQ4_0)
                        for (int k = 0; k < 4; k++) e[k] = _mm512_sub_epi16(e[k], eight);
                    if (q5) { /* pair (a, a + 2)'s high bits: qh bit a to bit 4, a + 2 to bit 20 */
                        for (int k = 0; k < 4; k++) {
                            const int a = 4 * m + (k & 1) * 16 + (k >> 1);
                            const __m512i t = _mm512_or_si512(e[k], _mm512_and_si512(bi_shr(qh, a - 18), b20));
                            e[k] = _mm512_ternarylogic_epi32(bi_shr(qh, a - 4), b4, t, 0xEA); /* (A & B) | C */
                            if (qtype == BQ5_0) e[k] = _mm512_sub_epi16(e[k], sixteen);
                        }
                    }
                    for (int t = 0; t < T; t++) {
                        const int32_t* xt = xj + t * xstride + 4 * m;
                        for (int k = 0; k < 4; k++)
                            acc[t][(4 * m + k) % NA] = _mm512_dpwssd_epi32(acc[t][(4 * m + k) % NA], e[k], _mm512_set1_epi32(xt[k]));
                    }
                }
            }
        }
        const int c = (int)(j % 16);
        for (int t = 0; t < T; t++) {
            __m512i I = acc[t][0];
            for (int a = 1; a < NA; a++) I = _mm512_add_epi32(I, acc[t][a]);
            const __m512 sd = _mm512_mul_ps(sv, _mm512_set1_ps(dxu[t * nu + j]));
            __m512 p = _mm512_fmadd_ps(_mm512_cvtepi32_ps(I), sd, j < 16 ? _mm512_setzero_ps() : P[t][c]);
            if (asym) p = _mm512_fmadd_ps(bv, _mm512_set1_ps(xsu[t * nu + j]), p);
            P[t][c] = p;
        }
    }
    lanes_store(P, T, nu, lm, bias, y, ldy, accumulate);
}

/* Q4_K / Q6_K rows n0 .. n0 + 15 against T tokens (lanes = rows, as bi_lanes_core): a pass
   walks the super-blocks of 256 values; each super-block's scales are expanded once from the
   gathered bytes (Q4_K: d, dmin and the 12 bytes of 6-bit scales / mins, ggml's
   get_scale_min_k4 per lane; Q6_K: d and 16 int8 scales), its codes gathered 8 bytes of 16 rows
   at a time and split into int16 pairs in the Q8_0 pair order (bi_pack_pairs' BQ8_0 layout:
   vector m of a unit holds values (4m, 4m + 2), (4m + 1, 4m + 3)):
   - Q4_K: 32 bytes per sub-block pair; byte l holds value l of unit 2c (low nibble) and of unit
     2c + 1 (high nibble);
   - Q6_K (units of 16): values 128n + 32k + l, l = 16h + i, sit in ql[64n + 32(k & 1) + l]'s
     nibble k >> 1 and qh[32n + l]'s bits 2k, 2k + 1; the unsigned 6-bit code u is used and the
     offset 32 taken off the exact integer once per unit: I = sum u q - 32 sum q (sq).
   Then per unit the canonical float steps (file comment), so the outputs are bitwise the
   other "bi" kernels' for every T. */
static inline __attribute__((always_inline)) void bi_lanes_kcore(
    const int qtype, const uint8_t* w, int64_t row_bytes, int64_t K, int R, const int T,
    const int32_t* xp, const float* dxu, const float* xsu, const int32_t* sq, const float* bias,
    float* y, int64_t ldy, int accumulate, const uint8_t* next, int64_t next_bytes) {
    const int q6 = qtype == BQ6_K;
    const int64_t nsb = K / 256, nu = q6 ? K / 16 : K / 32;
    const int bb = q6 ? 210 : 144;
    const int NA = T == 1 ? 4 : T <= 4 ? 2 : 1;
    const __mmask16 lm = R >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << R) - 1);
    const __m512i vidx = _mm512_mullo_epi32(
        _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
        _mm512_set1_epi32((int)row_bytes));
    const __m256i vidx8a = _mm512_castsi512_si256(vidx), vidx8b = _mm512_extracti64x4_epi64(vidx, 1);
    const __mmask8 lm8a = (__mmask8)lm, lm8b = (__mmask8)(lm >> 8);
    const __m512i ieven = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i iodd = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
    const __m512i M4 = _mm512_set1_epi32(0x000F000F), M6 = _mm512_set1_epi32(0x00300030);
    const __m512i x3f = _mm512_set1_epi32(63), xf = _mm512_set1_epi32(0xF), x3 = _mm512_set1_epi32(3);
    const int64_t xstride = 16 * (K / 32);
    __m512 P[BI_LANE_T][16];
    const int64_t span = (next_bytes + nsb - 1) / nsb;
    for (int64_t i = 0; i < nsb; i++) {
        for (int64_t o = 0; o < span; o += 64)
            if (i * span + o < next_bytes) _mm_prefetch((const char*)(next + i * span + o), _MM_HINT_T0);
        const uint8_t* base = w + i * bb;
        __m512 sv[16], bv[8];
        if (q6) {
            /* d: the high half of the dword at 206 (a dword at 208 would read past the row) */
            const __m512i dg = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), lm, vidx, (const void*)(base + 206), 1);
            const __m512 dv = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(dg, 16)));
            __m512i sc[4];
            bi_gather8(base + 192, vidx8a, vidx8b, lm8a, lm8b, ieven, iodd, sc);
            bi_gather8(base + 200, vidx8a, vidx8b, lm8a, lm8b, ieven, iodd, sc + 2);
            for (int j = 0; j < 16; j++) /* d * (float) sc[j], as quant.c's decoder */
                sv[j] = _mm512_mul_ps(dv, _mm512_cvtepi32_ps(_mm512_srai_epi32(
                                              _mm512_slli_epi32(sc[j / 4], (unsigned)(24 - 8 * (j % 4))), 24)));
        } else {
            const __m512i dg = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), lm, vidx, (const void*)base, 1);
            const __m512 dv = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dg));
            /* -dmin by its sign bit (as C's unary minus: -0 for +0) */
            const __m512 ndm = _mm512_castsi512_ps(_mm512_xor_si512(
                _mm512_castps_si512(_mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(dg, 16)))),
                _mm512_set1_epi32((int)0x80000000u)));
            const __m512i S0 = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), lm, vidx, (const void*)(base + 4), 1);
            const __m512i S1 = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), lm, vidx, (const void*)(base + 8), 1);
            const __m512i S2 = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), lm, vidx, (const void*)(base + 12), 1);
            for (int j = 0; j < 8; j++) { /* get_scale_min_k4 per lane; s = d * sc, b = -dmin * m */
                __m512i sc, mn;
                if (j < 4) {
                    sc = _mm512_and_si512(_mm512_srli_epi32(S0, (unsigned)(8 * j)), x3f);
                    mn = _mm512_and_si512(_mm512_srli_epi32(S1, (unsigned)(8 * j)), x3f);
                } else {
                    const unsigned k = (unsigned)(8 * (j - 4));
                    sc = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(S2, k), xf),
                                         _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(S0, k + 6), x3), 4));
                    mn = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(S2, k + 4), xf),
                                         _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(S1, k + 6), x3), 4));
                }
                sv[j] = _mm512_mul_ps(dv, _mm512_cvtepi32_ps(sc));
                bv[j] = _mm512_mul_ps(ndm, _mm512_cvtepi32_ps(mn));
            }
        }
        /* one unit (index ju inside the super-block) from its 4 (Q6_K) or 8 (Q4_K) vectors of
           pairs, each vector m's even pair in e[2m], odd in e[2m + 1] */
#define BI_KUNIT(NV, EXPR_E, EXPR_O, ju)                                                          \
    do {                                                                                          \
        const int64_t J = (q6 ? 16 : 8) * i + (ju);                                               \
        __m512i acc[BI_LANE_T][4];                                                                \
        for (int t = 0; t < T; t++)                                                               \
            for (int a = 0; a < NA; a++) acc[t][a] = _mm512_setzero_si512();                      \
        const int32_t* xj = xp + (q6 ? 8 : 16) * J;                                               \
        for (int m = 0; m < (NV); m++) {                                                          \
            const __m512i e = (EXPR_E), od = (EXPR_O);                                            \
            for (int t = 0; t < T; t++) {                                                         \
                const int32_t* xt = xj + t * xstride + 2 * m;                                     \
                acc[t][(2 * m) % NA] = _mm512_dpwssd_epi32(acc[t][(2 * m) % NA], e, _mm512_set1_epi32(xt[0])); \
                acc[t][(2 * m + 1) % NA] = _mm512_dpwssd_epi32(acc[t][(2 * m + 1) % NA], od, _mm512_set1_epi32(xt[1])); \
            }                                                                                     \
        }                                                                                         \
        const int c = (int)(J % 16);                                                              \
        for (int t = 0; t < T; t++) {                                                             \
            __m512i I = acc[t][0];                                                                \
            for (int a = 1; a < NA; a++) I = _mm512_add_epi32(I, acc[t][a]);                      \
            if (q6) I = _mm512_sub_epi32(I, _mm512_set1_epi32(32 * sq[t * nu + J]));              \
            const __m512 sd = _mm512_mul_ps(sv[ju], _mm512_set1_ps(dxu[t * nu + J]));             \
            __m512 p = _mm512_fmadd_ps(_mm512_cvtepi32_ps(I), sd, J < 16 ? _mm512_setzero_ps() : P[t][c]); \
            if (!q6) p = _mm512_fmadd_ps(bv[ju], _mm512_set1_ps(xsu[t * nu + J]), p);             \
            P[t][c] = p;                                                                          \
        }                                                                                         \
    } while (0)
        if (q6) {
            for (int n = 0; n < 2; n++)
                for (int h = 0; h < 2; h++) {
                    __m512i A[4], B[4], H[4];
                    const uint8_t* pa = base + 64 * n + 16 * h;
                    bi_gather8(pa, vidx8a, vidx8b, lm8a, lm8b, ieven, iodd, A);
                    bi_gather8(pa + 8, vidx8a, vidx8b, lm8a, lm8b, ieven, iodd, A + 2);
                    bi_gather8(pa + 32, vidx8a, vidx8b, lm8a, lm8b, ieven, iodd, B);
                    bi_gather8(pa + 40, vidx8a, vidx8b, lm8a, lm8b, ieven, iodd, B + 2);
                    const uint8_t* ph = base + 128 + 32 * n + 16 * h;
                    bi_gather8(ph, vidx8a, vidx8b, lm8a, lm8b, ieven, iodd, H);
                    bi_gather8(ph + 8, vidx8a, vidx8b, lm8a, lm8b, ieven, iodd, H + 2);
                    /* unit k: nibble k >> 1 of A (k even) or B (k odd), high bits 2k, 2k + 1 to
                       bits 4, 5 of each 16-bit half: (H >> (2k - 4)) & 0x30 | nibble */
#define BI_Q6K(k)                                                                                 \
    BI_KUNIT(4,                                                                                   \
             _mm512_ternarylogic_epi32(bi_shr(H[m], 2 * (k) - 4), M6,                             \
                                       _mm512_and_si512(bi_shr(((k) & 1 ? B : A)[m], 4 * ((k) >> 1)), M4), 0xEA), \
             _mm512_ternarylogic_epi32(bi_shr(H[m], 2 * (k) + 4), M6,                             \
                                       _mm512_and_si512(bi_shr(((k) & 1 ? B : A)[m], 4 * ((k) >> 1) + 8), M4), 0xEA), \
             8 * n + 2 * (k) + h)
                    BI_Q6K(0);
                    BI_Q6K(1);
                    BI_Q6K(2);
                    BI_Q6K(3);
#undef BI_Q6K
                }
        } else {
            for (int c2 = 0; c2 < 4; c2++) {
                __m512i g[8];
                const uint8_t* pq = base + 16 + 32 * c2;
                for (int hh = 0; hh < 4; hh++)
                    bi_gather8(pq + 8 * hh, vidx8a, vidx8b, lm8a, lm8b, ieven, iodd, g + 2 * hh);
                BI_KUNIT(8, _mm512_and_si512(g[m], M4), _mm512_and_si512(_mm512_srli_epi32(g[m], 8), M4), 2 * c2);
                BI_KUNIT(8, _mm512_and_si512(_mm512_srli_epi32(g[m], 4), M4),
                         _mm512_and_si512(_mm512_srli_epi32(g[m], 12), M4), 2 * c2 + 1);
            }
        }
#undef BI_KUNIT
    }
    lanes_store(P, T, nu, lm, bias, y, ldy, accumulate);
}

/* bi_lanes_core with T and the type as constants */
static void bi_lanes_pass(int qtype, const uint8_t* w, int64_t row_bytes, int64_t K, int R, int T,
                          const int32_t* xp, const float* dxu, const float* xsu, const int32_t* sq,
                          const float* bias, float* y, int64_t ldy, int accumulate,
                          const uint8_t* next, int64_t next_bytes) {
#define BI_LCASE(Q, TT)                                                                          \
    case TT:                                                                                     \
        bi_lanes_core(Q, w, row_bytes, K, R, TT, xp, dxu, xsu, bias, y, ldy, accumulate, next,   \
                      next_bytes);                                                               \
        break;
#define BI_LCASES(Q)                                                                             \
    switch (T) {                                                                                 \
        BI_LCASE(Q, 1) BI_LCASE(Q, 2) BI_LCASE(Q, 3) BI_LCASE(Q, 4) BI_LCASE(Q, 5) BI_LCASE(Q, 6) \
        BI_LCASE(Q, 7) BI_LCASE(Q, 8) default: break;                                            \
    }
#define BI_KCASE(Q, TT)                                                                          \
    case TT:                                                                                     \
        bi_lanes_kcore(Q, w, row_bytes, K, R, TT, xp, dxu, xsu, sq, bias, y, ldy, accumulate,    \
                       next, next_bytes);                                                        \
        break;
#define BI_KCASES(Q)                                                                             \
    switch (T) {                                                                                 \
        BI_KCASE(Q, 1) BI_KCASE(Q, 2) BI_KCASE(Q, 3) BI_KCASE(Q, 4) BI_KCASE(Q, 5) BI_KCASE(Q, 6) \
        BI_KCASE(Q, 7) BI_KCASE(Q, 8) default: break;                                            \
    }
    if (qtype == BQ4_K) {
        BI_KCASES(BQ4_K)
    } else if (qtype == BQ6_K) {
        BI_KCASES(BQ6_K)
    } else if (qtype == BQ8_0) {
        BI_LCASES(BQ8_0)
    } else if (qtype == BQ4_1) {
        BI_LCASES(BQ4_1)
    } else if (qtype == BQ5_0) {
        BI_LCASES(BQ5_0)
    } else if (qtype == BQ5_1) {
        BI_LCASES(BQ5_1)
    } else {
        BI_LCASES(BQ4_0)
    }
#undef BI_KCASES
#undef BI_KCASE
#undef BI_LCASES
#undef BI_LCASE
}

/* bi_lanes' arguments, for its passes on the pool */
typedef struct {
    int qtype;
    const uint8_t* w;
    int64_t N, K, row_bytes;
    int T;
    const int32_t* xp;
    const float *dxu, *xsu;
    const int32_t* sq; /* Q6_K: each token's sum of codes per unit */
    const float* bias;
    float* y;
    int64_t ldy;
    int accumulate;
} LanesJob;

/* passes i0 .. i1 - 1 of 16 rows (loom_par_for's task) */
static void lanes_passes(void* ctx, int64_t i0, int64_t i1, int worker) {
    (void)worker;
    const LanesJob* j = ctx;
    const int64_t N = j->N, rb = j->row_bytes;
    for (int64_t i = i0; i < i1; i++) {
        const int64_t n0 = 16 * i;
        const int R = N - n0 < 16 ? (int)(N - n0) : 16;
        const int64_t nx = N - n0 - R < 16 ? N - n0 - R : 16; /* the next pass's rows */
        bi_lanes_pass(j->qtype, j->w + n0 * rb, rb, j->K, R, j->T, j->xp, j->dxu, j->xsu, j->sq,
                      j->bias ? j->bias + n0 : NULL, j->y + n0, j->ldy, j->accumulate,
                      j->w + (n0 + R) * rb, nx * rb);
    }
}

/* loom_q_matmul_bi for bi_lanes_type at T <= BI_LANE_T: every token quantized (bi_quantize) and
   packed once, then passes of 16 rows over the threads */
static int bi_lanes(int qtype, const uint8_t* w, int64_t N, int64_t K, int64_t row_bytes,
                    const float* x, int64_t T, int64_t ldx, const float* bias, float* y,
                    int64_t ldy, int accumulate, int threads) {
    const int G = q_unit_len(qtype), ktype = qtype == BQ4_K || qtype == BQ6_K;
    const int64_t nu = K / G, nb = K / 32;
    int16_t* q = malloc(sizeof(int16_t) * (size_t)(K + 64));
    int32_t* xp = malloc(sizeof(int32_t) * (size_t)(T * nb * 16 + 16));
    float* dxu = malloc(sizeof(float) * (size_t)(T * nu + 16));
    float* xsu = malloc(sizeof(float) * (size_t)(T * nu + 16));
    int32_t* sq = malloc(sizeof(int32_t) * (size_t)(T * nu + 16)); /* Q6_K: sum of q per unit */
    if (!q || !xp || !dxu || !xsu || !sq) {
        free(q);
        free(xp);
        free(dxu);
        free(xsu);
        free(sq);
        return -2;
    }
    for (int64_t t = 0; t < T; t++) {
        bi_quantize(x + t * ldx, K, G, q, dxu + t * nu, xsu + t * nu);
        /* the K-types' codes pair up as Q8_0's do (bi_lanes_kcore) */
        bi_pack_pairs(ktype ? BQ8_0 : qtype, q, K, xp + t * nb * 16);
        if (qtype == BQ6_K)
            for (int64_t j = 0; j < nu; j++) {
                int32_t a = 0;
                for (int k = 0; k < 16; k++) a += q[16 * j + k];
                sq[t * nu + j] = a;
            }
    }
    free(q);
    const int64_t passes = (N + 15) / 16;
    LanesJob job = {qtype, w, N, K, row_bytes, (int)T, xp, dxu, xsu, sq, bias, y, ldy, accumulate};
    /* passes over the pool (pool.c): each pass's 16 rows are computed whole by one worker */
    loom_par_for(threads, passes, par_chunk(passes, threads), lanes_passes, &job);
    free(xp);
    free(dxu);
    free(xsu);
    free(sq);
    return 0;
}
#endif

/* loom_q_matmul's LOOM_Q_BI (its arguments; checked there) */
int loom_q_matmul_bi(int qtype, const uint8_t* w, int64_t N, int64_t K, int64_t row_bytes,
                     const float* x, int64_t T, int64_t ldx, const float* bias, float* y,
                     int64_t ldy, int accumulate, int threads) {
    const int G = q_unit_len(qtype), asym = q_is_asym(qtype);
    const int64_t nu = K / G;
    if (K % G) return -1;
    /* AVX2 builds, 1-4 tokens of Q4_K / Q6_K: quant_gemv_k_avx2.c's GEMV (lanes = values; the
       same bits, loom_q_bi_kgemv = 0 skips it) */
    if (T <= 4 && loom_q_bi_kgemv_type(qtype))
        return loom_q_matmul_bi_kgemv(qtype, w, N, K, row_bytes, x, T, ldx, bias, y, ldy,
                                      accumulate, threads);
    /* AVX2 builds, one token of Q8_0 / Q5_0: quant_gemv1_avx2.c's GEMV (one unit a ymm; the
       same bits, loom_q_bi_gemv1 = 0 skips it) */
    if (T == 1 && loom_q_bi_gemv1_type(qtype))
        return loom_q_matmul_bi_gemv1(qtype, w, N, K, row_bytes, x, T, bias, y, accumulate,
                                      threads);
    /* AVX2 builds, 1-4 tokens of Q8_0 / Q4_0 / Q4_1, 1-3 of Q5_0: quant_gemv_avx2.c's
       values-as-lanes GEMV (contiguous rows, no gathers; the same bits; loom_q_bi_gemv = 0
       skips it) */
    if (T <= loom_q_bi_gemv_max_t(qtype))
        return loom_q_matmul_bi_gemv(qtype, w, N, K, row_bytes, x, T, ldx, bias, y, ldy,
                                     accumulate, threads);
    /* AVX2 builds, 1-4 tokens of Q8_0 / Q4_0 / Q4_1 where that is off: quant_bi2.c's row
       lanes (each block of weights decoded once for every token); other types and 5 tokens and more:
       quant_bi_avx2.c's 8-token tiles, which waste lanes below that and win at 8 (SmolLM2's
       whole step: docs/benchmarks.md, "the tables of session 20"). Both are the portable C's
       bits (loom_q_bi_lanes / loom_q_bi_avx2 = 0 skip them) */
    if (T <= 4 && loom_q_bi_lanes2_type(qtype))
        return loom_q_matmul_bi_lanes2(qtype, w, N, K, row_bytes, x, T, ldx, bias, y, ldy,
                                       accumulate, threads);
#if !BI_AVX512
    /* AVX2 builds: quant_bi_avx2.c's tiles (the same bits; loom_q_bi_avx2 = 0 keeps the
       portable C below, the tests' reference) */
    if (loom_q_bi_avx2 && loom_q_bi_avx2_built())
        return loom_q_matmul_bi_avx2(qtype, w, N, K, row_bytes, x, T, ldx, bias, y, ldy, accumulate, threads);
#endif
#if BI_AVX512
    if (T <= BI_LANE_T && bi_lanes_type(qtype) && loom_q_bi_lanes)
        return bi_lanes(qtype, w, N, K, row_bytes, x, T, ldx, bias, y, ldy, accumulate, threads);
#endif
    int16_t* q = malloc(sizeof(int16_t) * (size_t)(T * K + 64));
    float* dxu = malloc(sizeof(float) * (size_t)(T * nu + 16));
    float* xsu = malloc(sizeof(float) * (size_t)(T * nu + 16));
    if (!q || !dxu || !xsu) {
        free(q);
        free(dxu);
        free(xsu);
        return -2;
    }
    memset(q + T * K, 0, sizeof(int16_t) * 64);
#if BI_AVX512
    const int tile = T > BI_GEMV_MAX;
    const int L = T <= 8 ? 8 : BI_TOK; /* token lanes: ymm up to 8 tokens, else zmm */
    const int64_t ntg = (T + L - 1) / L;
    int32_t* xp = NULL; /* [ntg][K / 2][L]: token pairs of codes, a vector per pair */
    float *dxt = NULL, *xst = NULL; /* [ntg][nu][L] */
    if (tile) {
        xp = aligned_alloc(64, sizeof(int32_t) * (size_t)(ntg * (K / 2) * L));
        dxt = aligned_alloc(64, sizeof(float) * (size_t)(ntg * nu * L));
        xst = aligned_alloc(64, sizeof(float) * (size_t)(ntg * nu * L));
        if (!xp || !dxt || !xst) {
            free(xp);
            free(dxt);
            free(xst);
            free(q);
            free(dxu);
            free(xsu);
            return -2;
        }
        /* the last group's missing tokens: zero codes and scales */
        for (int64_t t = T; t < ntg * L; t++) {
            const int64_t g = t / L, i = t % L;
            for (int64_t p = 0; p < K / 2; p++) xp[(g * (K / 2) + p) * L + i] = 0;
            for (int64_t j = 0; j < nu; j++) dxt[(g * nu + j) * L + i] = xst[(g * nu + j) * L + i] = 0.f;
        }
    }
#endif
    int failed = 0;
    if (threads < 1) threads = 1;
#if BI_AVX512
    const int64_t per = !tile ? 1 : L == 8 ? BI_ROWS8 : BI_BLOCK;
#else
    const int64_t per = 1;
#endif
    const int64_t ntiles = (N + per - 1) / per;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        int16_t* wd = malloc(sizeof(int16_t) * (size_t)(BI_BLOCK * K + 64));
        float* sd = malloc(sizeof(float) * (size_t)(BI_BLOCK * nu + 16));
        float* bd = malloc(sizeof(float) * (size_t)(BI_BLOCK * nu + 16));
        uint8_t* u = malloc((size_t)K + 64);
        float* s16 = malloc(sizeof(float) * (size_t)(K / 16 + 1));
        float* b16 = malloc(sizeof(float) * (size_t)(K / 16 + 1));
        float* part = malloc(sizeof(float) * (size_t)(BI_ROWS8 * (T > 16 ? T : 16) + 16));
        /* every token's codes (and, for the tile, its lanes of the packed groups) */
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++) {
            int16_t* qt = q + t * K;
            bi_quantize(x + t * ldx, K, G, qt, dxu + t * nu, xsu + t * nu);
#if BI_AVX512
            if (tile) {
                const int64_t g = t / L, i = t % L;
                int32_t* xo = xp + g * (K / 2) * L + i;
                for (int64_t p = 0; p < K / 2; p++) memcpy(xo + L * p, qt + 2 * p, 4);
                for (int64_t j = 0; j < nu; j++) {
                    dxt[(g * nu + j) * L + i] = dxu[t * nu + j];
                    xst[(g * nu + j) * L + i] = xsu[t * nu + j];
                }
            }
#endif
        }
        if (!wd || !sd || !bd || !u || !s16 || !b16 || !part) {
            failed = 1;
        } else {
#pragma omp for schedule(static)
            for (int64_t tl = 0; tl < ntiles; tl++) {
                const int64_t n0 = tl * per;
                const int R = N - n0 < per ? (int)(N - n0) : (int)per;
                for (int r = 0; r < R; r++) {
#if BI_AVX512
                    /* the same row of this thread's next tile (schedule static: tl + 1), so its
                       bytes arrive while this tile computes (a large matrix streams from memory;
                       the hardware prefetcher alone left the LM head's tiles waiting on it) */
                    if (tile && n0 + per + r < N)
                        for (int64_t o = 0; o < row_bytes; o += 64)
                            _mm_prefetch((const char*)(w + (n0 + per + r) * row_bytes + o), _MM_HINT_T1);
#endif
                    bi_decode_row(qtype, w + (n0 + r) * row_bytes, K, wd + r * K, sd + r * nu,
                                  bd + r * nu, u, s16, b16);
                }
#if BI_AVX512
                if (tile && L == 8) {
                    const int16_t* wr[BI_ROWS8];
                    const float* sr[BI_ROWS8];
                    const float* br[BI_ROWS8];
                    bi_row_ptrs(BI_ROWS8, R, wd, sd, bd, K, nu, wr, sr, br);
                    float sums[BI_ROWS8 * 8];
                    bi_tile8(wr, sr, br, asym, K, G, xp, dxt, xst, sums);
                    for (int r = 0; r < R; r++)
                        for (int i = 0; i < T; i++) part[r * T + i] = sums[8 * r + i];
                } else if (tile) {
                    /* token-group pairs outer, the block's 4-row passes inner; results straight
                       into y (the same float steps as through part below) */
                    for (int64_t g0 = 0; g0 < ntg; g0 += 2) {
                        const int TG = ntg - g0 >= 2 ? 2 : 1;
                        for (int r0 = 0; r0 < R; r0 += BI_ROWS) {
                            const int RR = R - r0 < BI_ROWS ? R - r0 : BI_ROWS;
                            const int16_t* wr[BI_ROWS];
                            const float* sr[BI_ROWS];
                            const float* br[BI_ROWS];
                            bi_row_ptrs(BI_ROWS, RR, wd + r0 * K, sd + r0 * nu, bd + r0 * nu, K, nu,
                                        wr, sr, br);
                            float sums[2 * BI_ROWS * 16];
                            bi_tile(wr, sr, br, asym, K, G, TG, xp + g0 * (K / 2) * 16, (K / 2) * 16,
                                    dxt + g0 * nu * 16, xst + g0 * nu * 16, nu * 16, sums);
                            for (int g = 0; g < TG; g++) {
                                const int64_t t0 = (g0 + g) * BI_TOK;
                                if (RR == BI_ROWS && t0 + BI_TOK <= T) {
                                    bi_put4x16(sums + 16 * g * BI_ROWS, y + t0 * ldy + n0 + r0, ldy,
                                               bias ? bias + n0 + r0 : NULL, accumulate);
                                    continue;
                                }
                                for (int r = 0; r < RR; r++) {
                                    const int64_t n = n0 + r0 + r;
                                    const float bn = bias ? bias[n] : 0.f;
                                    for (int i = 0; i < BI_TOK && (g0 + g) * BI_TOK + i < T; i++) {
                                        float* yo = y + ((g0 + g) * BI_TOK + i) * ldy + n;
                                        *yo = (accumulate ? *yo : 0.f) + sums[16 * (g * BI_ROWS + r) + i] + bn;
                                    }
                                }
                            }
                        }
                    }
                    continue;
                } else {
                    bi_gemv(wd, sd, bd, asym, K, G, T, q, dxu, xsu, part);
                }
#else
                bi_dot_c(wd, sd, bd, asym, K, G, T, q, dxu, xsu, part);
#endif
                for (int r = 0; r < R; r++) {
                    const float bn = bias ? bias[n0 + r] : 0.f;
                    for (int64_t t = 0; t < T; t++) {
                        float* yo = y + t * ldy + n0 + r;
                        *yo = (accumulate ? *yo : 0.f) + part[r * T + t] + bn;
                    }
                }
            }
        }
        free(wd);
        free(sd);
        free(bd);
        free(u);
        free(s16);
        free(b16);
        free(part);
    }
#if BI_AVX512
    free(xp);
    free(dxt);
    free(xst);
#endif
    free(q);
    free(dxu);
    free(xsu);
    return failed ? -2 : 0;
}
