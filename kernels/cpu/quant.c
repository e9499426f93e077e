/* Matmuls that read ggml's block-quantized weights (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K, Q5_0, Q5_1)
   in place.

   Weights: N rows of K values, each row `row_bytes` of blocks laid end to end exactly as a GGUF
   file stores them (runtime/layers/quant_types.py). Every layout decodes, per group of 16
   values, to unsigned codes u (0..255) with a float scale s and offset b: value = s * u + b.
   (Q8_0: u = q + 128, b = -128 d; Q4_0: u = nibble, b = -8 d; Q4_1: u = nibble, b = m;
   Q4_K: u = nibble, s = d * sc, b = -dmin * m; Q6_K: u = 6-bit code, s = d * sc, b = -32 s;
   Q5_0: u = 5-bit code, b = -16 d; Q5_1: u = 5-bit code, b = m.)

   Two ways to multiply, chosen by the caller (`mode`):
     LOOM_Q_INT8  activations quantized to int8 per block of 32 (scale max|x| / 127, as ggml's
                  q8 activations), integer dot products u8 x s8 -> i32 per group of 16
                  (AVX-512 VNNI vpdpbusd where the compiler targets it, portable C otherwise),
                  then scaled: y = sum_g dx (s_g * isum_g + b_g * xsum_g).
     LOOM_Q_I16   (Q8_0, Q4_0, Q4_1; T <= 8) activations quantized to 16 bits per block of 32,
                  held as two int8 halves, two integer dot products per block (gemv32_i16,
                  below: why and how); other types take LOOM_Q_INT8 in this mode.
     LOOM_Q_F32   each weight row dequantized to f32 in a thread-local row buffer (L1) and
                  dotted with the f32 activations by FMA: no activation rounding. For every
                  type at T <= 8 in AVX-512 builds: matmul_f32v (below), the blocks
                  expanded to f32 in registers, four rows a pass.
     LOOM_Q_BI    (quant_bi.c) 16-bit activations, one arithmetic for every T: batch-invariant.
     LOOM_Q_AUTO  per call (loom_q_matmul): LOOM_Q_BI at every T for Q8_0 / Q4_0 / Q4_1 /
                  Q5_0 / Q5_1 in AVX-512 VNNI builds (quant_bi.c's 16-row-lane kernel beats
                  matmul_f32v there at 1..8 tokens), else LOOM_Q_F32's matmul_f32v at T <= 8,
                  LOOM_Q_BI above.
     LOOM_Q_PREFILL (quant_i8.c) a prompt's rows: 8-bit activations and vpdpbusd on AVX-512 VNNI
                  builds, one arithmetic for every T; elsewhere LOOM_Q_AUTO.
   Either way a row is decoded once per call and used for all T tokens, so a GEMV (T = 1..8)
   streams the weights once and a GEMM (prefill) reuses the decoded row from L1.

   Threads: rows split statically over an OpenMP team (the pragmas are ignored without it). */

#include "loom_cpu.h"

#if defined(__F16C__) || defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__) && \
    defined(__AVX512VL__)
#define LOOM_Q_VNNI 1
#else
#define LOOM_Q_VNNI 0
#endif

enum { LOOM_Q8_0 = 0, LOOM_Q4_0 = 1, LOOM_Q4_1 = 2, LOOM_Q4_K = 3, LOOM_Q6_K = 4 };
enum { LOOM_Q5_0 = 5, LOOM_Q5_1 = 6 };
enum { LOOM_Q_INT8 = 0, LOOM_Q_F32 = 1, LOOM_Q_I16 = 2, LOOM_Q_BI = 3, LOOM_Q_AUTO = 4, LOOM_Q_PREFILL = 5 };

#define GROUP 16 /* values sharing one (s, b) after decoding */
#define ABLOCK 32 /* activation values sharing one int8 scale */
#define GEMV_MAX 8 /* tokens up to which LOOM_Q_INT8 takes the int8 dot products */

