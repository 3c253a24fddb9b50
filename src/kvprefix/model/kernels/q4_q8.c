/* y = x @ W.T for int4 weights in groups of 32 against int8 activations (llama.cpp's Q4 x Q8 idea) for a decode
 * step's few rows: the weight's 20 bytes a group are read once and summed in int32 on the CPU's u8 x s8 dot
 * products (AVX512-VNNI or AVX-VNNI dpbusd, else AVX2 maddubs, whose u4 x s8 pairs never saturate).
 *
 * Per output channel n and group g of 32 inputs, w = (q - 8) * scale + zero, q in 0..15, scale and zero bfloat16.
 * Each row of x is quantized per group in two int8 passes: d = max|x| / 127, qx = round(x / d), then what that
 * leaves, qe = round((x / d - qx) * 256) (clamped to 127), so x ~ d / 256 * (256 * qx + qe) to 1/65,000 of the
 * group's max (bfloat16 keeps 1/256 of each value; one pass, 1/254 of the max, moved this model's greedy answers
 * twice as far from float32's). With the integer sum S = 256 * sum(q * qx) + sum(q * qe) and Q likewise,
 *   sum(w * x) over a group ~ scale * d / 256 * (S - 8 * Q) + zero * sum(x),
 * the zero's term on the float sum, so only (q - 8), centred, meets the rounding of x.
 * Layout (kvprefix.model.int4_q8 packs it): the groups of a channel run in blocks of 8 and a tail of up to 7.
 *   nibbles[n][g][16]: byte j holds element j in its low nibble, j + 16 in its high one (GGUF's order);
 *   scale_zero[n][g]: scale's bfloat16 bits low, zero's high.
 * A row's quantized values (each pass's) run, in a block, per pair of groups (a, b): a's 0-15, b's 0-15, a's
 * 16-31, b's 16-31 (a 32-byte load of the pair's nibbles masks to the first half, shifts to the second); in the
 * tail, in order.
 * out [rows][n] is x's dtype (bfloat16 rounded to nearest even from the float32 sum). Every output is computed by
 * one thread in one fixed order whatever the thread or row count: a row's result never depends on the other rows.
 * Returns 0, or -1 without scratch memory. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define KVP_SIMD 1
#endif

#define GROUP 32
#define BLOCK 8


/* A row's statistics per group. */
typedef struct { float *d, *xsum; int32_t *qsum; } RowStats;

/* Row r's statistics in the scratch of ``rows`` rows: d, xsum, then qsum, each rows x groups. */
static inline RowStats stats_of(float *stats, int64_t rows, int64_t groups, int64_t r) {
    return (RowStats){stats + r * groups, stats + (rows + r) * groups, (int32_t *)(stats + (2 * rows + r) * groups)};
}

/* One row of k inputs (bfloat16 when bf16, else float32) into its two passes qx and qe (the layout above) and its
 * statistics (d there is d / 256, qsum 256 * sum(qx) + sum(qe)). */
static void quantize_row(const void *x, int bf16, int64_t k, int8_t *qx, int8_t *qe, RowStats s) {
    const int64_t groups = k / GROUP, blocked = groups / BLOCK * BLOCK;
    for (int64_t g = 0; g < groups; g++) {
        float v[GROUP], amax = 0.0f, sum = 0.0f;
        for (int i = 0; i < GROUP; i++) {
            v[i] = bf16 ? bf16_to_float(((const uint16_t *)x)[g * GROUP + i]) : ((const float *)x)[g * GROUP + i];
            amax = fmaxf(amax, fabsf(v[i]));
            sum += v[i];
        }
        const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        int64_t first = g * GROUP, second = first + 16;  /* where elements 0-15 and 16-31 go */
        if (g < blocked) {
            first = g / 2 * 2 * GROUP + (g % 2) * 16;
            second = first + GROUP;
        }
        int32_t qsum = 0, esum = 0;
        for (int i = 0; i < GROUP; i++) {
            const float scaled = v[i] * inv;
            const float q = nearbyintf(scaled);
            const float e = fminf(nearbyintf((scaled - q) * 256.0f), 127.0f);
            const int64_t at = (i < 16 ? first : second) + i % 16;
            qx[at] = (int8_t)q;
            qe[at] = (int8_t)e;
            qsum += (int32_t)q;
            esum += (int32_t)e;
        }
        s.d[g] = amax / 127.0f / 256.0f;
        s.xsum[g] = sum;
        s.qsum[g] = 256 * qsum + esum;
    }
}

