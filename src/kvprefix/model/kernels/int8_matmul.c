/* y = x @ W.T for int8 weights with a scale per output (W[n][k] = q * scale[n], q in -127..127), float32 out, x
 * in bfloat16 or float32: the two int8 passes per row of quantized_linear.int8_rows_matmul (the row scaled to
 * s = x / max|x| * 127 and rounded, a1 = round(s), then what that leaves, a2 = round((s - a1) * 254)), on
 * AVX512-VNNI's u8 x s8 dot products (vpdpbusd), whose int32 sums are exact. Per output and row the two sums are
 * combined and scaled in float32, y = fl(fl(fl(254 S1 + S2) * scale) * fl(max|x| / 32258)): four roundings after
 * exact integer sums. Each weight is read once for both passes and up to MAX_ROWS rows, so a decode's lm_head
 * runs at the memory's read bandwidth, where fbgemm's linear (the two passes as rows of one call, then PyTorch's
 * ops to combine them) took 1.5x as long (docs/model.md#native-kernels).
 *
 * x: [rows][k] bfloat16 (bf16 = 1) or float32; out: [rows][n] float32; k a multiple of 16, any n.
 * packed: per tile of 16 outputs (n rounded up, zero weights beyond it), k / 4 chunks of 64 bytes; byte 4i + j of
 * chunk c is output i's q at k = 4c + j, plus 128 (vpdpbusd's unsigned operand: 128 x the sum of a row's
 * activations is subtracted once per row). scales: bfloat16, one per output, n rounded up to 16.
 * Integer sums are exact in any order and the float steps are per element, so a row's result never depends on the
 * other rows or on the thread count. Only where the compiler targets AVX512-VNNI (kvp_int8_supported() says so);
 * elsewhere callers keep fbgemm's path. */
#ifndef KVP_INT8_MATMUL_C
#define KVP_INT8_MATMUL_C
#include <float.h>
#include <stdint.h>
#include <stdlib.h>

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>

#define TILE 16
#define MAX_ROWS 4 /* rows a pass over a tile carries (in registers); more rows pass over it again, from cache */
#define LEVELS 127 /* a pass's int8 levels on either side of zero */
/* Bytes ahead of the chunk being read that are prefetched, where a tile takes more than one pass (more than
 * MAX_ROWS rows): its passes from cache would leave the memory idle. One pass a tile streams at the read bandwidth
 * on the hardware prefetcher alone, which software prefetches only slowed (docs/model.md#native-kernels). */
#define PREFETCH 4096

int kvp_int8_supported(void) { return 1; }

/* Sixteen values of x from element i on, as float32. */
static inline __m512 load16(const void *x, int bf16, int64_t i) {
    if (!bf16) return _mm512_loadu_ps((const float *)x + i);
    const __m256i bits = _mm256_loadu_si256((const __m256i *)((const uint16_t *)x + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

/* One row's two passes: acts[0..k) = a1 and acts[k..2k) = a2 (int8), sums[0..1] = 128 x their sums (what the
 * weights' +128 adds to the dot products), *factor = max|x| / (127 x 254). A row with a NaN or an infinity gets
 * zero activations and a NaN factor: NaN outputs. */
static void quantize_row(const void *x, int bf16, int64_t k, int8_t *acts, int32_t *sums, float *factor) {
    __m512 top = _mm512_setzero_ps();
    __mmask16 bad = 0;
    for (int64_t i = 0; i < k; i += 16) {
        const __m512 v = _mm512_abs_ps(load16(x, bf16, i));
        bad |= _mm512_cmp_ps_mask(v, _mm512_set1_ps(FLT_MAX), _CMP_NLE_UQ); /* infinity or NaN */
        top = _mm512_max_ps(top, v);
    }
    const float max = _mm512_reduce_max_ps(top), row_max = max > FLT_MIN ? max : FLT_MIN;
    if (bad) {
        for (int64_t i = 0; i < 2 * k; i++) acts[i] = 0;
        sums[0] = sums[1] = 0;
        *factor = __builtin_nanf("");
        return;
    }
    const __m512 divisor = _mm512_set1_ps(row_max), levels = _mm512_set1_ps((float)LEVELS);
    const __m512 error_levels = _mm512_set1_ps((float)(2 * LEVELS));
    __m512i first = _mm512_setzero_si512(), second = _mm512_setzero_si512();
    for (int64_t i = 0; i < k; i += 16) {
        /* As int8_rows_matmul's x.div(row_max).mul_(127), round (to nearest even), (s - a1) * 254, round. */
        const __m512 s = _mm512_mul_ps(_mm512_div_ps(load16(x, bf16, i), divisor), levels);
        const __m512 a1 = _mm512_roundscale_ps(s, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m512 a2 = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_sub_ps(s, a1), error_levels),
                                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m512i q1 = _mm512_cvtps_epi32(a1), q2 = _mm512_cvtps_epi32(a2);
        _mm_storeu_si128((__m128i *)(acts + i), _mm512_cvtepi32_epi8(q1));
        _mm_storeu_si128((__m128i *)(acts + k + i), _mm512_cvtepi32_epi8(q2));
        first = _mm512_add_epi32(first, q1);
        second = _mm512_add_epi32(second, q2);
    }
    sums[0] = 128 * _mm512_reduce_add_epi32(first);
    sums[1] = 128 * _mm512_reduce_add_epi32(second);
    *factor = row_max / (float)(LEVELS * 2 * LEVELS);
}

/* rows (1..MAX_ROWS) rows against one tile: out[r][0..valid). Each row and pass sums in `chains` accumulators
 * (taking every chains-th chunk), enough independent chains in all for the pipeline; exact, so in any order. */
static inline __attribute__((always_inline)) void tile_rows(const int8_t *acts, int64_t k, const uint8_t *tile,
                                                            const uint16_t *scales, const int32_t *sums,
                                                            const float *factors, int rows, int chains, float *out,
                                                            int64_t n, __mmask16 valid, int prefetch) {
    __m512i acc[MAX_ROWS][2][4];
    for (int r = 0; r < rows; r++)
        for (int p = 0; p < 2; p++)
            for (int a = 0; a < chains; a++) acc[r][p][a] = _mm512_setzero_si512();
    for (int64_t c = 0; c < k / 4; c += chains)
        for (int a = 0; a < chains; a++) {
            const __m512i w = _mm512_loadu_si512(tile + (c + a) * 64);
            if (prefetch) _mm_prefetch((const char *)tile + (c + a) * 64 + PREFETCH, _MM_HINT_T0);
            for (int r = 0; r < rows; r++)
                for (int p = 0; p < 2; p++) {
                    const int32_t four = ((const int32_t *)(acts + (2 * r + p) * k))[c + a];
                    acc[r][p][a] = _mm512_dpbusd_epi32(acc[r][p][a], w, _mm512_set1_epi32(four));
                }
        }
    const __m512 scale = _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)scales)), 16));
    for (int r = 0; r < rows; r++) {
        __m512i sum[2];
        for (int p = 0; p < 2; p++) {
            sum[p] = acc[r][p][0];
            for (int a = 1; a < chains; a++) sum[p] = _mm512_add_epi32(sum[p], acc[r][p][a]);
            sum[p] = _mm512_sub_epi32(sum[p], _mm512_set1_epi32(sums[2 * r + p]));
        }
        const __m512 both = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[0]), _mm512_set1_ps((float)(2 * LEVELS)),
                                            _mm512_cvtepi32_ps(sum[1])); /* 254 S1 + S2, rounded once */
        const __m512 y = _mm512_mul_ps(_mm512_mul_ps(both, scale), _mm512_set1_ps(factors[r]));
        _mm512_mask_storeu_ps(out + r * n, valid, y);
    }
}

