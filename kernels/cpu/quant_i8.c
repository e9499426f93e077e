/* 8-bit activations for prompt rows: quant.c's mode LOOM_Q_PREFILL (5) on AVX-512 VNNI builds.

   Why: the batch-invariant kernels (quant_bi.c) quantize activations to 16 bits and multiply
   with vpdpwssd, 32 multiply-adds an instruction. A prompt's prefill (thousands of rows a step)
   is compute-bound there, while llama.cpp quantizes its activations to 8 bits (q8_0 / q8_K) and
   gets 64 multiply-adds from each vpdpbusd. This kernel does the same for the rows of a prompt
   (the forward passes mode 5 only for a step whose every row is a prompt row: cpu_forward.py);
   decode and draft-verify rows keep mode 4 / 3, so greedy speculation still equals plain
   decoding bit for bit.

   The arithmetic, per (row n, token t), whatever T, the thread count or the token's place in
   the tile (so a prompt's rows do not depend on how its prefill is split into chunks):
   - activations: per block of 32 values, dx = max|x| / 127 and codes q = sign(v) floor(|v| + 0.5),
     v = x * (1 / dx), clamped to [-127, 127] (quant_ref.quantize_act_ref's steps);
   - weights: quant_bi.c's row decode (int16 codes w, per unit of G = 32 values (Q6_K: 16) a
     scale s and for Q4_1 / Q5_1 / Q4_K an offset b), stored as unsigned bytes u = w + o (o:
     128 / 8 / 16 / 32 for Q8_0 / Q4_0 / Q5_0 / Q6_K, else 0), so vpdpbusd's unsigned operand;
   - unit j: I_j = sum u q - o * sum q, an exact int32 (= sum w q);
   - y = ((accumulate ? y : 0) + P) + bias with P from +0 over the units in increasing j:
       P = fma((float) I_j, s_j * dx_j, P);   asym: P = fma(b_j, xs_j, P), xs_j = dx_j * sum q.
   AVX2 + FMA builds without AVX-512 VNNI take quant_i8_avx2.c's kernel (the same arithmetic,
   bitwise); types without a kernel, and builds without either, take mode 4 (auto) instead. */

#include "loom_cpu.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define I8_AVX512 1
#else
#define I8_AVX512 0
#endif

enum { IQ8_0 = 0, IQ4_0 = 1, IQ4_1 = 2, IQ4_K = 3, IQ6_K = 4, IQ5_0 = 5, IQ5_1 = 6 };

float loom_q_i8_resid = 1e-3f; /* loom_cpu.h */

int loom_q_i8_type(int qtype) {
    return (I8_AVX512 || loom_q_i8_avx2_built()) && qtype >= IQ8_0 && qtype <= IQ5_1;
}

#if I8_AVX512
#define I8_ROWS 4 /* rows of one pass */
#define I8_TOK 16 /* tokens of one group (the lanes of a zmm) */
#define I8_BLOCK 32 /* rows decoded at once, each used by every token group */


/* codes of v (|v| <= ~127): sign(v) floor(|v| + 0.5), at most 127 */
static inline __m512i i8_round(__m512 v) {
    const __m512 r = _mm512_min_ps(_mm512_roundscale_ps(_mm512_add_ps(_mm512_abs_ps(v), _mm512_set1_ps(0.5f)),
                                                        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC),
                                   _mm512_set1_ps(127.f));
    const __m512i m = _mm512_cvttps_epi32(r);
    return _mm512_mask_sub_epi32(m, _mm512_cmplt_ps_mask(v, _mm512_setzero_ps()), _mm512_setzero_si512(), m);
}

/* one token: x [K] -> codes q [K] and residual codes q2 [K], per unit dx, dx2 = dx / 254, xs =
   dx * sum q + dx2 * sum q2, co = -o * sum q, co2 = -o * sum q2, nz = whether q2 has a nonzero */
