/* Shared pieces of the AVX2 "values as lanes" GEMVs of mode "bi" (quant_gemv_avx2.c; the
   canonical arithmetic is quant_bi.c's file comment). A row's units are taken 8 at a time (a
   "group"); the group's units p and p + 4 (p = 0..3) share a ymm, unit p in the low 128 bits,
   unit p + 4 in the high ones, each as 4 vectors of 8 int16 weights (v = 0..3) whose adjacent
   pairs meet these activation pairs in vpmaddwd (i = 0..3, values of the unit of 32):
     v 0: (4i, 4i + 2)   v 1: (4i + 1, 4i + 3)   v 2: (4i + 16, 4i + 18)   v 3: (4i + 17, 4i + 19)
   (a Q4_x byte's low / high nibbles as words masked / shifted by 0, 8, 4, 12 bits; a Q8_0 or
   Q5_0 byte vector's even / odd bytes sign-extended give the same four). A token's codes are
   quantized and packed once per call in that order (gv_quantize_pack), the 4 pair vectors' 4
   int32 each reduce to one ymm of the group's 8 exact unit dots I_j (gv_reduce8, lane k = unit
   8g + k), and the float steps run on 8 units at once (gv_fstep): lane k of P[g mod 2] is the
   canonical P[(8g + k) mod 16] and gets the group's units in increasing g, so each P[c] sees its
   units in increasing j.

   Only static inline functions, for builds with AVX2 + FMA + F16C (the includer checks). */
#ifndef LOOM_GEMV_AVX2_H
#define LOOM_GEMV_AVX2_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define GV_GROUP_DW 128 /* int32 activation pairs of one group of 8 units (4 pairs x 4 v x 8) */

/* One unit of 32 values at xb -> its codes c[k] (int32, values 8k .. 8k + 7), *dx and the sum of
   its codes: quant_bi.c's bi_quantize for G = 32 step for step (amax of |x|, dx = amax / 32512,
   inv = dx > 0 ? 1 / dx : 0, code = sign(v) * min(floor(|v * inv| + 0.5), 32512)) */
static inline int32_t gv_codes32(const float* xb, __m256i* c, float* dx) {
    const __m256 absm = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF)),
                 half = _mm256_set1_ps(0.5f);
    const __m256 lim = _mm256_set1_ps(32512.f);
    __m256 a[4];
    for (int k = 0; k < 4; k++) a[k] = _mm256_loadu_ps(xb + 8 * k);
    const __m256 m2 =
        _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(a[0], absm), _mm256_and_ps(a[1], absm)),
                      _mm256_max_ps(_mm256_and_ps(a[2], absm), _mm256_and_ps(a[3], absm)));
    __m128 m1 = _mm_max_ps(_mm256_castps256_ps128(m2), _mm256_extractf128_ps(m2, 1));
    m1 = _mm_max_ps(m1, _mm_movehl_ps(m1, m1));
    const float amax = _mm_cvtss_f32(_mm_max_ss(m1, _mm_shuffle_ps(m1, m1, 1)));
    const float dd = amax / 32512.f;
    const __m256 inv = _mm256_set1_ps(dd > 0 ? 1.f / dd : 0.f);
    __m256i sum = _mm256_setzero_si256();
    for (int k = 0; k < 4; k++) {
        const __m256 v = _mm256_mul_ps(a[k], inv);
        const __m256 r =
            _mm256_min_ps(_mm256_floor_ps(_mm256_add_ps(_mm256_and_ps(v, absm), half)), lim);
        const __m256i m = _mm256_cvttps_epi32(r);
        const __m256i neg = _mm256_castps_si256(_mm256_cmp_ps(v, _mm256_setzero_ps(), _CMP_LT_OQ));
        c[k] = _mm256_blendv_epi8(m, _mm256_sub_epi32(_mm256_setzero_si256(), m), neg);
        sum = _mm256_add_epi32(sum, c[k]);
    }
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(1, 0, 3, 2)));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(2, 3, 0, 1)));
    *dx = dd;
    return _mm_cvtsi128_si32(s4);
}

/* One token x [K] (K a multiple of 32) -> xp [ng][128] pairs (xp[g][32 p + 8 v + 4 h + i]:
   pair i of vector v of unit 8g + p + 4h; zero past K) and per unit dx, xs = dx * (sum of its
   codes) (0 past K): gv_codes32's codes and scales, without the int16 copy. */
