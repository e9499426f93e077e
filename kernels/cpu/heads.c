/* Compiled draft heads on the CPU (runtime/spec/head_kernel.py builds and calls them): EAGLE /
   EAGLE-3's whole draft round (loom_eagle_round) and Medusa's heads (loom_medusa_heads), one C
   call each, on the forward's blocks (forward.c's gemm_packed; blocks.h's rms, qk_norm_rope and
   silu_mul) and the packed weight layout the target's own steps read. The Head struct is in
   loom_cpu.h. */
#include "loom_cpu.h"

#include "blocks.h"

/* A head's matmuls are small (hidden 256: ~0.1 M multiply-adds a row); an OpenMP team per call
   costs more than it saves, and on a loaded machine a 2-thread team waits for a descheduled
   thread (measured at load 7: the bundled EAGLE-3 round 69 ms with 2 threads, 3.5 ms with 1).
   Threads only where a call has work enough to split. */
static inline int head_threads(int64_t T, int64_t K, int64_t N, int nthreads) {
    return T * K * N >= ((int64_t)1 << 22) ? nthreads : 1;
}
#if ISA_BITS == 512
/* a panel's outputs n0 .. n0 + 15 (those under N) for tokens 0 .. nt - 1: the four k chains'
   sums (acc[chain][token]), plus the bias, stored (or added to y) */
static inline void panel_out(__m512 acc[4][4], int64_t nt, int64_t n0, int64_t N, const float* b,
                             float* y, int64_t ldy, int accumulate) {
    const int64_t nn = N - n0 < PANEL ? N - n0 : PANEL;
    const __mmask16 m = nn >= PANEL ? (__mmask16)0xffff : (__mmask16)((1u << nn) - 1);
    const __m512 bias = b ? _mm512_maskz_loadu_ps(m, b + n0) : _mm512_setzero_ps();
    for (int t = 0; t < nt; t++) {
        float* o = y + t * ldy + n0;
        __m512 v =
            _mm512_add_ps(_mm512_add_ps(acc[0][t], acc[1][t]), _mm512_add_ps(acc[2][t], acc[3][t]));
        v = _mm512_add_ps(v, bias);
        if (accumulate) v = _mm512_add_ps(_mm512_maskz_loadu_ps(m, o), v);
        _mm512_mask_storeu_ps(o, m, v);
    }
}
/* y[t, n] (+)= sum_k x[t, k] w[n, k] + b[n] over panels stored in bfloat16 (wb, `_pack_bf16`:
   the packed layout's panels with k in pairs, [panels, K / 2, 16, 2], each float's upper 16
   bits): half the bytes of the float32 panels, for weights that are bfloat16 values (a bf16
   checkpoint), so the products are the same. One 64-byte load holds rows 0..15 of k and k + 1
   in each 32-bit lane's two halves, widened to two float lines by a shift and a mask (no
   cross-lane widening: at one token a row, that widening, not the ~1.6 MB a draft level reads,
   bounded the level). Tokens go four at a time (two: a pass of two; three: the spare
   accumulators repeat the first token), k in four interleaved chains, so 16 FMA chains stay
   in flight. */
