/* Attention for the eager CPU layers (runtime/cpu_kernels.py), reading K/V in place from the
   paged pool.

   The plain torch decode path gathers every request's K and V rows into a padded [B, L] copy on
   every layer of every step, then runs SDPA with a padding mask (whose CPU kernel is tuned for
   long queries, not one query row). These kernels walk each request's row of the req-to-token
   table instead: for one (request, kv head) they score the query heads of that group against
   the K rows the table names, softmax, and accumulate the V rows, with no copy and no padding.
   Also the fused RMSNorm and RoPE of the eager layers. */
#include "loom_cpu.h"

#define KV_T float
#define KV_ROW row_f32
#define DECODE_NAME loom_decode_f32
#define EXTEND_NAME loom_extend_f32
#define EXTEND_AS_DECODE 0
#include "attention_impl.h"
#undef KV_T
#undef KV_ROW
#undef DECODE_NAME
#undef EXTEND_NAME
#undef EXTEND_AS_DECODE

/* A bfloat16 pool's extend (a verify step's 1 + drafts) attends row by row as the decode
   step of each row's token would: the extend item's own order of sums (scores of every row
   per K row, unnormalised accumulation) differs from decode's in the last bits, and rounding
   K / V to bfloat16 makes such a bit a whole bf16 unit of the next layer's K / V, which moved
   greedy speculation off plain decoding. One K / V pass per row instead of one per request. */
#define KV_T uint16_t
#define KV_ROW row_bf16
#define DECODE_NAME loom_decode_bf16
#define EXTEND_NAME loom_extend_bf16
#define EXTEND_AS_DECODE 1
#include "attention_impl.h"
#undef KV_T
#undef KV_ROW
#undef DECODE_NAME
#undef EXTEND_NAME
#undef EXTEND_AS_DECODE

/* RMSNorm over rows x[o * so + i * si + 0 .. D-1] (o < no, i < ni) into out [no * ni, D]. With
   res [no * ni, D]: the row is x + res, and that sum is also written to res_out. */
void loom_rms_norm_f32(const float* x, int64_t no, int64_t ni, int64_t so, int64_t si, int64_t D,
                       const float* res, float* res_out, const float* w, float eps, float* out,
                       int nthreads) {
#pragma omp parallel for num_threads(nthreads) if (nthreads > 1)
    for (int64_t r = 0; r < no * ni; r++) {
        const float* src = x + (r / ni) * so + (r % ni) * si;
        float ss = 0.f;
        if (res) {
            const float* rr = res + r * D;
            float* sum = res_out + r * D;
#pragma omp simd reduction(+ : ss)
            for (int64_t d = 0; d < D; d++) {
                sum[d] = src[d] + rr[d];
                ss += sum[d] * sum[d];
            }
            src = sum;
        } else {
#pragma omp simd reduction(+ : ss)
            for (int64_t d = 0; d < D; d++) ss += src[d] * src[d];
        }
        const float inv = 1.f / sqrtf(ss / (float)D + eps);
        float* o = out + r * D;
#pragma omp simd
        for (int64_t d = 0; d < D; d++) o[d] = w[d] * (src[d] * inv);
    }
}

/* Neox-layout rotary embedding of rows x[t * st + h * sh + 0 .. D-1] into out [T, H, D]:
   cos/sin [max_pos, D] (the two halves repeat), positions [T]. */
void loom_rope_f32(const float* x, int64_t T, int64_t H, int64_t st, int64_t sh, int64_t D,
                   const int64_t* pos, const float* cos, const float* sin, float* out,
                   int nthreads) {
    const int64_t half = D / 2;
#pragma omp parallel for num_threads(nthreads) if (nthreads > 1)
    for (int64_t r = 0; r < T * H; r++) {
        const int64_t t = r / H, h = r % H;
        const float* a = x + t * st + h * sh;
        const float* c = cos + pos[t] * D;
        const float* s = sin + pos[t] * D;
        float* o = out + r * D;
#pragma omp simd
        for (int64_t i = 0; i < half; i++) {
            o[i] = a[i] * c[i] + (-a[i + half]) * s[i];
            o[i + half] = a[i + half] * c[i + half] + a[i] * s[i + half];
        }
    }
}