static inline float f16_to_f32(const uint8_t* p) {
#if defined(__F16C__)
    uint16_t v;
    memcpy(&v, p, 2);
    return _cvtsh_ss(v);
#else
    const uint16_t h = (uint16_t)(p[0] | (p[1] << 8));
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else { /* subnormal: normalise */
            exp = 127 - 15 + 1;
            while (!(man & 0x400)) {
                man <<= 1;
                exp--;
            }
            bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (man << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

float loom_q_f16(const uint8_t* p) { return f16_to_f32(p); }

static int block_values(int qtype) { return qtype == LOOM_Q4_K || qtype == LOOM_Q6_K ? 256 : 32; }

static int block_bytes(int qtype) {
    switch (qtype) {
        case LOOM_Q8_0: return 34;
        case LOOM_Q4_0: return 18;
        case LOOM_Q4_1: return 20;
        case LOOM_Q4_K: return 144;
        case LOOM_Q6_K: return 210;
        case LOOM_Q5_0: return 22;
        case LOOM_Q5_1: return 24;
        default: return 0;
    }
}

/* One Q5_0 / Q5_1 block (f16 d | Q5_1: f16 m | 32 high bits qh, little-endian | 16 bytes of
   nibbles) -> 32 codes u = nibble | high bit << 4 (value j: low nibble of qs[j] for j < 16,
   high nibble of qs[j - 16] above, high bit j of qh), as ggml's dequantize_row_q5_0 / _1. */
static void decode_q5_block(int qtype, const uint8_t* blk, uint8_t* u, float* s, float* b) {
    const int q51 = qtype == LOOM_Q5_1;
    const float d = f16_to_f32(blk);
    const float m = q51 ? f16_to_f32(blk + 2) : -16.f * d;
    const uint8_t* hb = blk + (q51 ? 4 : 2);
    const uint32_t qh = (uint32_t)hb[0] | (uint32_t)hb[1] << 8 | (uint32_t)hb[2] << 16 |
                        (uint32_t)hb[3] << 24;
    const uint8_t* qs = hb + 4;
    for (int j = 0; j < 16; j++) {
        u[j] = (uint8_t)((qs[j] & 0xF) | ((qh >> j) & 1) << 4);
        u[j + 16] = (uint8_t)((qs[j] >> 4) | ((qh >> (j + 16)) & 1) << 4);
    }
    s[0] = s[1] = d;
    b[0] = b[1] = m;
}

/* One row of K values -> codes u [K], scales s and offsets b [K / 16]. */
static void decode_row(int qtype, const uint8_t* row, int64_t K, uint8_t* u, float* s, float* b) {
    const int64_t nb = K / block_values(qtype);
    const int bb = block_bytes(qtype);
    for (int64_t i = 0; i < nb; i++) {
        const uint8_t* blk = row + i * bb;
        if (qtype == LOOM_Q5_0 || qtype == LOOM_Q5_1) {
            decode_q5_block(qtype, blk, u + 32 * i, s + 2 * i, b + 2 * i);
        } else if (qtype == LOOM_Q8_0) {
            const float d = f16_to_f32(blk);
            for (int j = 0; j < 32; j++) u[32 * i + j] = (uint8_t)((int8_t)blk[2 + j] + 128);
            s[2 * i] = s[2 * i + 1] = d;
            b[2 * i] = b[2 * i + 1] = -128.f * d;
        } else if (qtype == LOOM_Q4_0 || qtype == LOOM_Q4_1) {
            const float d = f16_to_f32(blk);
            const float m = qtype == LOOM_Q4_1 ? f16_to_f32(blk + 2) : -8.f * d;
            const uint8_t* qs = blk + (qtype == LOOM_Q4_1 ? 4 : 2);
            for (int j = 0; j < 16; j++) {
                u[32 * i + j] = qs[j] & 0xF;
                u[32 * i + j + 16] = qs[j] >> 4;
            }
            s[2 * i] = s[2 * i + 1] = d;
            b[2 * i] = b[2 * i + 1] = m;
        } else if (qtype == LOOM_Q4_K) {
            const float d = f16_to_f32(blk), dmin = f16_to_f32(blk + 2);
            const uint8_t* scales = blk + 4;
            const uint8_t* qs = blk + 16;
            uint8_t* uo = u + 256 * i;
            for (int c = 0; c < 4; c++) { /* 64 values: low nibbles, then high nibbles */
                for (int l = 0; l < 32; l++) {
                    uo[64 * c + l] = qs[32 * c + l] & 0xF;
                    uo[64 * c + 32 + l] = qs[32 * c + l] >> 4;
                }
                for (int h = 0; h < 2; h++) {
                    uint8_t sc, mn;
                    k4_scale_min(2 * c + h, scales, &sc, &mn);
                    const int64_t g = 16 * i + 4 * c + 2 * h; /* two groups of 16 per sub-block */
                    s[g] = s[g + 1] = d * sc;
                    b[g] = b[g + 1] = -dmin * mn;
                }
            }
        } else { /* Q6_K */
            const uint8_t* ql = blk;
            const uint8_t* qh = blk + 128;
            const int8_t* sc = (const int8_t*)(blk + 192);
            const float d = f16_to_f32(blk + 208);
            uint8_t* uo = u + 256 * i;
            for (int n = 0; n < 2; n++) {
                for (int l = 0; l < 32; l++) {
                    const uint8_t h = qh[32 * n + l];
                    const uint8_t* q = ql + 64 * n;
                    uo[128 * n + l] = (uint8_t)((q[l] & 0xF) | ((h & 3) << 4));
                    uo[128 * n + l + 32] = (uint8_t)((q[l + 32] & 0xF) | (((h >> 2) & 3) << 4));
                    uo[128 * n + l + 64] = (uint8_t)((q[l] >> 4) | (((h >> 4) & 3) << 4));
                    uo[128 * n + l + 96] = (uint8_t)((q[l + 32] >> 4) | (((h >> 6) & 3) << 4));
                }
            }
            for (int g = 0; g < 16; g++) {
                s[16 * i + g] = d * sc[g];
                b[16 * i + g] = -32.f * d * sc[g];
            }
        }
    }
}

void loom_q_decode_row(int qtype, const uint8_t* row, int64_t K, uint8_t* u, float* s, float* b) {
    decode_row(qtype, row, K, u, s, b);
}

/* x [T, K] f32 -> xq [T, K] int8, dx [T, K / 32] (the block's scale), xs [T, K / 16] (each
   group's sum of xq times its block's scale: what an offset b multiplies). */
static void quantize_act(const float* x, int64_t T, int64_t K, int8_t* xq, float* dx, float* xs) {
    for (int64_t t = 0; t < T; t++) {
        for (int64_t k0 = 0; k0 < K; k0 += ABLOCK) {
            const float* xb = x + t * K + k0;
            float amax = 0.f;
            for (int j = 0; j < ABLOCK; j++) {
                const float a = xb[j] < 0 ? -xb[j] : xb[j];
                amax = a > amax ? a : amax;
            }
            const float d = amax / 127.f, inv = d > 0 ? 1.f / d : 0.f;
            int8_t* q = xq + t * K + k0;
            int sum[2] = {0, 0};
            for (int j = 0; j < ABLOCK; j++) {
                const int v = (int)__builtin_roundf(xb[j] * inv);
                q[j] = (int8_t)v;
                sum[j / GROUP] += v;
            }
            dx[(t * K + k0) / ABLOCK] = d;
            xs[(t * K + k0) / GROUP] = d * sum[0];
            xs[(t * K + k0) / GROUP + 1] = d * sum[1];
        }
    }
}

/* sum over a row: dx_blk * s_g * (u_g . xq_g) + b_g * xs_g */
static inline float dot_int8(const uint8_t* u, const float* s, const float* b, const int8_t* xq,
                             const float* dx, const float* xs, int64_t K) {
    float acc = 0.f;
#if LOOM_Q_VNNI
    /* 64 values (4 groups) a step: 16 i32 lanes, lanes 4g..4g+3 hold group g's partial sums;
       each lane is scaled by its group's s * dx, so one FMA folds the four groups in. */
    __m512 vacc = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 64 <= K; k += 64) {
        const __m512i uv = _mm512_loadu_si512((const void*)(u + k));
        const __m512i xv = _mm512_loadu_si512((const void*)(xq + k));
        const __m512i isum = _mm512_dpbusd_epi32(_mm512_setzero_si512(), uv, xv);
        const int64_t g = k / GROUP;
        const __m128 sg = _mm_loadu_ps(s + g);
        const __m128 dg = _mm_set_ps(dx[g / 2 + 1], dx[g / 2 + 1], dx[g / 2], dx[g / 2]);
        const __m128 sd = _mm_mul_ps(sg, dg);
        /* lane l gets sd[l / 4] */
        const __m512 sdl = _mm512_permutexvar_ps(
            _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0),
            _mm512_castps128_ps512(sd));
        vacc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), sdl, vacc);
    }
    acc = _mm512_reduce_add_ps(vacc);
    for (; k < K; k += GROUP) {
        int32_t is = 0;
        for (int j = 0; j < GROUP; j++) is += (int32_t)u[k + j] * (int32_t)xq[k + j];
        acc += s[k / GROUP] * dx[k / ABLOCK] * (float)is;
    }
#else
    for (int64_t k = 0; k < K; k += GROUP) {
        int32_t is = 0;
        for (int j = 0; j < GROUP; j++) is += (int32_t)u[k + j] * (int32_t)xq[k + j];
        acc += s[k / GROUP] * dx[k / ABLOCK] * (float)is;
    }
#endif
    float off = 0.f;
    for (int64_t g = 0; g < K / GROUP; g++) off += b[g] * xs[g];
    return acc + off;
}

static inline void dequant_into(const uint8_t* u, const float* s, const float* b, int64_t K,
                                float* w) {
    for (int64_t g = 0; g < K / GROUP; g++) {
        const float sg = s[g], bg = b[g];
#pragma omp simd
        for (int j = 0; j < GROUP; j++) w[g * GROUP + j] = sg * (float)u[g * GROUP + j] + bg;
    }
}

/* 1 where this build has the VNNI int8 path, 0 on the portable one. */
int loom_q_vnni(void) { return LOOM_Q_VNNI; }

#if LOOM_Q_VNNI
/* One row of 32-value blocks (Q8_0, Q4_0, Q4_1) against T <= GEMV_MAX int8 token rows, each
   block's codes expanded in a register (never stored) and reused by every token. */
static void gemv32_vnni(int qtype, const uint8_t* row, int64_t K, int64_t T, const int8_t* xq,
                        const float* dx, const float* xs, float* out) {
    const int64_t nb = K / 32, G = K / GROUP;
    const int bb = block_bytes(qtype);
    __m256 acc[GEMV_MAX];
    float off[GEMV_MAX];
    for (int64_t t = 0; t < T; t++) {
        acc[t] = _mm256_setzero_ps();
        off[t] = 0.f;
    }
    const __m128i low = _mm_set1_epi8(0x0F);
    for (int64_t i = 0; i < nb; i++) {
        const uint8_t* blk = row + i * bb;
        const float d = f16_to_f32(blk);
        float m;
        __m256i u;
        if (qtype == LOOM_Q8_0) { /* int8 q + 128 as unsigned is q ^ 0x80 */
            u = _mm256_xor_si256(_mm256_loadu_si256((const __m256i*)(blk + 2)),
                                 _mm256_set1_epi8((char)0x80));
            m = -128.f * d;
        } else {
            const __m128i q = _mm_loadu_si128((const __m128i*)(blk + (qtype == LOOM_Q4_1 ? 4 : 2)));
            const __m128i lo = _mm_and_si128(q, low), hi = _mm_and_si128(_mm_srli_epi16(q, 4), low);
            u = _mm256_set_m128i(hi, lo);
            m = qtype == LOOM_Q4_1 ? f16_to_f32(blk + 2) : -8.f * d;
        }
        for (int64_t t = 0; t < T; t++) {
            const __m256i xv = _mm256_loadu_si256((const __m256i*)(xq + t * K + 32 * i));
            const __m256i is = _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, xv);
            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is), _mm256_set1_ps(d * dx[t * nb + i]),
                                     acc[t]);
            off[t] += m * (xs[t * G + 2 * i] + xs[t * G + 2 * i + 1]);
        }
    }
    for (int64_t t = 0; t < T; t++) {
        const __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc[t]), _mm256_extractf128_ps(acc[t], 1));
        const __m128 h2 = _mm_add_ps(h, _mm_movehl_ps(h, h));
        out[t] = _mm_cvtss_f32(_mm_add_ss(h2, _mm_shuffle_ps(h2, h2, 1))) + off[t];
    }
}
#endif

