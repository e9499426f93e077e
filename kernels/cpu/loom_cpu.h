/* loom's CPU kernels: one shared library, built at run time by loom.runtime.native from the .c
   files of this folder (attention.c, attn_avx2.c, forward.c, heads.c, ngram_store.c, pool.c,
   quant.c, quant_bi.c, quant_bi2.c, quant_bi_avx2.c, quant_gemv_avx2.c, quant_gemv1_avx2.c,
   quant_gemv_k_avx2.c, quant_i8.c, quant_i8_avx2.c, layout.c).

   This header is the contract with Python. Every function Python calls is declared here with
   LOOM_API, and native.py generates the ctypes signatures from these prototypes (pointers:
   c_void_p; int64_t, int, float, double: their ctypes), so a prototype and its ctypes call
   cannot disagree. Every struct Python also lays out (ctypes.Structure: Layer, Model, Head;
   the n-gram store's Node records and header slots, read through memoryviews) is defined here
   and listed in layout.c, whose sizes and offsets native.check_layout compares with the
   Python side at load. Everything else here is shared between the .c files only. */
#ifndef LOOM_CPU_H
#define LOOM_CPU_H

#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* clock_gettime's CLOCK_THREAD_CPUTIME_ID under -std=c11 */
#endif
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#if defined(__AVX__) && defined(__FMA__)
#include <immintrin.h>
#endif

/* the library is built with -fvisibility=hidden: only these symbols are exported */
#define LOOM_API __attribute__((visibility("default")))

/* ---- helpers shared by the .c files ------------------------------------------------------ */

/* exp(x) for a softmax (x <= 0: a score minus its row max), in arithmetic that vectorizes
   (libm's expf does not without -ffast-math): 2^n * e^r with |r| <= ln2 / 2 and a degree-6
   Taylor polynomial, relative error ~2e-7; exactly 0 below -87 (and for -inf: masked). */
static inline float fast_expf(float x) {
    const float n = __builtin_rintf(x * 1.44269504f);
    const float r = (x - n * 0.693145752f) - n * 1.42860677e-6f;
    float p = 1.f / 720.f;
    p = p * r + 1.f / 120.f;
    p = p * r + 1.f / 24.f;
    p = p * r + 1.f / 6.f;
    p = p * r + 0.5f;
    p = p * r + 1.f;
    p = p * r + 1.f;
    const int32_t e = ((int32_t)(n < -126.f ? -126.f : n) + 127) << 23;
    float scale;
    memcpy(&scale, &e, 4);
    return x < -87.f ? 0.f : p * scale;
}

/* The block types' shared facts, by quant.c's type ids (Q8_0 0, Q4_0 1, Q4_1 2, Q4_K 3, Q6_K 4,
   Q5_0 5, Q5_1 6), for the kernels that decode rows to integer codes (quant_bi.c, quant_i8.c,
   quant_i8_avx2.c): the values of one scaled unit (Q6_K's sub-blocks of 16, else 32), whether a
   unit carries an offset (Q4_1 / Q5_1 / Q4_K: y gets b_j * (dx * sum of codes)), and the offset o
   that makes a symmetric type's codes w + o unsigned (0 for the asymmetric ones). */
static inline int q_unit_len(int qtype) { return qtype == 4 ? 16 : 32; }
static inline int q_is_asym(int qtype) { return qtype == 2 || qtype == 6 || qtype == 3; }
static inline int q_sym_offset(int qtype) {
    return qtype == 0 ? 128 : qtype == 1 ? 8 : qtype == 5 ? 16 : qtype == 4 ? 32 : 0;
}

/* A K or V row as f32: in place for an f32 pool, else widened into `buf` (bf16 -> f32 is a
   16-bit shift, which vectorizes; an element-wise load inside the dot products does not). */