static void i8_quantize(const float* x, int64_t K, int G, int off, int8_t* q, int8_t* q2,
                        float* dxu, float* dx2u, float* xsu, int32_t* cou, int32_t* co2u,
                        uint8_t* nz) {
    for (int64_t k0 = 0; k0 < K; k0 += 32) {
        const __m512 a0 = _mm512_loadu_ps(x + k0), a1 = _mm512_loadu_ps(x + k0 + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a0), _mm512_abs_ps(a1)));
        const float dd = amax / 127.f;
        const __m512 inv = _mm512_set1_ps(dd > 0 ? 1.f / dd : 0.f);
        const float d2 = dd / 254.f;
        int sum[2], sum2[2];
        __m512 e[2], ee = _mm512_setzero_ps(), xx = _mm512_setzero_ps();
        for (int h = 0; h < 2; h++) {
            const __m512 a = h ? a1 : a0;
            const __m512i c = i8_round(_mm512_mul_ps(a, inv));
            _mm_storeu_si128((__m128i*)(q + k0 + 16 * h), _mm512_cvtepi32_epi8(c));
            sum[h] = _mm512_reduce_add_epi32(c);
            e[h] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(c), _mm512_set1_ps(dd), a);
            ee = _mm512_fmadd_ps(e[h], e[h], ee);
            xx = _mm512_fmadd_ps(a, a, xx);
        }
        /* the residual plane where 8 bits leave the block coarse (an outlier sets dx): its
           error energy above loom_q_i8_resid of the energy of the values but the largest */
        const int resid = d2 > 0 && _mm512_reduce_add_ps(ee) >
                                        loom_q_i8_resid * (_mm512_reduce_add_ps(xx) - amax * amax);
        const __m512 inv2 = _mm512_set1_ps(resid ? 1.f / d2 : 0.f);
        for (int h = 0; h < 2; h++) {
            const __m512i c = i8_round(_mm512_mul_ps(e[h], inv2));
            _mm_storeu_si128((__m128i*)(q2 + k0 + 16 * h), _mm512_cvtepi32_epi8(c));
            sum2[h] = _mm512_reduce_add_epi32(c);
        }
        for (int h = 0; h < (G == 32 ? 1 : 2); h++) {
            const int u = G == 32 ? (int)(k0 / 32) : (int)(k0 / 16) + h;
            const int s1 = G == 32 ? sum[0] + sum[1] : sum[h], s2 = G == 32 ? sum2[0] + sum2[1] : sum2[h];
            dxu[u] = dd;
            dx2u[u] = d2;
            xsu[u] = dd * (float)s1 + d2 * (float)s2;
            cou[u] = -off * s1;
            co2u[u] = -off * s2;
            nz[u] = (uint8_t)resid;
        }
    }
}

/* the residual plane of a token group pair: xr as xp, dx2 / co2 as dxt / cot, fl [TG][nu]
   (fstride apart): whether a token of the group has residual codes in the unit */
typedef struct {
    const int32_t* xr;
    const float* dx2;
    const int32_t* co2;
    const uint8_t* fl;
    int64_t fstride;
} I8Res;

/* I8_ROWS rows (u [K] bytes each, s / b per unit) against TG groups of 16 tokens: xp
   [TG][K / 4][16] code quads, xstride apart; dxt / xst / cot [TG][nu][16], sstride apart;
   sums [TG][I8_ROWS][16]. Each quad: TG activation loads, I8_ROWS weight broadcasts,
   TG * I8_ROWS vpdpbusd (64 multiply-adds each). */
