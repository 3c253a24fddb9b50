/* RMSNorm of rows, with the reference's roundings in one pass over each row: PyTorch's CPU path runs it as ~8 ops
 * (upcast, square, mean, add, rsqrt, multiply, downcast, then the weight), each dispatched apart, ~19 us a call
 * on a 576-wide bfloat16 row where the arithmetic takes well under one (docs/model.md#native-kernels).
 *
 * x, out: [rows][size]; weight: [size]; all bfloat16 when bf16, else float32.
 * r = 1 / sqrt(mean(x * x) + eps) in float32, the squares summed in 8 lanes then across (the order differs from
 * PyTorch's reduction: r may differ in its last bit). bfloat16: out = bf16(bf16(x * r) * w), as transformers'
 * LlamaRMSNorm (normalize in float32, round to the model's dtype, then scale); float32: out = (x * r) * w.
 * Each row is one thread's (OpenMP at PyTorch's thread count): a row's result never depends on the others. */
#ifndef KVP_RMS_NORM_C
#define KVP_RMS_NORM_C
#include <math.h>
#include <stdint.h>

#include "bf16.h"
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define KVP_SIMD 1
#endif

/* sum(x * x) over a row: eight lane sums (element i in lane i % 8), then lanes 0+4, 1+5, ... added pairwise. */
static float sum_of_squares(const void *x, int bf16, int64_t size) {
    float lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t i = 0;
#ifdef KVP_SIMD
    __m256 acc = _mm256_setzero_ps();
    for (; i + 8 <= size; i += 8) {
        __m256 v;
        if (bf16)
            v = _mm256_castsi256_ps(_mm256_slli_epi32(
                _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)x + i))), 16));
        else
            v = _mm256_loadu_ps((const float *)x + i);
        acc = _mm256_fmadd_ps(v, v, acc);
    }
    _mm256_storeu_ps(lanes, acc);
#else
    for (; i + 8 <= size; i += 8)
        for (int l = 0; l < 8; l++) {
            const float v = load_element(x, bf16, i + l);
            lanes[l] = fmaf(v, v, lanes[l]);
        }
#endif
    for (; i < size; i++) {
        const float v = load_element(x, bf16, i);
        lanes[i % 8] = fmaf(v, v, lanes[i % 8]);
    }
    return ((lanes[0] + lanes[4]) + (lanes[2] + lanes[6])) + ((lanes[1] + lanes[5]) + (lanes[3] + lanes[7]));
}

void kvp_rms_norm(const void *x, const void *weight, int64_t rows, int64_t size, float eps, int bf16, void *out,
                  int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && rows > 1)
    for (int64_t r = 0; r < rows; r++) {
        const char *row = (const char *)x + r * size * (bf16 ? 2 : 4);
        const float scale = 1.0f / sqrtf(sum_of_squares(row, bf16, size) / (float)size + eps);
        for (int64_t i = 0; i < size; i++) {
            const float normed = load_element(row, bf16, i) * scale;
            if (bf16)
                ((uint16_t *)out)[r * size + i] = float_to_bf16(bf16_round(normed) * load_element(weight, 1, i));
            else
                ((float *)out)[r * size + i] = normed * load_element(weight, 0, i);
        }
    }
}
#endif
