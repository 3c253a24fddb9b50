/* A decoder layer's elementwise steps on bfloat16 rows, each one pass where PyTorch dispatches two or three ops
 * (docs/model.md#native-kernels); the fused decode layer (decode_layer.c) runs the same functions, so both paths
 * compute the same bits.
 *
 * kvp_rotary: q and k heads [tokens][heads][dim] (row stride `stride` elements) rotated in place with cos and signed
 * sin [tokens][dim], as the model's apply_rotary_: x = bf16(x * cos), then bf16(x + swap_halves(x_before) * sin),
 * each product and sum rounded to float32 on its own (PyTorch's mul_ and addcmul_).
 * kvp_silu_mul: out[t][i] = bf16(bf16(silu(g)) * u) for g = gate_up[t][i], u = gate_up[t][inner + i], silu(g) =
 * g * sigmoid(g) in float32 with the polynomial exp of decode_attention.c (its SIMD lanes equal its scalar).
 * Each row is one thread's: a row's result never depends on the others. */
#ifndef KVP_LAYER_OPS_C
#define KVP_LAYER_OPS_C
#include <stdint.h>

#include "bf16.h"
#include "decode_attention.c" /* exp_neg and exp_neg8 */

static void rotary_row(uint16_t *x, int64_t heads, int64_t dim, const uint16_t *cos, const uint16_t *sin) {
    const int64_t half = dim / 2;
    float before[MAX_DIM];
    for (int64_t h = 0; h < heads; h++) {
        uint16_t *head = x + h * dim;
        for (int64_t i = 0; i < dim; i++) before[i] = bf16_to_float(head[i]);
        for (int64_t i = 0; i < dim; i++) {
            const float turned = bf16_round(before[i] * bf16_to_float(cos[i]));
            const float swapped = before[i < half ? i + half : i - half];
            head[i] = float_to_bf16(turned + swapped * bf16_to_float(sin[i]));
        }
    }
}

/* Returns 0, or -1 for an odd head size or one over MAX_DIM. */
int kvp_rotary(void *x, int64_t tokens, int64_t heads, int64_t dim, int64_t stride, const void *cos,
               const void *sin, int threads) {
    if (dim % 2 || dim > MAX_DIM) return -1;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && tokens > 1)
    for (int64_t t = 0; t < tokens; t++)
        rotary_row((uint16_t *)x + t * stride, heads, dim, (const uint16_t *)cos + t * dim,
                   (const uint16_t *)sin + t * dim);
    return 0;
}

static inline float silu(float g) {
    const float e = exp_neg(-fabsf(g));
    return g * ((g >= 0.0f ? 1.0f : e) / (1.0f + e));
}

#ifdef KVP_SIMD
/* Eight floats rounded to bfloat16 as float_to_bf16 rounds each (to nearest even, NaN kept NaN): their top 16 bits. */
static inline __m256i bf16_bits8(__m256 f) {
    const __m256i u = _mm256_castps_si256(f);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i top = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), odd)), 16);
    const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    return _mm256_blendv_epi8(top, quiet, _mm256_castps_si256(_mm256_cmp_ps(f, f, _CMP_UNORD_Q)));
}

static inline __m256 bf16_round8(__m256 f) { return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits8(f), 16)); }

static inline void store8_bf16(uint16_t *out, __m256 f) {
    const __m256i bits = bf16_bits8(f);
    _mm_storeu_si128((__m128i *)out, _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(bits, bits),
                                                                                       0x08)));
}
#endif

static void silu_mul_row(const uint16_t *gate_up, int64_t inner, uint16_t *out) {
    int64_t i = 0;
#ifdef KVP_SIMD
    const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
    for (; i + 8 <= inner; i += 8) {
        const __m256 g = load8(gate_up, 1, i);
        const __m256 e = exp_neg8(_mm256_sub_ps(zero, _mm256_andnot_ps(_mm256_set1_ps(-0.0f), g)));
        const __m256 top = _mm256_blendv_ps(e, one, _mm256_cmp_ps(g, zero, _CMP_GE_OQ));
        const __m256 s = _mm256_mul_ps(g, _mm256_div_ps(top, _mm256_add_ps(one, e)));
        store8_bf16(out + i, _mm256_mul_ps(bf16_round8(s), load8(gate_up, 1, inner + i)));
    }
#endif
    for (; i < inner; i++)
        out[i] = float_to_bf16(bf16_round(silu(bf16_to_float(gate_up[i]))) * bf16_to_float(gate_up[inner + i]));
}

void kvp_silu_mul(const void *gate_up, int64_t tokens, int64_t inner, void *out, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && tokens > 1)
    for (int64_t t = 0; t < tokens; t++)
        silu_mul_row((const uint16_t *)gate_up + t * 2 * inner, inner, (uint16_t *)out + t * inner);
}
#endif