static inline __attribute__((always_inline)) void i8_tile_core(
    const uint8_t* const* u, const float* const* s, const float* const* b, int asym, int64_t K,
    const int G, const int TG, const int32_t* xp, int64_t xstride, const float* dxt,
    const float* xst, const int32_t* cot, int64_t sstride, const I8Res* res, float* sums) {
    const int64_t nu = K / G;
    __m512 P[2][I8_ROWS];
    for (int g = 0; g < TG; g++)
        for (int r = 0; r < I8_ROWS; r++) P[g][r] = _mm512_setzero_ps();
    for (int64_t j = 0; j < nu; j++) {
        /* two accumulator sets (even / odd quads): independent vpdpbusd chains; the offset
           term starts the first set */
        __m512i acc[2][I8_ROWS], acc2[2][I8_ROWS];
        for (int g = 0; g < TG; g++) {
            const __m512i co = _mm512_loadu_si512((const void*)(cot + g * sstride + j * 16));
            for (int r = 0; r < I8_ROWS; r++) {
                acc[g][r] = co;
                acc2[g][r] = _mm512_setzero_si512();
            }
        }
        const int32_t* xj = xp + j * G / 4 * 16;
#pragma GCC unroll 8
        for (int p = 0; p < G / 4; p += 2) {
            __m512i x[2], x2[2];
            for (int g = 0; g < TG; g++) {
                x[g] = _mm512_loadu_si512((const void*)(xj + g * xstride + 16 * p));
                x2[g] = _mm512_loadu_si512((const void*)(xj + g * xstride + 16 * p + 16));
            }
            for (int r = 0; r < I8_ROWS; r++) {
                int32_t quad, quad2;
                memcpy(&quad, u[r] + j * G + 4 * p, 4);
                memcpy(&quad2, u[r] + j * G + 4 * p + 4, 4);
                const __m512i wv = _mm512_set1_epi32(quad), wv2 = _mm512_set1_epi32(quad2);
                for (int g = 0; g < TG; g++) {
                    acc[g][r] = _mm512_dpbusd_epi32(acc[g][r], wv, x[g]);
                    acc2[g][r] = _mm512_dpbusd_epi32(acc2[g][r], wv2, x2[g]);
                }
            }
        }
        for (int g = 0; g < TG; g++) {
            const __m512 dx = _mm512_loadu_ps(dxt + g * sstride + j * 16);
            for (int r = 0; r < I8_ROWS; r++) {
                const __m512 sd = _mm512_mul_ps(_mm512_set1_ps(s[r][j]), dx);
                const __m512i I = _mm512_add_epi32(acc[g][r], acc2[g][r]);
                P[g][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(I), sd, P[g][r]);
            }
        }
        /* the residual plane, where a token of the pass has one in this unit: a token without
           it adds fma(0, ., P) = P (P is never -0), so the bits do not depend on its neighbours */
        if (res->fl[j] || (TG == 2 && res->fl[res->fstride + j])) {
            for (int g = 0; g < TG; g++) {
                const __m512i co = _mm512_loadu_si512((const void*)(res->co2 + g * sstride + j * 16));
                for (int r = 0; r < I8_ROWS; r++) acc[g][r] = co;
            }
            const int32_t* rj = res->xr + j * G / 4 * 16;
            for (int p = 0; p < G / 4; p++) {
                __m512i x[2];
                for (int g = 0; g < TG; g++) x[g] = _mm512_loadu_si512((const void*)(rj + g * xstride + 16 * p));
                for (int r = 0; r < I8_ROWS; r++) {
                    int32_t quad;
                    memcpy(&quad, u[r] + j * G + 4 * p, 4);
                    const __m512i wv = _mm512_set1_epi32(quad);
                    for (int g = 0; g < TG; g++) acc[g][r] = _mm512_dpbusd_epi32(acc[g][r], wv, x[g]);
                }
            }
            for (int g = 0; g < TG; g++) {
                const __m512 dx2 = _mm512_loadu_ps(res->dx2 + g * sstride + j * 16);
                for (int r = 0; r < I8_ROWS; r++)
                    P[g][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[g][r]),
                                              _mm512_mul_ps(_mm512_set1_ps(s[r][j]), dx2), P[g][r]);
            }
        }
        if (asym)
            for (int g = 0; g < TG; g++) {
                const __m512 xs = _mm512_loadu_ps(xst + g * sstride + j * 16);
                for (int r = 0; r < I8_ROWS; r++)
                    P[g][r] = _mm512_fmadd_ps(_mm512_set1_ps(b[r][j]), xs, P[g][r]);
            }
    }
    for (int g = 0; g < TG; g++)
        for (int r = 0; r < I8_ROWS; r++) _mm512_storeu_ps(sums + 16 * (g * I8_ROWS + r), P[g][r]);
}

