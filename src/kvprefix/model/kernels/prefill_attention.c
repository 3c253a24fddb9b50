/* Causal attention of a bfloat16 prefill chunk on AVX512-BF16: each query row against the keys up to its own
 * position, in one pass over blocks of 64 keys with a running max and sum (flash attention's online softmax).
 * Scores are exact products summed in float32 (pair dot products, no bfloat16 rounding of the scores), weights
 * rounded to bfloat16 for their product with the values, output normalized once and rounded to nearest even.
 * PyTorch's way on CPU (its flash kernel, or query tiles of its matmuls and softmax) runs at about half the matmul
 * peak here: separate passes over the scores, copies of transposed operands (docs/model.md#native-kernels).
 *
 * q: [new][heads][dim] with a token stride of q_stride elements; out: [new][heads][dim]; keys, values:
 * [seq][kv_heads][dim] with token strides k_stride, v_stride (views of the step's K/V or of a gathered context);
 * the chunk is positions seq - new .. seq - 1. Query heads h * group .. (h + 1) * group - 1 attend to KV head h
 * (GQA). packed: scratch of 2 * kv_heads * padded * dim bfloat16 elements (padded: seq rounded up to 64;
 * native_prefill.scratch_size), where each KV head's keys are laid out as [key block][dim pair][64 keys][2] and its
 * values as [key pair][dim][2] (what the pair dot products read).
 * A row's result depends only on its query, its position and the keys and values: blocks are aligned to absolute
 * positions, rows never share a sum, and what a row does not see it skips or weighs by an exact 0. So it does not
 * depend on the chunk it came in, the other rows or the thread count. Only where the compiler targets AVX512-BF16
 * (kvp_prefill_supported() says so); elsewhere callers keep PyTorch's ops. Returns 0, or -1 for a head size that
 * is not a multiple of 64 up to 256. */
#ifndef KVP_PREFILL_ATTENTION_C
#define KVP_PREFILL_ATTENTION_C
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>

#define BLOCK_KEYS 64  /* keys a block: a register block's scores of it (6 rows x 4 vectors) fill 24 registers */
#define ROWS 6         /* query rows a register block carries */
#define TILE_ROWS 60   /* query rows that take each key block in turn while it stays in L1 */
#define MAX_DIM 256

int kvp_prefill_supported(void) { return 1; }

/* exp(x) for x <= 0 on 16 lanes: decode_attention.c's exp_neg steps (2^n * a degree-6 polynomial of the reduced
 * argument), 0 below -87 and for -inf. */
static inline __m512 exp_neg16(__m512 x) {
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(-0.693145752f),
                                     _mm512_fmadd_ps(n, _mm512_set1_ps(-1.42860677e-6f), x));
    __m512 p = _mm512_set1_ps(1.0f / 720.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(_mm512_max_ps(n, _mm512_set1_ps(-126.0f))),
                                                         _mm512_set1_epi32(127)), 23);
    const __mmask16 kept = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GE_OQ);
    return _mm512_maskz_mul_ps(kept, p, _mm512_castsi512_ps(e));
}

/* One KV head's keys into [block][dim pair][64 keys][2] and values into [key pair][dim][2] (zeros past seq). */
static void pack_head(const uint16_t *keys, int64_t k_stride, const uint16_t *values, int64_t v_stride, int64_t seq,
                      int64_t dim, uint32_t *kp, uint32_t *vp) {
    const int64_t pairs = dim / 2, padded = (seq + BLOCK_KEYS - 1) / BLOCK_KEYS * BLOCK_KEYS;
    for (int64_t t = 0; t < padded; t++) {
        uint32_t *column = kp + (t / BLOCK_KEYS) * pairs * BLOCK_KEYS + t % BLOCK_KEYS;
        if (t < seq) {
            const uint32_t *key = (const uint32_t *)(keys + t * k_stride);
            for (int64_t p = 0; p < pairs; p++) column[p * BLOCK_KEYS] = key[p];
        } else {
            for (int64_t p = 0; p < pairs; p++) column[p * BLOCK_KEYS] = 0;
        }
    }
    for (int64_t t = 0; t < padded; t += 2) {
        uint32_t *pair = vp + (t / 2) * dim;
        const uint16_t *first = values + t * v_stride, *second = values + (t + 1) * v_stride;
        for (int64_t d = 0; d < dim; d++)
            pair[d] = (t < seq ? first[d] : 0) | (uint32_t)(t + 1 < seq ? second[d] : 0) << 16;
    }
}

static inline __m512bh pair_of(const uint16_t *p) { return (__m512bh)_mm512_set1_epi32(*(const int32_t *)p); }

/* Rows 0..rows-1 of a register block (queries q[i], positions pos[i]) against key block b: the running max m,
 * sum l and unnormalized outputs o (float32 [rows][dim]) updated. */
