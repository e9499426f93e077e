/* Mode "bi" (quant_bi.c's canonical batch-invariant arithmetic) on AVX2 + FMA builds without
   AVX-512 VNNI: the tiles of quant_bi.c are AVX-512 only, and such a build ran the portable
   C (quant.c's generic row decoder, then scalar fmaf per unit and token) for every matmul of
   every step (decode, verify and prompt rows).

   The arithmetic is the file comment's of quant_bi.c, unchanged: 16-bit activation codes per
   block of 32, int16 weight codes, an exact int32 I per (unit, row, token), then per unit
   P[j mod 16] = fma((float) I, s_j * dx_j, P[...]) (asym: then fma(b_j, xs_j, P[...])), the
   fixed tree over the 16 partials, ((accumulate ? y : 0) + sum) + bias. Integer sums are exact
   in any order and every float step is the same IEEE operation on the same values, so the
   outputs are bitwise the portable C's (tests/test_quant_kernels.py compares them through the
   knob loom_q_bi_avx2).

   How, one kernel for every token count ("lanes = tokens"): a call quantizes its tokens once
   and packs them in groups of 8 tokens, one int32 lane a token holding two consecutive codes
   (values 2p, 2p + 1); a pass takes 4 rows decoded to int16 codes and 1 or 2 groups, and for
   each pair p of a unit broadcasts the row's two codes and multiplies them into the group
   vector by vpmaddwd (16 multiply-adds an instruction, exact int32 sums), 8 accumulators of
   4 rows x 2 groups. Rows are decoded 32 at a time (each once per call), and the token groups
   walk over that block's 4-row passes, so a long prompt streams its packed codes once per 32
   rows. At 1-7 tokens the group's unused lanes hold zero codes (computed and dropped). */

#include "loom_cpu.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && \
    !(defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__))
#define BA_ON 1
#include <immintrin.h>

#include "simd_avx2.h"
#else
#define BA_ON 0
#endif

int loom_q_bi_avx2 = 4; /* loom_cpu.h: 4 = 3 with a group's 8 tokens packed by 8 x 8 transposes
                           (ba_quant_group), 3 = ba_decode_row32 with one dword load a block's
                           scale, 2 = with the earlier scale gather, 1 = ba_decode_row for all */

int loom_q_bi_avx2_built(void) { return BA_ON; }

int loom_q_hold = 1; /* loom_cpu.h: 1 = loom_q_hold_x keeps a packing for the next segment */

#if BA_ON

enum { AQ8_0 = 0, AQ4_0 = 1, AQ4_1 = 2, AQ4_K = 3, AQ6_K = 4, AQ5_0 = 5, AQ5_1 = 6 };

#define BA_Q 32512 /* quant_bi.c's BI_Q: codes in [-32512, 32512] */
#define BA_ROWS 6 /* rows of one pass: 6 rows x 2 groups = 12 accumulators, 2 code vectors
                     and the broadcast in 15 of the 16 ymm (bench: 4 x 2, 2 x 4, 4 x 3, 8 x 1
                     were 5-15 percent slower at K = 640, L1-resident) */
#define BA_MAXR BA_ROWS
#define BA_MAXG 2
#define BA_BLOCK 48 /* rows decoded at once (8 passes) for more than BA_SMALL_G token groups: the
                       groups walk over the block's passes, so a long prompt streams its packed
                       codes once per 48 rows (the decoded rows sit in L2) */
#define BA_SMALL_G 4 /* up to 32 tokens (decode and verify steps) a block is one pass's 6 rows,
                        decoded into L1 right before the pass (at 8 tokens the decode costs about
                        half of the multiply-adds: its output should not go through L2) */

static inline float ba_f16(const uint8_t* p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return _cvtsh_ss(v);
}

/* 16 bytes -> 16 int16 codes minus c, stored at w */
static inline void ba_widen(__m128i bytes, int c, int16_t* w) {
    _mm256_storeu_si256((__m256i*)w, _mm256_sub_epi16(_mm256_cvtepu8_epi16(bytes), _mm256_set1_epi16((short)c)));
}

/* One row -> int16 codes w [K], scale s and offset b per unit: quant_bi.c's bi_decode_row
   (the same codes, and scales / offsets by the same float operations as quant.c's decoder) */
