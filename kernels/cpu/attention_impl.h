/* The paged attention kernels for one K/V element type. attention.c includes this file once per
   type, with KV_T (the pool's element type), KV_ROW (its row loader, loom_cpu.h: row_f32 or
   row_bf16), DECODE_NAME and EXTEND_NAME (the two exported functions) defined; an instance is
   the same code with the element type fixed, as a C++ template would be. No include guard:
   it is meant to be included more than once. EXTEND_AS_DECODE (0 / 1): whether EXTEND_NAME
   runs each query row through DECODE_ITEM (below). */
#define ATTN_CAT_(a, b) a##b
#define ATTN_CAT(a, b) ATTN_CAT_(a, b)
#define DECODE_ITEM ATTN_CAT(DECODE_NAME, _item)
#define EXTEND_ITEM ATTN_CAT(EXTEND_NAME, _item)
#define DECODE_SIZED ATTN_CAT(DECODE_NAME, _sized)

/* q [B, H, D] f32; k [S, Hkv, D], v [S, Hkv, Dv] (T); table [R, stride] i64 slot ids;
   rows, lens [B] i64; out [B, H, Dv] f32. Query head h reads kv head h / (H / Hkv). */
/* One (request, kv head): its G query heads qb [G, D] over the L rows `slots` names. Inlined
   with D, Dv constant for the common head sizes, so the row loops unroll and stay in
   registers. */
static inline __attribute__((always_inline)) void
DECODE_ITEM(const float* qb, const KV_T* k, const KV_T* v, const int64_t* slots, int64_t L,
            int64_t Hkv, int64_t h, int64_t G, const int64_t D, const int64_t Dv, float scale,
            float* s, float* acc, float* buf, float* o) {
    for (int64_t t = 0; t < L; t++) {
        const float* kp = KV_ROW(k + (slots[t] * Hkv + h) * D, buf, D);
        for (int64_t g = 0; g < G; g++) {
            const float* qg = qb + g * D;
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < D; d++) dot += qg[d] * kp[d];
            s[g * L + t] = dot * scale;
        }
    }
    for (int64_t g = 0; g < G; g++) {
        float* sg = s + g * L;
        float m = -INFINITY, sum = 0.f;
#pragma omp simd reduction(max : m)
        for (int64_t t = 0; t < L; t++) m = sg[t] > m ? sg[t] : m;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < L; t++) {
            sg[t] = fast_expf(sg[t] - m);
            sum += sg[t];
        }
        const float inv = L > 0 ? 1.f / sum : 0.f;
#pragma omp simd
        for (int64_t t = 0; t < L; t++) sg[t] *= inv;
    }
    memset(acc, 0, sizeof(float) * G * Dv);
    for (int64_t t = 0; t < L; t++) {
        const float* vp = KV_ROW(v + (slots[t] * Hkv + h) * Dv, buf, Dv);
        for (int64_t g = 0; g < G; g++) {
            const float p = s[g * L + t];
            float* a = acc + g * Dv;
#pragma omp simd
            for (int64_t d = 0; d < Dv; d++) a[d] += p * vp[d];
        }
    }
    memcpy(o, acc, sizeof(float) * G * Dv);
}
/* DECODE_ITEM with D, Dv made constants for the common head sizes (64, 128). */
static inline __attribute__((always_inline)) void
DECODE_SIZED(const float* qb, const KV_T* k, const KV_T* v, const int64_t* slots, int64_t L,
             int64_t Hkv, int64_t h, int64_t G, const int64_t D, const int64_t Dv, float scale,
             float* s, float* acc, float* buf, float* o) {
    if (D == 64 && Dv == 64)
        DECODE_ITEM(qb, k, v, slots, L, Hkv, h, G, 64, 64, scale, s, acc, buf, o);
    else if (D == 128 && Dv == 128)
        DECODE_ITEM(qb, k, v, slots, L, Hkv, h, G, 128, 128, scale, s, acc, buf, o);
    else
        DECODE_ITEM(qb, k, v, slots, L, Hkv, h, G, D, Dv, scale, s, acc, buf, o);
}
void DECODE_NAME(const float* q, const KV_T* k, const KV_T* v, const int64_t* table, int64_t stride,
                 const int64_t* rows, const int64_t* lens, float* out, int64_t B, int64_t H,
                 int64_t Hkv, int64_t D, int64_t Dv, float scale, int64_t max_len, int nthreads) {
    const int64_t G = H / Hkv;
#pragma omp parallel num_threads(nthreads) if (nthreads > 1)
    {
        float* s = (float*)malloc(sizeof(float) * G * (max_len > 0 ? max_len : 1));
        float* acc = (float*)malloc(sizeof(float) * G * Dv);
        float* buf = (float*)malloc(sizeof(float) * (D > Dv ? D : Dv));
#pragma omp for schedule(dynamic)
        for (int64_t w = 0; w < B * Hkv; w++) {
            const int64_t b = w / Hkv, h = w % Hkv, L = lens[b];
            const int64_t* slots = table + rows[b] * stride;
            const float* qb = q + (b * H + h * G) * D;
            float* o = out + (b * H + h * G) * Dv;
            DECODE_SIZED(qb, k, v, slots, L, Hkv, h, G, D, Dv, scale, s, acc, buf, o);
        }
        free(s);
        free(acc);
        free(buf);
    }
}