#define TILE 4 /* rows computed together: a block's nibbles are unpacked once for them */

#ifdef KVP_SIMD
static inline __m256i dot_u8s8(__m256i acc, __m256i w, __m256i x) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, w, x);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, w, x);
#else /* lane i: bytes 4i..4i+3, as dpbusd; each int16 at most 2 * 15 * 127 */
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)));
#endif
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

static inline int32_t hsum_int(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}
#endif

#ifdef KVP_SIMD
/* A pair of groups' eight lanes of 256 * sum(q * qx) + sum(q * qe): lanes 0-3 the first group's, 4-7 the second's.
 * a, b: the pair's values 0-15 and 16-31; x, e: the passes' 64 bytes for the pair. */
static inline __m256i pair_sums(__m256i a, __m256i b, const int8_t *x, const int8_t *e) {
    const __m256i first = dot_u8s8(dot_u8s8(_mm256_setzero_si256(), a, _mm256_loadu_si256((const __m256i *)x)), b,
                                   _mm256_loadu_si256((const __m256i *)(x + 32)));
    const __m256i second = dot_u8s8(dot_u8s8(_mm256_setzero_si256(), a, _mm256_loadu_si256((const __m256i *)e)), b,
                                    _mm256_loadu_si256((const __m256i *)(e + 32)));
    return _mm256_add_epi32(_mm256_slli_epi32(first, 8), second);
}
#endif

/* The float terms of one group from its integer sum. */
static inline float group_value(int32_t sum, uint32_t scale_zero, float d, float xsum, int32_t qsum, float acc) {
    acc = fmaf((float)(sum - 8 * qsum), bf16_to_float(scale_zero & 0xFFFF) * d, acc);
    return fmaf(bf16_to_float(scale_zero >> 16), xsum, acc);
}

/* Outputs of one channel for ``tile`` (1..TILE) rows: its groups against each row's quantized values. */
static inline void dot_rows(const int tile, const uint8_t *nibbles, const uint32_t *scale_zero, int64_t groups,
                            const int8_t *const *qx, const int8_t *const *qe, const RowStats *s, void *out, int bf16, int64_t at,
                            int64_t stride) {
    const int64_t blocked = groups / BLOCK * BLOCK;
    float total[TILE];
#ifdef KVP_SIMD
    const __m256i low = _mm256_set1_epi8(0x0F);
    __m256 acc[TILE];
    for (int r = 0; r < tile; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < blocked; g += BLOCK) {
        __m256i a[4], b[4];  /* per pair of groups: elements 0-15 of both, 16-31 of both */
        for (int p = 0; p < 4; p++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(nibbles + g * 16 + 32 * p));
            a[p] = _mm256_and_si256(v, low);
            b[p] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        }
        const __m256i sz = _mm256_loadu_si256((const __m256i *)(scale_zero + g));
        const __m256 scale = _mm256_castsi256_ps(_mm256_slli_epi32(sz, 16));
        const __m256 zero = _mm256_castsi256_ps(_mm256_and_si256(sz, _mm256_set1_epi32((int)0xFFFF0000u)));
        for (int r = 0; r < tile; r++) {
            const int8_t *x = qx[r] + g * GROUP, *e = qe[r] + g * GROUP;
            __m256i sums[4];
            for (int p = 0; p < 4; p++) sums[p] = pair_sums(a[p], b[p], x + 64 * p, e + 64 * p);
            /* The horizontal adds leave the block's eight sums in the order 0, 2, 4, 6, 1, 3, 5, 7. */
            const __m256i ints = _mm256_permutevar8x32_epi32(
                _mm256_hadd_epi32(_mm256_hadd_epi32(sums[0], sums[1]), _mm256_hadd_epi32(sums[2], sums[3])),
                _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            const __m256i qsum8 = _mm256_slli_epi32(_mm256_loadu_si256((const __m256i *)(s[r].qsum + g)), 3);
            const __m256 dscale = _mm256_mul_ps(scale, _mm256_loadu_ps(s[r].d + g));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(ints, qsum8)), dscale, acc[r]);
            acc[r] = _mm256_fmadd_ps(zero, _mm256_loadu_ps(s[r].xsum + g), acc[r]);
        }
    }
    for (int r = 0; r < tile; r++) total[r] = hsum(acc[r]);
    for (int64_t g = blocked; g < groups; g++) {
        const __m128i v = _mm_loadu_si128((const __m128i *)(nibbles + g * 16));
        const __m256i w = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), low);
        for (int r = 0; r < tile; r++) {
            const __m256i x = _mm256_loadu_si256((const __m256i *)(qx[r] + g * GROUP));
            const __m256i e = _mm256_loadu_si256((const __m256i *)(qe[r] + g * GROUP));
            const __m256i both = _mm256_add_epi32(_mm256_slli_epi32(dot_u8s8(_mm256_setzero_si256(), w, x), 8),
                                                  dot_u8s8(_mm256_setzero_si256(), w, e));
            const int32_t sum = hsum_int(both);
            total[r] = group_value(sum, scale_zero[g], s[r].d[g], s[r].xsum[g], s[r].qsum[g], total[r]);
        }
    }