static void ba_decode_row(int qtype, const uint8_t* row, int64_t K, int16_t* w, float* s, float* b) {
    const __m128i low = _mm_set1_epi8(0x0F);
    if (qtype == AQ8_0 || qtype == AQ4_0 || qtype == AQ4_1 || qtype == AQ5_0 || qtype == AQ5_1) {
        const int bb = qtype == AQ8_0 ? 34 : qtype == AQ4_0 ? 18 : qtype == AQ4_1 ? 20 : qtype == AQ5_0 ? 22 : 24;
        const int q5 = qtype == AQ5_0 || qtype == AQ5_1;
        for (int64_t i = 0; i < K / 32; i++) {
            const uint8_t* blk = row + i * bb;
            int16_t* wo = w + 32 * i;
            const float d = ba_f16(blk);
            s[i] = d;
            if (qtype == AQ8_0) {
                _mm256_storeu_si256((__m256i*)wo, _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(blk + 2))));
                _mm256_storeu_si256((__m256i*)(wo + 16), _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(blk + 18))));
                b[i] = 0.f;
                continue;
            }
            const int hasm = qtype == AQ4_1 || qtype == AQ5_1;
            const uint8_t* qs = blk + (q5 ? (hasm ? 8 : 6) : (hasm ? 4 : 2));
            const __m128i q = _mm_loadu_si128((const __m128i*)qs);
            __m128i lo = _mm_and_si128(q, low), hi = _mm_and_si128(_mm_srli_epi16(q, 4), low);
            if (q5) { /* value j: bit j of qh adds 16 */
                uint32_t qh;
                memcpy(&qh, blk + (hasm ? 4 : 2), 4);
                const __m128i sel = _mm_set1_epi64x((long long)0x8040201008040201ULL);
                const __m128i sixteen = _mm_set1_epi8(16);
                /* byte k of lo takes bit k of qh's low half, of hi bit k of its high half */
                const __m128i hl = _mm_shuffle_epi8(_mm_cvtsi32_si128((int)qh),
                                                    _mm_set_epi64x(0x0101010101010101LL, 0));
                const __m128i hh = _mm_shuffle_epi8(_mm_cvtsi32_si128((int)qh),
                                                    _mm_set_epi64x(0x0303030303030303LL, 0x0202020202020202LL));
                lo = _mm_or_si128(lo, _mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(hl, sel), sel), sixteen));
                hi = _mm_or_si128(hi, _mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(hh, sel), sel), sixteen));
            }
            const int c = qtype == AQ4_0 ? 8 : qtype == AQ5_0 ? 16 : 0;
            ba_widen(lo, c, wo);
            ba_widen(hi, c, wo + 16);
            b[i] = qtype == AQ4_0 ? 0.f : qtype == AQ5_0 ? -16.f * d : ba_f16(blk + 2);
        }
        return;
    }
    if (qtype == AQ4_K) { /* 144 bytes: f16 d, f16 dmin, 12 bytes of 6-bit scales / mins, 128 of codes */
        for (int64_t i = 0; i < K / 256; i++) {
            const uint8_t* blk = row + i * 144;
            const float d = ba_f16(blk), dmin = ba_f16(blk + 2);
            const uint8_t* q = blk + 4;
            for (int c = 0; c < 4; c++) /* 32 bytes: sub-block 2c low nibbles, 2c + 1 high */
                for (int h = 0; h < 2; h++) {
                    const __m128i v = _mm_loadu_si128((const __m128i*)(blk + 16 + 32 * c + 16 * h));
                    ba_widen(_mm_and_si128(v, low), 0, w + 256 * i + 64 * c + 16 * h);
                    ba_widen(_mm_and_si128(_mm_srli_epi16(v, 4), low), 0, w + 256 * i + 64 * c + 32 + 16 * h);
                }
            for (int j = 0; j < 8; j++) {
                uint8_t sc, mn;
                k4_scale_min(j, q, &sc, &mn);
                s[8 * i + j] = d * sc;
                b[8 * i + j] = -dmin * mn;
            }
        }
        return;
    }
    /* Q6_K, 210 bytes: 128 low nibbles, 64 bytes of 2-bit highs, 16 int8 scales, f16 d;
       value 128n + 32k + l in ql[64n + 32(k & 1) + l]'s nibble k >> 1 and qh[32n + l]'s bits 2k, 2k + 1 */
    const __m128i m3 = _mm_set1_epi8(3);
    for (int64_t i = 0; i < K / 256; i++) {
        const uint8_t* blk = row + i * 210;
        for (int n = 0; n < 2; n++)
            for (int h = 0; h < 2; h++) {
                const __m128i A = _mm_loadu_si128((const __m128i*)(blk + 64 * n + 16 * h));
                const __m128i B = _mm_loadu_si128((const __m128i*)(blk + 64 * n + 32 + 16 * h));
                const __m128i H = _mm_loadu_si128((const __m128i*)(blk + 128 + 32 * n + 16 * h));
                /* 2-bit fields are masked per byte before the 16-bit shifts, so no bits cross bytes */
                const __m128i v[4] = {
                    _mm_or_si128(_mm_and_si128(A, low), _mm_slli_epi16(_mm_and_si128(H, m3), 4)),
                    _mm_or_si128(_mm_and_si128(B, low), _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(H, 2), m3), 4)),
                    _mm_or_si128(_mm_and_si128(_mm_srli_epi16(A, 4), low), _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(H, 4), m3), 4)),
                    _mm_or_si128(_mm_and_si128(_mm_srli_epi16(B, 4), low), _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(H, 6), m3), 4))};
                for (int k = 0; k < 4; k++) ba_widen(v[k], 32, w + 256 * i + 128 * n + 32 * k + 16 * h);
            }
        const int8_t* sc = (const int8_t*)(blk + 192);
        const float d = ba_f16(blk + 208);
        for (int g = 0; g < 16; g++) {
            s[16 * i + g] = d * sc[g];
            b[16 * i + g] = -32.f * d * sc[g];
        }
    }
}

