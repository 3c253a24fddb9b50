/* Attention of decode queries (one new token each) straight over their paged KV blocks: no gather of the context
 * into a contiguous copy, no mask over padding, each key and value read once for all the query heads of its KV
 * head (GQA). PyTorch's path (the gather, then its flash kernel with a padding mask) takes 2-3x as long on the
 * built-in model (docs/model.md#native-kernels).
 *
 * q, out: [decodes][heads][dim]; cache: [blocks][block_size][2 * kv_heads][dim] (K heads, then V heads), all
 * bfloat16 when bf16, else float32; block_table: [decodes][max_blocks] (int64); seq_lens: [decodes] (int64).
 * Per (decode, KV head): scores in float32, a softmax with the max subtracted (exp as a degree-6 polynomial on the
 * reduced argument, ~2 ulp), then the weighted values, normalized once; out rounded to nearest even when bf16.
 * Each (decode, KV head) is one thread's, in one fixed order: a decode's result never depends on the batch or on
 * the thread count. Returns 0; -1 without scratch memory; -2 for a head size over MAX_DIM or more than MAX_GROUP
 * query heads a KV head. */
#ifndef KVP_DECODE_ATTENTION_C
#define KVP_DECODE_ATTENTION_C
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define KVP_SIMD 1
#endif

#define MAX_DIM 256
#define MAX_GROUP 16

static inline void store_one(void *p, int bf16, int64_t i, float f) {
    if (bf16)
        ((uint16_t *)p)[i] = float_to_bf16(f);
    else
        ((float *)p)[i] = f;
}

/* exp(x) for x <= 0: 2^n * p(r), r = x - n ln 2 in [-ln2/2, ln2/2], p a degree-6 Taylor polynomial. */
static inline float exp_neg(float x) {
    if (x < -87.0f) return 0.0f;
    const float n = nearbyintf(x * 1.44269504f);
    const float r = fmaf(n, -0.693145752f, fmaf(n, -1.42860677e-6f, x));
    float p = 1.0f / 720.0f;
    p = fmaf(p, r, 1.0f / 120.0f);
    p = fmaf(p, r, 1.0f / 24.0f);
    p = fmaf(p, r, 1.0f / 6.0f);
    p = fmaf(p, r, 0.5f);
    p = fmaf(p, r, 1.0f);
    p = fmaf(p, r, 1.0f);
    union { uint32_t u; float f; } scale = {(uint32_t)((int32_t)n + 127) << 23};
    return p * scale.f;
}

#ifdef KVP_SIMD
/* Eight elements from i on, as float32. */
static inline __m256 load8(const void *p, int bf16, int64_t i) {
    if (!bf16) return _mm256_loadu_ps((const float *)p + i);
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* exp_neg on eight lanes, step for step (the same roundings: a lane equals the scalar's result). */
static inline __m256 exp_neg8(__m256 x) {
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-0.693145752f),
                                     _mm256_fmadd_ps(n, _mm256_set1_ps(-1.42860677e-6f), x));
    __m256 p = _mm256_set1_ps(1.0f / 720.0f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    /* n clamped so its exponent stays a normal float's; below -87 the result is 0, as the scalar's */
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(_mm256_max_ps(n, _mm256_set1_ps(-126.0f))),
                                                         _mm256_set1_epi32(127)), 23);
    const __m256 out = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
    return _mm256_and_ps(out, _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_GE_OQ));
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#endif

#if defined(__AVX512BF16__)
/* The scores of bfloat16 queries and keys with dim a multiple of 32, on AVX512-BF16's pair dot products: exact
 * products summed in float32 (16 lanes, then across), then scaled; each head's max. About half the time of the
 * float32 path below, which converts each key once per query head. */
static inline void scores_bf16(const uint16_t *q, const void *cache, const int64_t *table, int64_t seq_len,
                               int64_t group, int64_t h, int64_t dim, int64_t block_size, int64_t row, float scale,
                               float *scores, float *top) {
    __m512bh query[MAX_GROUP][MAX_DIM / 32];
    for (int64_t g = 0; g < group; g++)
        for (int64_t c = 0; c < dim / 32; c++)
            query[g][c] = (__m512bh)_mm512_loadu_si512(q + (h * group + g) * dim + 32 * c);
    for (int64_t t = 0; t < seq_len; t++) {
        const uint16_t *key = (const uint16_t *)cache + (table[t / block_size] * block_size + t % block_size) * row
                              + h * dim;
        __m512bh keys[MAX_DIM / 32];
        for (int64_t c = 0; c < dim / 32; c++) keys[c] = (__m512bh)_mm512_loadu_si512(key + 32 * c);
        for (int64_t g = 0; g < group; g++) {
            __m512 sum = _mm512_setzero_ps();
            for (int64_t c = 0; c < dim / 32; c++) sum = _mm512_dpbf16_ps(sum, query[g][c], keys[c]);
            scores[g * seq_len + t] = _mm512_reduce_add_ps(sum) * scale;
            top[g] = fmaxf(top[g], scores[g * seq_len + t]);
        }
    }
}
#endif