static inline const float* row_f32(const float* p, float* buf, int64_t n) {
    (void)buf;
    (void)n;
    return p;
}
static inline const float* row_bf16(const uint16_t* p, float* buf, int64_t n) {
    /* the bits go through memcpy, not a uint32_t* store into the floats: that store's type
       punning breaks strict aliasing (GCC then saw the float reads as of uninitialized
       memory); the copy compiles to the same vector shift and store */
#pragma omp simd
    for (int64_t i = 0; i < n; i++) {
        const uint32_t u = (uint32_t)p[i] << 16;
        float f;
        memcpy(&f, &u, sizeof(f));
        buf[i] = f;
    }
    return buf;
}

/* float32 -> bfloat16 bits, rounded to nearest even as torch's Tensor.to(torch.bfloat16) does
   (c10::BFloat16's round_to_nearest_even: NaN -> 0x7FC0, denormals kept), so a pool the C
   forward writes holds the bits the eager layers' stores would. Integer code, which vectorizes
   on every target (AVX-512 BF16's VCVTNEPS2BF16 flushes denormals, so it is not used). */
static inline void store_bf16(uint16_t* dst, const float* src, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, src + i, sizeof(u));
        const int nan = (u & 0x7fffffffu) > 0x7f800000u;
        const uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
        dst[i] = (uint16_t)(nan ? 0x7fc0u : r);
    }
}

/* Output rows per packed panel: the projections and LM heads are packed into panels of 16
   output rows, K-major (cpu_forward.pack), one sequential stream a panel. */
#define PANEL 16
/* Tokens per pass over a panel: every loaded weight vector feeds MT FMAs. AVX-512: one zmm
   per token (16 accumulators of 32 registers); AVX2: two ymm per token (12 of 16). */
#if defined(__AVX512F__)
#define ISA_BITS 512
#define MT_MAX 16
#else
#define ISA_BITS 256
#define MT_MAX 6
#endif

/* ---- structs Python lays out too (ctypes; checked through layout.c) ---------------------- */

/* a weight kept block-quantized (quant.c; cpu_forward._QSeg): output rows row0 .. row0 + rows
   in one block type; a matrix is nseg such segments covering all its rows */
typedef struct {
    int64_t qtype, row0, rows, row_bytes;
    const uint8_t* data;
} QSeg;

typedef struct {
    int64_t nseg;
    const QSeg* seg;
} QMat;

/* one decoder layer of the forward (cpu_forward._Layer) */
typedef struct {
    const float *ln1, *qkv_w, *qkv_b, *q_norm, *k_norm, *o_w, *o_b;
    const float *ln2, *gu_w, *gu_b, *down_w, *down_b;
    float *k_cache, *v_cache; /* [slots, Hkv, D]: float, or bfloat16 bits (Model.kv_bf16) */
    /* the projections packed into panels (forward.c, above gemm_packed), or NULL: gemm */
    const float *qkv_p, *o_p, *gu_p, *down_p;
    /* the projections block-quantized, or NULL: the float weights above */
    const QMat *qkv_q, *o_q, *gu_q, *down_q;
    /* Gemma 3 (NULL / 0 for the Llama family): the norms of the attention output and of the
       MLP output (ln2 is then the pre-feedforward norm), this layer's own RoPE tables (local
       or global base; NULL: the model's), and its sliding window (a query at position p sees
       keys at p - window + 1 .. p; 0: global) */
    const float *post_attn_ln, *post_ff_ln, *cos, *sin;
    int64_t window;
} Layer;

/* the forward's model (cpu_forward._Model) */
typedef struct {
    int64_t hidden, heads, kv_heads, head_dim, inter, vocab, layers, max_pos;
    float eps, scale;
    const float *embed, *norm, *lm_head, *cos, *sin; /* cos/sin [max_pos, D] */
    const Layer* layer;
    const float* lm_head_p; /* the LM head packed, or NULL */
    /* the embedding table and LM head block-quantized, or NULL; q_mode: quant.c's mode */
    const QMat *embed_q, *lm_head_q;
    int64_t q_mode;
    /* Gemma 3: act 1 = gelu(tanh)-gated MLP (0: SiLU); the embedding rows times embed_scale;
       every RMSNorm scales by norm_add + weight (1: Gemma's zero-centred weights; 0: Llama) */
    int64_t act;
    float embed_scale, norm_add;
    /* 1: every layer's k_cache / v_cache holds bfloat16 (uint16_t) elements, stored rounded to
       nearest even and read back widened to float32; 0: float32 */
    int64_t kv_bf16;
} Model;