/* i8_tile_core specialised: G 32 or 16, one or two token groups */
static void i8_tile(const uint8_t* const* u, const float* const* s, const float* const* b,
                    int asym, int64_t K, int G, int TG, const int32_t* xp, int64_t xstride,
                    const float* dxt, const float* xst, const int32_t* cot, int64_t sstride,
                    const I8Res* res, float* sums) {
    if (G == 32 && TG == 2)
        i8_tile_core(u, s, b, asym, K, 32, 2, xp, xstride, dxt, xst, cot, sstride, res, sums);
    else if (G == 32)
        i8_tile_core(u, s, b, asym, K, 32, 1, xp, xstride, dxt, xst, cot, sstride, res, sums);
    else if (TG == 2)
        i8_tile_core(u, s, b, asym, K, 16, 2, xp, xstride, dxt, xst, cot, sstride, res, sums);
    else
        i8_tile_core(u, s, b, asym, K, 16, 1, xp, xstride, dxt, xst, cot, sstride, res, sums);
}

/* loom_q_matmul_i8's per-thread work on one block of up to I8_BLOCK rows from n0 */
typedef struct {
    int qtype, G, asym, off;
    const uint8_t* w;
    int64_t N, K, row_bytes, T, ntg, nu;
    const int32_t *xp, *xr;
    const float *dxt, *xst, *dx2t;
    const int32_t *cot, *co2t;
    const uint8_t* flt; /* [ntg][nu] */
    const float* bias;
    float* y;
    int64_t ldy;
    int accumulate;
} I8Job;

static void i8_block(const I8Job* jb, int64_t n0, uint8_t* ud, int16_t* wd, float* sd, float* bd,
                     uint8_t* scratch, float* s16, float* b16) {
    const int64_t K = jb->K, nu = jb->nu, N = jb->N, T = jb->T;
    const int R = N - n0 < I8_BLOCK ? (int)(N - n0) : I8_BLOCK;
    const __m512i o16 = _mm512_set1_epi16((short)jb->off);
    for (int r = 0; r < R; r++) {
        if (n0 + I8_BLOCK + r < N) /* the next block's row (see quant_bi.c's tile loop) */
            for (int64_t o = 0; o < jb->row_bytes; o += 64)
                _mm_prefetch((const char*)(jb->w + (n0 + I8_BLOCK + r) * jb->row_bytes + o), _MM_HINT_T1);
        loom_q_decode_row16(jb->qtype, jb->w + (n0 + r) * jb->row_bytes, K, wd, sd + r * nu,
                            bd + r * nu, scratch, s16, b16);
        for (int64_t k = 0; k < K; k += 32)
            _mm256_storeu_si256((__m256i*)(ud + r * K + k),
                                _mm512_cvtepi16_epi8(_mm512_add_epi16(_mm512_loadu_si512((const void*)(wd + k)), o16)));
    }
    for (int64_t g0 = 0; g0 < jb->ntg; g0 += 2) {
        const int TG = jb->ntg - g0 >= 2 ? 2 : 1;
        for (int r0 = 0; r0 < R; r0 += I8_ROWS) {
            const int RR = R - r0 < I8_ROWS ? R - r0 : I8_ROWS;
            const uint8_t* ur[I8_ROWS];
            const float* sr[I8_ROWS];
            const float* br[I8_ROWS];
            for (int r = 0; r < I8_ROWS; r++) { /* rows past RR repeat r0: computed, dropped */
                const int rr = r0 + (r < RR ? r : 0);
                ur[r] = ud + rr * K;
                sr[r] = sd + rr * nu;
                br[r] = bd + rr * nu;
            }
            float sums[2 * I8_ROWS * 16];
            const I8Res res = {jb->xr + g0 * (K / 4) * 16, jb->dx2t + g0 * nu * 16,
                               jb->co2t + g0 * nu * 16, jb->flt + g0 * nu, nu};
            i8_tile(ur, sr, br, jb->asym, K, jb->G, TG, jb->xp + g0 * (K / 4) * 16, (K / 4) * 16,
                    jb->dxt + g0 * nu * 16, jb->xst + g0 * nu * 16, jb->cot + g0 * nu * 16, nu * 16,
                    &res, sums);
            for (int g = 0; g < TG; g++) {
                const int64_t t0 = (g0 + g) * I8_TOK;
                if (RR == I8_ROWS && t0 + I8_TOK <= T) {
                    loom_q_put4x16(sums + 16 * g * I8_ROWS, jb->y + t0 * jb->ldy + n0 + r0, jb->ldy,
                                   jb->bias ? jb->bias + n0 + r0 : NULL, jb->accumulate);
                    continue;
                }
                for (int r = 0; r < RR; r++) {
                    const int64_t n = n0 + r0 + r;
                    const float bn = jb->bias ? jb->bias[n] : 0.f;
                    for (int i = 0; i < I8_TOK && t0 + i < T; i++) {
                        float* yo = jb->y + (t0 + i) * jb->ldy + n;
                        *yo = (jb->accumulate ? *yo : 0.f) + sums[16 * (g * I8_ROWS + r) + i] + bn;
                    }
                }
            }
        }
    }
}