/* ---- 16-bit activations for the SmolLM2 block types (Q8_0, Q4_0, Q4_1): LOOM_Q_I16 ----------

   Why: int8 activations per block of 32 (LOOM_Q_INT8, ggml's q8 scheme) flip SmolLM2-135M's
   teacher-forced top-1 on 3.6% of 2,000 tokens against the f32-dequantized model (its LM head
   alone 2.2%); 16-bit per block of 32 flips none (benchmarks/bench_real.py --agreement).
   How: each activation block keeps one f32 scale d = max|x| / 32512 and codes q in
   [-32512, 32512], stored as two int8 halves q = 255 * hi + lo with hi, lo in [-127, 127]
   (255 is odd, so lo = q - 255 * round(q / 255) never reaches +-128, and a sign flip of either
   stays in range, which the Q8_0 sign trick below needs). A block's integer dot is then two
   u8 x s8 dot products over the same weight register, 255 * (u . hi) + (u . lo); every partial
   sum fits int32 (32 * 255 * 32512 < 2^31) and the u8 x s8 pair sums of maddubs fit int16
   (2 * 15 * 127 for 4-bit codes; 2 * 127 * 127 for Q8_0's |q|). */

#define I16_MAX 8 /* tokens up to which LOOM_Q_I16 takes these kernels (larger: f32 GEMM, which
                     measured as fast at 8 tokens and 1.7x faster at 32) */
#define I16_Q 32512 /* 127 * 256: the largest code */

static int has_i16(int qtype) {
    return qtype == LOOM_Q8_0 || qtype == LOOM_Q4_0 || qtype == LOOM_Q4_1;
}

/* the types the f32 decode GEMV (matmul_f32v) reads: every type but none */
static int has_f32v(int qtype) {
    return has_i16(qtype) || qtype == LOOM_Q5_0 || qtype == LOOM_Q5_1 || qtype == LOOM_Q4_K ||
           qtype == LOOM_Q6_K;
}

/* x [K] f32 -> hi, lo [K] int8, d [K / 32] (the block's scale), xs [K / 32] (d * the block's
   sum of codes: what a block offset m multiplies). */
static void quantize_act16(const float* x, int64_t K, int8_t* hi, int8_t* lo, float* d,
                           float* xs) {
    for (int64_t k0 = 0; k0 < K; k0 += 32) {
        const float* xb = x + k0;
        float amax = 0.f;
        for (int j = 0; j < 32; j++) {
            const float a = xb[j] < 0 ? -xb[j] : xb[j];
            amax = a > amax ? a : amax;
        }
        const float dd = amax / (float)I16_Q, inv = dd > 0 ? 1.f / dd : 0.f;
        int sum = 0;
        for (int j = 0; j < 32; j++) {
            int q = (int)__builtin_roundf(xb[j] * inv);
            q = q > I16_Q ? I16_Q : q < -I16_Q ? -I16_Q : q;
            const int h = (q >= 0 ? q + 127 : q - 127) / 255; /* round(q / 255), no ties */
            hi[k0 + j] = (int8_t)h;
            lo[k0 + j] = (int8_t)(q - 255 * h);
            sum += q;
        }
        d[k0 / 32] = dd;
        xs[k0 / 32] = dd * (float)sum;
    }
}

#if defined(__AVX2__)
/* 8 int32 partial sums of u8 u x s8 x over 32 lanes (each lane 4 adjacent products) */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define DOT32(u, x) _mm256_dpbusd_epi32(_mm256_setzero_si256(), (u), (x))
#elif defined(__AVXVNNI__)
#define DOT32(u, x) _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), (u), (x))
#else
#define DOT32(u, x) _mm256_madd_epi16(_mm256_maddubs_epi16((u), (x)), _mm256_set1_epi16(1))
#endif
#define TIMES255(v) _mm256_sub_epi32(_mm256_slli_epi32((v), 8), (v))

#define DOTACC32(acc, u, x) _mm256_add_epi32((acc), DOT32((u), (x)))
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#undef DOTACC32
#define DOTACC32(acc, u, x) _mm256_dpbusd_epi32((acc), (u), (x))
#elif defined(__AVXVNNI__)
#undef DOTACC32
#define DOTACC32(acc, u, x) _mm256_dpbusd_avx_epi32((acc), (u), (x))
#endif

#define I16_CHUNK 64 /* blocks whose scales one pre-pass converts (a stack array) */

/* The f16 scale d (and Q4_1's f16 min m: -8 d for Q4_0, 0 for Q8_0) of blocks i0 .. i0 + n - 1
   of a row as floats: one 16-lane gather of the blocks' first 4 bytes (d and m sit there) per
   16 blocks with AVX-512, F16C scalars otherwise. */
static inline void block_scales(int qtype, const uint8_t* row, int64_t i0, int n, float* d,
                                float* m) {
    const int bb = block_bytes(qtype);
    int j = 0;
#if defined(__AVX512F__)
    const __m512i idx = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                           _mm512_set1_epi32(bb));
    for (; j < n; j += 16) {
        const __mmask16 k = n - j >= 16 ? 0xFFFF : (__mmask16)((1u << (n - j)) - 1);
        const __m512i g = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), k, idx,
                                                      (const void*)(row + (i0 + j) * bb), 1);
        const __m512 dv = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(g));
        const __m512 mv = qtype == LOOM_Q4_1 ? _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(g, 16)))
                          : qtype == LOOM_Q4_0 ? _mm512_mul_ps(dv, _mm512_set1_ps(-8.f))
                                               : _mm512_setzero_ps();
        _mm512_mask_storeu_ps(d + j, k, dv);
        _mm512_mask_storeu_ps(m + j, k, mv);
    }
#endif
    for (; j < n; j++) {
        const uint8_t* blk = row + (i0 + j) * bb;
        d[j] = f16_to_f32(blk);
        m[j] = qtype == LOOM_Q4_1 ? f16_to_f32(blk + 2) : qtype == LOOM_Q4_0 ? -8.f * d[j] : 0.f;
    }
}

/* One row of Q8_0 / Q4_0 / Q4_1 blocks against T <= I16_MAX tokens of 16-bit activations;
   each block decoded once into a register and used by every token, its scales converted
   ahead per chunk (block_scales). Q8_0 multiplies |q| by x carrying q's sign (AVX2's sign
   trick), so it has no offset term. */