/* an EAGLE / EAGLE-3 draft head (head_kernel._Head) */
typedef struct {
    int64_t variant; /* 0 EAGLE (fc over [emb; feature], n layers, target LM head), 1 EAGLE-3 */
    int64_t hidden, heads, kv_heads, head_dim, inter, layers, max_pos, vocab, dvocab, fc_in;
    float eps, scale;
    const float *embed, *fc_w, *fc_b, *in_norm, *hidden_norm, *norm, *lm_head, *cos, *sin;
    const int64_t* d2t;       /* EAGLE-3: target id = draft id + d2t[draft id] */
    const Layer* layer;       /* its qkv_p / o_p / gu_p / down_p: the packed projections */
    const float *fc_p, *lm_p; /* fc and the LM head packed (cpu_forward.pack) */
    /* the same in bfloat16 (NULL: a matrix that is not all bfloat16 values): fc, the LM head,
       then per layer qkv, o, gate_up, down */
    const uint16_t *fc_bf, *lm_bf;
    const uint16_t* const* layer_bf; /* [layers * 4] */
    /* 1: the bfloat16 panels' matmuls round their inputs to bfloat16 too (VDPBF16PS, where the
       build has it); 0: float32 inputs against the widened panels */
    int64_t bf16_inputs;
} Head;

/* The n-gram store (ngram_store.c, ngram_store_c.CNgramTrie): one mapping of int64 words,
   NGT_HEADER header slots, then max_ids Node records, then the free stack (max_ids ids). */
enum {
    NGT_DEPTH,
    NGT_CAPACITY,
    NGT_MAX_IDS,
    NGT_N_IDS,
    NGT_SIZE,
    NGT_TAIL,
    NGT_CLOCK,
    NGT_EVICTED_AT,
    NGT_NFREE,
    NGT_TABLE,
    NGT_MASK,
    NGT_HEADER = 16
};
#define NGT_ROOT 0
#define NGT_CUT (-1)
/* the Python store's _GROW and SECOND_CHANCES (ngram_store.py; checked at load) */
#define NGT_GROW 4096
#define NGT_SECOND_CHANCES 64

/* a node's record, two cache lines: what a token or an eviction reads first, the links */
typedef struct {
    int64_t parent, token, count, stamp, ostamp, queued, nxt, died;
    int64_t first, last, next, prev, nkids, live, pad0, pad1;
} Node;

/* ---- forward.c's matmuls, which heads.c runs too (hidden: not exported) --------------------- */

/* y[t, n] (+)= sum_k x[t, k] w[n, k] + b[n]: row-major weights w [N, K] */
void gemm(const float* x, int64_t T, int64_t K, int64_t ldx, const float* w, const float* b,
          int64_t N, float* y, int64_t ldy, int accumulate, int nthreads);
/* the same over weights packed into panels (wp: cpu_forward.pack's layout) */
void gemm_packed(const float* x, int64_t T, int64_t K, int64_t ldx, const float* wp, const float* b,
                 int64_t N, float* y, int64_t ldy, int accumulate, int nthreads);

/* The forward's matmul: the packed panels where there are any, at every token count (one copy
   of the weights is read, so only it has to stay in cache), else the row-major tiles. */
static inline void mm(const float* x, int64_t T, int64_t K, int64_t ldx, const float* w,
                      const float* wp, const float* b, int64_t N, float* y, int64_t ldy,
                      int accumulate, int nthreads) {
    if (wp)
        gemm_packed(x, T, K, ldx, wp, b, N, y, ldy, accumulate, nthreads);
    else
        gemm(x, T, K, ldx, w, b, N, y, ldy, accumulate, nthreads);
}

/* ---- the API Python calls (ctypes signatures are generated from these) ------------------- */

/* attention.c: paged attention reading K/V in place through the req-to-token table, and the
   fused norm / RoPE of the eager layers (cpu_kernels.py) */