/* ba_decode_row for the 32-value block types (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1; knob
   loom_q_bi_avx2 = 2): the same codes, scales and offsets, in fewer instructions. A block's 32
   codes go from one 256-bit vector of bytes (the nibbles side by side, Q5's fifth bits from qh
   by a byte shuffle and compare, the type's offset subtracted as bytes: every code fits int8)
   to two sign extensions; the f16 scales (and Q4_1 / Q5_1's offsets) of 8 blocks convert in
   one vcvtph2ps, exact as _cvtsh_ss; symmetric types store no offsets (a pass reads b only for
   asymmetric ones). At 32 tokens a row's decode is ~10 percent of its multiply-adds, so the
   per-block scalar work counted (docs/benchmarks.md, session 22's "batch" section). */
static inline int32_t ba_ld32(const uint8_t* p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* fast (knob 3): the 4-bit types' nibbles in 128-bit halves (no lane insert / extract), no
   offset subtraction where the offset is 0, Q8_0's codes sign-extended from memory, and the
   scales of 8 blocks from one dword load a block (f16 d and, for Q4_1 / Q5_1, the f16 offset
   after it; for the symmetric types the high half is the codes' first bytes, dropped), split
   by a mask, a shift and an unsigned pack (knob 2's gather copied 2-byte scales through the
   stack and inserted them as words: a hot spot at 8 tokens, docs/benchmarks.md session 23
   "b8"). The same codes and floats. */
static void ba_decode_row32(int qtype, const uint8_t* row, int64_t K, int16_t* w, float* s, float* b, int fast) {
    const int64_t nu = K / 32;
    const int bb = qtype == AQ8_0 ? 34 : qtype == AQ4_0 ? 18 : qtype == AQ4_1 ? 20 : qtype == AQ5_0 ? 22 : 24;
    const int q5 = qtype == AQ5_0 || qtype == AQ5_1, hasm = qtype == AQ4_1 || qtype == AQ5_1;
    const int qoff = q5 ? (hasm ? 8 : 6) : (hasm ? 4 : 2);
    const __m256i low = _mm256_set1_epi8(0x0F);
    const __m256i off = _mm256_set1_epi8((char)(qtype == AQ4_0 ? 8 : qtype == AQ5_0 ? 16 : 0));
    /* byte k of the shuffled qh holds qh's byte k / 8; the mask picks its bit k mod 8 */
    const __m256i qsel = _mm256_set_epi64x(0x0303030303030303LL, 0x0202020202020202LL,
                                           0x0101010101010101LL, 0);
    const __m256i bsel = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    const __m256i sixteen = _mm256_set1_epi8(16);
    const __m128i low128 = _mm_set1_epi8(0x0F), off128 = _mm256_castsi256_si128(off);
    if (fast && qtype == AQ8_0) /* sign extension from memory */
        for (int64_t i = 0; i < nu; i++) {
            const uint8_t* blk = row + i * bb;
            _mm256_storeu_si256((__m256i*)(w + 32 * i), _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(blk + 2))));
            _mm256_storeu_si256((__m256i*)(w + 32 * i + 16), _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(blk + 18))));
        }
    else if (fast && !q5) /* Q4_0, Q4_1 */
        for (int64_t i = 0; i < nu; i++) {
            const __m128i q = _mm_loadu_si128((const __m128i*)(row + i * bb + qoff));
            __m128i lo = _mm_and_si128(q, low128), hi = _mm_and_si128(_mm_srli_epi16(q, 4), low128);
            if (qtype == AQ4_0) {
                lo = _mm_sub_epi8(lo, off128);
                hi = _mm_sub_epi8(hi, off128);
            }
            _mm256_storeu_si256((__m256i*)(w + 32 * i), _mm256_cvtepi8_epi16(lo));
            _mm256_storeu_si256((__m256i*)(w + 32 * i + 16), _mm256_cvtepi8_epi16(hi));
        }
    else
        for (int64_t i = 0; i < nu; i++) {
            const uint8_t* blk = row + i * bb;
            __m256i v;
            if (qtype == AQ8_0)
                v = _mm256_loadu_si256((const __m256i*)(blk + 2));
            else {
                const __m128i q = _mm_loadu_si128((const __m128i*)(blk + qoff));
                /* values 0-15: the low nibbles, 16-31: the high ones */
                v = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q, 4), q), low);
                if (q5) { /* value j: bit j of qh adds 16 */
                    uint32_t qh;
                    memcpy(&qh, blk + (hasm ? 4 : 2), 4);
                    const __m256i hb = _mm256_shuffle_epi8(_mm256_set1_epi32((int)qh), qsel);
                    v = _mm256_or_si256(v, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(hb, bsel), bsel), sixteen));
                }
                v = _mm256_sub_epi8(v, off);
            }
            _mm256_storeu_si256((__m256i*)(w + 32 * i), _mm256_cvtepi8_epi16(_mm256_castsi256_si128(v)));
            _mm256_storeu_si256((__m256i*)(w + 32 * i + 16), _mm256_cvtepi8_epi16(_mm256_extracti128_si256(v, 1)));
        }
    int64_t i = 0;
    const __m128i lo16 = _mm_set1_epi32(0xFFFF);
    for (; fast && i + 8 <= nu; i += 8) {
        const uint8_t* r0 = row + i * bb;
        const __m128i a = _mm_setr_epi32(ba_ld32(r0), ba_ld32(r0 + bb), ba_ld32(r0 + 2 * bb), ba_ld32(r0 + 3 * bb));
        const __m128i c = _mm_setr_epi32(ba_ld32(r0 + 4 * bb), ba_ld32(r0 + 5 * bb), ba_ld32(r0 + 6 * bb),
                                         ba_ld32(r0 + 7 * bb));
        /* the halves are < 2^16: packus keeps them exactly, in order */
        _mm256_storeu_ps(s + i, _mm256_cvtph_ps(_mm_packus_epi32(_mm_and_si128(a, lo16), _mm_and_si128(c, lo16))));
        if (hasm)
            _mm256_storeu_ps(b + i, _mm256_cvtph_ps(_mm_packus_epi32(_mm_srli_epi32(a, 16), _mm_srli_epi32(c, 16))));
    }
    for (; i + 8 <= nu; i += 8) {
        uint16_t d[8], m[8];
        for (int k = 0; k < 8; k++) {
            memcpy(d + k, row + (i + k) * bb, 2);
            memcpy(m + k, row + (i + k) * bb + 2, 2);
        }
        _mm256_storeu_ps(s + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)d)));
        if (hasm) _mm256_storeu_ps(b + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)m)));
    }
    for (; i < nu; i++) {
        s[i] = ba_f16(row + i * bb);
        if (hasm) b[i] = ba_f16(row + i * bb + 2);
    }
}