static void gemv32_i16(int qtype, const uint8_t* row, int64_t K, int64_t T, const int8_t* xh,
                       const int8_t* xl, const float* dx, const float* xs, float* out) {
    const int64_t nb = K / 32;
    const int bb = block_bytes(qtype);
    __m256 acc[I16_MAX];
    float off[I16_MAX];
    float dsc[I16_CHUNK], msc[I16_CHUNK];
    for (int64_t t = 0; t < T; t++) {
        acc[t] = _mm256_setzero_ps();
        off[t] = 0.f;
    }
    const __m128i low = _mm_set1_epi8(0x0F);
    const int qoff = qtype == LOOM_Q4_1 ? 4 : 2;
    for (int64_t i0 = 0; i0 < nb; i0 += I16_CHUNK) {
        const int n = nb - i0 < I16_CHUNK ? (int)(nb - i0) : I16_CHUNK;
        block_scales(qtype, row, i0, n, dsc, msc);
        if (qtype != LOOM_Q8_0)
            for (int64_t t = 0; t < T; t++) {
                float o = 0.f;
                for (int j = 0; j < n; j++) o += msc[j] * xs[t * nb + i0 + j];
                off[t] += o;
            }
        for (int j = 0; j < n; j++) {
            const int64_t i = i0 + j;
            const uint8_t* blk = row + i * bb;
            const float d = dsc[j];
            if (qtype == LOOM_Q8_0) {
                const __m256i q = _mm256_loadu_si256((const __m256i*)(blk + 2));
                const __m256i u = _mm256_sign_epi8(q, q); /* |q| (q = -128 gives 128 as u8) */
                for (int64_t t = 0; t < T; t++) {
                    const __m256i h = _mm256_sign_epi8(
                        _mm256_loadu_si256((const __m256i*)(xh + t * K + 32 * i)), q);
                    const __m256i l = _mm256_sign_epi8(
                        _mm256_loadu_si256((const __m256i*)(xl + t * K + 32 * i)), q);
                    const __m256i is = DOTACC32(TIMES255(DOT32(u, h)), u, l);
                    acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is),
                                             _mm256_set1_ps(d * dx[t * nb + i]), acc[t]);
                }
            } else {
                const __m128i q = _mm_loadu_si128((const __m128i*)(blk + qoff));
                const __m256i u = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), low),
                                                   _mm_and_si128(q, low));
                for (int64_t t = 0; t < T; t++) {
                    const __m256i h = _mm256_loadu_si256((const __m256i*)(xh + t * K + 32 * i));
                    const __m256i l = _mm256_loadu_si256((const __m256i*)(xl + t * K + 32 * i));
                    const __m256i is = DOTACC32(TIMES255(DOT32(u, h)), u, l);
                    acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is),
                                             _mm256_set1_ps(d * dx[t * nb + i]), acc[t]);
                }
            }
        }
    }
    for (int64_t t = 0; t < T; t++) {
        const __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc[t]), _mm256_extractf128_ps(acc[t], 1));
        const __m128 h2 = _mm_add_ps(h, _mm_movehl_ps(h, h));
        out[t] = _mm_cvtss_f32(_mm_add_ss(h2, _mm_shuffle_ps(h2, h2, 1))) + off[t];
    }
}
#else
/* portable C: the same arithmetic (integer dots per block, then scaled) */
static void gemv32_i16(int qtype, const uint8_t* row, int64_t K, int64_t T, const int8_t* xh,
                       const int8_t* xl, const float* dx, const float* xs, float* out) {
    const int64_t nb = K / 32;
    const int bb = block_bytes(qtype);
    for (int64_t t = 0; t < T; t++) out[t] = 0.f;
    for (int64_t i = 0; i < nb; i++) {
        const uint8_t* blk = row + i * bb;
        const float d = f16_to_f32(blk);
        int16_t w[32]; /* the block's signed codes (Q8_0) or unsigned nibbles */
        float m = 0.f;
        if (qtype == LOOM_Q8_0) {
            for (int j = 0; j < 32; j++) w[j] = (int8_t)blk[2 + j];
        } else {
            const uint8_t* qs = blk + (qtype == LOOM_Q4_1 ? 4 : 2);
            for (int j = 0; j < 16; j++) {
                w[j] = qs[j] & 0xF;
                w[j + 16] = qs[j] >> 4;
            }
            m = qtype == LOOM_Q4_1 ? f16_to_f32(blk + 2) : -8.f * d;
        }
        for (int64_t t = 0; t < T; t++) {
            const int8_t* h = xh + t * K + 32 * i;
            const int8_t* l = xl + t * K + 32 * i;
            int32_t sh = 0, sl = 0;
            for (int j = 0; j < 32; j++) {
                sh += w[j] * h[j];
                sl += w[j] * l[j];
            }
            out[t] += d * dx[t * nb + i] * (float)(255 * sh + sl) + m * xs[t * nb + i];
        }
    }
}
#endif

typedef float v16 __attribute__((vector_size(64)));

/* (macros, not functions: a 64-byte vector argument or result changes the ABI without
   AVX-512, which -Wpsabi reports) */
#define LD16(v, p) memcpy(&(v), (p), sizeof(v16))

/* y[t, n0 + r] (+)= wf[r] . x[t] for R <= 4 dequantized rows wf [R, K] and all T tokens: tiles
   of 4 rows x 4 tokens, 16 vector accumulators, so each loaded weight vector feeds 4 FMAs and
   each token vector 4 (the rows stay in L1 while the tokens pass). */
static void gemm_rows(const float* wf, int R, int64_t K, const float* x, int64_t ldx, int64_t T,
                      const float* bias, int64_t n0, float* y, int64_t ldy, int accumulate) {
    for (int64_t t0 = 0; t0 < T; t0 += 4) {
        const int tt = T - t0 < 4 ? (int)(T - t0) : 4;
        v16 acc[4][4];
        memset(acc, 0, sizeof(acc));
        const float* xr[4];
        const float* wr[4];
        for (int j = 0; j < 4; j++) xr[j] = x + (t0 + (j < tt ? j : 0)) * ldx;
        for (int r = 0; r < 4; r++) wr[r] = wf + (r < R ? r : 0) * K;
        for (int64_t k = 0; k < K; k += 16) {
            v16 w0, w1, w2, w3;
            LD16(w0, wr[0] + k);
            LD16(w1, wr[1] + k);
            LD16(w2, wr[2] + k);
            LD16(w3, wr[3] + k);
            for (int j = 0; j < 4; j++) {
                v16 xv;
                LD16(xv, xr[j] + k);
                acc[0][j] += w0 * xv;
                acc[1][j] += w1 * xv;
                acc[2][j] += w2 * xv;
                acc[3][j] += w3 * xv;
            }
        }
        for (int r = 0; r < R; r++) {
            const float bn = bias ? bias[n0 + r] : 0.f;
            for (int j = 0; j < tt; j++) {
                float* yo = y + (t0 + j) * ldy + n0 + r;
                float sum = 0.f;
                for (int i = 0; i < 16; i++) sum += acc[r][j][i];
                *yo = (accumulate ? *yo : 0.f) + sum + bn;
            }
        }
    }
}

/* loom_q_matmul's LOOM_Q_I16 branch: activations quantized once per call (quantize_act16),
   rows split over the threads, each row decoded once for all T tokens (gemv32_i16). */
static int matmul_i16(int qtype, const uint8_t* w, int64_t N, int64_t K, int64_t row_bytes,
                      const float* x, int64_t T, int64_t ldx, const float* bias, float* y,
                      int64_t ldy, int accumulate, int threads) {
    const int64_t nb = K / 32;
    int8_t* xh = malloc((size_t)(T * K + 64));
    int8_t* xl = malloc((size_t)(T * K + 64));
    float* dx = malloc(sizeof(float) * (size_t)(T * nb + 1));
    float* xs = malloc(sizeof(float) * (size_t)(T * nb + 1));
    if (!xh || !xl || !dx || !xs) {
        free(xh);
        free(xl);
        free(dx);
        free(xs);
        return -2;
    }
    for (int64_t t = 0; t < T; t++)
        quantize_act16(x + t * ldx, K, xh + t * K, xl + t * K, dx + t * nb, xs + t * nb);
    if (threads < 1) threads = 1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        float part[I16_MAX];
        gemv32_i16(qtype, w + n * row_bytes, K, T, xh, xl, dx, xs, part);
        const float bn = bias ? bias[n] : 0.f;
        for (int64_t t = 0; t < T; t++) {
            float* yo = y + t * ldy + n;
            *yo = (accumulate ? *yo : 0.f) + part[t] + bn;
        }
    }
    free(xh);
    free(xl);
    free(dx);
    free(xs);
    return 0;
}