LOOM_API void loom_decode_f32(const float* q, const float* k, const float* v, const int64_t* table,
                              int64_t stride, const int64_t* rows, const int64_t* lens, float* out,
                              int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t Dv, float scale,
                              int64_t max_len, int nthreads);
LOOM_API void loom_decode_bf16(const float* q, const uint16_t* k, const uint16_t* v,
                               const int64_t* table, int64_t stride, const int64_t* rows,
                               const int64_t* lens, float* out, int64_t B, int64_t H, int64_t Hkv,
                               int64_t D, int64_t Dv, float scale, int64_t max_len, int nthreads);
LOOM_API void loom_extend_f32(const float* q, const float* k, const float* v, const int64_t* table,
                              int64_t stride, const int64_t* rows, const int64_t* lens,
                              const int64_t* exts, const int64_t* qstart, const uint8_t* mask,
                              const int64_t* mask_off, float* out, int64_t B, int64_t H,
                              int64_t Hkv, int64_t D, int64_t Dv, float scale, int64_t max_len,
                              int64_t max_ext, int nthreads);
LOOM_API void loom_extend_bf16(const float* q, const uint16_t* k, const uint16_t* v,
                               const int64_t* table, int64_t stride, const int64_t* rows,
                               const int64_t* lens, const int64_t* exts, const int64_t* qstart,
                               const uint8_t* mask, const int64_t* mask_off, float* out, int64_t B,
                               int64_t H, int64_t Hkv, int64_t D, int64_t Dv, float scale,
                               int64_t max_len, int64_t max_ext, int nthreads);
LOOM_API void loom_rms_norm_f32(const float* x, int64_t no, int64_t ni, int64_t so, int64_t si,
                                int64_t D, const float* res, float* res_out, const float* w,
                                float eps, float* out, int nthreads);
LOOM_API void loom_rope_f32(const float* x, int64_t T, int64_t H, int64_t st, int64_t sh, int64_t D,
                            const int64_t* pos, const float* cos, const float* sin, float* out,
                            int nthreads);

/* forward.c: the compiled forward (cpu_forward.py) */
LOOM_API int loom_isa_bits(void);
LOOM_API void loom_linear_f32(const float* x, int64_t T, int64_t K, const float* w, const float* b,
                              int64_t N, float* y, int nthreads);
LOOM_API void loom_linear_packed_f32(const float* x, int64_t T, int64_t K, const float* wp,
                                     const float* b, int64_t N, float* y, int nthreads);
LOOM_API int loom_forward_f32(const Model* m, int64_t T, const int64_t* ids, const int64_t* pos,
                              const int64_t* slots, int64_t B, const int64_t* starts,
                              const int64_t* rows, const int64_t* seq_lens, const int64_t* table,
                              int64_t stride, const uint8_t* masks, const int64_t* mask_offs,
                              int64_t N, const int64_t* logit_rows, float* logits, int nthreads,
                              double* prof, float* hidden_out, int64_t n_aux,
                              const int64_t* aux_layers, float* aux_out);
/* tuning knobs of the forward's attention paths (tests and benchmarks set them: c_int.in_dll) */
LOOM_API extern int loom_block_attn_min;
LOOM_API extern int loom_small_attn_max;
LOOM_API extern int loom_step_rows;
/* attn_avx2.c: 1 (default) = AVX2 builds take its one-token attention kernel (forward.c
   attn_one), 0 = attn_items' per-token loop (the same bits; the tests' reference) */
LOOM_API extern int loom_attn_avx2;
/* attn_avx2.c: how many K rows ahead of its score pass its one-token kernel prefetches (rounded
   down to its blocks of 8, at least 8), and 1 = kv head 0's call fetches whole pool slots (every
   kv head's rows), 0 = each call its own head's rows (8 and 0: the kernel before session 25);
   only cache state, never a value */