static void free_each(void** p, int n) {
    for (int i = 0; i < n; i++) free(p[i]);
}
#endif

/* loom_q_matmul's LOOM_Q_PREFILL for loom_q_i8_type's types (its arguments; checked there) */
int loom_q_matmul_i8(int qtype, const uint8_t* w, int64_t N, int64_t K, int64_t row_bytes,
                     const float* x, int64_t T, int64_t ldx, const float* bias, float* y,
                     int64_t ldy, int accumulate, int threads) {
#if I8_AVX512
    const int G = q_unit_len(qtype), off = q_sym_offset(qtype);
    const int64_t nu = K / G, ntg = (T + I8_TOK - 1) / I8_TOK;
    if (K % 32) return -1;
    /* [ntg][K / 4][16] quads of codes, [ntg][nu][16] per-unit scales, sums and offsets; the
       last group's missing tokens zero */
    int32_t* xp = aligned_alloc(64, sizeof(int32_t) * (size_t)(ntg * (K / 4) * 16));
    float* dxt = aligned_alloc(64, sizeof(float) * (size_t)(ntg * nu * 16));
    float* xst = aligned_alloc(64, sizeof(float) * (size_t)(ntg * nu * 16));
    int32_t* cot = aligned_alloc(64, sizeof(int32_t) * (size_t)(ntg * nu * 16));
    int32_t* xr = aligned_alloc(64, sizeof(int32_t) * (size_t)(ntg * (K / 4) * 16));
    float* dx2t = aligned_alloc(64, sizeof(float) * (size_t)(ntg * nu * 16));
    int32_t* co2t = aligned_alloc(64, sizeof(int32_t) * (size_t)(ntg * nu * 16));
    uint8_t* flt = calloc((size_t)(ntg * nu), 1);
    uint8_t* nzt = calloc((size_t)(T * nu + 16), 1); /* [T][nu]: i8_quantize's nz per token */
    void* held[] = {xp, dxt, xst, cot, xr, dx2t, co2t, flt, nzt}; /* freed on either return */
    const int nheld = (int)(sizeof held / sizeof *held);
    if (!nzt || !xp || !dxt || !xst || !cot || !xr || !dx2t || !co2t || !flt) {
        free_each(held, nheld);
        return -2;
    }
    if (threads < 1) threads = 1;
    for (int64_t t = T; t < ntg * I8_TOK; t++) {
        const int64_t g = t / I8_TOK, i = t % I8_TOK;
        for (int64_t p = 0; p < K / 4; p++) xp[(g * (K / 4) + p) * 16 + i] = xr[(g * (K / 4) + p) * 16 + i] = 0;
        for (int64_t j = 0; j < nu; j++) {
            dxt[(g * nu + j) * 16 + i] = xst[(g * nu + j) * 16 + i] = dx2t[(g * nu + j) * 16 + i] = 0.f;
            cot[(g * nu + j) * 16 + i] = co2t[(g * nu + j) * 16 + i] = 0;
        }
    }
    const I8Job jb = {qtype, G, q_is_asym(qtype), off, w, N, K, row_bytes, T, ntg, nu, xp, xr, dxt,
                      xst, dx2t, cot, co2t, flt, bias, y, ldy, accumulate};
    const int64_t nblocks = (N + I8_BLOCK - 1) / I8_BLOCK;
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        int8_t* q = malloc((size_t)K + 64);
        int8_t* q2 = malloc((size_t)K + 64);
        float* dx2u = malloc(sizeof(float) * (size_t)(nu + 16));
        int32_t* co2u = malloc(sizeof(int32_t) * (size_t)(nu + 16));
        float* dxu = malloc(sizeof(float) * (size_t)(nu + 16));
        float* xsu = malloc(sizeof(float) * (size_t)(nu + 16));
        int32_t* cou = malloc(sizeof(int32_t) * (size_t)(nu + 16));
        uint8_t* ud = malloc((size_t)(I8_BLOCK * K + 64));
        int16_t* wd = malloc(sizeof(int16_t) * (size_t)(K + 64));
        float* sd = malloc(sizeof(float) * (size_t)(I8_BLOCK * nu + 16));
        float* bd = malloc(sizeof(float) * (size_t)(I8_BLOCK * nu + 16));
        uint8_t* scratch = malloc((size_t)K + 64);
        float* s16 = malloc(sizeof(float) * (size_t)(K / 16 + 1));
        float* b16 = malloc(sizeof(float) * (size_t)(K / 16 + 1));
        const int ok = q && q2 && dx2u && co2u && dxu && xsu && cou && ud && wd && sd && bd && scratch && s16 && b16;
        if (!ok) failed = 1;
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++) {
            if (!ok) continue;
            i8_quantize(x + t * ldx, K, G, off, q, q2, dxu, dx2u, xsu, cou, co2u, nzt + t * nu);
            const int64_t g = t / I8_TOK, i = t % I8_TOK;
            int32_t* xo = xp + g * (K / 4) * 16 + i;
            int32_t* xro = xr + g * (K / 4) * 16 + i;
            for (int64_t p = 0; p < K / 4; p++) {
                memcpy(xo + 16 * p, q + 4 * p, 4);
                memcpy(xro + 16 * p, q2 + 4 * p, 4);
            }
            for (int64_t j = 0; j < nu; j++) {
                dxt[(g * nu + j) * 16 + i] = dxu[j];
                xst[(g * nu + j) * 16 + i] = xsu[j];
                cot[(g * nu + j) * 16 + i] = cou[j];
                dx2t[(g * nu + j) * 16 + i] = dx2u[j];
                co2t[(g * nu + j) * 16 + i] = co2u[j];
            }
        }