/* ---- f32 activations, weights expanded in registers: the decode GEMV (LOOM_Q_F32, T <= 8) --

   For Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q4_K / Q6_K at T <= F32V_MAX tokens (AVX-512
   builds; has_f32v). Each 32-value block (a K type: each 32-value unit of a super-block) becomes
   two 16-lane f32 weight vectors in registers (values 0..15 and 16..31: the GGUF nibble order
   needs no shuffle) that multiply the f32 activations as they are: nothing rounds the
   activations (the 16-bit path's only approximation), and the weights are the same f32 values
   d * u + m that the dequantizing reference and the prefill path compute.
   - Q4_0 / Q4_1: the block's 16 possible values d * u + m form a table (one FMA on an iota);
     vpermps picks each lane's value by its low 4 bits, i.e. the low nibble, and after a
     4-bit shift the high one: no mask, no int -> float conversion, no separate offset term.
   - Q8_0: the bytes sign-extend and convert; s = lo * xa + hi * xb, then acc += d * s.
   - Q5_0 / Q5_1, Q4_K, Q6_K: f32v_unit below (a 32-entry table and vpermt2ps; the Q4 table
     with a unit's own scale and min; 6-bit codes converted and scaled per group of 16).
   Four rows go together (each activation vector loaded once for them, four independent
   accumulator chains), the accumulators stay vectors across the row and are reduced once at
   its end, and the f16 scales of F32V_CHUNK blocks are converted by one gather (block_scales).
   Tokens go in passes of up to 4 over the same four rows (L1-resident by then).

   Why not integers: with 16-bit activations a block costs two u8 x s8 dots, their combination
   and a conversion to float per block, in a 256-bit lane per token; bench_quant_gemv.py
   measured this form 1.9x faster on SmolLM2's matrices (docs/benchmarks.md, "batch-1 GEMV"). */
/* rows ahead whose block at the same position a pass prefetches (two groups of four on): the
   hardware prefetcher alone left a token's matmuls ~1.5x slower streaming the 96 MB of SmolLM2
   than with the same matrices cache-resident (docs/benchmarks.md, "batch-1 GEMV"). A tuning
   knob the benchmark sets through ctypes (c_int.in_dll). */
int loom_q_prefetch_rows = 8;
/* rows a group of f32v_wide (T > 4) takes: 1 .. F32V_WR (3: 5-8 tokens 1.15-1.4x faster than two
   passes of four, bench_quant_gemv.py --wide-rows); any other value keeps the two passes. A
   tuning knob the benchmark sets through ctypes, like the one above. */
int loom_q_wide_rows = 3;
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define LOOM_Q_F32V 1
#define F32V_MAX 8    /* tokens up to which LOOM_Q_F32 takes these kernels */
#define F32V_CHUNK 16 /* blocks whose scales one gather converts */

/* a Q8_0 block's 32 codes as f32: values 0..15 in *lo, 16..31 in *hi */
static inline __attribute__((always_inline)) void f32v_q8(const uint8_t* blk, __m512* lo,
                                                          __m512* hi) {
    *lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(blk + 2))));
    *hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(blk + 18))));
}

/* The types f32v_unit expands (Gemma 3's Q5_0 / Q4_K / Q6_K, and Q5_1) */
static inline int f32v_unit_type(int qtype) {
    return qtype == LOOM_Q5_0 || qtype == LOOM_Q5_1 || qtype == LOOM_Q4_K || qtype == LOOM_Q6_K;
}

/* Per 32-value unit i0 .. i0 + n - 1 of a row of f32v_unit_type blocks, the two floats
   f32v_unit takes: Q5_x the block's d and offset m (-16 d for Q5_0); Q4_K the unit's
   sub-block scale d * sc and offset -dmin * min; Q6_K the scales d * sc of its two groups of
   16 (a: values 0..15, b: 16..31; the offset is -32 times each). i0 is a multiple of 8 for
   the K types (F32V_CHUNK is), so a chunk covers whole super-blocks. */
static inline void f32v_scales(int qtype, const uint8_t* row, int64_t i0, int n, float* a,
                               float* b) {
    const int bb = block_bytes(qtype);
    if (qtype == LOOM_Q5_0 || qtype == LOOM_Q5_1) {
        for (int j = 0; j < n; j++) {
            const uint8_t* blk = row + (i0 + j) * bb;
            a[j] = f16_to_f32(blk);
            b[j] = qtype == LOOM_Q5_1 ? f16_to_f32(blk + 2) : -16.f * a[j];
        }
    } else if (qtype == LOOM_Q4_K) {
        for (int j = 0; j < n; j += 8) {
            const uint8_t* blk = row + (i0 + j) / 8 * bb;
            const float d = f16_to_f32(blk), dmin = f16_to_f32(blk + 2);
            for (int u = 0; u < 8; u++) {
                uint8_t sc, mn;
                k4_scale_min(u, blk + 4, &sc, &mn);
                a[j + u] = d * sc;
                b[j + u] = -dmin * mn;
            }
        }
    } else { /* Q6_K */
        for (int j = 0; j < n; j += 8) {
            const uint8_t* blk = row + (i0 + j) / 8 * bb;
            const int8_t* sc = (const int8_t*)(blk + 192);
            const float d = f16_to_f32(blk + 208);
            for (int u = 0; u < 8; u++) {
                a[j + u] = d * sc[2 * u];
                b[j + u] = d * sc[2 * u + 1];
            }
        }
    }
}

/* Unit i (32 values) of a row of f32v_unit_type blocks as f32 weights: values 0..15 in *lo,
   16..31 in *hi, each the f32 value s * u + b of the dequantizing reference (one FMA, or an
   exact small-integer product for Q6_K). a, b: f32v_scales' pair for the unit.
   - Q5_x: the 32 possible values form two 16-entry tables (codes 0..15 and 16..31);
     vpermt2ps picks by 5 index bits: the nibble, and bit 4 set from qh's bit for the lane.
   - Q4_K: unit j of a super-block holds the low (j even) or high (j odd) nibbles of the 32
     bytes qs[32 (j / 2) ..]; the unit's 16-entry table as Q4_0 / Q4_1's.
   - Q6_K: unit j's codes are 4 bits of ql (bytes 64 (j / 4) + 32 (j % 2) .., the high
     nibble for j % 4 >= 2) and 2 bits of qh (bytes 32 (j / 4) .., shifted by 2 (j % 4)), as
     ggml's dequantize_row_q6_K; (code - 32) converts exactly and is scaled per 16 values. */
static inline __attribute__((always_inline)) void f32v_unit(int qtype, const uint8_t* row,
                                                            int64_t i, float a, float b,
                                                            __m512* lo, __m512* hi) {
    const __m512 iota = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512i nib = _mm512_set1_epi32(15);
    if (qtype == LOOM_Q5_0 || qtype == LOOM_Q5_1) {
        const uint8_t* blk = row + i * block_bytes(qtype);
        const uint8_t* qhp = blk + (qtype == LOOM_Q5_1 ? 4 : 2);
        uint32_t qh;
        memcpy(&qh, qhp, 4);
        const __m512 t0 = _mm512_fmadd_ps(iota, _mm512_set1_ps(a), _mm512_set1_ps(b));
        const __m512 t1 = _mm512_fmadd_ps(_mm512_add_ps(iota, _mm512_set1_ps(16.f)),
                                          _mm512_set1_ps(a), _mm512_set1_ps(b));
        const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(qhp + 4)));
        const __m512i bit4 = _mm512_set1_epi32(16);
        const __m512i il = _mm512_and_si512(v, nib), ih = _mm512_srli_epi32(v, 4);
        *lo = _mm512_permutex2var_ps(t0, _mm512_mask_or_epi32(il, (__mmask16)qh, il, bit4), t1);
        *hi = _mm512_permutex2var_ps(
            t0, _mm512_mask_or_epi32(ih, (__mmask16)(qh >> 16), ih, bit4), t1);
    } else if (qtype == LOOM_Q4_K) {
        const int j = (int)(i & 7);
        const uint8_t* q = row + (i >> 3) * 144 + 16 + 32 * (j >> 1);
        const __m512 tab = _mm512_fmadd_ps(iota, _mm512_set1_ps(a), _mm512_set1_ps(b));
        __m512i v0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)q));
        __m512i v1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(q + 16)));
        if (j & 1) {
            v0 = _mm512_srli_epi32(v0, 4);
            v1 = _mm512_srli_epi32(v1, 4);
        }
        *lo = _mm512_permutexvar_ps(v0, tab); /* vpermps reads the low 4 index bits */
        *hi = _mm512_permutexvar_ps(v1, tab);
    } else { /* Q6_K */
        const int j = (int)(i & 7);
        const uint8_t* blk = row + (i >> 3) * 210;
        const uint8_t* ql = blk + 64 * (j >> 2) + 32 * (j & 1);
        const uint8_t* qh = blk + 128 + 32 * (j >> 2);
        const __m128i ns = _mm_cvtsi32_si128(4 * ((j >> 1) & 1)), hs = _mm_cvtsi32_si128(2 * (j & 3));
        const __m512i three = _mm512_set1_epi32(3), off = _mm512_set1_epi32(32);
        __m512i c[2];
        for (int h = 0; h < 2; h++) {
            const __m512i l = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(ql + 16 * h)));
            const __m512i u = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(qh + 16 * h)));
            c[h] = _mm512_sub_epi32(
                _mm512_or_si512(_mm512_and_si512(_mm512_srl_epi32(l, ns), nib),
                                _mm512_slli_epi32(_mm512_and_si512(_mm512_srl_epi32(u, hs), three), 4)),
                off);
        }
        *lo = _mm512_mul_ps(_mm512_cvtepi32_ps(c[0]), _mm512_set1_ps(a));
        *hi = _mm512_mul_ps(_mm512_cvtepi32_ps(c[1]), _mm512_set1_ps(b));
    }
}