LOOM_API extern int loom_attn_avx2_ahead;
LOOM_API extern int loom_attn_avx2_slots;
/* attn_avx2.c: forward.c's attn_one in AVX2 builds; 0 where it does not apply */
int loom_attn_one_avx2(const float* qb, int64_t S, const int64_t* cols, const float* kc,
                       const float* vc, int64_t Hkv, int64_t kh, int64_t G, int64_t D, float scale,
                       float* o, float* sc, int bf16);
/* attn_avx2.c: query rows a tile of one request takes in AVX2 builds (forward.c attn_items,
   loom_attn_rows_avx2, bitwise each row's loom_attn_one_avx2); <= 1 = one row at a time (the
   A/B reference). loom_attn_tile_rows: the rows in effect (1 where the kernel is not built) */
LOOM_API extern int loom_attn_rows;
int loom_attn_tile_rows(void);
int loom_attn_rows_avx2(const float* q, int64_t ldq, int64_t R, const int64_t* cols,
                        const int64_t* lo, const int64_t* len, const float* kc, const float* vc,
                        int64_t Hkv, int64_t kh, int64_t G, int64_t D, float scale, float* o,
                        int64_t ldo, float* sc, int bf16);
/* forward.c, AVX2 builds: 1 (default) = a 7- or 8-token packed f32 matmul is one pass, 0 = the
   ceil(T / MT_MAX) passes (4 + 3, 4 + 4); and the lanes a request's query rows round up to in
   the small attention (8 on AVX2; 16 = the older rounding). Both are A/B knobs of the benches */
LOOM_API extern int loom_f32_verify_tiles;
LOOM_API extern int loom_small_attn_round;

/* heads.c: the compiled draft heads (runtime/spec/head_kernel.py) */
LOOM_API int loom_head_bf16_dot(void);
LOOM_API int loom_eagle_round(const Head* m, int64_t T, const int64_t* ids, const int64_t* pos,
                              const int64_t* slots, const float* feats, int64_t ldf, int64_t B,
                              const int64_t* starts, const int64_t* rows, const int64_t* seq_lens,
                              const int64_t* table, int64_t stride, int64_t nd,
                              const int64_t* draft_reqs, int64_t steps, int64_t* out_tokens,
                              float* logits_out, float* hidden_out, int nthreads, double* prof);
LOOM_API void loom_medusa_heads(const float* h, int64_t n, int64_t Hd, int64_t k, int64_t nl,
                                const float* res_p, const float* res_b, const float* lm_p,
                                int own_lm, int64_t V, int64_t topk, float* out_logp,
                                int64_t* out_ids, int nthreads);

/* ngram_store.c: the n-gram trie's node store (runtime/spec/ngram_store_c.py); h is the
   mapping's first word */
LOOM_API int64_t ngt_init(int64_t* h);
LOOM_API void ngt_free(int64_t* h);
LOOM_API int64_t ngt_extend(int64_t* h, const int64_t* ptrs, int64_t n, const int64_t* toks,
                            int64_t k, int64_t gen_from, int64_t* buf);
LOOM_API int64_t ngt_walk(int64_t* h, int64_t node, const int64_t* toks, int64_t k);
LOOM_API int64_t ngt_child(int64_t* h, int64_t node, int64_t tok);
LOOM_API int64_t ngt_best(int64_t* h, int64_t node, int by_count);
LOOM_API int64_t ngt_recent(int64_t* h, int64_t p, int64_t other, int generated, int64_t scan);
LOOM_API int64_t ngt_children(int64_t* h, int64_t node, int64_t* out);
LOOM_API int64_t ngt_match(int64_t* h, const int64_t* ptrs, int64_t m, const int64_t* after,
                           int64_t k, int64_t min_w, int64_t max_w, int skip, int64_t min_ctx,
                           int64_t scan);
LOOM_API int64_t ngt_deepest(int64_t* h, const int64_t* toks, int64_t n, int64_t min_w);
LOOM_API int64_t ngt_check(int64_t* h);