static inline __attribute__((always_inline)) void block_rows(const uint16_t *const *q, const int64_t *pos, int rows,
                                                             int64_t b, const uint32_t *kp, const uint32_t *vp,
                                                             int64_t dim, float scale, float *m, float *l, float *o) {
    const int64_t pairs = dim / 2, first = b * BLOCK_KEYS;
    __m512 s[ROWS][4];
    for (int i = 0; i < rows; i++)
        for (int c = 0; c < 4; c++) s[i][c] = _mm512_setzero_ps();
    const uint32_t *block = kp + b * pairs * BLOCK_KEYS;
    for (int64_t p = 0; p < pairs; p++) {
        __m512bh k[4];
        for (int c = 0; c < 4; c++) k[c] = (__m512bh)_mm512_loadu_si512(block + p * BLOCK_KEYS + 16 * c);
        for (int i = 0; i < rows; i++) {
            const __m512bh qp = pair_of(q[i] + 2 * p);
            for (int c = 0; c < 4; c++) s[i][c] = _mm512_dpbf16_ps(s[i][c], qp, k[c]);
        }
    }
    uint16_t weights[ROWS][BLOCK_KEYS] __attribute__((aligned(64)));
    float gaps[16] __attribute__((aligned(64))) = {0}, sums[ROWS];
    int64_t seen = 0; /* keys of this block the register block's last row sees */
    int rescale = 0;  /* whether a row's max rose: its sums so far are scaled to the new one */
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int i = 0; i < rows; i++) {
        const int64_t visible = pos[i] - first + 1; /* <= 0 for a row before the block: all its weights 0 */
        if (visible < BLOCK_KEYS)
            for (int c = 0; c < 4; c++) {
                const __mmask16 later = _mm512_cmp_epi32_mask(_mm512_add_epi32(lane, _mm512_set1_epi32(16 * c)),
                                                              _mm512_set1_epi32((int)visible), _MM_CMPINT_GE);
                s[i][c] = _mm512_mask_mov_ps(s[i][c], later, _mm512_set1_ps(-INFINITY));
            }
        const __m512 top = _mm512_max_ps(_mm512_max_ps(s[i][0], s[i][1]), _mm512_max_ps(s[i][2], s[i][3]));
        /* the max in the scaled scores' units (scale > 0), then each weight exp(score * scale - max), one fma */
        const float peak = fmaxf(m[i], _mm512_reduce_max_ps(top) * scale);
        gaps[i] = m[i] - peak;
        rescale |= peak != m[i];
        m[i] = peak;
        __m512 e[4];
        for (int c = 0; c < 4; c++)
            e[c] = exp_neg16(_mm512_fmadd_ps(s[i][c], _mm512_set1_ps(scale), _mm512_set1_ps(-peak)));
        sums[i] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(e[0], e[1]), _mm512_add_ps(e[2], e[3])));
        _mm512_store_si512(weights[i], (__m512i)_mm512_cvtne2ps_pbh(e[1], e[0]));
        _mm512_store_si512(weights[i] + 32, (__m512i)_mm512_cvtne2ps_pbh(e[3], e[2]));
        seen = visible > seen ? visible : seen;
    }
    float alpha[16] __attribute__((aligned(64)));
    if (rescale) /* every row's factor exp(old max - new max) at once; 1 where the max stayed */
        _mm512_store_ps(alpha, exp_neg16(_mm512_load_ps(gaps)));
    for (int i = 0; i < rows; i++) l[i] = (rescale ? l[i] * alpha[i] : l[i]) + sums[i];
    const int64_t key_pairs = seen >= BLOCK_KEYS ? BLOCK_KEYS / 2 : (seen + 1) / 2; /* the rest weigh 0 */
    const uint32_t *value_pairs = vp + (first / 2) * dim;
    for (int64_t d = 0; d < dim; d += 64) {
        __m512 acc[ROWS][4];
        for (int i = 0; i < rows; i++)
            for (int c = 0; c < 4; c++) {
                acc[i][c] = _mm512_loadu_ps(o + i * dim + d + 16 * c);
                if (rescale) acc[i][c] = _mm512_mul_ps(acc[i][c], _mm512_set1_ps(alpha[i]));
            }
        for (int64_t j = 0; j < key_pairs; j++) {
            __m512bh v[4];
            for (int c = 0; c < 4; c++) v[c] = (__m512bh)_mm512_loadu_si512(value_pairs + j * dim + d + 16 * c);
            for (int i = 0; i < rows; i++) {
                const __m512bh wp = pair_of(weights[i] + 2 * j);
                for (int c = 0; c < 4; c++) acc[i][c] = _mm512_dpbf16_ps(acc[i][c], wp, v[c]);
            }
        }
        for (int i = 0; i < rows; i++)
            for (int c = 0; c < 4; c++) _mm512_storeu_ps(o + i * dim + d + 16 * c, acc[i][c]);
    }
}