/* How a type's 32 values expand, as a constant of each f32v_rows / f32v_wide instance: with
   the type a run-time branch in the block loop, adding the unit types' code to that loop made
   the Q4_1 batch-1 GEMV ~1.5x slower (bench_quant_gemv, a SmolLM2 token 10.7 -> 16.1 ms). */
enum { F32V_Q8, F32V_Q4, F32V_UNIT };
static inline int f32v_kind(int qtype) {
    return qtype == LOOM_Q8_0 ? F32V_Q8 : f32v_unit_type(qtype) ? F32V_UNIT : F32V_Q4;
}

/* the two floats of units i0 .. i0 + n - 1 of one row that f32v_expand takes */
static inline __attribute__((always_inline)) void f32v_chunk_scales(const int kind, int qtype,
                                                                    const uint8_t* row,
                                                                    int64_t i0, int n,
                                                                    float* a, float* b) {
    if (kind == F32V_UNIT)
        f32v_scales(qtype, row, i0, n, a, b);
    else
        block_scales(qtype, row, i0, n, a, b);
}

/* unit i (32 values) of a row (blocks of bb bytes) as two f32 vectors, values 0..15 in *lo and 16..31 in *hi: the
   weights themselves, except Q8_0's, which are its codes (its scale multiplies their dot
   product in f32v_fma) */
static inline __attribute__((always_inline)) void f32v_expand(const int kind, int qtype,
                                                              int bb, const uint8_t* row,
                                                              int64_t i, float a, float b,
                                                              __m512* lo, __m512* hi) {
    if (kind == F32V_UNIT) {
        f32v_unit(qtype, row, i, a, b, lo, hi);
    } else if (kind == F32V_Q8) {
        f32v_q8(row + i * bb, lo, hi);
    } else {
        const __m512 iota =
            _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
        const __m512 tab = _mm512_fmadd_ps(iota, _mm512_set1_ps(a), _mm512_set1_ps(b));
        const __m512i v = _mm512_cvtepu8_epi32(
            _mm_loadu_si128((const __m128i*)(row + i * bb + (qtype == LOOM_Q4_1 ? 4 : 2))));
        *lo = _mm512_permutexvar_ps(v, tab);
        *hi = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), tab);
    }
}

/* acc + unit (lo, hi) . token (xa, xb), d: Q8_0's scale. The one order of operations every
   instance of f32v_rows and f32v_wide takes: what makes their outputs bitwise the same for
   every grouping of rows and tokens. */
static inline __attribute__((always_inline)) __m512 f32v_fma(const int kind, __m512 acc,
                                                             __m512 lo, __m512 hi, __m512 xa,
                                                             __m512 xb, __m512 d) {
    if (kind == F32V_Q8)
        return _mm512_fmadd_ps(_mm512_fmadd_ps(hi, xb, _mm512_mul_ps(lo, xa)), d, acc);
    return _mm512_fmadd_ps(hi, xb, _mm512_fmadd_ps(lo, xa, acc));
}

/* out[r * TT + t] = row r of R rows (row_bytes apart from w) . token t of TT (x rows ldx
   apart) */
static inline __attribute__((always_inline)) void f32v_rows(int qtype, const uint8_t* w,
                                                            int64_t row_bytes, int64_t K,
                                                            const float* x, int64_t ldx,
                                                            float* out, const int R,
                                                            const int TT, const int kind) {
    const int64_t nb = K / 32;
    const int bb = block_bytes(qtype);
    /* 32-value units per block: 8 (a shift of 3) for the K types' 256-value super-blocks */
    const int ush = qtype == LOOM_Q4_K || qtype == LOOM_Q6_K ? 3 : 0;
    __m512 acc[16];
    float dsc[4][F32V_CHUNK], msc[4][F32V_CHUNK];
    const int64_t pf = loom_q_prefetch_rows;
    for (int i = 0; i < R * TT; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t i0 = 0; i0 < nb; i0 += F32V_CHUNK) {
        const int n = nb - i0 < F32V_CHUNK ? (int)(nb - i0) : F32V_CHUNK;
        for (int r = 0; r < R; r++)
            f32v_chunk_scales(kind, qtype, w + r * row_bytes, i0, n, dsc[r], msc[r]);
        for (int j = 0; j < n; j++) {
            const int64_t i = i0 + j;
            __m512 xa[4], xb[4];
            for (int t = 0; t < TT; t++) {
                xa[t] = _mm512_loadu_ps(x + t * ldx + 32 * i);
                xb[t] = _mm512_loadu_ps(x + t * ldx + 32 * i + 16);
            }
            for (int r = 0; r < R; r++) {
                /* unit i's bytes sit near i * bb >> ush (a shift: a division here, per unit
                   and row, cost the batch-1 decode ~30%) */
                _mm_prefetch((const char*)(w + (r + pf) * row_bytes + ((i * bb) >> ush)),
                             _MM_HINT_T0);
                __m512 lo, hi;
                f32v_expand(kind, qtype, bb, w + r * row_bytes, i, dsc[r][j], msc[r][j], &lo, &hi);
                const __m512 d = _mm512_set1_ps(dsc[r][j]);
                for (int t = 0; t < TT; t++)
                    acc[r * TT + t] = f32v_fma(kind, acc[r * TT + t], lo, hi, xa[t], xb[t], d);
            }
        }
    }
    for (int i = 0; i < R * TT; i++) out[i] = _mm512_reduce_add_ps(acc[i]);
}

/* rows n0 .. n0 + R - 1 (R <= 4) against tokens t0 .. t0 + TT - 1 (TT <= 4): one instance per
   constant pair, so the accumulators are registers */
static void f32v_block(int qtype, const uint8_t* w, int64_t row_bytes, int64_t K, const float* x,
                       int64_t ldx, float* out, int R, int TT) {
#define F32V_CASE(RR, TTT, KIND)                                                               \
    case 4 * (RR) + (TTT):                                                                     \
        f32v_rows(qtype, w, row_bytes, K, x, ldx, out, RR, TTT, KIND);                         \
        break;
#define F32V_CASES(KIND)                                                                       \
    switch (4 * R + TT) {                                                                      \
        F32V_CASE(4, 1, KIND) F32V_CASE(4, 2, KIND) F32V_CASE(4, 3, KIND)                      \
        F32V_CASE(4, 4, KIND) F32V_CASE(1, 1, KIND) F32V_CASE(1, 2, KIND)                      \
        F32V_CASE(1, 3, KIND) F32V_CASE(1, 4, KIND) default: break;                            \
    }
    switch (f32v_kind(qtype)) {
    case F32V_Q8: F32V_CASES(F32V_Q8) break;
    case F32V_Q4: F32V_CASES(F32V_Q4) break;
    default: F32V_CASES(F32V_UNIT) break;
    }
#undef F32V_CASES
#undef F32V_CASE
}

