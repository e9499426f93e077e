"""C source of the compiled CPU forward (runtime/cpu_forward.py builds and calls it).

One call runs a llama-style dense decoder stack over a step's T tokens: embedding, then per
layer RMSNorm, the fused QKV projection (+ bias), the per-head q/k RMSNorm (Qwen3), neox RoPE,
the K/V store into the pool slots, paged attention reading K/V in place through the
req-to-token table (causal, or a request's custom tree mask), O projection + residual,
RMSNorm, the SiLU-gated MLP + residual; then the final RMSNorm and the LM head for the rows
that need logits only. Weights are read in place from the torch tensors (row-major [out, in],
float32). The matmuls are register-tiled dot products (4 output rows x 2 tokens) written with
GCC/clang vector extensions, so -march=native picks the SIMD width.
"""

SOURCE = r"""
#define _GNU_SOURCE
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef float v8 __attribute__((vector_size(32)));

static inline v8 ld(const float* p) { v8 v; memcpy(&v, p, sizeof(v)); return v; }
static inline float hsum(v8 v) {
    return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

typedef struct {
    const float *ln1, *qkv_w, *qkv_b, *q_norm, *k_norm, *o_w, *o_b;
    const float *ln2, *gu_w, *gu_b, *down_w, *down_b;
    float *k_cache, *v_cache; /* [slots, Hkv, D] */
} Layer;

typedef struct {
    int64_t hidden, heads, kv_heads, head_dim, inter, vocab, layers, max_pos;
    float eps, scale;
    const float *embed, *norm, *lm_head, *cos, *sin; /* cos/sin [max_pos, D] */
    const Layer* layer;
} Model;

/* y[t, n] (+)= sum_k x[t, k] w[n, k] + b[n] for t < T, n < N; rows of x are ldx apart, of y ldy. */
static void gemm(const float* x, int64_t T, int64_t K, int64_t ldx, const float* w, const float* b,
                 int64_t N, float* y, int64_t ldy, int accumulate, int nthreads) {
    const int64_t K8 = K & ~(int64_t)7, tiles = (N + 3) / 4;
    #pragma omp parallel for schedule(static) num_threads(nthreads) if(nthreads > 1)
    for (int64_t tile = 0; tile < tiles; tile++) {
        const int64_t n0 = tile * 4, nn = N - n0 < 4 ? N - n0 : 4;
        const float* wr[4];
        for (int r = 0; r < 4; r++) wr[r] = w + (n0 + (r < nn ? r : 0)) * K;
        int64_t t = 0;
        for (; t + 2 <= T; t += 2) {
            const float *x0 = x + t * ldx, *x1 = x0 + ldx;
            v8 a00 = {0}, a01 = {0}, a10 = {0}, a11 = {0}, a20 = {0}, a21 = {0}, a30 = {0}, a31 = {0};
            for (int64_t k = 0; k < K8; k += 8) {
                if (t == 0 && !(k & 15)) { /* first token pair: the next tile's rows */
                    __builtin_prefetch(wr[0] + k + 4 * K); __builtin_prefetch(wr[1] + k + 4 * K);
                    __builtin_prefetch(wr[2] + k + 4 * K); __builtin_prefetch(wr[3] + k + 4 * K);
                }
                const v8 u = ld(x0 + k), v = ld(x1 + k);
                v8 w0 = ld(wr[0] + k); a00 += w0 * u; a01 += w0 * v;
                v8 w1 = ld(wr[1] + k); a10 += w1 * u; a11 += w1 * v;
                v8 w2 = ld(wr[2] + k); a20 += w2 * u; a21 += w2 * v;
                v8 w3 = ld(wr[3] + k); a30 += w3 * u; a31 += w3 * v;
            }
            float s[4][2] = {{hsum(a00), hsum(a01)}, {hsum(a10), hsum(a11)},
                             {hsum(a20), hsum(a21)}, {hsum(a30), hsum(a31)}};
            for (int64_t k = K8; k < K; k++)
                for (int r = 0; r < 4; r++) { s[r][0] += wr[r][k] * x0[k]; s[r][1] += wr[r][k] * x1[k]; }
            for (int r = 0; r < nn; r++)
                for (int j = 0; j < 2; j++) {
                    float* o = y + (t + j) * ldy + n0 + r;
                    const float val = s[r][j] + (b ? b[n0 + r] : 0.f);
                    *o = accumulate ? *o + val : val;
                }
        }
        for (; t < T; t++) {
            const float* x0 = x + t * ldx;
            /* two accumulators a row (even / odd 8-blocks): eight FMA chains in flight */
            v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, b0 = {0}, b1 = {0}, b2 = {0}, b3 = {0};
            int64_t k = 0;
            for (; k + 16 <= K8; k += 16) {
                /* the next tile's rows: 4K floats on */
                __builtin_prefetch(wr[0] + k + 4 * K); __builtin_prefetch(wr[1] + k + 4 * K);
                __builtin_prefetch(wr[2] + k + 4 * K); __builtin_prefetch(wr[3] + k + 4 * K);
                const v8 u = ld(x0 + k), v = ld(x0 + k + 8);
                a0 += ld(wr[0] + k) * u; a1 += ld(wr[1] + k) * u;
                a2 += ld(wr[2] + k) * u; a3 += ld(wr[3] + k) * u;
                b0 += ld(wr[0] + k + 8) * v; b1 += ld(wr[1] + k + 8) * v;
                b2 += ld(wr[2] + k + 8) * v; b3 += ld(wr[3] + k + 8) * v;
            }
            for (; k < K8; k += 8) {
                const v8 u = ld(x0 + k);
                a0 += ld(wr[0] + k) * u; a1 += ld(wr[1] + k) * u;
                a2 += ld(wr[2] + k) * u; a3 += ld(wr[3] + k) * u;
            }
            float s[4] = {hsum(a0 + b0), hsum(a1 + b1), hsum(a2 + b2), hsum(a3 + b3)};
            for (int64_t k = K8; k < K; k++)
                for (int r = 0; r < 4; r++) s[r] += wr[r][k] * x0[k];
            for (int r = 0; r < nn; r++) {
                float* o = y + t * ldy + n0 + r;
                const float val = s[r] + (b ? b[n0 + r] : 0.f);
                *o = accumulate ? *o + val : val;
            }
        }
    }
}

/* y [T, N] = x [T, K] w [N, K]^T (+ b): the matmul above on its own, for tests and tuning */
void loom_linear_f32(const float* x, int64_t T, int64_t K, const float* w, const float* b,
                     int64_t N, float* y, int nthreads) {
    gemm(x, T, K, K, w, b, N, y, N, 0, nthreads);
}

static inline double cpu_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}
/* with prof != NULL: prof[0] += the calling thread's CPU seconds in matmuls, prof[1] in
   attention (the benchmark's step split) */
#define TIMED(slot, stmt) do { const double t0_ = prof ? cpu_seconds() : 0.;                 \
    stmt; if (prof) prof[slot] += cpu_seconds() - t0_; } while (0)

/* out[D] = w * x / rms(x); out may alias x */
static void rms(const float* x, const float* w, int64_t D, float eps, float* out) {
    float ss = 0.f;
    #pragma omp simd reduction(+:ss)
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

/* One step. Requests b < B own tokens starts[b] .. starts[b+1]-1 (the last extend tokens of a
   sequence of seq_lens[b] KV columns, read through table[rows[b] * stride + column]); token j
   of request b sees columns 0 .. prefix + j (prefix = seq_lens[b] - its token count), or with
   mask_offs[b] >= 0 the columns c < seq_lens[b] where masks[mask_offs[b] + j * seq_lens[b] + c]
   is nonzero. Rows logit_rows[0 .. N-1] get float32 logits [N, vocab]. With hidden_out, every
   row's final-norm hidden state [T, hidden]; with n_aux > 0, aux_out [n_aux, T, hidden] gets the
   residual stream after layer aux_layers[a] (both what LlamaModel.forward captures).
   Returns 0, or -1 for a position past the rotary table, -2 for a token id past the vocab. */
int loom_forward_f32(const Model* m, int64_t T, const int64_t* ids, const int64_t* pos,
                     const int64_t* slots, int64_t B, const int64_t* starts, const int64_t* rows,
                     const int64_t* seq_lens, const int64_t* table, int64_t stride,
                     const uint8_t* masks, const int64_t* mask_offs, int64_t N,
                     const int64_t* logit_rows, float* logits, int nthreads, double* prof,
                     float* hidden_out, int64_t n_aux, const int64_t* aux_layers,
                     float* aux_out) {
    const int64_t Hd = m->hidden, H = m->heads, Hkv = m->kv_heads, D = m->head_dim;
    const int64_t G = H / Hkv, I = m->inter, QKV = (H + 2 * Hkv) * D;
    for (int64_t t = 0; t < T; t++) {
        if (pos[t] < 0 || pos[t] >= m->max_pos) return -1;
        if (ids[t] < 0 || ids[t] >= m->vocab) return -2;
    }
    int64_t max_len = 1;
    for (int64_t b = 0; b < B; b++) max_len = seq_lens[b] > max_len ? seq_lens[b] : max_len;
    int64_t* tok_req = malloc(sizeof(int64_t) * (T > 0 ? T : 1));
    for (int64_t b = 0; b < B; b++)
        for (int64_t t = starts[b]; t < starts[b + 1]; t++) tok_req[t] = b;
    float* x = malloc(sizeof(float) * T * Hd);     /* residual stream */
    float* h = malloc(sizeof(float) * T * Hd);     /* normed input of a block */
    float* qkv = malloc(sizeof(float) * T * QKV);
    float* att = malloc(sizeof(float) * T * H * D);
    float* gu = malloc(sizeof(float) * T * 2 * I);
    for (int64_t t = 0; t < T; t++) memcpy(x + t * Hd, m->embed + ids[t] * Hd, sizeof(float) * Hd);
    const int attn_threads = nthreads > 1 && T * Hkv * max_len * H * D > (1 << 17) ? nthreads : 1;

    for (int64_t l = 0; l < m->layers; l++) {
        const Layer* L = m->layer + l;
        for (int64_t t = 0; t < T; t++) rms(x + t * Hd, L->ln1, Hd, m->eps, h + t * Hd);
        TIMED(0, gemm(h, T, Hd, Hd, L->qkv_w, L->qkv_b, QKV, qkv, QKV, 0, nthreads));
        for (int64_t t = 0; t < T; t++) {
            float* q = qkv + t * QKV;
            float* k = q + H * D;
            const float* v = k + Hkv * D;
            const float *c = m->cos + pos[t] * D, *s = m->sin + pos[t] * D;
            for (int64_t i = 0; i < H; i++) {
                if (L->q_norm) rms(q + i * D, L->q_norm, D, m->eps, q + i * D);
                rope(q + i * D, c, s, D);
            }
            for (int64_t i = 0; i < Hkv; i++) {
                if (L->k_norm) rms(k + i * D, L->k_norm, D, m->eps, k + i * D);
                rope(k + i * D, c, s, D);
            }
            memcpy(L->k_cache + slots[t] * Hkv * D, k, sizeof(float) * Hkv * D);
            memcpy(L->v_cache + slots[t] * Hkv * D, v, sizeof(float) * Hkv * D);
        }
        const double att0 = prof ? cpu_seconds() : 0.;
        #pragma omp parallel num_threads(attn_threads) if(attn_threads > 1)
        {
            float* sc = malloc(sizeof(float) * G * max_len);
            float* acc = malloc(sizeof(float) * G * D);
            #pragma omp for schedule(dynamic)
            for (int64_t w = 0; w < T * Hkv; w++) {
                const int64_t t = w / Hkv, kh = w % Hkv, b = tok_req[t];
                const int64_t S = seq_lens[b], j = t - starts[b];
                const int64_t n_tok = starts[b + 1] - starts[b];
                const uint8_t* mrow = mask_offs[b] >= 0 ? masks + mask_offs[b] + j * S : NULL;
                const int64_t len = mrow ? S : S - n_tok + j + 1;
                const int64_t* cols = table + rows[b] * stride;
                const float* qb = qkv + t * QKV + kh * G * D;
                float mx[G], den[G];
                for (int64_t g = 0; g < G; g++) mx[g] = -INFINITY;
                for (int64_t c = 0; c < len; c++) {
                    if (mrow && !mrow[c]) { for (int64_t g = 0; g < G; g++) sc[g * len + c] = -INFINITY; continue; }
                    const float* kp = L->k_cache + (cols[c] * Hkv + kh) * D;
                    for (int64_t g = 0; g < G; g++) {
                        const float* qg = qb + g * D;
                        float dot = 0.f;
                        #pragma omp simd reduction(+:dot)
                        for (int64_t d = 0; d < D; d++) dot += qg[d] * kp[d];
                        dot *= m->scale;
                        sc[g * len + c] = dot;
                        mx[g] = dot > mx[g] ? dot : mx[g];
                    }
                }
                for (int64_t g = 0; g < G; g++) {
                    float sum = 0.f;
                    for (int64_t c = 0; c < len; c++) {
                        const float e = sc[g * len + c] == -INFINITY ? 0.f : expf(sc[g * len + c] - mx[g]);
                        sc[g * len + c] = e;
                        sum += e;
                    }
                    den[g] = sum > 0.f ? 1.f / sum : 0.f;
                }
                memset(acc, 0, sizeof(float) * G * D);
                for (int64_t c = 0; c < len; c++) {
                    if (mrow && !mrow[c]) continue;
                    const float* vp = L->v_cache + (cols[c] * Hkv + kh) * D;
                    for (int64_t g = 0; g < G; g++) {
                        const float p = sc[g * len + c];
                        float* a = acc + g * D;
                        #pragma omp simd
                        for (int64_t d = 0; d < D; d++) a[d] += p * vp[d];
                    }
                }
                float* o = att + t * H * D + kh * G * D;
                for (int64_t g = 0; g < G; g++)
                    for (int64_t d = 0; d < D; d++) o[g * D + d] = acc[g * D + d] * den[g];
            }
            free(sc);
            free(acc);
        }
        if (prof) prof[1] += cpu_seconds() - att0;
        TIMED(0, gemm(att, T, H * D, H * D, L->o_w, L->o_b, Hd, x, Hd, 1, nthreads));
        for (int64_t t = 0; t < T; t++) rms(x + t * Hd, L->ln2, Hd, m->eps, h + t * Hd);
        TIMED(0, gemm(h, T, Hd, Hd, L->gu_w, L->gu_b, 2 * I, gu, 2 * I, 0, nthreads));
        for (int64_t t = 0; t < T; t++) {
            float* g = gu + t * 2 * I;
            const float* u = g + I;
            for (int64_t i = 0; i < I; i++) g[i] = g[i] / (1.f + expf(-g[i])) * u[i];
        }
        TIMED(0, gemm(gu, T, I, 2 * I, L->down_w, L->down_b, Hd, x, Hd, 1, nthreads));
        /* an EAGLE-3 drafter's aux features: the residual stream after layer l (the eager
           model's hidden + residual), [n_aux, T, Hd] in capture_layers order */
        for (int64_t a = 0; a < n_aux; a++)
            if (aux_layers[a] == l) memcpy(aux_out + a * T * Hd, x, sizeof(float) * T * Hd);
    }
    /* a drafter reading the final hidden states (capture_layers not None): every row, normed */
    if (hidden_out)
        for (int64_t t = 0; t < T; t++) rms(x + t * Hd, m->norm, Hd, m->eps, hidden_out + t * Hd);
    for (int64_t r = 0; r < N; r++) rms(x + logit_rows[r] * Hd, m->norm, Hd, m->eps, h + r * Hd);
    TIMED(0, gemm(h, N, Hd, Hd, m->lm_head, NULL, m->vocab, logits, m->vocab, 0, nthreads));
    free(tok_req); free(x); free(h); free(qkv); free(att); free(gu);
    return 0;
}
"""
