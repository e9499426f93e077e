/* Shared pieces of the AVX2 "values as lanes" GEMVs of mode "bi" (quant_gemv_avx2.c; the
   canonical arithmetic is quant_bi.c's file comment). A row's units are taken 8 at a time (a
   "group"); the group's units p and p + 4 (p = 0..3) share a ymm, unit p in the low 128 bits,
   unit p + 4 in the high ones, each as 4 vectors of 8 int16 weights (v = 0..3) whose adjacent
   pairs meet these activation pairs in vpmaddwd (i = 0..3, values of the unit of 32):
     v 0: (4i, 4i + 2)   v 1: (4i + 1, 4i + 3)   v 2: (4i + 16, 4i + 18)   v 3: (4i + 17, 4i + 19)
   (a Q4_x byte's low / high nibbles as words masked / shifted by 0, 8, 4, 12 bits; a Q8_0 or
   Q5_0 byte vector's even / odd bytes sign-extended give the same four). A token's codes are
   packed once per call in that order (gv_pack), the 4 pair vectors' 4 int32 each reduce to one
   ymm of the group's 8 exact unit dots I_j (gv_reduce8, lane k = unit 8g + k), and the float
   steps run on 8 units at once (gv_fstep): lane k of P[g mod 2] is the canonical P[(8g + k) mod 16]
   and gets the group's units in increasing g, so each P[c] sees its units in increasing j.

   Only static inline functions, for builds with AVX2 + FMA + F16C (the includer checks). */
#ifndef LOOM_GEMV_AVX2_H
#define LOOM_GEMV_AVX2_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define GV_GROUP_DW 128 /* int32 activation pairs of one group of 8 units (4 pairs x 4 v x 8) */

/* One token's 16-bit codes q [8 * ng units of 32] (zero past the row's units) -> xp [ng][128]
   int32 pairs in the order above: xp[g][32 p + 8 v + 4 h + i] for unit 8g + p + 4h. */
static inline void gv_pack(const int16_t* q, int64_t ng, int32_t* xp) {
    static const int8_t first[4] = {0, 1, 16, 17}; /* value of pair i = 0, v = 0..3 */
    for (int64_t g = 0; g < ng; g++)
        for (int p = 0; p < 4; p++)
            for (int h = 0; h < 2; h++) {
                const int16_t* u = q + 32 * (8 * g + p + 4 * h);
                int32_t* o = xp + GV_GROUP_DW * g + 32 * p + 4 * h;
                for (int v = 0; v < 4; v++)
                    for (int i = 0; i < 4; i++) {
                        const int a = first[v] + 4 * i;
                        o[8 * v + i] = (int32_t)((uint32_t)(uint16_t)u[a] | (uint32_t)(uint16_t)u[a + 2] << 16);
                    }
            }
}

/* v[p] = [unit p's 4 partial int32 | unit p + 4's] -> lane k = unit k's exact sum */
static inline __m256i gv_reduce8(__m256i v0, __m256i v1, __m256i v2, __m256i v3) {
    return _mm256_hadd_epi32(_mm256_hadd_epi32(v0, v1), _mm256_hadd_epi32(v2, v3));
}

/* the f16 at byte offsets 0 (*s) and 2 (*b) of m <= 8 blocks of `stride` bytes from p, as f32
   (0 past m) */
static inline void gv_f16x8(const uint8_t* p, int stride, int m, __m256* s, __m256* b) {
    int32_t d[8]; /* (inserted into a register: a stored array read as one vector would stall
                     on store forwarding) */
    for (int k = 0; k < 8; k++) {
        d[k] = 0;
        if (k < m) memcpy(&d[k], p + (int64_t)k * stride, 4);
    }
    const __m256i v = _mm256_set_epi32(d[7], d[6], d[5], d[4], d[3], d[2], d[1], d[0]);
    const __m256i lo = _mm256_and_si256(v, _mm256_set1_epi32(0xFFFF));
    const __m256i hi = _mm256_srli_epi32(v, 16);
    *s = _mm256_cvtph_ps(_mm_packus_epi32(_mm256_castsi256_si128(lo), _mm256_extracti128_si256(lo, 1)));
    *b = _mm256_cvtph_ps(_mm_packus_epi32(_mm256_castsi256_si128(hi), _mm256_extracti128_si256(hi, 1)));
}

/* the canonical float steps of 8 units: P = fma((float) I, s * dx, P), then (asym)
   P = fma(b, xs, P), lane by lane */
static inline __m256 gv_fstep(__m256 P, __m256i I, __m256 s, __m256 dx, int asym, __m256 b, __m256 xs) {
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