/* quant.c: matmuls and row gathers on ggml block-quantized weights (runtime/layers/quant_ops.py);
   qtype 0..6 = Q8_0, Q4_0, Q4_1, Q4_K, Q6_K, Q5_0, Q5_1; mode 0 = int8 activations (T <= 8), 1 = f32,
   2 = 16-bit activations (Q8_0 / Q4_0 / Q4_1, T <= 8; other types: mode 0), 3 = 16-bit
   activations for every type and T, batch-invariant (quant_bi.c), 4 = auto (per call: 3 for
   the types loom_q_auto_bi names, else 1's f32 GEMV where the build has it and T <= 8, else 3),
   5 = prompt rows (quant_i8.c: 8-bit activations for loom_q_i8_type's types, else 4) */
LOOM_API int loom_q_vnni(void);
LOOM_API int loom_q_f32v(void);
LOOM_API extern int loom_q_prefetch_rows;
LOOM_API extern int loom_q_wide_rows;
/* quant_bi.c: 1 (default) = mode 3 takes its 16-row-lane kernel for Q8_0 / Q4_0 / Q4_1 / Q5_x at
   T <= 8 (AVX-512 builds), 0 = its older GEMV / 8-token tile (the same bits; a knob for
   bench_quant_gemv.py's A/B) */
LOOM_API extern int loom_q_bi_lanes;
/* quant_bi_avx2.c: 4 (default) = mode 3 takes its AVX2 tiles in AVX2 + FMA builds without
   AVX-512 VNNI, rows of the 32-value block types decoded by ba_decode_row32 (its fast variant),
   a call's tokens packed a group of 8 at a time by register transposes (ba_quant_group);
   3 = the same with the tokens packed one at a time (ba_quant_tokens); 2 = ba_decode_row32's
   earlier variant; 1 = the tiles with the earlier row decoder for every
   type; 0 = the portable C (the same bits; the tests' reference and an A/B knob) */
LOOM_API extern int loom_q_bi_avx2;
/* 1 where this build has quant_bi_avx2.c's kernels */
LOOM_API int loom_q_bi_avx2_built(void);
/* 1 where mode 4 (auto) takes mode 3 at every token count for this block type (bi_lanes built
   and on: Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1 in AVX-512 VNNI builds), 0 where it takes 1's f32 GEMV at T <= 8 */
LOOM_API int loom_q_auto_bi(int qtype);
LOOM_API int loom_q_matmul(int qtype, int mode, const uint8_t* w, int64_t N, int64_t K,
                           int64_t row_bytes, const float* x, int64_t T, int64_t ldx,
                           const float* bias, float* y, int64_t ldy, int accumulate, int threads);
LOOM_API int loom_q_rows(int qtype, const uint8_t* w, int64_t N, int64_t K, int64_t row_bytes,
                         const int64_t* ids, int64_t T, float* out, int threads);

/* quant.c -> quant_bi.c (internal): one row's codes / scales / offsets, an f16 value, and the
   batch-invariant matmul (loom_q_matmul's mode 3, its arguments) */
void loom_q_decode_row(int qtype, const uint8_t* row, int64_t K, uint8_t* u, float* s, float* b);
float loom_q_f16(const uint8_t* p);
int loom_q_matmul_bi(int qtype, const uint8_t* w, int64_t N, int64_t K, int64_t row_bytes,
                     const float* x, int64_t T, int64_t ldx, const float* bias, float* y,
                     int64_t ldy, int accumulate, int threads);
/* quant_bi.c <-> quant_bi2.c (internal): one token's 16-bit codes and per-unit scales / sums
   (bi_quantize); whether mode 3 takes quant_bi2.c's AVX2 8-row-lane kernel for a type at
   T <= 8 (Q8_0 / Q4_0 / Q4_1 in AVX2 builds without AVX-512, loom_q_bi_lanes on; the same
   bits as the portable C), and that kernel (loom_q_matmul's arguments) */
void loom_q_bi_quantize(const float* x, int64_t K, int G, int16_t* q, float* dxu, float* xsu);
void loom_q_bi_pack_pairs(int qtype, const int16_t* q, int64_t K, int32_t* xp);
/* Q4_K (and Q5_K): sub-block j's 6-bit scale and min from the block's 12 scale bytes q
   (ggml's get_scale_min_k4); quant.c, quant_bi.c and quant_bi_avx2.c decode with it */
