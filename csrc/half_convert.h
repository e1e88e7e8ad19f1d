/* IEEE half and bfloat16 to and from float in plain C, for the C reference kernels (amp.c, normalize.c). */
#ifndef HOTLOOP_HALF_CONVERT_H
#define HOTLOOP_HALF_CONVERT_H

#include <stdint.h>
#include <string.h>

/* Integer arithmetic only: the results do not depend on the floating-point environment, and they
   are bit for bit those of CUDA's __float2half_rn / __float2bfloat16_rn for every non-NaN float. */

static inline float hl_bits_to_float(uint32_t b) {
    float f;
    memcpy(&f, &b, sizeof(f));
    return f;
}

static inline uint32_t hl_float_to_bits(float f) {
    uint32_t b;
    memcpy(&b, &f, sizeof(b));
    return b;
}

static inline float hl_half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    if (exp == 0) {
        if (man == 0)
            return hl_bits_to_float(sign);
        int shifts = 0; /* a subnormal: normalise it */
        while (!(man & 0x400u)) {
            man <<= 1;
            shifts++;
        }
        return hl_bits_to_float(sign | ((uint32_t)(113 - shifts) << 23) | ((man & 0x3ffu) << 13));
    }
    if (exp == 31)
        return hl_bits_to_float(sign | 0x7f800000u | (man << 13));
    return hl_bits_to_float(sign | ((exp + 112) << 23) | (man << 13));
}

/* round to nearest even, as __float2half_rn and torch's .half(); a NaN becomes the quiet NaN 0x7e00
   with its sign */
static inline uint16_t hl_float_to_half(float f) {
    uint32_t x = hl_float_to_bits(f), sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
    if (ax > 0x7f800000u)
        return (uint16_t)(sign | 0x7e00u); /* NaN */
    if (ax >= 0x477ff000u)
        return (uint16_t)(sign | 0x7c00u); /* 65520 and up round to inf */
    if (ax < 0x38800000u) {                /* below 2^-14: a subnormal half or zero */
        if (ax <= 0x33000000u)
            return (uint16_t)sign; /* up to 2^-25 (a tie, to even) rounds to zero */
        uint32_t e = ax >> 23, m = (ax & 0x7fffffu) | 0x800000u, shift = 126 - e;
        uint32_t r = m >> shift, rem = m & ((1u << shift) - 1), halfway = 1u << (shift - 1);
        if (rem > halfway || (rem == halfway && (r & 1u)))
            r++;
        return (uint16_t)(sign | r);
    }
    uint32_t r = ax + 0xfffu + ((ax >> 13) & 1u);
    return (uint16_t)(sign | ((r - (112u << 23)) >> 13));
}

static inline float hl_bf16_to_float(uint16_t h) { return hl_bits_to_float((uint32_t)h << 16); }

/* round to nearest even; a NaN stays NaN (quieted, its sign and top payload bits kept) */
static inline uint16_t hl_float_to_bf16(float f) {
    uint32_t x = hl_float_to_bits(f);
    if ((x & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((x >> 16) | 0x40u);
    return (uint16_t)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

#endif