/* horizontal max / sum of 8 lanes */
static inline float ba_hmax(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}
static inline int ba_hsum(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm_cvtsi128_si32(s);
}

/* Token x [K] -> codes q [K] and per unit dx and xs = dx * (sum of the unit's q): quant_bi.c's
   bi_quantize, the same f32 steps (max |x| is exact in any order; v = x * (1 / dx), then
   sign(v) * min(floor(|v| + 0.5), 32512)) */
static void ba_quantize(const float* x, int64_t K, int G, int16_t* q, float* dxu, float* xsu) {
    const __m256 absm = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256 half = _mm256_set1_ps(0.5f), lim = _mm256_set1_ps((float)BA_Q);
    for (int64_t k0 = 0; k0 < K; k0 += 32) {
        __m256 a[4];
        for (int h = 0; h < 4; h++) a[h] = _mm256_loadu_ps(x + k0 + 8 * h);
        const __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(a[0], absm), _mm256_and_ps(a[1], absm)),
                                       _mm256_max_ps(_mm256_and_ps(a[2], absm), _mm256_and_ps(a[3], absm)));
        const float dd = ba_hmax(m) / (float)BA_Q;
        const __m256 inv = _mm256_set1_ps(dd > 0 ? 1.f / dd : 0.f);
        __m256i c[4];
        for (int h = 0; h < 4; h++) {
            const __m256 v = _mm256_mul_ps(a[h], inv);
            const __m256 r = _mm256_min_ps(_mm256_round_ps(_mm256_add_ps(_mm256_and_ps(v, absm), half),
                                                           _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC),
                                           lim);
            const __m256i ri = _mm256_cvttps_epi32(r);
            const __m256i neg = _mm256_castps_si256(_mm256_cmp_ps(v, _mm256_setzero_ps(), _CMP_LT_OQ));
            c[h] = _mm256_sub_epi32(_mm256_xor_si256(ri, neg), neg); /* -ri where v < 0 */
        }
        /* int32 -> int16 in order: packs interleaves 128-bit halves, the permute restores them */
        const __m256i p01 = _mm256_permute4x64_epi64(_mm256_packs_epi32(c[0], c[1]), _MM_SHUFFLE(3, 1, 2, 0));
        const __m256i p23 = _mm256_permute4x64_epi64(_mm256_packs_epi32(c[2], c[3]), _MM_SHUFFLE(3, 1, 2, 0));
        _mm256_storeu_si256((__m256i*)(q + k0), p01);
        _mm256_storeu_si256((__m256i*)(q + k0 + 16), p23);
        const int s0 = ba_hsum(_mm256_add_epi32(c[0], c[1])), s1 = ba_hsum(_mm256_add_epi32(c[2], c[3]));
        if (G == 32) {
            dxu[k0 / 32] = dd;
            xsu[k0 / 32] = dd * (float)(s0 + s1);
        } else {
            dxu[k0 / 16] = dxu[k0 / 16 + 1] = dd;
            xsu[k0 / 16] = dd * (float)s0;
            xsu[k0 / 16 + 1] = dd * (float)s1;
        }
    }
}