static inline void k4_scale_min(int j, const uint8_t* q, uint8_t* sc, uint8_t* m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (uint8_t)((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
        *m = (uint8_t)((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
    }
}
LOOM_API int loom_q_bi_lanes2_type(int qtype);
int loom_q_matmul_bi_lanes2(int qtype, const uint8_t* w, int64_t N, int64_t K, int64_t row_bytes,
                            const float* x, int64_t T, int64_t ldx, const float* bias, float* y,
                            int64_t ldy, int accumulate, int threads);
/* quant_gemv_k_avx2.c: 1 (default) = mode 3 takes its 1-4 token GEMV (lanes = values) for Q4_K /
   Q6_K in AVX2 + FMA builds without AVX-512 VNNI, 0 = quant_bi_avx2.c's tiles (the same bits; the
   tests' reference and bench_quant_gemv.py's --bi-kgemv A/B); whether a type takes it in this
   build, and that GEMV (loom_q_matmul's arguments, T <= 4) */
LOOM_API extern int loom_q_bi_kgemv;
LOOM_API int loom_q_bi_kgemv_type(int qtype);
int loom_q_matmul_bi_kgemv(int qtype, const uint8_t* w, int64_t N, int64_t K, int64_t row_bytes,
                           const float* x, int64_t T, int64_t ldx, const float* bias, float* y,
                           int64_t ldy, int accumulate, int threads);

/* quant_gemv_avx2.c: 1 (default) = mode 3 takes its values-as-lanes GEMV for Q8_0 / Q4_0 / Q4_1
   at 1..4 tokens and Q5_0 at 1..3 in AVX2 + FMA + F16C builds without AVX-512, 0 = quant_bi2.c's
   row lanes / quant_bi_avx2.c's tiles (the same bits; the tests' reference and bench_quant_gemv.py's A/B);
   whether it takes a type now, the most tokens it takes for it (0: none; Q5_0 3, else 4), and
   the kernel (quant_bi.c -> it, loom_q_matmul's arguments) */
LOOM_API extern int loom_q_bi_gemv;
LOOM_API int loom_q_bi_gemv_type(int qtype);
LOOM_API int loom_q_bi_gemv_max_t(int qtype);
int loom_q_matmul_bi_gemv(int qtype, const uint8_t* w, int64_t N, int64_t K, int64_t row_bytes,
                          const float* x, int64_t T, int64_t ldx, const float* bias, float* y,
                          int64_t ldy, int accumulate, int threads);
/* quant_gemv1_avx2.c: 1 (default) = mode 3 takes its one-token Q8_0 / Q5_0 GEMV (one unit a
   ymm) in AVX2 + FMA + F16C builds without AVX-512, 0 = quant_gemv_avx2.c's at one token (the same
   bits; the tests' reference and bench_quant_gemv.py's A/B); whether it takes a type now, and the
   kernel (quant_bi.c -> it, loom_q_matmul's arguments at T = 1) */
LOOM_API extern int loom_q_bi_gemv1;
LOOM_API int loom_q_bi_gemv1_type(int qtype);
int loom_q_matmul_bi_gemv1(int qtype, const uint8_t* w, int64_t N, int64_t K, int64_t row_bytes,
                           const float* x, int64_t T, const float* bias, float* y, int accumulate,
                           int threads);
/* quant_bi.c -> quant_i8.c (internal): bi_decode_row's int16 codes / scales / offsets of a row,
   and (AVX-512 builds) the tiles' 4-row x 16-token store; quant_i8.c: whether mode 5 has its
   8-bit kernel for the type in this build, and that kernel (loom_q_matmul's arguments) */
void loom_q_decode_row16(int qtype, const uint8_t* row, int64_t K, int16_t* w, float* s, float* b,
                         uint8_t* u, float* s16, float* b16);
/* quant_bi.c -> quant_bi_avx2.c (internal): mode 3 on AVX2 (loom_q_matmul's arguments) */
int loom_q_matmul_bi_avx2(int qtype, const uint8_t* w, int64_t N, int64_t K, int64_t row_bytes,
                          const float* x, int64_t T, int64_t ldx, const float* bias, float* y,
                          int64_t ldy, int accumulate, int threads);
/* quant_bi_avx2.c: loom_q_hold_x(x, T, K, ldx) lets the calls up to loom_q_release_x() that
   multiply this x (same T, K, ldx, unit length) reuse its 16-bit codes (forward.c's qmm over a
   matrix's row segments); no-ops where the tiles are not built or loom_q_hold is 0 (each call
   quantizes its x: the A/B reference, the same bits) */
LOOM_API extern int loom_q_hold;
LOOM_API void loom_q_hold_x(const float* x, int64_t T, int64_t K, int64_t ldx);
LOOM_API void loom_q_release_x(void);
void loom_q_put4x16(const float* sums, float* y, int64_t ldy, const float* bias, int accumulate);
LOOM_API int loom_q_i8_type(int qtype);
/* quant_i8.c: a block of 32 activations gets a second 8-bit plane (its rounding error at
   dx / 254) where that error's energy is above this fraction of the energy of the block's
   values but its largest (an outlier sets dx); 0: every block (about 15-bit activations, twice the multiply-adds) */
LOOM_API extern float loom_q_i8_resid;
int loom_q_matmul_i8(int qtype, const uint8_t* w, int64_t N, int64_t K, int64_t row_bytes,
                     const float* x, int64_t T, int64_t ldx, const float* bias, float* y,
                     int64_t ldy, int accumulate, int threads);
/* quant_i8_avx2.c: mode 5 in AVX2 + FMA builds without AVX-512 VNNI (quant_i8.c's arithmetic,
   bitwise); the knob 1 (default) its AVX2 kernel, 0 the same arithmetic in scalar C (one
   thread: the tests' bitwise reference); whether the build has it; the kernel (quant_i8.c ->
   it, loom_q_matmul's arguments; -1 where not built) */
LOOM_API extern int loom_q_i8_avx2;
LOOM_API int loom_q_i8_avx2_built(void);
int loom_q_matmul_i8_avx2(int qtype, const uint8_t* w, int64_t N, int64_t K, int64_t row_bytes,
                          const float* x, int64_t T, int64_t ldx, const float* bias, float* y,
                          int64_t ldy, int accumulate, int threads);

/* pool.c: loom_par_for(nthreads, n, chunk, fn, ctx) runs fn(ctx, i0, i1, worker) over [0, n) in
   chunks of `chunk` items, claimed by the caller (worker 0) and the pool's helpers (workers
   1 .. nthreads - 1) as they come; returns when every chunk is done. fn must give the same
   result whoever runs a chunk (each output computed inside one item). loom_pool: 1 (default)
   the pool, 0 an OpenMP static `parallel for` over the chunks (bench_decode_threads.py's A/B). */
typedef void (*loom_task_fn)(void* ctx, int64_t i0, int64_t i1, int worker);
void loom_par_for(int nthreads, int64_t n, int64_t chunk, loom_task_fn fn, void* ctx);
LOOM_API extern int loom_pool;
/* pool.c: 1 = a loop's last (threads x chunk) items in quarter chunks, 0 (default) = equal
   chunks; a helper's spin before it sleeps, ns (default 20000). Knobs for
   bench_decode_threads.py's A/B (no result depends on them) */
LOOM_API extern int loom_pool_tail;
LOOM_API extern int64_t loom_pool_spin_ns;
/* chunks of a loop of n items over nthreads: about four a thread, so that a helper that is
   late or preempted holds little of the work */
static inline int64_t par_chunk(int64_t n, int nthreads) {
    const int64_t parts = 4 * (int64_t)(nthreads > 1 ? nthreads : 1);
    return (n + parts - 1) / parts;
}

/* layout.c: for "Struct.field" its offset and size, for "Struct" 0 and its sizeof, for a
   constant's name its value and 0; returns 0, or -1 for a name it does not list */
LOOM_API int loom_layout(const char* name, int64_t* value, int64_t* size);

#endif