/* One decode's query heads [h * group, (h + 1) * group) against KV head h over its seq_len positions. */
static inline void attend(const void *q, const void *cache, const int64_t *table, int64_t seq_len, int64_t heads,
                          int64_t kv_heads, int64_t dim, int64_t block_size, int64_t h, float scale, int bf16,
                          void *out, float *scores) {
    const int64_t group = heads / kv_heads, row = 2 * kv_heads * dim, size = bf16 ? 2 : 4;
    float query[MAX_GROUP][MAX_DIM], acc[MAX_GROUP][MAX_DIM], top[MAX_GROUP], total[MAX_GROUP];
    for (int64_t g = 0; g < group; g++) {
        for (int64_t i = 0; i < dim; i++) query[g][i] = load_element(q, bf16, (h * group + g) * dim + i) * scale;
        top[g] = -INFINITY;
        total[g] = 0.0f;
        memset(acc[g], 0, sizeof(float) * (size_t)dim);
    }
#if defined(__AVX512BF16__)
    if (bf16 && dim % 32 == 0)
        scores_bf16(q, cache, table, seq_len, group, h, dim, block_size, row, scale, scores, top);
    else
#endif
    for (int64_t t = 0; t < seq_len; t++) {  /* scores, and each head's max */
        const char *key = (const char *)cache + ((table[t / block_size] * block_size + t % block_size) * row
                                                 + h * dim) * size;
        for (int64_t g = 0; g < group; g++) {
            float s;
#ifdef KVP_SIMD
            if (dim % 8 == 0) {
                __m256 sum = _mm256_setzero_ps();
                for (int64_t i = 0; i < dim; i += 8)
                    sum = _mm256_fmadd_ps(_mm256_loadu_ps(query[g] + i), load8(key, bf16, i), sum);
                s = hsum(sum);
            } else
#endif
            {
                s = 0.0f;
                for (int64_t i = 0; i < dim; i++) s = fmaf(query[g][i], load_element(key, bf16, i), s);
            }
            scores[g * seq_len + t] = s;
            top[g] = fmaxf(top[g], s);
        }
    }
    for (int64_t g = 0; g < group; g++) {  /* the weights, and their sum (in lanes, then across) */
        float *p = scores + g * seq_len;
        int64_t t = 0;
#ifdef KVP_SIMD
        __m256 lanes = _mm256_setzero_ps();
        for (; t + 8 <= seq_len; t += 8) {
            const __m256 e = exp_neg8(_mm256_sub_ps(_mm256_loadu_ps(p + t), _mm256_set1_ps(top[g])));
            _mm256_storeu_ps(p + t, e);
            lanes = _mm256_add_ps(lanes, e);
        }
        total[g] = hsum(lanes);
#endif
        for (; t < seq_len; t++) {
            p[t] = exp_neg(p[t] - top[g]);
            total[g] += p[t];
        }
    }
    for (int64_t t = 0; t < seq_len; t++) {  /* the values, weighted */
        const char *value = (const char *)cache + ((table[t / block_size] * block_size + t % block_size) * row
                                                   + (kv_heads + h) * dim) * size;
        for (int64_t g = 0; g < group; g++) {
            const float p = scores[g * seq_len + t];
#ifdef KVP_SIMD
            if (dim % 8 == 0) {
                const __m256 weight = _mm256_set1_ps(p);
                for (int64_t i = 0; i < dim; i += 8)
                    _mm256_storeu_ps(acc[g] + i,
                                     _mm256_fmadd_ps(weight, load8(value, bf16, i), _mm256_loadu_ps(acc[g] + i)));
                continue;
            }
#endif
            for (int64_t i = 0; i < dim; i++) acc[g][i] = fmaf(p, load_element(value, bf16, i), acc[g][i]);
        }
    }
    for (int64_t g = 0; g < group; g++) {
        const float inv = 1.0f / total[g];
        for (int64_t i = 0; i < dim; i++) store_one(out, bf16, (h * group + g) * dim + i, acc[g][i] * inv);
    }
}

int kvp_decode_attention(const void *q, const void *cache, const int64_t *block_table, int64_t max_blocks,
                         const int64_t *seq_lens, int64_t decodes, int64_t heads, int64_t kv_heads, int64_t dim,
                         int64_t block_size, float scale, int bf16, void *out, int threads) {
    if (dim > MAX_DIM || heads / kv_heads > MAX_GROUP) return -2;
    int64_t longest = 0;
    for (int64_t d = 0; d < decodes; d++) longest = seq_lens[d] > longest ? seq_lens[d] : longest;
    const int64_t group = heads / kv_heads, size = bf16 ? 2 : 4, tasks = decodes * kv_heads;
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1 && tasks > 1)
    {
        float *scores = malloc(sizeof(float) * (size_t)(group * (longest ? longest : 1)));
        if (scores == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t task = 0; task < tasks; task++) {
            if (scores == NULL) continue;
            const int64_t d = task / kv_heads, h = task % kv_heads;
            const void *query = (const char *)q + d * heads * dim * size;
            void *result = (char *)out + d * heads * dim * size;
            const int64_t *table = block_table + d * max_blocks;
            if (bf16 && dim == 64)  /* constant dtype and head size: each specialized */
                attend(query, cache, table, seq_lens[d], heads, kv_heads, 64, block_size, h, scale, 1, result, scores);
            else if (bf16 && dim == 128)
                attend(query, cache, table, seq_lens[d], heads, kv_heads, 128, block_size, h, scale, 1, result, scores);
            else if (bf16)
                attend(query, cache, table, seq_lens[d], heads, kv_heads, dim, block_size, h, scale, 1, result, scores);
            else
                attend(query, cache, table, seq_lens[d], heads, kv_heads, dim, block_size, h, scale, 0, result, scores);
        }
        free(scores);
    }
    return failed ? -1 : 0;
}
#endif