static inline void gv_quantize_pack(const float* x, int64_t K, int64_t ng, int32_t* xp, float* dxu,
                                    float* xsu) {
    /* words of a lane [0..7] -> [0, 2, 4, 6, 1, 3, 5, 7] */
    const __m256i eo = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15, 0, 1,
                                        4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
    const int64_t nu = K / 32;
    for (int64_t j = 0; j < 8 * ng; j++) {
        /* unit j = 8g + p + 4h: v 0, 1 at xp[g][32 p + 4 h + 0 / 8], v 2, 3 at + 16 / 24 */
        int32_t* o = xp + GV_GROUP_DW * (j / 8) + 32 * (j % 4) + 4 * ((j % 8) / 4);
        if (j >= nu) {
            dxu[j] = xsu[j] = 0.f;
            for (int v = 0; v < 4; v++)
                _mm_storeu_si128((__m128i*)(o + 8 * v), _mm_setzero_si128());
            continue;
        }
        __m256i c[4];
        float dd;
        const int32_t sum = gv_codes32(x + 32 * j, c, &dd);
        dxu[j] = dd;
        xsu[j] = dd * (float)sum;
        for (int h = 0; h < 2; h++) { /* values 16h .. 16h + 15 -> v 2h (even), 2h + 1 (odd) */
            /* packs works per 128-bit lane: [c0 lo 4, c1 lo 4 | c0 hi 4, c1 hi 4] -> permute */
            const __m256i w = _mm256_permute4x64_epi64(_mm256_packs_epi32(c[2 * h], c[2 * h + 1]),
                                                       _MM_SHUFFLE(3, 1, 2, 0));
            const __m256i d =
                _mm256_permute4x64_epi64(_mm256_shuffle_epi8(w, eo), _MM_SHUFFLE(3, 1, 2, 0));
            _mm_storeu_si128((__m128i*)(o + 16 * h), _mm256_castsi256_si128(d));
            _mm_storeu_si128((__m128i*)(o + 16 * h + 8), _mm256_extracti128_si256(d, 1));
        }
    }
}

/* v[p] = [unit p's 4 partial int32 | unit p + 4's] -> lane k = unit k's exact sum */
static inline __m256i gv_reduce8(__m256i v0, __m256i v1, __m256i v2, __m256i v3) {
    return _mm256_hadd_epi32(_mm256_hadd_epi32(v0, v1), _mm256_hadd_epi32(v2, v3));
}

/* the f16 at byte offsets 0 (*s) and 2 (*b) of m <= 8 blocks of `stride` bytes from p, as f32
   (0 past m): 8 dword loads joined by unpacks (an array of 8 ints read as one vector cost twice
   the whole group's time on Zen 3, store forwarding; a vpgatherdd more than these:
   docs/benchmarks.md, helper "gemv") */
static inline void gv_f16x8(const uint8_t* p, int stride, int m, __m256* s, __m256* b) {
    __m128i d[8];
    for (int k = 0; k < 8; k++) {
        int32_t t = 0;
        if (k < m) memcpy(&t, p + (int64_t)k * stride, 4);
        d[k] = _mm_cvtsi32_si128(t);
    }
    const __m128i a =
        _mm_unpacklo_epi64(_mm_unpacklo_epi32(d[0], d[1]), _mm_unpacklo_epi32(d[2], d[3]));
    const __m128i c =
        _mm_unpacklo_epi64(_mm_unpacklo_epi32(d[4], d[5]), _mm_unpacklo_epi32(d[6], d[7]));
    const __m256i v = _mm256_inserti128_si256(_mm256_castsi128_si256(a), c, 1);
    const __m256i lo = _mm256_and_si256(v, _mm256_set1_epi32(0xFFFF));
    const __m256i hi = _mm256_srli_epi32(v, 16);
    *s = _mm256_cvtph_ps(
        _mm_packus_epi32(_mm256_castsi256_si128(lo), _mm256_extracti128_si256(lo, 1)));
    *b = _mm256_cvtph_ps(
        _mm_packus_epi32(_mm256_castsi256_si128(hi), _mm256_extracti128_si256(hi, 1)));
}

/* the canonical float steps of 8 units: P = fma((float) I, s * dx, P), then (asym)
   P = fma(b, xs, P), lane by lane */
static inline __m256 gv_fstep(__m256 P, __m256i I, __m256 s, __m256 dx, int asym, __m256 b,
                              __m256 xs) {
    P = _mm256_fmadd_ps(_mm256_cvtepi32_ps(I), _mm256_mul_ps(s, dx), P);
    return asym ? _mm256_fmadd_ps(b, xs, P) : P;
}

/* the canonical tree over P[0..15] = (lo lanes 0..7, hi lanes 0..7) */
static inline float gv_tree(__m256 lo, __m256 hi) {
    const __m256 l1 = _mm256_add_ps(lo, hi);
    const __m128 l2 = _mm_add_ps(_mm256_castps256_ps128(l1), _mm256_extractf128_ps(l1, 1));
    const __m128 l3 = _mm_add_ps(l2, _mm_movehl_ps(l2, l2));
    return _mm_cvtss_f32(_mm_add_ss(l3, _mm_shuffle_ps(l3, l3, 1)));
}

#endif