/* One pass: rows w[0..3] (int16 codes, scales s, offsets b per unit) against TG groups of 8
   tokens (xp: [K / 2][8] int32 code pairs a group, groups xstride ints apart; dxt / xst:
   [nu][8] a group, sstride apart) -> sums[(r * TG + g) * 8 + i], the canonical sum of row r
   and token 8g + i before y, accumulate and bias. */
static inline __attribute__((always_inline)) void ba_pass_core(
    const int16_t* const* w, const float* const* s, const float* const* b, const int asym,
    int64_t K, const int G, const int R, const int TG, const int32_t* xp, int64_t xstride,
    const float* dxt, const float* xst, int64_t sstride, float* sums) {
    const int64_t nu = K / G;
    const int PU = G / 2; /* pairs a unit */
    __m256 P[BA_MAXR][BA_MAXG][16]; /* 6 KB: L1 */
    for (int64_t j = 0; j < nu; j++) {
        __m256i acc[BA_MAXR][BA_MAXG];
        for (int r = 0; r < R; r++)
            for (int g = 0; g < TG; g++) acc[r][g] = _mm256_setzero_si256();
        const int32_t* xj = xp + j * PU * 8;
#pragma GCC unroll 16
        for (int p = 0; p < PU; p++) {
            __m256i xv[BA_MAXG];
            for (int g = 0; g < TG; g++) xv[g] = _mm256_loadu_si256((const __m256i*)(xj + g * xstride + 8 * p));
            for (int r = 0; r < R; r++) {
                int32_t wp;
                memcpy(&wp, w[r] + j * G + 2 * p, 4);
                const __m256i wv = _mm256_set1_epi32(wp);
                for (int g = 0; g < TG; g++) {
                    acc[r][g] = _mm256_add_epi32(acc[r][g], _mm256_madd_epi16(wv, xv[g]));
                    /* keeps each sum a chain in its register: unrolled, GCC otherwise
                       reassociates the integer adds into trees of products and spills them */
                    __asm__("" : "+x"(acc[r][g]));
                }
            }
        }
        const int c = (int)(j % 16);
        for (int g = 0; g < TG; g++) {
            const __m256 dx = _mm256_loadu_ps(dxt + g * sstride + 8 * j);
            const __m256 xs = asym ? _mm256_loadu_ps(xst + g * sstride + 8 * j) : _mm256_setzero_ps();
            for (int r = 0; r < R; r++) {
                const __m256 sd = _mm256_mul_ps(_mm256_set1_ps(s[r][j]), dx);
                __m256 pv = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r][g]), sd, j < 16 ? _mm256_setzero_ps() : P[r][g][c]);
                if (asym) pv = _mm256_fmadd_ps(_mm256_set1_ps(b[r][j]), xs, pv);
                P[r][g][c] = pv;
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int g = 0; g < TG; g++) {
            __m256* Pc = P[r][g];
            for (int64_t c = nu; c < 16; c++) Pc[c] = _mm256_setzero_ps();
            __m256 l1[8], l2[4];
            for (int c = 0; c < 8; c++) l1[c] = _mm256_add_ps(Pc[c], Pc[c + 8]);
            for (int c = 0; c < 4; c++) l2[c] = _mm256_add_ps(l1[c], l1[c + 4]);
            _mm256_storeu_ps(sums + (r * TG + g) * 8,
                             _mm256_add_ps(_mm256_add_ps(l2[0], l2[2]), _mm256_add_ps(l2[1], l2[3])));
        }
}

static void ba_pass(const int16_t* const* w, const float* const* s, const float* const* b, int asym,
                    int64_t K, int G, int TG, const int32_t* xp, int64_t xstride, const float* dxt,
                    const float* xst, int64_t sstride, float* sums) {
#define BA_CASE(GG, TT, AA)                                                                      \
    if (G == GG && TG == TT && asym == AA) {                                                     \
        ba_pass_core(w, s, b, AA, K, GG, BA_ROWS, TT, xp, xstride, dxt, xst, sstride, sums);     \
        return;                                                                                  \
    }
    BA_CASE(32, 2, 0)
    BA_CASE(32, 1, 0)
    BA_CASE(32, 2, 1)
    BA_CASE(32, 1, 1)
    BA_CASE(16, 2, 0)
    BA_CASE(16, 1, 0)
#undef BA_CASE
}

/* Group g's 8 tokens x 6 rows of sums ([r][TG][8]) into y (token i at y + i * ldy, its 6
   rows consecutive): an 8 x 8 transpose (two zero rows), then per token
   ((accumulate ? y : 0) + sum) + bias, the portable C's two adds */