/* out[r * TT + t] as f32v_rows computes it, for R <= F32V_WR rows and 4 < TT <= 8 tokens in
   one pass: each block's weights are expanded once for all TT tokens (two passes of f32v_rows
   expand them twice), the accumulators are R * TT registers and each token's activations are
   loaded once a block for the R rows. Every accumulator takes the same FMAs in the same order
   as in f32v_rows, so the outputs are bitwise those of f32v_rows (and so of T = 1). */
#define F32V_WR 3
static inline __attribute__((always_inline)) void f32v_wide(int qtype, const uint8_t* w,
                                                            int64_t row_bytes, int64_t K,
                                                            const float* x, int64_t ldx,
                                                            float* out, const int R,
                                                            const int TT, const int kind) {
    const int64_t nb = K / 32;
    const int bb = block_bytes(qtype);
    /* 32-value units per block: 8 (a shift of 3) for the K types' 256-value super-blocks */
    const int ush = qtype == LOOM_Q4_K || qtype == LOOM_Q6_K ? 3 : 0;
    __m512 acc[F32V_WR * F32V_MAX];
    float dsc[F32V_WR][F32V_CHUNK], msc[F32V_WR][F32V_CHUNK];
    const int64_t pf = loom_q_prefetch_rows;
    for (int i = 0; i < R * TT; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t i0 = 0; i0 < nb; i0 += F32V_CHUNK) {
        const int n = nb - i0 < F32V_CHUNK ? (int)(nb - i0) : F32V_CHUNK;
        for (int r = 0; r < R; r++)
            f32v_chunk_scales(kind, qtype, w + r * row_bytes, i0, n, dsc[r], msc[r]);
        for (int j = 0; j < n; j++) {
            const int64_t i = i0 + j;
            __m512 lo[F32V_WR], hi[F32V_WR], d[F32V_WR];
            for (int r = 0; r < R; r++) {
                _mm_prefetch((const char*)(w + (r + pf) * row_bytes + ((i * bb) >> ush)),
                             _MM_HINT_T0);
                f32v_expand(kind, qtype, bb, w + r * row_bytes, i, dsc[r][j], msc[r][j], &lo[r],
                            &hi[r]);
                d[r] = _mm512_set1_ps(dsc[r][j]);
            }
            for (int t = 0; t < TT; t++) {
                const __m512 xa = _mm512_loadu_ps(x + t * ldx + 32 * i);
                const __m512 xb = _mm512_loadu_ps(x + t * ldx + 32 * i + 16);
                for (int r = 0; r < R; r++)
                    acc[r * TT + t] = f32v_fma(kind, acc[r * TT + t], lo[r], hi[r], xa, xb, d[r]);
            }
        }
    }
    for (int i = 0; i < R * TT; i++) out[i] = _mm512_reduce_add_ps(acc[i]);
}

/* f32v_wide for R rows (1 .. F32V_WR) and TT tokens (5 .. 8), one instance per constant pair */
static void f32v_wide_block(int qtype, const uint8_t* w, int64_t row_bytes, int64_t K,
                            const float* x, int64_t ldx, float* out, int R, int TT) {
#define F32V_WCASE(RR, TTT, KIND)                                                              \
    case 8 * (RR) + (TTT):                                                                     \
        f32v_wide(qtype, w, row_bytes, K, x, ldx, out, RR, TTT, KIND);                         \
        break;
#define F32V_WCASES(KIND)                                                                      \
    switch (8 * R + TT) {                                                                      \
        F32V_WCASE(1, 5, KIND) F32V_WCASE(1, 6, KIND) F32V_WCASE(1, 7, KIND)                   \
        F32V_WCASE(1, 8, KIND) F32V_WCASE(2, 5, KIND) F32V_WCASE(2, 6, KIND)                   \
        F32V_WCASE(2, 7, KIND) F32V_WCASE(2, 8, KIND) F32V_WCASE(3, 5, KIND)                   \
        F32V_WCASE(3, 6, KIND) F32V_WCASE(3, 7, KIND) F32V_WCASE(3, 8, KIND) default: break;   \
    }
    switch (f32v_kind(qtype)) {
    case F32V_Q8: F32V_WCASES(F32V_Q8) break;
    case F32V_Q4: F32V_WCASES(F32V_Q4) break;
    default: F32V_WCASES(F32V_UNIT) break;
    }
#undef F32V_WCASES
#undef F32V_WCASE
}

/* matmul_f32v's arguments, for its row groups on the pool */
typedef struct {
    int qtype;
    const uint8_t* w;
    int64_t N, K, row_bytes;
    const float* x;
    int64_t T, ldx;
    const float* bias;
    float* y;
    int64_t ldy;
    int accumulate, wr;
} F32vJob;

/* groups g0 .. g1 - 1 of j->wr rows, all T (> 4) tokens in one pass (loom_par_for's task) */
static void f32v_wide_groups(void* ctx, int64_t g0, int64_t g1, int worker) {
    (void)worker;
    const F32vJob* j = ctx;
    const int64_t N = j->N, T = j->T;
    for (int64_t g = g0; g < g1; g++) {
        const int64_t n0 = j->wr * g;
        const int R = N - n0 < j->wr ? (int)(N - n0) : j->wr;
        float o[F32V_WR * F32V_MAX];
        f32v_wide_block(j->qtype, j->w + n0 * j->row_bytes, j->row_bytes, j->K, j->x, j->ldx, o, R,
                        (int)T);
        for (int r = 0; r < R; r++) {
            const float bn = j->bias ? j->bias[n0 + r] : 0.f;
            for (int64_t t = 0; t < T; t++) {
                float* yo = j->y + t * j->ldy + n0 + r;
                *yo = (j->accumulate ? *yo : 0.f) + o[r * T + t] + bn;
            }
        }
    }
}

/* groups g0 .. g1 - 1 of four rows, the tokens in passes of up to four (loom_par_for's task) */
static void f32v_groups(void* ctx, int64_t g0, int64_t g1, int worker) {
    (void)worker;
    const F32vJob* j = ctx;
    const int64_t N = j->N, T = j->T, rb = j->row_bytes;
    for (int64_t g = g0; g < g1; g++) {
        const int64_t n0 = 4 * g;
        const int R = N - n0 < 4 ? (int)(N - n0) : 4;
        float part[4 * F32V_MAX];
        for (int64_t t0 = 0; t0 < T; t0 += 4) {
            const int TT = T - t0 < 4 ? (int)(T - t0) : 4;
            float o[16];
            if (R == 4) {
                f32v_block(j->qtype, j->w + n0 * rb, rb, j->K, j->x + t0 * j->ldx, j->ldx, o, 4,
                           TT);
            } else {
                for (int r = 0; r < R; r++)
                    f32v_block(j->qtype, j->w + (n0 + r) * rb, rb, j->K, j->x + t0 * j->ldx, j->ldx,
                               o + r * TT, 1, TT);
            }
            for (int r = 0; r < R; r++)
                for (int t = 0; t < TT; t++) part[r * F32V_MAX + t0 + t] = o[r * TT + t];
        }
        for (int r = 0; r < R; r++) {
            const float bn = j->bias ? j->bias[n0 + r] : 0.f;
            for (int64_t t = 0; t < T; t++) {
                float* yo = j->y + t * j->ldy + n0 + r;
                *yo = (j->accumulate ? *yo : 0.f) + part[r * F32V_MAX + t] + bn;
            }
        }
    }
}

/* loom_q_matmul's LOOM_Q_F32 branch for T <= F32V_MAX (has_f32v types): groups of four rows
   over the threads (the pool, pool.c), each group's tokens in passes of up to four (7: 4 + 3) */
static int matmul_f32v(int qtype, const uint8_t* w, int64_t N, int64_t K, int64_t row_bytes,
                       const float* x, int64_t T, int64_t ldx, const float* bias, float* y,
                       int64_t ldy, int accumulate, int threads) {
    const int wr = loom_q_wide_rows;
    F32vJob job = {qtype, w, N, K, row_bytes, x, T, ldx, bias, y, ldy, accumulate, wr};
    if (T > 4 && wr >= 1 && wr <= F32V_WR) {
        const int64_t wgroups = (N + wr - 1) / wr;
        loom_par_for(threads, wgroups, par_chunk(wgroups, threads), f32v_wide_groups, &job);
        return 0;
    }
    const int64_t groups = (N + 3) / 4;
    loom_par_for(threads, groups, par_chunk(groups, threads), f32v_groups, &job);
    return 0;
}
#else
#define LOOM_Q_F32V 0
#define F32V_MAX 0
#endif