static inline void bf16_pair(const uint16_t* p, __m512* lo, __m512* hi) {
    const __m512i v = _mm512_loadu_si512((const void*)p);
    *lo = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
    *hi = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xFFFF0000u)));
}
static void gemm_bf16(const float* x, int64_t T, int64_t K, int64_t ldx, const uint16_t* wb,
                      const float* b, int64_t N, float* y, int64_t ldy, int accumulate) {
    const int64_t panels = (N + PANEL - 1) / PANEL, K4 = K & ~(int64_t)3;
    for (int64_t t0 = 0; t0 < T; t0 += 4) {
        const int64_t nt = T - t0 < 4 ? T - t0 : 4;
        const float* xr[4];
        for (int t = 0; t < 4; t++) xr[t] = x + (t0 + (t < nt ? t : 0)) * ldx;
        for (int64_t p = 0; p < panels; p++) {
            const uint16_t* w = wb + p * K * PANEL;
            __m512 acc[4][4];
            for (int u = 0; u < 4; u++)
                for (int t = 0; t < 4; t++) acc[u][t] = _mm512_setzero_ps();
            if (nt == 1) {
                for (int64_t k = 0; k < K4; k += 4) {
                    __m512 wv[4];
                    bf16_pair(w + k * PANEL, &wv[0], &wv[1]);
                    bf16_pair(w + (k + 2) * PANEL, &wv[2], &wv[3]);
#pragma GCC unroll 4
                    for (int u = 0; u < 4; u++)
                        acc[u][0] = _mm512_fmadd_ps(wv[u], _mm512_set1_ps(xr[0][k + u]), acc[u][0]);
                }
            } else if (nt == 2) { /* a catch-up's 6 rows: 4 + 2, not 4 + 4 */
                for (int64_t k = 0; k < K4; k += 4) {
                    __m512 wv[4];
                    bf16_pair(w + k * PANEL, &wv[0], &wv[1]);
                    bf16_pair(w + (k + 2) * PANEL, &wv[2], &wv[3]);
#pragma GCC unroll 4
                    for (int u = 0; u < 4; u++) {
#pragma GCC unroll 2
                        for (int t = 0; t < 2; t++)
                            acc[u][t] =
                                _mm512_fmadd_ps(wv[u], _mm512_set1_ps(xr[t][k + u]), acc[u][t]);
                    }
                }
            } else {
                for (int64_t k = 0; k < K4; k += 4) {
                    __m512 wv[4];
                    bf16_pair(w + k * PANEL, &wv[0], &wv[1]);
                    bf16_pair(w + (k + 2) * PANEL, &wv[2], &wv[3]);
#pragma GCC unroll 4
                    for (int u = 0; u < 4; u++) {
#pragma GCC unroll 4
                        for (int t = 0; t < 4; t++)
                            acc[u][t] =
                                _mm512_fmadd_ps(wv[u], _mm512_set1_ps(xr[t][k + u]), acc[u][t]);
                    }
                }
            }
            if (K4 < K) { /* K even (`_pack_bf16`): one pair left */
                __m512 wv[2];
                bf16_pair(w + K4 * PANEL, &wv[0], &wv[1]);
                for (int64_t k = K4; k < K; k++)
                    for (int t = 0; t < 4; t++)
                        acc[0][t] =
                            _mm512_fmadd_ps(wv[k - K4], _mm512_set1_ps(xr[t][k]), acc[0][t]);
            }
            panel_out(acc, nt, p * PANEL, N, b, y + t0 * ldy, ldy, accumulate);
        }
    }
}
#if defined(__AVX512BF16__)
static inline uint32_t bf16_rne(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (u >> 16) | 0x40u; /* NaN stays NaN */
    return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}
/* x's rows as bfloat16 pairs, rounded to nearest even: xb[t * K/2 + j] = (x[t][2j] low,
   x[t][2j + 1] high), the lane layout VDPBF16PS pairs with a bf16 panel's (row, k pair) */
