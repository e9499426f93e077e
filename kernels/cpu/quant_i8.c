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
   Types without the kernel, and builds without AVX-512 VNNI, take mode 4 (auto) instead. */

#include "loom_cpu.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define I8_AVX512 1
#else
#define I8_AVX512 0
#endif

enum { IQ8_0 = 0, IQ4_0 = 1, IQ4_1 = 2, IQ4_K = 3, IQ6_K = 4, IQ5_0 = 5, IQ5_1 = 6 };

int loom_q_i8_type(int qtype) { return I8_AVX512 && qtype >= IQ8_0 && qtype <= IQ5_1; }

#if I8_AVX512
#define I8_ROWS 4 /* rows of one pass */
#define I8_TOK 16 /* tokens of one group (the lanes of a zmm) */
#define I8_BLOCK 32 /* rows decoded at once, each used by every token group */

static int i8_unit(int qtype) { return qtype == IQ6_K ? 16 : 32; }
static int i8_asym(int qtype) { return qtype == IQ4_1 || qtype == IQ5_1 || qtype == IQ4_K; }
static int i8_offset(int qtype) {
    switch (qtype) {
        case IQ8_0: return 128;
        case IQ4_0: return 8;
        case IQ5_0: return 16;
        case IQ6_K: return 32;
        default: return 0;
    }
}

/* one token: x [K] -> codes q [K], per unit dx, xs = dx * sum q and co = -o * sum q */
static void i8_quantize(const float* x, int64_t K, int G, int off, int8_t* q, float* dxu,
                        float* xsu, int32_t* cou) {
    const __m512 half = _mm512_set1_ps(0.5f), lim = _mm512_set1_ps(127.f);
    for (int64_t k0 = 0; k0 < K; k0 += 32) {
        const __m512 a0 = _mm512_loadu_ps(x + k0), a1 = _mm512_loadu_ps(x + k0 + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a0), _mm512_abs_ps(a1)));
        const float dd = amax / 127.f;
        const __m512 inv = _mm512_set1_ps(dd > 0 ? 1.f / dd : 0.f);
        int sum[2];
        for (int h = 0; h < 2; h++) {
            const __m512 v = _mm512_mul_ps(h ? a1 : a0, inv);
            const __m512 r = _mm512_min_ps(_mm512_roundscale_ps(_mm512_add_ps(_mm512_abs_ps(v), half),
                                                                _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC),
                                           lim);
            const __m512i m = _mm512_cvttps_epi32(r);
            const __m512i c = _mm512_mask_sub_epi32(m, _mm512_cmplt_ps_mask(v, _mm512_setzero_ps()),
                                                    _mm512_setzero_si512(), m);
            _mm_storeu_si128((__m128i*)(q + k0 + 16 * h), _mm512_cvtepi32_epi8(c));
            sum[h] = _mm512_reduce_add_epi32(c);
        }
        if (G == 32) {
            dxu[k0 / 32] = dd;
            xsu[k0 / 32] = dd * (float)(sum[0] + sum[1]);
            cou[k0 / 32] = -off * (sum[0] + sum[1]);
        } else {
            for (int h = 0; h < 2; h++) {
                dxu[k0 / 16 + h] = dd;
                xsu[k0 / 16 + h] = dd * (float)sum[h];
                cou[k0 / 16 + h] = -off * sum[h];
            }
        }
    }
}

/* I8_ROWS rows (u [K] bytes each, s / b per unit) against TG groups of 16 tokens: xp
   [TG][K / 4][16] code quads, xstride apart; dxt / xst / cot [TG][nu][16], sstride apart;
   sums [TG][I8_ROWS][16]. Each quad: TG activation loads, I8_ROWS weight broadcasts,
   TG * I8_ROWS vpdpbusd (64 multiply-adds each). */
static inline __attribute__((always_inline)) void i8_tile_core(
    const uint8_t* const* u, const float* const* s, const float* const* b, int asym, int64_t K,
    const int G, const int TG, const int32_t* xp, int64_t xstride, const float* dxt,
    const float* xst, const int32_t* cot, int64_t sstride, float* sums) {
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
            const __m512 xs = asym ? _mm512_loadu_ps(xst + g * sstride + j * 16) : _mm512_setzero_ps();
            for (int r = 0; r < I8_ROWS; r++) {
                const __m512 sd = _mm512_mul_ps(_mm512_set1_ps(s[r][j]), dx);
                const __m512i I = _mm512_add_epi32(acc[g][r], acc2[g][r]);
                P[g][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(I), sd, P[g][r]);
                if (asym) P[g][r] = _mm512_fmadd_ps(_mm512_set1_ps(b[r][j]), xs, P[g][r]);
            }
        }
    }
    for (int g = 0; g < TG; g++)
        for (int r = 0; r < I8_ROWS; r++) _mm512_storeu_ps(sums + 16 * (g * I8_ROWS + r), P[g][r]);
}

