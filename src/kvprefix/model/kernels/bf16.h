/* bfloat16 <-> float32 for the kernels (each includes it): a bfloat16 is a float32's top 16 bits; rounding to it
 * is to nearest even, as PyTorch's conversion (NaN kept NaN). */
#ifndef KVP_BF16_H
#define KVP_BF16_H
#include <stdint.h>

static inline float bf16_to_float(uint16_t bits) {
    union { uint32_t u; float f; } v = {(uint32_t)bits << 16};
    return v.f;
}

static inline uint16_t float_to_bf16(float f) {
    union { float f; uint32_t u; } v = {f};
    if ((v.u & 0x7F800000u) == 0x7F800000u && (v.u & 0x7FFFFFu)) return (uint16_t)((v.u >> 16) | 0x40);
    return (uint16_t)((v.u + 0x7FFFu + ((v.u >> 16) & 1u)) >> 16);
}

/* f rounded to bfloat16, as float32 (what a tensor of the model's dtype holds after the step that made f). */
static inline float bf16_round(float f) { return bf16_to_float(float_to_bf16(f)); }

/* Element i of a bfloat16 (bf16) or float32 array, as float32. */
static inline float load_element(const void *p, int bf16, int64_t i) {
    return bf16 ? bf16_to_float(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}
#endif