static void bf16_pairs(const float* x, int64_t T, int64_t K, int64_t ldx, uint32_t* xb) {
    for (int64_t t = 0; t < T; t++) {
        const float* r = x + t * ldx;
        uint32_t* o = xb + t * (K / 2);
        int64_t k = 0;
        for (; k + 32 <= K; k += 32) {
            const __m512bh v =
                _mm512_cvtne2ps_pbh(_mm512_loadu_ps(r + k + 16), _mm512_loadu_ps(r + k));
            _mm512_storeu_si512((void*)(o + k / 2), (__m512i)v);
        }
        for (; k < K; k += 2) o[k / 2] = bf16_rne(r[k]) | (bf16_rne(r[k + 1]) << 16);
    }
}
static void gemm_bf16dp(const float* x, int64_t T, int64_t K, int64_t ldx, const uint16_t* wb,
                        const float* b, int64_t N, float* y, int64_t ldy, int accumulate) {
    const int64_t K2 = K / 2, panels = (N + PANEL - 1) / PANEL, J4 = K2 & ~(int64_t)3;
    uint32_t stack_xb[8192];
    uint32_t* xb = T * K2 <= 8192 ? stack_xb : malloc(sizeof(uint32_t) * T * K2);
    bf16_pairs(x, T, K, ldx, xb);
    for (int64_t t0 = 0; t0 < T; t0 += 4) {
        const int64_t nt = T - t0 < 4 ? T - t0 : 4;
        const uint32_t* xr[4];
        for (int t = 0; t < 4; t++) xr[t] = xb + (t0 + (t < nt ? t : 0)) * K2;
        for (int64_t p = 0; p < panels; p++) {
            const uint32_t* w = (const uint32_t*)(wb + p * K * PANEL);
            __m512 acc[4][4];
            for (int u = 0; u < 4; u++)
                for (int t = 0; t < 4; t++) acc[u][t] = _mm512_setzero_ps();
            int64_t j = 0;
            if (nt == 1) {
                for (; j < J4; j += 4) {
#pragma GCC unroll 4
                    for (int u = 0; u < 4; u++)
                        acc[u][0] = _mm512_dpbf16_ps(
                            acc[u][0],
                            (__m512bh)_mm512_loadu_si512((const void*)(w + (j + u) * PANEL)),
                            (__m512bh)_mm512_set1_epi32((int)xr[0][j + u]));
                }
            } else {
                for (; j < J4; j += 4) {
#pragma GCC unroll 4
                    for (int u = 0; u < 4; u++) {
                        const __m512bh wv =
                            (__m512bh)_mm512_loadu_si512((const void*)(w + (j + u) * PANEL));
#pragma GCC unroll 4
                        for (int t = 0; t < 4; t++)
                            acc[u & 1][t] = _mm512_dpbf16_ps(
                                acc[u & 1][t], wv, (__m512bh)_mm512_set1_epi32((int)xr[t][j + u]));
                    }
                }
            }
            for (; j < K2; j++) {
                const __m512bh wv = (__m512bh)_mm512_loadu_si512((const void*)(w + j * PANEL));
                for (int t = 0; t < 4; t++)
                    acc[0][t] =
                        _mm512_dpbf16_ps(acc[0][t], wv, (__m512bh)_mm512_set1_epi32((int)xr[t][j]));
            }
            panel_out(acc, nt, p * PANEL, N, b, y + t0 * ldy, ldy, accumulate);
        }
    }
    if (xb != stack_xb) free(xb);
}
#endif
#endif