/* i8_tile_core specialised: G 32 or 16, one or two token groups */
static void i8_tile(const uint8_t* const* u, const float* const* s, const float* const* b,
                    int asym, int64_t K, int G, int TG, const int32_t* xp, int64_t xstride,
                    const float* dxt, const float* xst, const int32_t* cot, int64_t sstride,
                    float* sums) {
    if (G == 32 && TG == 2)
        i8_tile_core(u, s, b, asym, K, 32, 2, xp, xstride, dxt, xst, cot, sstride, sums);
    else if (G == 32)
        i8_tile_core(u, s, b, asym, K, 32, 1, xp, xstride, dxt, xst, cot, sstride, sums);
    else if (TG == 2)
        i8_tile_core(u, s, b, asym, K, 16, 2, xp, xstride, dxt, xst, cot, sstride, sums);
    else
        i8_tile_core(u, s, b, asym, K, 16, 1, xp, xstride, dxt, xst, cot, sstride, sums);
}

/* loom_q_matmul_i8's per-thread work on one block of up to I8_BLOCK rows from n0 */
typedef struct {
    int qtype, G, asym, off;
    const uint8_t* w;
    int64_t N, K, row_bytes, T, ntg, nu;
    const int32_t* xp;
    const float *dxt, *xst;
    const int32_t* cot;
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
            i8_tile(ur, sr, br, jb->asym, K, jb->G, TG, jb->xp + g0 * (K / 4) * 16, (K / 4) * 16,
                    jb->dxt + g0 * nu * 16, jb->xst + g0 * nu * 16, jb->cot + g0 * nu * 16, nu * 16,
                    sums);
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
#endif

/* loom_q_matmul's LOOM_Q_PREFILL for loom_q_i8_type's types (its arguments; checked there) */
int loom_q_matmul_i8(int qtype, const uint8_t* w, int64_t N, int64_t K, int64_t row_bytes,
                     const float* x, int64_t T, int64_t ldx, const float* bias, float* y,
                     int64_t ldy, int accumulate, int threads) {
#if I8_AVX512
    const int G = i8_unit(qtype), off = i8_offset(qtype);
    const int64_t nu = K / G, ntg = (T + I8_TOK - 1) / I8_TOK;
    if (K % 32) return -1;
    /* [ntg][K / 4][16] quads of codes, [ntg][nu][16] per-unit scales, sums and offsets; the
       last group's missing tokens zero */
    int32_t* xp = aligned_alloc(64, sizeof(int32_t) * (size_t)(ntg * (K / 4) * 16));
    float* dxt = aligned_alloc(64, sizeof(float) * (size_t)(ntg * nu * 16));
    float* xst = aligned_alloc(64, sizeof(float) * (size_t)(ntg * nu * 16));
    int32_t* cot = aligned_alloc(64, sizeof(int32_t) * (size_t)(ntg * nu * 16));
    if (!xp || !dxt || !xst || !cot) {
        free(xp);
        free(dxt);
        free(xst);
        free(cot);
        return -2;
    }
    if (threads < 1) threads = 1;
    for (int64_t t = T; t < ntg * I8_TOK; t++) {
        const int64_t g = t / I8_TOK, i = t % I8_TOK;
        for (int64_t p = 0; p < K / 4; p++) xp[(g * (K / 4) + p) * 16 + i] = 0;
        for (int64_t j = 0; j < nu; j++) {
            dxt[(g * nu + j) * 16 + i] = xst[(g * nu + j) * 16 + i] = 0.f;
            cot[(g * nu + j) * 16 + i] = 0;
        }
    }
    const I8Job jb = {qtype, G, i8_asym(qtype), off, w, N, K, row_bytes, T, ntg, nu, xp, dxt, xst,
                      cot, bias, y, ldy, accumulate};
    const int64_t nblocks = (N + I8_BLOCK - 1) / I8_BLOCK;
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        int8_t* q = malloc((size_t)K + 64);
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
        const int ok = q && dxu && xsu && cou && ud && wd && sd && bd && scratch && s16 && b16;
        if (!ok) failed = 1;
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++) {
            if (!ok) continue;
            i8_quantize(x + t * ldx, K, G, off, q, dxu, xsu, cou);
            const int64_t g = t / I8_TOK, i = t % I8_TOK;
            int32_t* xo = xp + g * (K / 4) * 16 + i;
            for (int64_t p = 0; p < K / 4; p++) memcpy(xo + 16 * p, q + 4 * p, 4);
            for (int64_t j = 0; j < nu; j++) {
                dxt[(g * nu + j) * 16 + i] = dxu[j];
                xst[(g * nu + j) * 16 + i] = xsu[j];
                cot[(g * nu + j) * 16 + i] = cou[j];
            }
        }
#pragma omp for schedule(static)
        for (int64_t bl = 0; bl < nblocks; bl++)
            if (ok) i8_block(&jb, bl * I8_BLOCK, ud, wd, sd, bd, scratch, s16, b16);
        free(q);
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
    free(xp);
    free(dxt);
    free(xst);
    free(cot);
    return failed ? -2 : 0;
#else
    return loom_q_matmul(qtype, 4, w, N, K, row_bytes, x, T, ldx, bias, y, ldy, accumulate, threads);
#endif
}
