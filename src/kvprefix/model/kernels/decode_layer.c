/* The decoder layers of a decode-only step in one call: the int4 projections, RMSNorm, rotary, the KV write, decode
 * attention and SiLU of the other kernels here, in the order and with the roundings of the model's own forward
 * (llama.DecoderLayer with those kernels), so the result is the same bits. What it saves is the Python between
 * them: ~20 ops and calls a layer, each costing microseconds, and the gaps they leave in reading the weights
 * (docs/model.md#native-kernels).
 *
 * x: [decodes][hidden] bfloat16, the residual stream, updated in place; layers: count struct kvp_layer, whose
 * projections are int4_matmul.c's packing: qkv [(heads + 2 kv_heads) dim], o [hidden], gate_up [2 inner] (gate
 * rows, then up), down [hidden], none padded. cos, sin: [decodes][dim] (apply_rotary_'s factors); slots:
 * [decodes] cache rows of the new K and V; table, seq_lens: as decode_attention.c takes them (seq_lens counting the
 * new token). Returns 0; -1 without scratch memory; -2 for shapes the kernels do not take. Only where
 * int4_matmul.c has its AVX512-BF16 path (kvp_decode_layer_supported). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "int4_matmul.c"
#include "layer_ops.c"
#include "rms_norm.c"

int kvp_decode_layer_supported(void) { return kvp_int4_supported(); }

/* One layer's pointers, as the caller packs them (int64 each): the two norms' weights, each projection's packed
 * weights and scales (qkv, o, gate_up, down), and the layer's cache. */
struct kvp_layer {
    const uint16_t *input_norm, *post_norm;
    struct { const uint8_t *packed; const uint16_t *scales; } proj[4];
    uint16_t *cache;
};

/* x += y, bfloat16 (each sum rounded once, as PyTorch's add_). */
static void add_rows(uint16_t *x, const uint16_t *y, int64_t n) {
    for (int64_t i = 0; i < n; i++) x[i] = float_to_bf16(bf16_to_float(x[i]) + bf16_to_float(y[i]));
}

int kvp_decode_layers(uint16_t *x, int64_t decodes, int64_t hidden, float eps, const struct kvp_layer *layers,
                      int64_t count, int64_t heads, int64_t kv_heads, int64_t dim, int64_t inner, const uint16_t *cos,
                      const uint16_t *sin, const int64_t *slots, int64_t block_size, const int64_t *table,
                      int64_t max_blocks, const int64_t *seq_lens, float scale, int threads) {
    const int64_t width = (heads + 2 * kv_heads) * dim, q_size = heads * dim, kv_row = 2 * kv_heads * dim;
    uint16_t *scratch = malloc(sizeof(uint16_t) * (size_t)decodes * (hidden + width + 2 * q_size + 3 * inner));
    if (!scratch) return -1;
    uint16_t *normed = scratch, *qkv = normed + decodes * hidden, *q = qkv + decodes * width;
    uint16_t *attended = q + decodes * q_size, *gate_up = attended + decodes * q_size;
    uint16_t *activated = gate_up + decodes * 2 * inner, *sum = normed; /* a projection's output reuses normed */
    int status = 0;
    for (int64_t l = 0; l < count && !status; l++) {
        const struct kvp_layer *layer = layers + l;
        status = -2; /* what a projection's or rotary's refusal returns: shapes */
        kvp_rms_norm(x, layer->input_norm, decodes, hidden, eps, 1, normed, threads);
        if (kvp_int4_matmul(normed, decodes, hidden, layer->proj[0].packed, layer->proj[0].scales, width, qkv,
                            threads) ||
            kvp_rotary(qkv, decodes, heads + kv_heads, dim, width, cos, sin, threads))
            break;
        for (int64_t d = 0; d < decodes; d++) {
            memcpy(layer->cache + slots[d] * kv_row, qkv + d * width + q_size, sizeof(uint16_t) * (size_t)kv_row);
            memcpy(q + d * q_size, qkv + d * width, sizeof(uint16_t) * (size_t)q_size);
        }
        status = kvp_decode_attention(q, layer->cache, table, max_blocks, seq_lens, decodes, heads, kv_heads, dim,
                                      block_size, scale, 1, attended, threads);
        if (status) break;
        status = -2;
        if (kvp_int4_matmul(attended, decodes, q_size, layer->proj[1].packed, layer->proj[1].scales, hidden, sum,
                            threads))
            break;
        add_rows(x, sum, decodes * hidden);
        kvp_rms_norm(x, layer->post_norm, decodes, hidden, eps, 1, normed, threads);
        if (kvp_int4_matmul(normed, decodes, hidden, layer->proj[2].packed, layer->proj[2].scales, 2 * inner,
                            gate_up, threads))
            break;
        kvp_silu_mul(gate_up, decodes, inner, activated, threads);
        if (kvp_int4_matmul(activated, decodes, inner, layer->proj[3].packed, layer->proj[3].scales, hidden, sum,
                            threads))
            break;
        add_rows(x, sum, decodes * hidden);
        status = 0;
    }
    free(scratch);
    return status;
}