/* whether this build takes bfloat16 products with VDPBF16PS (Head.bf16_inputs can be 1) */
int loom_head_bf16_dot(void) {
#if ISA_BITS == 512 && defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}

/* A head matmul: the bfloat16 panels (wb) where this build has their kernel and the call runs
   on one thread, else the forward's matmul (`mm`: the float32 packed panels wp, one
   sequential stream a panel as the target's steps read, else the row-major tiles w). */
static inline void hmm(int64_t act16, const float* x, int64_t T, int64_t K, int64_t ldx,
                       const float* w, const float* wp, const uint16_t* wb, const float* b,
                       int64_t N, float* y, int64_t ldy, int accumulate, int nthreads) {
    const int nt = head_threads(T, K, N, nthreads);
#if ISA_BITS == 512
    if (wb && nt == 1) {
#if defined(__AVX512BF16__)
        if (act16) {
            gemm_bf16dp(x, T, K, ldx, wb, b, N, y, ldy, accumulate);
            return;
        }
#endif
        gemm_bf16(x, T, K, ldx, wb, b, N, y, ldy, accumulate);
        return;
    }
#else
    (void)wb;
#endif
    (void)act16;
    mm(x, T, K, ldx, w, wp, b, N, y, ldy, accumulate, nt);
}

static inline double head_wall(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* scores then softmax-weighted V over `len` pool columns (cols -> slots) and `n_extra` entries
   [n_extra, Hkv, D] held elsewhere; one query row q [H, D] -> out [H, D]. Per KV head, its G
   query heads at once (each K / V row read once for all of them); the softmax over a head's
   scores as one vectorized pass (fast_expf: libm's expf is a call per score). sc: G * n. */
static void head_attend(const Head* m, const Layer* L, const float* q, const int64_t* cols,
                        int64_t len, const float* ek, const float* ev, int64_t ext_stride,
                        int64_t n_extra, float* sc, float* out) {
    const int64_t H = m->heads, Hkv = m->kv_heads, D = m->head_dim, G = H / Hkv;
    const int64_t n = len + n_extra;
    for (int64_t kh = 0; kh < Hkv; kh++) {
        const float* qk = q + kh * G * D; /* heads kh * G .. kh * G + G - 1 */
        for (int64_t c = 0; c < n; c++) {
            const float* kp = c < len ? L->k_cache + (cols[c] * Hkv + kh) * D
                                      : ek + (c - len) * ext_stride + kh * D;
            for (int64_t g = 0; g < G; g++) {
                const float* qh = qk + g * D;
                float dot = 0.f;
#pragma omp simd reduction(+ : dot)
                for (int64_t d = 0; d < D; d++) dot += qh[d] * kp[d];
                sc[g * n + c] = dot * m->scale;
            }
        }
        float* o = out + kh * G * D;
        memset(o, 0, sizeof(float) * G * D);
        for (int64_t g = 0; g < G; g++) {
            float* s = sc + g * n;
            float mx = -INFINITY;
#pragma omp simd reduction(max : mx)
            for (int64_t c = 0; c < n; c++) mx = s[c] > mx ? s[c] : mx;
            float sum = 0.f;
#pragma omp simd reduction(+ : sum)
            for (int64_t c = 0; c < n; c++) {
                const float e = fast_expf(s[c] - mx);
                s[c] = e;
                sum += e;
            }
            const float inv = 1.f / sum;
#pragma omp simd
            for (int64_t c = 0; c < n; c++) s[c] *= inv;
        }
        for (int64_t c = 0; c < n; c++) {
            const float* vp = c < len ? L->v_cache + (cols[c] * Hkv + kh) * D
                                      : ev + (c - len) * ext_stride + kh * D;
            for (int64_t g = 0; g < G; g++) {
                const float p = sc[g * n + c];
                float* og = o + g * D;
#pragma omp simd
                for (int64_t d = 0; d < D; d++) og[d] += p * vp[d];
            }
        }
    }
}

/* The head over T rows: row t reads token ids[t] at rotary position pos[t] and feature
   feat + t * ldf (`fused`: a target feature, else the head's own previous output) and attends
   to pool columns cols[t][0 .. lens[t]-1]; with slots, its K/V go to pool slot slots[t] first
   (the catch-up: causal through the table), else to the loop buffers lk/lv at entry `level`
   of row t, and it also attends to entries 0 .. level there (the draft loop). x [T, hidden]
   gets the output hidden state: of every row, or with `keep` (n_keep distinct row indices)
   of those rows only. Every row's K/V is stored at every layer, but past the last layer's
   K/V projection only the kept rows' outputs are read (in a catch-up, the last row of each
   drafting request), so the last layer's attention, o_proj and MLP run for those alone: a
   catch-up of a few rows (or a prefill's hundreds) costs its fc and qkv per row and the rest
   once. */
static void head_stack(const Head* m, int64_t T, const int64_t* ids, const int64_t* pos,
                       const float* feat, int64_t ldf, int fused, const int64_t* const* cols,
                       const int64_t* lens, const int64_t* slots, float* lk, float* lv,
                       int64_t level, int64_t steps, float* x, int64_t max_len, const int64_t* keep,
                       int64_t n_keep, int nthreads) {
    const int64_t Hd = m->hidden, H = m->heads, Hkv = m->kv_heads, D = m->head_dim, I = m->inter;
    const int64_t QKV = (H + 2 * Hkv) * D, KVD = Hkv * D;
    const int64_t Kin = m->variant == 0 ? Hd : 2 * Hd;
    float* hin = malloc(sizeof(float) * T * 2 * Hd);
    float* qkv = malloc(sizeof(float) * T * QKV);
    float* att = malloc(sizeof(float) * T * H * D);
    float* gu = malloc(sizeof(float) * T * 2 * I);
    float* sc = malloc(sizeof(float) * (H / Hkv) * (max_len + steps + 1));
    float* xs = keep ? malloc(sizeof(float) * (n_keep > 0 ? n_keep : 1) * Hd) : NULL;
    if (m->variant == 0) {
        for (int64_t t = 0; t < T; t++) {
            memcpy(hin + t * 2 * Hd, m->embed + ids[t] * Hd, sizeof(float) * Hd);
            memcpy(hin + t * 2 * Hd + Hd, feat + t * ldf, sizeof(float) * Hd);
        }
        hmm(m->bf16_inputs, hin, T, 2 * Hd, 2 * Hd, m->fc_w, m->fc_p, m->fc_bf, m->fc_b, Hd, x, Hd,
            0, nthreads);
    } else if (fused) {
        hmm(m->bf16_inputs, feat, T, m->fc_in, ldf, m->fc_w, m->fc_p, m->fc_bf, m->fc_b, Hd, x, Hd,
            0, nthreads);
    } else {
        for (int64_t t = 0; t < T; t++) memcpy(x + t * Hd, feat + t * ldf, sizeof(float) * Hd);
    }
    for (int64_t l = 0; l < m->layers; l++) {
        const Layer* L = m->layer + l;
        const uint16_t* const* bf = m->layer_bf + 4 * l;
        for (int64_t t = 0; t < T; t++) {
            float* hr = hin + t * Kin;
            if (m->variant == 1) {
                rms(m->embed + ids[t] * Hd, m->in_norm, Hd, m->eps, hr);
                rms(x + t * Hd, m->hidden_norm, Hd, m->eps, hr + Hd);
            } else if (L->ln1) {
                rms(x + t * Hd, L->ln1, Hd, m->eps, hr);
            } else {
                memcpy(hr, x + t * Hd, sizeof(float) * Hd);
            }
        }
        hmm(m->bf16_inputs, hin, T, Kin, Kin, L->qkv_w, L->qkv_p, bf[0], L->qkv_b, QKV, qkv, QKV, 0,
            nthreads);
        /* the target forward's q/k RMSNorm + RoPE (forward.c) */
        qk_norm_rope(qkv, T, QKV, H, Hkv, D, L->q_norm, L->k_norm, m->eps, m->cos, m->sin, pos);
        for (int64_t t = 0; t < T; t++) { /* every row's K/V first: the attention reads them */
            const float* k = qkv + t * QKV + H * D;
            const float* v = k + KVD;
            float* kd = slots ? L->k_cache + slots[t] * KVD
                              : lk + (t * m->layers + l) * steps * KVD + level * KVD;
            float* vd = slots ? L->v_cache + slots[t] * KVD
                              : lv + (t * m->layers + l) * steps * KVD + level * KVD;
            memcpy(kd, k, sizeof(float) * KVD);
            memcpy(vd, v, sizeof(float) * KVD);
        }
        /* the rows whose output this layer computes: all but at the last layer with `keep`;
           they are compacted to rows 0 .. n-1 of att / xo (xo: x itself when all are kept) */
        const int last = keep && l + 1 == m->layers;
        const int64_t n = last ? n_keep : T;
        float* xo = x;
        if (last && n > 0) {
            xo = xs;
            for (int64_t j = 0; j < n; j++)
                memcpy(xs + j * Hd, x + keep[j] * Hd, sizeof(float) * Hd);
        }
        for (int64_t j = 0; j < n; j++) {
            const int64_t t = last ? keep[j] : j;
            const float* q = qkv + t * QKV;
            if (slots) {
                head_attend(m, L, q, cols[t], lens[t], NULL, NULL, 0, 0, sc, att + j * H * D);
            } else {
                const int64_t base = (t * m->layers + l) * steps * KVD;
                head_attend(m, L, q, cols[t], lens[t], lk + base, lv + base, KVD, level + 1, sc,
                            att + j * H * D);
            }
        }
        if (n == 0) continue;
        hmm(m->bf16_inputs, att, n, H * D, H * D, L->o_w, L->o_p, bf[1], L->o_b, Hd, xo, Hd, 1,
            nthreads);
        for (int64_t j = 0; j < n; j++) rms(xo + j * Hd, L->ln2, Hd, m->eps, hin + j * Hd);
        hmm(m->bf16_inputs, hin, n, Hd, Hd, L->gu_w, L->gu_p, bf[2], L->gu_b, 2 * I, gu, 2 * I, 0,
            nthreads);
        for (int64_t j = 0; j < n; j++) silu_mul(gu + j * 2 * I, gu + j * 2 * I + I, I);
        hmm(m->bf16_inputs, gu, n, I, 2 * I, L->down_w, L->down_p, bf[3], L->down_b, Hd, xo, Hd, 1,
            nthreads);
        if (last)
            for (int64_t j = 0; j < n; j++)
                memcpy(x + keep[j] * Hd, xs + j * Hd, sizeof(float) * Hd);
    }
    free(hin);
    free(qkv);
    free(att);
    free(gu);
    free(sc);
    free(xs);
}

/* logits [n, dvocab] of the head's output rows x [n, hidden]; tokens[i * stride] = the target
   id of each row's argmax (the first on a tie) */
static void head_pick(const Head* m, const float* x, int64_t n, float* logits, float* normed,
                      int64_t* tokens, int64_t stride, int nthreads) {
    const int64_t Hd = m->hidden, V = m->dvocab;
    const float* in = x;
    if (m->norm) {
        for (int64_t i = 0; i < n; i++) rms(x + i * Hd, m->norm, Hd, m->eps, normed + i * Hd);
        in = normed;
    }
    hmm(m->bf16_inputs, in, n, Hd, Hd, m->lm_head, m->lm_p, m->lm_bf, NULL, V, logits, V, 0,
        nthreads);
    for (int64_t i = 0; i < n; i++) {
        const float* r = logits + i * V;
        int64_t best = 0;
        for (int64_t v = 1; v < V; v++) best = r[v] > r[best] ? v : best;
        tokens[i * stride] = best + (m->d2t ? m->d2t[best] : 0);
    }
}

/* One EAGLE draft round. Catch-up: rows 0..T-1 (request b owns starts[b] .. starts[b+1]-1, the
   last tokens of its seq_lens[b] committed head entries, read through table[rows[b] * stride
   + column]). Then for each of the nd requests draft_reqs[i]: `steps` greedy draft tokens from
   its last row, out_tokens [nd, steps] (target ids). Optional: logits_out [steps, nd, dvocab],
   hidden_out [T, hidden] (the catch-up's output), prof[0] / prof[1] += wall seconds of the
   catch-up / the draft loop. Returns 0, -1 for a position past the rotary table, -2 for a
   token id past the embedding. */
int loom_eagle_round(const Head* m, int64_t T, const int64_t* ids, const int64_t* pos,
                     const int64_t* slots, const float* feats, int64_t ldf, int64_t B,
                     const int64_t* starts, const int64_t* rows, const int64_t* seq_lens,
                     const int64_t* table, int64_t stride, int64_t nd, const int64_t* draft_reqs,
                     int64_t steps, int64_t* out_tokens, float* logits_out, float* hidden_out,
                     int nthreads, double* prof) {
    const int64_t Hd = m->hidden;
    int64_t max_len = 1;
    for (int64_t b = 0; b < B; b++) {
        max_len = seq_lens[b] > max_len ? seq_lens[b] : max_len;
        if (seq_lens[b] + steps > m->max_pos) return -1;
    }
    for (int64_t t = 0; t < T; t++) {
        if (pos[t] < 0 || pos[t] >= m->max_pos) return -1;
        if (ids[t] < 0 || ids[t] >= m->vocab) return -2;
    }
    double t0 = prof ? head_wall() : 0.;
    const int64_t** cols = malloc(sizeof(int64_t*) * ((T > nd ? T : nd) + 1));
    int64_t* lens = malloc(sizeof(int64_t) * ((T > nd ? T : nd) + 1));
    for (int64_t b = 0; b < B; b++) {
        const int64_t n_tok = starts[b + 1] - starts[b];
        for (int64_t t = starts[b]; t < starts[b + 1]; t++) {
            cols[t] = table + rows[b] * stride;
            lens[t] = seq_lens[b] - n_tok + (t - starts[b]) + 1;
        }
    }
    float* x = malloc(sizeof(float) * (T > 0 ? T : 1) * Hd);
    /* the rows whose output is read: all for hidden_out, else each drafting request's last */
    int64_t* keep = hidden_out ? NULL : malloc(sizeof(int64_t) * (nd > 0 ? nd : 1));
    if (keep)
        for (int64_t i = 0; i < nd; i++) keep[i] = starts[draft_reqs[i] + 1] - 1;
    head_stack(m, T, ids, pos, feats, ldf, 1, cols, lens, slots, NULL, NULL, 0, steps, x, max_len,
               keep, nd, nthreads);
    free(keep);
    if (hidden_out) memcpy(hidden_out, x, sizeof(float) * T * Hd);
    if (prof) {
        const double t1 = head_wall();
        prof[0] += t1 - t0;
        t0 = t1;
    }
    if (nd > 0) {
        const int64_t KVD = m->kv_heads * m->head_dim;
        float* cur = malloc(sizeof(float) * nd * Hd);
        float* nxt = malloc(sizeof(float) * nd * Hd);
        float* normed = malloc(sizeof(float) * nd * Hd);
        float* lg = malloc(sizeof(float) * nd * m->dvocab);
        float* lk = malloc(sizeof(float) * nd * m->layers * steps * KVD);
        float* lv = malloc(sizeof(float) * nd * m->layers * steps * KVD);
        int64_t* lids = malloc(sizeof(int64_t) * nd);
        int64_t* lpos = malloc(sizeof(int64_t) * nd);
        for (int64_t i = 0; i < nd; i++) {
            const int64_t b = draft_reqs[i];
            memcpy(cur + i * Hd, x + (starts[b + 1] - 1) * Hd, sizeof(float) * Hd);
            cols[i] = table + rows[b] * stride;
            lens[i] = seq_lens[b];
        }
        for (int64_t level = 0; level < steps; level++) {
            head_pick(m, cur, nd, lg, normed, out_tokens + level, steps, nthreads);
            if (logits_out)
                memcpy(logits_out + level * nd * m->dvocab, lg, sizeof(float) * nd * m->dvocab);
            if (level + 1 == steps) break;
            for (int64_t i = 0; i < nd; i++) {
                lids[i] = out_tokens[i * steps + level];
                lpos[i] = seq_lens[draft_reqs[i]] + level;
            }
            head_stack(m, nd, lids, lpos, cur, Hd, 0, cols, lens, NULL, lk, lv, level, steps, nxt,
                       max_len, NULL, 0, nthreads);
            float* tmp = cur;
            cur = nxt;
            nxt = tmp;
        }
        free(cur);
        free(nxt);
        free(normed);
        free(lg);
        free(lk);
        free(lv);
        free(lids);
        free(lpos);
    }
    if (prof) prof[1] += head_wall() - t0;
    free(cols);
    free(lens);
    free(x);
    return 0;
}

/* Medusa: h [n, hidden] -> for each head i < k: x = h; x += SiLU(W_ij x + b_ij) for j < nl;
   logits = LM_i x (LM: [V, hidden] shared, or head i's own with own_lm); the top-`topk`
   log-probabilities and ids, out_logp / out_ids [n, k, topk], best first (ties: lower id).
   Weights packed (cpu_forward.pack): res_p the k * nl blocks' W, lm_p the LM head(s), each
   matrix padded to whole panels. */
void loom_medusa_heads(const float* h, int64_t n, int64_t Hd, int64_t k, int64_t nl,
                       const float* res_p, const float* res_b, const float* lm_p, int own_lm,
                       int64_t V, int64_t topk, float* out_logp, int64_t* out_ids, int nthreads) {
    float* x = malloc(sizeof(float) * k * n * Hd); /* [k, n, Hd]: every head's rows */
    float* y = malloc(sizeof(float) * n * Hd);
    float* lg = malloc(sizeof(float) * k * n * V);
    const int64_t res_ld = (Hd + PANEL - 1) / PANEL * PANEL * Hd; /* one packed matrix */
    const int64_t lm_ld = (V + PANEL - 1) / PANEL * PANEL * Hd;
    for (int64_t i = 0; i < k; i++) {
        float* xi = x + i * n * Hd;
        memcpy(xi, h, sizeof(float) * n * Hd);
        for (int64_t j = 0; j < nl; j++) {
            const int64_t at = i * nl + j;
            hmm(0, xi, n, Hd, Hd, NULL, res_p + at * res_ld, NULL, res_b + at * Hd, Hd, y, Hd, 0,
                nthreads);
            for (int64_t e = 0; e < n * Hd; e++) xi[e] += y[e] / (1.f + expf(-y[e]));
        }
        if (own_lm)
            hmm(0, xi, n, Hd, Hd, NULL, lm_p + i * lm_ld, NULL, NULL, V, lg + i * n * V, V, 0,
                nthreads);
    }
    /* a shared LM head: one pass over its weights for all k * n rows */
    if (!own_lm) hmm(0, x, k * n, Hd, Hd, NULL, lm_p, NULL, NULL, V, lg, V, 0, nthreads);
    for (int64_t i = 0; i < k; i++)
        for (int64_t r = 0; r < n; r++) {
            const float* row = lg + (i * n + r) * V;
            float mx = -INFINITY;
            for (int64_t v = 0; v < V; v++) mx = row[v] > mx ? row[v] : mx;
            float sum = 0.f;
#pragma omp simd reduction(+ : sum)
            for (int64_t v = 0; v < V; v++) sum += expf(row[v] - mx);
            const float lse = mx + logf(sum);
            float* lp = out_logp + (r * k + i) * topk;
            int64_t* id = out_ids + (r * k + i) * topk;
            int64_t have = 0;
            for (int64_t v = 0; v < V; v++) {
                const float val = row[v];
                if (have == topk && val <= row[id[topk - 1]]) continue;
                int64_t p = have < topk ? have++ : topk - 1;
                while (p > 0 && row[id[p - 1]] < val) {
                    id[p] = id[p - 1];
                    p--;
                }
                id[p] = v;
            }
            for (int64_t q = 0; q < have; q++) lp[q] = row[id[q]] - lse;
        }
    free(x);
    free(y);
    free(lg);
}