/* Several query rows per request (a short extend, a draft tree's verify step): q [T, H, D] f32
   with request b's E = exts[b] rows at q[qstart[b] ..]; they attend to the K/V rows
   table[rows[b], :lens[b]]. Row j sees column t where mask[mask_off[b] + j * L + t] != 0, or,
   with mask_off[b] < 0, causally: t <= L - E + j. out [T, H, Dv] f32. One (request, kv head)
   per work item, so each K/V row is read once for all E x G query rows. */
/* One (request, kv head): its E new rows x G query heads, inlined with D, Dv constant for
   the common head sizes as in DECODE_ITEM. */
static inline __attribute__((always_inline)) void
EXTEND_ITEM(const float* q, const KV_T* k, const KV_T* v, const int64_t* slots, const uint8_t* mk,
            int64_t L, int64_t E, int64_t q0, int64_t H, int64_t Hkv, int64_t h, int64_t G,
            const int64_t D, const int64_t Dv, float scale, float* s, float* acc, float* buf,
            float* denom, float* out) {
    const int64_t P = L - E;
    for (int64_t t = 0; t < L; t++) {
        const float* kp = KV_ROW(k + (slots[t] * Hkv + h) * D, buf, D);
        for (int64_t j = 0; j < E; j++) {
            const int ok = mk ? mk[j * L + t] != 0 : t <= P + j;
            const float* qj = q + ((q0 + j) * H + h * G) * D;
            for (int64_t g = 0; g < G; g++) {
                float dot = -INFINITY;
                if (ok) {
                    const float* qg = qj + g * D;
                    dot = 0.f;
#pragma omp simd reduction(+ : dot)
                    for (int64_t d = 0; d < D; d++) dot += qg[d] * kp[d];
                    dot *= scale;
                }
                s[(j * G + g) * L + t] = dot;
            }
        }
    }
    for (int64_t r = 0; r < E * G; r++) {
        float* sr = s + r * L;
        float m = -INFINITY, sum = 0.f;
#pragma omp simd reduction(max : m)
        for (int64_t t = 0; t < L; t++) m = sr[t] > m ? sr[t] : m;
        if (m == -INFINITY) { /* a row that sees nothing: zeros, not NaN */
            for (int64_t t = 0; t < L; t++) sr[t] = 0.f;
        } else {
#pragma omp simd reduction(+ : sum)
            for (int64_t t = 0; t < L; t++) {
                sr[t] = fast_expf(sr[t] - m);
                sum += sr[t];
            }
        }
        denom[r] = sum;
    }
    memset(acc, 0, sizeof(float) * E * G * Dv);
    for (int64_t t = 0; t < L; t++) {
        const float* vp = KV_ROW(v + (slots[t] * Hkv + h) * Dv, buf, Dv);
        for (int64_t r = 0; r < E * G; r++) {
            const float p = s[r * L + t];
            if (p == 0.f) continue;
            float* a = acc + r * Dv;
#pragma omp simd
            for (int64_t d = 0; d < Dv; d++) a[d] += p * vp[d];
        }
    }
    for (int64_t j = 0; j < E; j++) {
        for (int64_t g = 0; g < G; g++) {
            const int64_t r = j * G + g;
            float* o = out + ((q0 + j) * H + h * G + g) * Dv;
            const float inv = denom[r] > 0.f ? 1.f / denom[r] : 0.f;
#pragma omp simd
            for (int64_t d = 0; d < Dv; d++) o[d] = acc[r * Dv + d] * inv;
        }
    }
}
void EXTEND_NAME(const float* q, const KV_T* k, const KV_T* v, const int64_t* table, int64_t stride,
                 const int64_t* rows, const int64_t* lens, const int64_t* exts,
                 const int64_t* qstart, const uint8_t* mask, const int64_t* mask_off, float* out,
                 int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t Dv, float scale,
                 int64_t max_len, int64_t max_ext, int nthreads) {
    const int64_t G = H / Hkv;
    const int64_t R = G * (max_ext > 0 ? max_ext : 1);
#pragma omp parallel num_threads(nthreads) if (nthreads > 1)
    {
        float* s = (float*)malloc(sizeof(float) * R * (max_len > 0 ? max_len : 1));
        float* acc = (float*)malloc(sizeof(float) * R * Dv);
        float* buf = (float*)malloc(sizeof(float) * (D > Dv ? D : Dv));
        float* denom = (float*)malloc(sizeof(float) * R);
#if EXTEND_AS_DECODE
        int64_t* seen = (int64_t*)malloc(sizeof(int64_t) * (max_len > 0 ? max_len : 1));
#endif
#pragma omp for schedule(dynamic)
        for (int64_t w = 0; w < B * Hkv; w++) {
            const int64_t b = w / Hkv, h = w % Hkv;
            const int64_t* slots = table + rows[b] * stride;
            const uint8_t* mk = mask_off[b] >= 0 ? mask + mask_off[b] : NULL;
#if EXTEND_AS_DECODE
            /* each row as the decode step of its token: the slots it sees, in order, through
               DECODE_ITEM, so its sums are decode's bit for bit (a 16-bit pool rounds a
               last-bit difference of a K / V value into a whole unit: attention.c) */
            for (int64_t j = 0, L = lens[b], E = exts[b]; j < E; j++) {
                int64_t n = 0;
                for (int64_t t = 0; t < L; t++)
                    if (mk ? mk[j * L + t] != 0 : t <= L - E + j) seen[n++] = slots[t];
                const float* qb = q + ((qstart[b] + j) * H + h * G) * D;
                float* o = out + ((qstart[b] + j) * H + h * G) * Dv;
                DECODE_SIZED(qb, k, v, seen, n, Hkv, h, G, D, Dv, scale, s, acc, buf, o);
            }
            continue;
#endif
            if (D == 64 && Dv == 64)
                EXTEND_ITEM(q, k, v, slots, mk, lens[b], exts[b], qstart[b], H, Hkv, h, G, 64, 64,
                            scale, s, acc, buf, denom, out);
            else if (D == 128 && Dv == 128)
                EXTEND_ITEM(q, k, v, slots, mk, lens[b], exts[b], qstart[b], H, Hkv, h, G, 128, 128,
                            scale, s, acc, buf, denom, out);
            else
                EXTEND_ITEM(q, k, v, slots, mk, lens[b], exts[b], qstart[b], H, Hkv, h, G, D, Dv,
                            scale, s, acc, buf, denom, out);
        }
        free(s);
        free(acc);
        free(buf);
        free(denom);
#if EXTEND_AS_DECODE
        free(seen);
#endif
    }
}

#undef DECODE_ITEM
#undef DECODE_SIZED
#undef EXTEND_ITEM
#undef ATTN_CAT
#undef ATTN_CAT_