static inline void ba_put6x8(const float* sums, int TG, int g, float* y, int64_t ldy,
                             const float* bias, int accumulate) {
    __m256 v[8];
    for (int r = 0; r < 8; r++) v[r] = r < BA_ROWS ? _mm256_loadu_ps(sums + (r * TG + g) * 8) : _mm256_setzero_ps();
    transpose8_ps(v);
    const __m256* tok = v; /* tok[i] lane r: row r of token i */
    const __m128 blo = bias ? _mm_loadu_ps(bias) : _mm_setzero_ps();
    const __m128 bhi = bias ? _mm_castpd_ps(_mm_load_sd((const double*)(bias + 4))) : _mm_setzero_ps();
    for (int i = 0; i < 8; i++) {
        float* yo = y + i * ldy;
        const __m128 plo = accumulate ? _mm_loadu_ps(yo) : _mm_setzero_ps();
        const __m128 phi = accumulate ? _mm_castpd_ps(_mm_load_sd((const double*)(yo + 4))) : _mm_setzero_ps();
        _mm_storeu_ps(yo, _mm_add_ps(_mm_add_ps(plo, _mm256_castps256_ps128(tok[i])), blo));
        _mm_store_sd((double*)(yo + 4), _mm_castps_pd(_mm_add_ps(_mm_add_ps(phi, _mm256_extractf128_ps(tok[i], 1)), bhi)));
    }
}

typedef struct {
    int qtype, G, asym;
    const uint8_t* w;
    int64_t N, K, row_bytes, T, ngroups, block;
    const int32_t* xp; /* [ngroups][K / 2][8] */
    const float *dxt, *xst; /* [ngroups][nu][8] */
    const float* bias;
    float* y;
    int64_t ldy;
    int accumulate;
    int row32; /* ba_decode_row32 decodes the rows (2: its fast variant) */
    int failed;
} BaJob;

/* row blocks i0 .. i1 - 1 of jb->block rows (loom_par_for's task) */
static void ba_blocks(void* ctx, int64_t i0, int64_t i1, int worker) {
    (void)worker;
    BaJob* jb = ctx;
    const int64_t K = jb->K, nu = K / jb->G, T = jb->T;
    int16_t* wd = malloc(sizeof(int16_t) * (size_t)(BA_BLOCK * K + 64));
    float* sd = malloc(sizeof(float) * (size_t)(BA_BLOCK * nu + 16));
    float* bd = malloc(sizeof(float) * (size_t)(BA_BLOCK * nu + 16));
    if (!wd || !sd || !bd) {
        free(wd);
        free(sd);
        free(bd);
        jb->failed = 1;
        return;
    }
    for (int64_t blk = i0; blk < i1; blk++) {
        const int64_t n0 = blk * jb->block;
        const int R = jb->N - n0 < jb->block ? (int)(jb->N - n0) : (int)jb->block;
        for (int r = 0; r < R; r++) {
            const uint8_t* row = jb->w + (n0 + r) * jb->row_bytes;
            if (jb->row32)
                ba_decode_row32(jb->qtype, row, K, wd + r * K, sd + r * nu, bd + r * nu, jb->row32 == 2);
            else
                ba_decode_row(jb->qtype, row, K, wd + r * K, sd + r * nu, bd + r * nu);
        }
        for (int64_t g0 = 0; g0 < jb->ngroups; g0 += 2) {
            const int TG = jb->ngroups - g0 >= 2 ? 2 : 1;
            for (int r0 = 0; r0 < R; r0 += BA_ROWS) {
                const int RR = R - r0 < BA_ROWS ? R - r0 : BA_ROWS;
                const int16_t* wr[BA_ROWS];
                const float* sr[BA_ROWS];
                const float* br[BA_ROWS];
                for (int r = 0; r < BA_ROWS; r++) { /* rows past RR repeat the first: dropped */
                    const int rr = r0 + (r < RR ? r : 0);
                    wr[r] = wd + rr * K;
                    sr[r] = sd + rr * nu;
                    br[r] = bd + rr * nu;
                }
                float sums[BA_ROWS * BA_MAXG * 8];
                ba_pass(wr, sr, br, jb->asym, K, jb->G, TG, jb->xp + g0 * (K / 2) * 8, (K / 2) * 8,
                        jb->dxt + g0 * nu * 8, jb->xst + g0 * nu * 8, nu * 8, sums);
                int done = 0;
                for (int g = 0; g < TG && RR == BA_ROWS && (g0 + g) * 8 + 8 <= T; g++, done++)
                    ba_put6x8(sums, TG, g, jb->y + (g0 + g) * 8 * jb->ldy + n0 + r0, jb->ldy,
                              jb->bias ? jb->bias + n0 + r0 : NULL, jb->accumulate);
                if (done == TG) continue;
                for (int r = 0; r < RR; r++) {
                    const int64_t n = n0 + r0 + r;
                    const float bn = jb->bias ? jb->bias[n] : 0.f;
                    for (int g = done; g < TG; g++)
                        for (int i = 0; i < 8; i++) {
                            const int64_t t = (g0 + g) * 8 + i;
                            if (t >= T) break;
                            float* yo = jb->y + t * jb->ldy + n;
                            *yo = (jb->accumulate ? *yo : 0.f) + sums[(r * TG + g) * 8 + i] + bn;
                        }
                }
            }
        }
    }
    free(wd);
    free(sd);
    free(bd);
}