/* 1 where this build has the f32 decode GEMV (matmul_f32v), 0 where LOOM_Q_F32 dequantizes
   rows at every token count. */
int loom_q_f32v(void) { return LOOM_Q_F32V; }

/* y[t, n] (+)= sum_k W[n, k] x[t, k] + bias[n] for x [T, K] f32 with rows ldx apart, y rows
   ldy apart; accumulate: add to y instead of storing; bias NULL: none. mode LOOM_Q_INT8 takes
   the int8-activation dot products for T <= GEMV_MAX (decode: the weights stream once, the
   integer dots are the cheapest per byte); larger T, and mode LOOM_Q_F32, dequantize 4 rows at
   a time to f32 and run the register-tiled FMA kernel over all tokens (prefill: the decode cost
   is shared by T tokens, and the activations are not rounded).
   Returns 0, or -1 for an unknown qtype / K not whole blocks, -2 when out of memory. */
int loom_q_matmul(int qtype, int mode, const uint8_t* w, int64_t N, int64_t K, int64_t row_bytes,
                  const float* x, int64_t T, int64_t ldx, const float* bias, float* y,
                  int64_t ldy, int accumulate, int threads) {
    const int bv = block_values(qtype);
    if (bv == 0 || block_bytes(qtype) == 0 || K % bv || row_bytes != K / bv * block_bytes(qtype))
        return -1;
    /* LOOM_Q_AUTO, per call: the batch-invariant 16-bit arithmetic at every T for the types
       whose 1..8-token kernel has lanes = rows (quant_bi.c bi_lanes: 1.3x the f32 GEMV's speed
       at one token, 1.5x at eight, on SmolLM2's Q4_1 / Q8_0; ~1.9x on Gemma 3's Q5_0; 2-3.5x
       on its Q4_K / Q6_K); in a build without them the f32 decode GEMV where it exists
       (unrounded activations, the fastest there at T <= F32V_MAX), the batch-invariant tile
       above it */
    /* LOOM_Q_PREFILL: a prompt's rows (quant_i8.c); types without its kernel take LOOM_Q_AUTO */
    if (mode == LOOM_Q_PREFILL) {
        if (loom_q_i8_type(qtype))
            return loom_q_matmul_i8(qtype, w, N, K, row_bytes, x, T, ldx, bias, y, ldy, accumulate,
                                    threads);
        mode = LOOM_Q_AUTO;
    }
    if (mode == LOOM_Q_AUTO)
        mode = loom_q_auto_bi(qtype) ? LOOM_Q_BI
               : LOOM_Q_F32V && T <= F32V_MAX && has_f32v(qtype) ? LOOM_Q_F32
                                                                 : LOOM_Q_BI;
    if (mode == LOOM_Q_BI) /* quant_bi.c: the same arithmetic for every T */
        return loom_q_matmul_bi(qtype, w, N, K, row_bytes, x, T, ldx, bias, y, ldy, accumulate,
                                threads);
    /* LOOM_Q_I16 on a type without 16-bit kernels takes the int8 ones (T <= GEMV_MAX) */
    const int i16 = mode == LOOM_Q_I16 && has_i16(qtype) && T <= I16_MAX;
    const int int8 = !i16 && (mode == LOOM_Q_INT8 || mode == LOOM_Q_I16) && T <= GEMV_MAX;
    if (i16) return matmul_i16(qtype, w, N, K, row_bytes, x, T, ldx, bias, y, ldy, accumulate,
                               threads);
#if LOOM_Q_F32V
    if (mode == LOOM_Q_F32 && T <= F32V_MAX && has_f32v(qtype))
        return matmul_f32v(qtype, w, N, K, row_bytes, x, T, ldx, bias, y, ldy, accumulate,
                           threads);
#endif
    int8_t* xq = NULL;
    float *dx = NULL, *xs = NULL;
    if (int8) {
        xq = malloc((size_t)(T * K + 64));
        dx = malloc(sizeof(float) * (size_t)(T * K / ABLOCK + 1));
        xs = malloc(sizeof(float) * (size_t)(T * K / GROUP + 1));
        if (!xq || !dx || !xs) {
            free(xq);
            free(dx);
            free(xs);
            return -2;
        }
        for (int64_t t = 0; t < T; t++)
            quantize_act(x + t * ldx, 1, K, xq + t * K, dx + t * K / ABLOCK, xs + t * K / GROUP);
    }
    int failed = 0;
    if (threads < 1) threads = 1;
    const int64_t tiles = (N + 3) / 4;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        uint8_t* u = malloc((size_t)K + 64);
        float* s = malloc(sizeof(float) * (size_t)(K / GROUP + 1));
        float* b = malloc(sizeof(float) * (size_t)(K / GROUP + 1));
        float* wf = int8 ? NULL : malloc(sizeof(float) * (size_t)(4 * K));
        if (!u || !s || !b || (!int8 && !wf)) {
            failed = 1;
        } else if (int8) {
            float part[GEMV_MAX];
#pragma omp for schedule(static)
            for (int64_t n = 0; n < N; n++) {
                const uint8_t* row = w + n * row_bytes;
#if LOOM_Q_VNNI
                if (bv == 32 && qtype <= LOOM_Q4_1) { /* Q5_x: decode_row below */
                    gemv32_vnni(qtype, row, K, T, xq, dx, xs, part);
                } else
#endif
                {
                    decode_row(qtype, row, K, u, s, b);
                    for (int64_t t = 0; t < T; t++)
                        part[t] = dot_int8(u, s, b, xq + t * K, dx + t * K / ABLOCK,
                                           xs + t * K / GROUP, K);
                }
                const float bn = bias ? bias[n] : 0.f;
                for (int64_t t = 0; t < T; t++) {
                    float* yo = y + t * ldy + n;
                    *yo = (accumulate ? *yo : 0.f) + part[t] + bn;
                }
            }
        } else {
#pragma omp for schedule(static)
            for (int64_t tile = 0; tile < tiles; tile++) {
                const int64_t n0 = 4 * tile;
                const int R = N - n0 < 4 ? (int)(N - n0) : 4;
                for (int r = 0; r < R; r++) {
                    decode_row(qtype, w + (n0 + r) * row_bytes, K, u, s, b);
                    dequant_into(u, s, b, K, wf + r * K);
                }
                gemm_rows(wf, R, K, x, ldx, T, bias, n0, y, ldy, accumulate);
            }
        }
        free(u);
        free(s);
        free(b);
        free(wf);
    }
    free(xq);
    free(dx);
    free(xs);
    return failed ? -2 : 0;
}

/* out[i] = dequantized row ids[i] of W [N, K] (an embedding lookup; ids < 0 or >= N: -1). */
int loom_q_rows(int qtype, const uint8_t* w, int64_t N, int64_t K, int64_t row_bytes,
                const int64_t* ids, int64_t T, float* out, int threads) {
    const int bv = block_values(qtype);
    if (bv == 0 || K % bv || row_bytes != K / bv * block_bytes(qtype)) return -1;
    for (int64_t i = 0; i < T; i++)
        if (ids[i] < 0 || ids[i] >= N) return -1;
    int failed = 0;
    if (threads < 1) threads = 1;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        uint8_t* u = malloc((size_t)K + 64);
        float* s = malloc(sizeof(float) * (size_t)(K / GROUP + 1));
        float* b = malloc(sizeof(float) * (size_t)(K / GROUP + 1));
        if (!u || !s || !b) {
            failed = 1;
        } else {
#pragma omp for schedule(static)
            for (int64_t i = 0; i < T; i++) {
                decode_row(qtype, w + ids[i] * row_bytes, K, u, s, b);
                dequant_into(u, s, b, K, out + i * K);
            }
        }
        free(u);
        free(s);
        free(b);
    }
    return failed ? -2 : 0;
}