#else
    for (int r = 0; r < tile; r++) {
        total[r] = 0.0f;
        for (int64_t g = 0; g < groups; g++) {
            const int8_t *x = qx[r] + (g < blocked ? g / 2 * 2 * GROUP + (g % 2) * 16 : g * GROUP);
            const int64_t second = g < blocked ? GROUP : 16;  /* where its elements 16-31 are */
            const int8_t *e = qe[r] + (x - qx[r]);
            int32_t sum = 0;
            for (int j = 0; j < 16; j++)
                sum += (nibbles[g * 16 + j] & 0x0F) * (256 * x[j] + e[j])
                       + (nibbles[g * 16 + j] >> 4) * (256 * x[second + j] + e[second + j]);
            total[r] = group_value(sum, scale_zero[g], s[r].d[g], s[r].xsum[g], s[r].qsum[g], total[r]);
        }
    }
#endif
    for (int r = 0; r < tile; r++) {
        if (bf16)
            ((uint16_t *)out)[at + r * stride] = float_to_bf16(total[r]);
        else
            ((float *)out)[at + r * stride] = total[r];
    }
}

int kvp_q4_q8_matmul(const void *x, int bf16, int64_t rows, int64_t k, const uint8_t *nibbles,
                     const uint32_t *scale_zero, int64_t n, void *out, int threads) {
    const int64_t groups = k / GROUP;
    if (rows == 0 || n == 0) return 0;
    int8_t *qx = malloc((size_t)(2 * rows * k)), *qe = qx + rows * k;
    float *stats = malloc(sizeof(float) * (size_t)(rows * groups * 3));
    if (qx == NULL || stats == NULL) {
        free(qx);
        free(stats);
        return -1;
    }
    for (int64_t r = 0; r < rows; r++)
        quantize_row((const char *)x + r * k * (bf16 ? 2 : 4), bf16, k, qx + r * k, qe + r * k,
                     stats_of(stats, rows, groups, r));
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t j = 0; j < n; j++) {
        for (int64_t r = 0; r < rows; r += TILE) {
            const int8_t *x[TILE], *e[TILE];
            RowStats s[TILE];
            const int tile = rows - r < TILE ? (int)(rows - r) : TILE;
            for (int t = 0; t < tile; t++) {
                x[t] = qx + (r + t) * k;
                e[t] = qe + (r + t) * k;
                s[t] = stats_of(stats, rows, groups, r + t);
            }
            const uint8_t *w = nibbles + j * groups * 16;
            switch (tile) {  /* constant tiles: each specialized */
                case 1: dot_rows(1, w, scale_zero + j * groups, groups, x, e, s, out, bf16, r * n + j, n); break;
                case 2: dot_rows(2, w, scale_zero + j * groups, groups, x, e, s, out, bf16, r * n + j, n); break;
                case 3: dot_rows(3, w, scale_zero + j * groups, groups, x, e, s, out, bf16, r * n + j, n); break;
                default: dot_rows(TILE, w, scale_zero + j * groups, groups, x, e, s, out, bf16, r * n + j, n);
            }
        }
    }
    free(qx);
    free(stats);
    return 0;
}