/* Query rows r0 .. r0 + count - 1 of KV head h (row r: token r / group, query head h * group + r % group). */
static inline __attribute__((always_inline)) void tile(const uint16_t *q, int64_t q_stride, int64_t heads,
                                                       int64_t group, int64_t h, int64_t context, int64_t r0,
                                                       int64_t count, const uint32_t *kp, const uint32_t *vp,
                                                       int64_t dim, float scale, uint16_t *out) {
    float o[TILE_ROWS * MAX_DIM], m[TILE_ROWS], l[TILE_ROWS];
    const uint16_t *rows[TILE_ROWS];
    int64_t pos[TILE_ROWS];
    for (int64_t i = 0; i < count; i++) {
        const int64_t r = r0 + i;
        rows[i] = q + (r / group) * q_stride + (h * group + r % group) * dim;
        pos[i] = context + r / group;
        m[i] = -INFINITY;
        l[i] = 0.0f;
    }
    memset(o, 0, sizeof(float) * (size_t)(count * dim));
    const int64_t blocks = pos[count - 1] / BLOCK_KEYS + 1;
    for (int64_t b = 0; b < blocks; b++) {
        for (int64_t i = 0; i < count; i += ROWS) {
            const int n = count - i < ROWS ? (int)(count - i) : ROWS;
            if (pos[i + n - 1] < b * BLOCK_KEYS) continue; /* none of these rows reaches the block */
            switch (n) { /* constant row counts: each specialized */
            case 6: block_rows(rows + i, pos + i, 6, b, kp, vp, dim, scale, m + i, l + i, o + i * dim); break;
            case 5: block_rows(rows + i, pos + i, 5, b, kp, vp, dim, scale, m + i, l + i, o + i * dim); break;
            case 4: block_rows(rows + i, pos + i, 4, b, kp, vp, dim, scale, m + i, l + i, o + i * dim); break;
            case 3: block_rows(rows + i, pos + i, 3, b, kp, vp, dim, scale, m + i, l + i, o + i * dim); break;
            case 2: block_rows(rows + i, pos + i, 2, b, kp, vp, dim, scale, m + i, l + i, o + i * dim); break;
            default: block_rows(rows + i, pos + i, 1, b, kp, vp, dim, scale, m + i, l + i, o + i * dim);
            }
        }
    }
    for (int64_t i = 0; i < count; i++) {
        const int64_t r = r0 + i;
        uint16_t *target = out + ((r / group) * heads + h * group + r % group) * dim;
        const __m512 inv = _mm512_set1_ps(1.0f / l[i]);
        for (int64_t d = 0; d < dim; d += 16)
            _mm256_storeu_si256((__m256i *)(target + d),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(o + i * dim + d), inv)));
    }
}

int kvp_prefill_attention(const void *q, int64_t q_stride, const void *keys, int64_t k_stride, const void *values,
                          int64_t v_stride, int64_t new, int64_t seq, int64_t heads, int64_t kv_heads, int64_t dim,
                          float scale, void *packed, void *out, int threads) {
    if (dim % 64 || dim > MAX_DIM) return -1;
    const int64_t group = heads / kv_heads, context = seq - new, rows = new * group;
    const int64_t padded = (seq + BLOCK_KEYS - 1) / BLOCK_KEYS * BLOCK_KEYS, head_words = padded * dim / 2;
    uint32_t *kp = packed, *vp = (uint32_t *)packed + kv_heads * head_words;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t h = 0; h < kv_heads; h++)
        pack_head((const uint16_t *)keys + h * dim, k_stride, (const uint16_t *)values + h * dim, v_stride, seq, dim,
                  kp + h * head_words, vp + h * head_words);
    const int64_t tiles = (rows + TILE_ROWS - 1) / TILE_ROWS;
    /* interleaved: a tile further down the chunk sees more keys */
#pragma omp parallel for schedule(static, 1) num_threads(threads) if (threads > 1)
    for (int64_t task = 0; task < kv_heads * tiles; task++) {
        const int64_t h = task % kv_heads, r0 = (task / kv_heads) * TILE_ROWS;
        const int64_t count = rows - r0 < TILE_ROWS ? rows - r0 : TILE_ROWS;
        const uint32_t *keys_packed = kp + h * head_words, *values_packed = vp + h * head_words;
        if (dim == 64) /* the common head size: specialized */
            tile(q, q_stride, heads, group, h, context, r0, count, keys_packed, values_packed, 64, scale, out);
        else
            tile(q, q_stride, heads, group, h, context, r0, count, keys_packed, values_packed, dim, scale, out);
    }
    return 0;
}
#else
int kvp_prefill_supported(void) { return 0; }
#endif
#endif