typedef struct {
    const float* x;
    int64_t K, T, ldx;
    int G;
    int32_t* xp;
    float *dxt, *xst;
    int failed;
} BaQuantJob;

/* tokens t0 .. t1 - 1: quantized and written into their group's lanes */
static void ba_quant_tokens(void* ctx, int64_t t0, int64_t t1, int worker) {
    (void)worker;
    BaQuantJob* jb = ctx;
    const int64_t K = jb->K, nu = K / jb->G;
    int16_t* q = malloc(sizeof(int16_t) * (size_t)(K + 16));
    float* dxu = malloc(sizeof(float) * (size_t)(2 * nu + 2));
    float* xsu = dxu + nu + 1;
    if (!q || !dxu) {
        free(q);
        free(dxu);
        jb->failed = 1;
        return;
    }
    for (int64_t t = t0; t < t1; t++) {
        const int64_t g = t / 8, i = t % 8;
        ba_quantize(jb->x + t * jb->ldx, K, jb->G, q, dxu, xsu);
        int32_t* xo = jb->xp + g * (K / 2) * 8 + i;
        for (int64_t p = 0; p < K / 2; p++) memcpy(xo + 8 * p, q + 2 * p, 4);
        for (int64_t j = 0; j < nu; j++) {
            jb->dxt[(g * nu + j) * 8 + i] = dxu[j];
            jb->xst[(g * nu + j) * 8 + i] = xsu[j];
        }
    }
    free(q);
    free(dxu);
}

/* groups g0 .. g1 - 1 (knob 4): the same codes as ba_quant_tokens, written a group at a time.
   The group's tokens are quantized into 8 rows of K codes (rows past T zero, as the zeroed
   buffers' lanes are), and each run of 8 code pairs of the 8 rows is transposed in registers
   into 8 stores of a pair's 8 lanes: ba_quant_tokens wrote every pair of every token as its
   own 4-byte store at a 32-byte stride (K / 2 scalar stores a token; at 128 tokens the packing
   was 4-8 percent of a Gemma 3 matrix's time, docs/benchmarks.md session 24). Only bits move:
   the float shuffles of transpose8_ps never change a lane. */
static void ba_quant_group(void* ctx, int64_t g0, int64_t g1, int worker) {
    (void)worker;
    BaQuantJob* jb = ctx;
    const int64_t K = jb->K, nu = K / jb->G, P = K / 2;
    int16_t* q = malloc(sizeof(int16_t) * (size_t)(8 * K + 16));
    float* dxu = malloc(sizeof(float) * (size_t)(16 * nu + 2));
    float* xsu = dxu + 8 * nu + 1;
    if (!q || !dxu) {
        free(q);
        free(dxu);
        jb->failed = 1;
        return;
    }
    for (int64_t g = g0; g < g1; g++) {
        const int n = jb->T - 8 * g < 8 ? (int)(jb->T - 8 * g) : 8;
        for (int i = 0; i < n; i++)
            ba_quantize(jb->x + (8 * g + i) * jb->ldx, K, jb->G, q + i * K, dxu + i * nu, xsu + i * nu);
        if (n < 8) {
            memset(q + n * K, 0, sizeof(int16_t) * (size_t)((8 - n) * K));
            memset(dxu + n * nu, 0, sizeof(float) * (size_t)((8 - n) * nu));
            memset(xsu + n * nu, 0, sizeof(float) * (size_t)((8 - n) * nu));
        }
        float* xo = (float*)(jb->xp + g * P * 8); /* [P][8] */
        for (int64_t p0 = 0; p0 < P; p0 += 8) { /* P = K / 2 is a multiple of 16 */
            __m256 v[8];
            for (int i = 0; i < 8; i++) v[i] = _mm256_loadu_ps((const float*)(q + i * K + 2 * p0));
            transpose8_ps(v); /* v[l] lane i: token i's pair p0 + l */
            for (int l = 0; l < 8; l++) _mm256_storeu_ps(xo + (p0 + l) * 8, v[l]);
        }
        for (int64_t j = 0; j < nu; j++)
            for (int i = 0; i < 8; i++) {
                jb->dxt[(g * nu + j) * 8 + i] = dxu[i * nu + j];
                jb->xst[(g * nu + j) * 8 + i] = xsu[i * nu + j];
            }
    }
    free(q);
    free(dxu);
}

/* A held packing (loom_q_hold_x): the codes of one x kept for the next calls on the same x,
   T, K, ldx and unit length (forward.c's qmm over the segments of one matrix: Gemma 3's qkv is
   Q5_0 q / k rows and Q8_0 v rows, both units of 32, that quantized the same rows twice). The
   codes are a function of (x, K, G) alone, so a reused packing is the bits a fresh one would
   be. Per calling thread (forward.c calls its matmuls from one thread). */
static _Thread_local struct {
    const float* x;
    int64_t T, K, ldx;
    int G, on;
    int32_t* xp;
    float *dxt, *xst;
} ba_hold;

