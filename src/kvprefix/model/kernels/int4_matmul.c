/* y = x @ W.T for int4 weights in groups of 32 (W[n][k] = (q - 8) * scale[n][g] + zero[n][g], g = k / 32, q in
 * 0..15), bfloat16 activations and output, a few rows at a time (decode). The weights stay packed through the dot
 * product: each nibble becomes the bfloat16 value q - 8 (exact) by one table lookup and meets the activations in
 * AVX512-BF16's pair dot product, which sums exact products in float32. Per group and output, the float32 sum
 * sum_k (q - 8) * x is then scaled, and zero * sum_k x added: the weights of the reference, summed in float32.
 * PyTorch's int4 op converts each weight to float and applies scale and zero before its product, which makes it
 * compute-bound at a few GB/s of packed weights (docs/model.md#native-kernels).
 *
 * x: [rows][k] bfloat16; out: [rows][n] bfloat16 (rounded to nearest even); n a multiple of 16, k of 32.
 * packed: per tile of 16 outputs, per group, 4 chunks of 32 16-bit words; word 2i + j of chunk c holds output i's
 * q at k = 32 g + 8 c + 2 h + j in bits 4h..4h+3 (h = 0..3), so one chunk's nibble h is the pair dot product of
 * k pair 16 g + 4 c + h for all 16 outputs. scales: per tile, per group, 16 scales then 16 zeros (bfloat16).
 * Each tile is one thread's, each row summed in one fixed order: a row's result never depends on the other rows
 * or on the thread count. Only where the compiler targets AVX512-BF16 (kvp_int4_supported() says so); elsewhere
 * callers keep PyTorch's op. */
#ifndef KVP_INT4_MATMUL_C
#define KVP_INT4_MATMUL_C
#include <stdint.h>

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>

#define TILE 16
#define GROUP 32
#define MAX_ROWS 4 /* rows a pass over a tile carries (in registers); more rows pass over it again */
/* Bytes ahead of the chunk being read that are prefetched: a decode step streams through ~120 small matrices, each
 * a fresh start for the hardware prefetcher (docs/model.md#native-kernels). */
#define PREFETCH 4096

int kvp_int4_supported(void) { return 1; }

/* Sixteen bfloat16 values from p on, as float32. */
static inline __m512 bf16x16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* The 32 words of one chunk's nibble h as bfloat16 (q - 8), by a table lookup (vpermw) that reads each index's
 * low 5 bits: the table repeats its 16 values, so the bit above the nibble needs no mask. */
static inline __m512i nibble_values(__m512i words, int h, __m512i table) {
    return _mm512_permutexvar_epi16(h ? _mm512_srli_epi16(words, 4 * h) : words, table);
}

/* rows (1..MAX_ROWS) rows of x against one tile: out[r][0..15]. Each row sums a group's chunks in four
 * accumulators, one per nibble position (independent chains for the pipeline), added pairwise at the group's end. */
static inline __attribute__((always_inline)) void tile_rows(const uint16_t *x, int64_t k, const uint8_t *tile,
                                                            const uint16_t *scales, const float *sums, int rows,
                                                            uint16_t *out, int64_t n, __m512i table) {
    __m512 total[MAX_ROWS];
    for (int r = 0; r < rows; r++) total[r] = _mm512_setzero_ps();
    const int64_t groups = k / GROUP;
    for (int64_t g = 0; g < groups; g++) {
        __m512 acc[MAX_ROWS][4];
        for (int r = 0; r < rows; r++)
            for (int h = 0; h < 4; h++) acc[r][h] = _mm512_setzero_ps();
        const uint8_t *chunks = tile + g * (TILE * GROUP / 2);
        for (int c = 0; c < 4; c++) {
            const __m512i words = _mm512_loadu_si512(chunks + c * 64);
            _mm_prefetch((const char *)chunks + c * 64 + PREFETCH, _MM_HINT_T0);
            for (int h = 0; h < 4; h++) {
                const __m512bh w = (__m512bh)nibble_values(words, h, table);
                const int64_t pair = g * 16 + c * 4 + h;
                for (int r = 0; r < rows; r++) {
                    const uint32_t xp = ((const uint32_t *)(x + r * k))[pair];
                    acc[r][h] = _mm512_dpbf16_ps(acc[r][h], w, (__m512bh)_mm512_set1_epi32((int)xp));
                }
            }
        }
        const __m512 scale = bf16x16(scales + g * 32), zero = bf16x16(scales + g * 32 + 16);
        for (int r = 0; r < rows; r++) {
            const __m512 sum = _mm512_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]), _mm512_add_ps(acc[r][2], acc[r][3]));
            total[r] = _mm512_fmadd_ps(sum, scale, total[r]);
            total[r] = _mm512_fmadd_ps(zero, _mm512_set1_ps(sums[r * groups + g]), total[r]);
        }
    }
    for (int r = 0; r < rows; r++)
        _mm256_storeu_si256((__m256i *)(out + r * n), (__m256i)_mm512_cvtneps_pbh(total[r]));
}

#define TILE_ROWS(R)                                                                                     \
    case R:                                                                                              \
        tile_rows(x + r0 * k, k, packed + t * tile_bytes, scales + t * groups * 32, sums + r0 * groups, R, \
                  out + r0 * n + t * TILE, n, table);                                                    \
        break;

/* x's sum over each group of 32 in float32, in one fixed order: [rows][k / 32]. */
static void group_sums(const uint16_t *x, int64_t rows, int64_t k, float *sums) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t g = 0; g < k / GROUP; g++) {
            const uint16_t *group = x + r * k + g * GROUP;
            sums[r * (k / GROUP) + g] = _mm512_reduce_add_ps(_mm512_add_ps(bf16x16(group), bf16x16(group + 16)));
        }
}

/* Returns 0, or -1 for shapes it does not take (n not a multiple of 16, k of 32, no rows). */
int kvp_int4_matmul(const uint16_t *x, int64_t rows, int64_t k, const uint8_t *packed, const uint16_t *scales,
                    int64_t n, uint16_t *out, int threads) {
    if (n % TILE || k % GROUP || rows < 1) return -1;
    float sums[rows * (k / GROUP)];
    group_sums(x, rows, k, sums);
    int16_t values[32];
    for (int i = 0; i < 32; i++) {
        const float v = (float)((i & 15) - 8);
        union { float f; uint32_t u; } bits = {v};
        values[i] = (int16_t)(bits.u >> 16); /* small integers are exact in bfloat16 */
    }
    const __m512i table = _mm512_loadu_si512(values);
    const int64_t tiles = n / TILE, groups = k / GROUP, tile_bytes = groups * (TILE * GROUP / 2);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && tiles > 1)
    for (int64_t t = 0; t < tiles; t++)
        for (int64_t r0 = 0; r0 < rows; r0 += MAX_ROWS) {
            switch (rows - r0 < MAX_ROWS ? rows - r0 : MAX_ROWS) {
                TILE_ROWS(1) TILE_ROWS(2) TILE_ROWS(3) TILE_ROWS(4)
            }
        }
    return 0;
}
#else
int kvp_int4_supported(void) { return 0; }

int kvp_int4_matmul(const uint16_t *x, int64_t rows, int64_t k, const uint8_t *packed, const uint16_t *scales,
                    int64_t n, uint16_t *out, int threads) {
    (void)x, (void)rows, (void)k, (void)packed, (void)scales, (void)n, (void)out, (void)threads;
    return -1;
}
#endif
#endif