/* Accumulator chains a row and pass at `rows` rows a pass: 8 chains in all (fewer rows, more of their own). The
 * prefetch argument a constant in each call, so that the loop without it carries no test. */
#define TILE_ROWS(R)                                                                                           \
    case R:                                                                                                    \
        if (prefetch)                                                                                          \
            tile_rows(acts + r0 * 2 * k, k, packed + t * TILE * k, scales + t * TILE, sums + 2 * r0,           \
                      factors + r0, R, R == 1 ? 4 : R == 2 ? 2 : 1, out + r0 * n + t * TILE, n, valid, 1);     \
        else                                                                                                   \
            tile_rows(acts + r0 * 2 * k, k, packed + t * TILE * k, scales + t * TILE, sums + 2 * r0,           \
                      factors + r0, R, R == 1 ? 4 : R == 2 ? 2 : 1, out + r0 * n + t * TILE, n, valid, 0);     \
        break;

/* Returns 0, or -1 for shapes it does not take (k not a multiple of 16, no rows or outputs) or no memory. */
int kvp_int8_matmul(const void *x, int bf16, int64_t rows, int64_t k, const uint8_t *packed, const uint16_t *scales,
                    int64_t n, float *out, int threads) {
    if (k % 16 || k < 16 || rows < 1 || n < 1) return -1;
    int8_t *acts = malloc((size_t)(rows * 2 * k));
    int32_t *sums = malloc((size_t)rows * 2 * sizeof(int32_t));
    float *factors = malloc((size_t)rows * sizeof(float));
    if (!acts || !sums || !factors) {
        free(acts), free(sums), free(factors);
        return -1;
    }
    const int64_t stride = bf16 ? 2 * k : 4 * k; /* bytes a row of x */
    for (int64_t r = 0; r < rows; r++)
        quantize_row((const char *)x + r * stride, bf16, k, acts + r * 2 * k, sums + 2 * r, factors + r);
    const int64_t tiles = (n + TILE - 1) / TILE;
    const int prefetch = rows > MAX_ROWS;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && tiles > 1)
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t left = n - t * TILE;
        const __mmask16 valid = left >= TILE ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
        for (int64_t r0 = 0; r0 < rows; r0 += MAX_ROWS) {
            switch (rows - r0 < MAX_ROWS ? rows - r0 : MAX_ROWS) {
                TILE_ROWS(1) TILE_ROWS(2) TILE_ROWS(3) TILE_ROWS(4)
            }
        }
    }
    free(acts), free(sums), free(factors);
    return 0;
}
#else
int kvp_int8_supported(void) { return 0; }

int kvp_int8_matmul(const void *x, int bf16, int64_t rows, int64_t k, const uint8_t *packed, const uint16_t *scales,
                    int64_t n, float *out, int threads) {
    (void)x, (void)bf16, (void)rows, (void)k, (void)packed, (void)scales, (void)n, (void)out, (void)threads;
    return -1;
}
#endif
#endif
