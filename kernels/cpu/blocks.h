/* The forward's per-row blocks that heads.c runs too: RMSNorm, neox RoPE, the q/k norm + RoPE
   of a step's attention inputs, the SiLU gate. Included by forward.c and heads.c only, as
   static functions: each library path inlines them where its loops call them, as it did when
   both were one source. */
#ifndef LOOM_BLOCKS_H
#define LOOM_BLOCKS_H

#include "loom_cpu.h"

/* out[D] = w * x / rms(x); out may alias x */
static void rms(const float* x, const float* w, int64_t D, float eps, float* out) {
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int64_t d = 0; d < D; d++) ss += x[d] * x[d];
    const float inv = 1.f / sqrtf(ss / (float)D + eps);
#pragma omp simd
    for (int64_t d = 0; d < D; d++) out[d] = w[d] * (x[d] * inv);
}

static void rope(float* x, const float* c, const float* s, int64_t D) {
    const int64_t half = D / 2;
    for (int64_t i = 0; i < half; i++) {
        const float a = x[i], b = x[i + half];
        x[i] = a * c[i] - b * s[i];
        x[i + half] = b * c[i + half] + a * s[i + half];
    }
}

/* The attention inputs of T tokens in place: token t's H query heads at qkv + t * ld, its Hkv
   key heads right after them (head_dim D); each head RMSNormed by q_norm / k_norm where not
   NULL (Qwen3), then neox-rotated at position pos[t] (cos / sin [max_pos, D]). */
static void qk_norm_rope(float* qkv, int64_t T, int64_t ld, int64_t H, int64_t Hkv, int64_t D,
                         const float* q_norm, const float* k_norm, float eps, const float* cos,
                         const float* sin, const int64_t* pos) {
    for (int64_t t = 0; t < T; t++) {
        float* q = qkv + t * ld;
        float* k = q + H * D;
        const float *c = cos + pos[t] * D, *s = sin + pos[t] * D;
        for (int64_t i = 0; i < H; i++) {
            if (q_norm) rms(q + i * D, q_norm, D, eps, q + i * D);
            rope(q + i * D, c, s, D);
        }
        for (int64_t i = 0; i < Hkv; i++) {
            if (k_norm) rms(k + i * D, k_norm, D, eps, k + i * D);
            rope(k + i * D, c, s, D);
        }
    }
}

/* g[i] = silu(g[i]) * u[i]: AVX2 eight at a time (loom_cpu.h's fast_expf in intrinsics, on
   -g clamped at 80: GCC does not vectorize the scalar loop), libm's expf for the rest */
static void silu_mul(float* g, const float* u, int64_t I) {
    int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
    const __m256 one = _mm256_set1_ps(1.f);
    for (; i + 8 <= I; i += 8) {
        const __m256 gv = _mm256_loadu_ps(g + i);
        const __m256 x =
            _mm256_min_ps(_mm256_sub_ps(_mm256_setzero_ps(), gv), _mm256_set1_ps(80.f));
        const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m256 r =
            _mm256_sub_ps(_mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(0.693145752f))),
                          _mm256_mul_ps(n, _mm256_set1_ps(1.42860677e-6f)));
        __m256 p = _mm256_set1_ps(1.f / 720.f);
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120.f));
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24.f));
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6.f));
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
        p = _mm256_fmadd_ps(p, r, one);
        p = _mm256_fmadd_ps(p, r, one);
        const __m256i e = _mm256_slli_epi32(
            _mm256_add_epi32(_mm256_cvttps_epi32(_mm256_max_ps(n, _mm256_set1_ps(-126.f))),
                             _mm256_set1_epi32(127)),
            23);
        /* exp(x), 0 where x < -87 (g > 87) */
        const __m256 ex = _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e)),
                                        _mm256_cmp_ps(x, _mm256_set1_ps(-87.f), _CMP_GE_OQ));
        _mm256_storeu_ps(g + i, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(one, ex)),
                                              _mm256_loadu_ps(u + i)));
    }
#endif
    for (; i < I; i++) g[i] = g[i] / (1.f + expf(-g[i])) * u[i];
}

#endif