#pragma omp for schedule(static)
        for (int64_t g = 0; g < ntg; g++) /* a group's unit has a residual plane if a token does */
            for (int64_t j = 0; j < nu; j++) {
                uint8_t f = 0;
                for (int64_t t = g * I8_TOK; t < T && t < (g + 1) * I8_TOK; t++) f |= nzt[t * nu + j];
                flt[g * nu + j] = f;
            }
#pragma omp for schedule(static)
        for (int64_t bl = 0; bl < nblocks; bl++)
            if (ok) i8_block(&jb, bl * I8_BLOCK, ud, wd, sd, bd, scratch, s16, b16);
        free(q);
        free(q2);
        free(dx2u);
        free(co2u);
        free(dxu);
        free(xsu);
        free(cou);
        free(ud);
        free(wd);
        free(sd);
        free(bd);
        free(scratch);
        free(s16);
        free(b16);
    }
    free_each(held, nheld);
    return failed ? -2 : 0;
#else
    if (loom_q_i8_avx2_built())
        return loom_q_matmul_i8_avx2(qtype, w, N, K, row_bytes, x, T, ldx, bias, y, ldy, accumulate,
                                     threads);
    return loom_q_matmul(qtype, 4, w, N, K, row_bytes, x, T, ldx, bias, y, ldy, accumulate, threads);
#endif
}
