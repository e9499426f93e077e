/* Small AVX2 pieces shared by kernels/cpu's AVX2 code (attn_avx2.c, forward.c's gelu, the tiles'
   output stores): one copy each, so their bits cannot drift apart.

   Only static inline functions, for builds with AVX2 (the includer checks). */
#ifndef LOOM_SIMD_AVX2_H
#define LOOM_SIMD_AVX2_H

#include <immintrin.h>

/* loom_cpu.h's fast_expf on 8 lanes: the same IEEE operations in the same order, element by
   element (rint in the current rounding mode, the two-constant ln 2 reduction, the degree-6
   Horner polynomial, the exponent clamped at -126, 0 below -87), so each lane is fast_expf's
   bits. No FMA: the scalar builds with -std=c11 (no contraction), so every product is rounded
   before its add. */
static inline __attribute__((always_inline)) __m256 fast_exp8(__m256 x) {
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                     _MM_FROUND_CUR_DIRECTION);
    const __m256 r = _mm256_sub_ps(_mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(0.693145752f))),
                                   _mm256_mul_ps(n, _mm256_set1_ps(1.42860677e-6f)));
    __m256 p = _mm256_set1_ps(1.f / 720.f);
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.f / 120.f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.f / 24.f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.f / 6.f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(0.5f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.f));
    const __m256 lo = _mm256_set1_ps(-126.f);
    const __m256 nc = _mm256_blendv_ps(n, lo, _mm256_cmp_ps(n, lo, _CMP_LT_OQ));
    const __m256i e = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvttps_epi32(nc), _mm256_set1_epi32(127)), 23);
    const __m256 v = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
    return _mm256_andnot_ps(_mm256_cmp_ps(x, _mm256_set1_ps(-87.f), _CMP_LT_OQ), v);
}

/* The 8 x 8 transpose in place: afterwards lane r of a[l] is what lane l of a[r] was */
static inline __attribute__((always_inline)) void transpose8_ps(__m256* a) {
    const __m256 t0 = _mm256_unpacklo_ps(a[0], a[1]), t1 = _mm256_unpackhi_ps(a[0], a[1]);
    const __m256 t2 = _mm256_unpacklo_ps(a[2], a[3]), t3 = _mm256_unpackhi_ps(a[2], a[3]);
    const __m256 t4 = _mm256_unpacklo_ps(a[4], a[5]), t5 = _mm256_unpackhi_ps(a[4], a[5]);
    const __m256 t6 = _mm256_unpacklo_ps(a[6], a[7]), t7 = _mm256_unpackhi_ps(a[6], a[7]);
    const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
    const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
    const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    a[0] = _mm256_permute2f128_ps(u0, u4, 0x20);
    a[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
    a[2] = _mm256_permute2f128_ps(u2, u6, 0x20);
    a[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
    a[4] = _mm256_permute2f128_ps(u0, u4, 0x31);
    a[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
    a[6] = _mm256_permute2f128_ps(u2, u6, 0x31);
    a[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
}

#endif