void loom_q_release_x(void) {
    free(ba_hold.xp);
    free(ba_hold.dxt);
    free(ba_hold.xst);
    memset(&ba_hold, 0, sizeof(ba_hold));
}

void loom_q_hold_x(const float* x, int64_t T, int64_t K, int64_t ldx) {
    loom_q_release_x();
    if (loom_q_hold < 1 || loom_q_bi_avx2 < 4) return;
    ba_hold.x = x, ba_hold.T = T, ba_hold.K = K, ba_hold.ldx = ldx, ba_hold.on = 1;
}

int loom_q_matmul_bi_avx2(int qtype, const uint8_t* w, int64_t N, int64_t K, int64_t row_bytes,
                          const float* x, int64_t T, int64_t ldx, const float* bias, float* y,
                          int64_t ldy, int accumulate, int threads) {
    const int G = qtype == AQ6_K ? 16 : 32;
    const int asym = qtype == AQ4_1 || qtype == AQ5_1 || qtype == AQ4_K;
    const int64_t nu = K / G, ng = (T + 7) / 8;
    if (K % 32 || ((qtype == AQ4_K || qtype == AQ6_K) && K % 256)) return -1;
    if (threads < 1) threads = 1;
    const int held = ba_hold.on && ba_hold.x == x && ba_hold.T == T && ba_hold.K == K &&
                     ba_hold.ldx == ldx && loom_q_bi_avx2 >= 4;
    int32_t* xp;
    float *dxt, *xst;
    if (held && ba_hold.xp && ba_hold.G == G) {
        xp = ba_hold.xp, dxt = ba_hold.dxt, xst = ba_hold.xst;
    } else {
        /* ba_quant_group (knob 4) writes every lane of every group (a last group's lanes past T
           as zero codes and scales), so only the tail pad is cleared; ba_quant_tokens writes
           tokens only, so its buffers start zeroed */
        const size_t nx = (size_t)(ng * (K / 2) * 8 + 8), ns = (size_t)(ng * nu * 8 + 8);
        const int all = loom_q_bi_avx2 >= 4;
        xp = all ? malloc(nx * sizeof(int32_t)) : calloc(nx, sizeof(int32_t));
        dxt = all ? malloc(ns * sizeof(float)) : calloc(ns, sizeof(float));
        xst = all ? malloc(ns * sizeof(float)) : calloc(ns, sizeof(float));
        if (!xp || !dxt || !xst) {
            free(xp);
            free(dxt);
            free(xst);
            return -2;
        }
        if (all) {
            memset(xp + nx - 8, 0, 8 * sizeof(int32_t));
            memset(dxt + ns - 8, 0, 8 * sizeof(float));
            memset(xst + ns - 8, 0, 8 * sizeof(float));
        }
        BaQuantJob qj = {x, K, T, ldx, G, xp, dxt, xst, 0};
        if (all)
            loom_par_for(threads, ng, par_chunk(ng, threads), ba_quant_group, &qj);
        else
            loom_par_for(threads, T, par_chunk(T, threads), ba_quant_tokens, &qj);
        if (qj.failed) {
            free(xp);
            free(dxt);
            free(xst);
            return -2;
        }
        if (held && !ba_hold.xp) /* kept for the next segment; freed by loom_q_release_x */
            ba_hold.xp = xp, ba_hold.dxt = dxt, ba_hold.xst = xst, ba_hold.G = G;
    }
    const int owned = !(held && ba_hold.xp == xp);
    const int64_t block = ng <= BA_SMALL_G ? BA_ROWS : BA_BLOCK;
    const int64_t nblocks = (N + block - 1) / block;
    const int row32 = loom_q_bi_avx2 >= 2 && qtype != AQ4_K && qtype != AQ6_K ? (loom_q_bi_avx2 >= 3 ? 2 : 1) : 0;
    BaJob job = {qtype, G, asym, w, N, K, row_bytes, T, ng, block, xp, dxt, xst, bias, y, ldy, accumulate, row32, 0};
    loom_par_for(threads, nblocks, par_chunk(nblocks, threads), ba_blocks, &job);
    if (owned) {
        free(xp);
        free(dxt);
        free(xst);
    }
    return job.failed ? -2 : 0;
}

#else

void loom_q_hold_x(const float* x, int64_t T, int64_t K, int64_t ldx) {
    (void)x, (void)T, (void)K, (void)ldx;
}
void loom_q_release_x(void) {}

int loom_q_matmul_bi_avx2(int qtype, const uint8_t* w, int64_t N, int64_t K, int64_t row_bytes,
                          const float* x, int64_t T, int64_t ldx, const float* bias, float* y,
                          int64_t ldy, int accumulate, int threads) {
    (void)qtype, (void)w, (void)N, (void)K, (void)row_bytes, (void)x, (void)T, (void)ldx;
    (void)bias, (void)y, (void)ldy, (void)accumulate, (void)threads;
    return -1;
}

#endif
