/* float16 and bfloat16 on the device without cuda_fp16.h or cuda_bf16.h: 16-bit storage types and the conversions those headers make, bit for bit. */
#ifndef HOTLOOP_HALF_CUH
#define HOTLOOP_HALF_CUH

#include "rtc_prelude.h"

/* One stored value, laid out as __half and __nv_bfloat16 are (2 bytes, 2-byte aligned). The kernels
   only load, convert and store such values, so the types carry no arithmetic. */
struct hl_half {
    uint16_t bits;
};

struct hl_bfloat16 {
    uint16_t bits;
};

/* __half2float and __float2half_rn are these two PTX conversions on every arch (round to nearest
   even, subnormals kept) */
__device__ inline float hl_half2float(hl_half h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h.bits));
    return f;
}

__device__ inline hl_half hl_float2half_rn(float f) {
    hl_half h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h.bits) : "f"(f));
    return h;
}

/* bfloat16 is the upper half of a float32: widening is a shift, exact for every value (the same bits
   as cvt.f32.bf16, which cuda_bf16.h takes on sm_90) */
__device__ inline float hl_bfloat162float(hl_bfloat16 b) { return __uint_as_float((uint32_t)b.bits << 16); }

/* float32 to bfloat16 in integer arithmetic: round to nearest even on the bits, which also rounds past
   the largest finite value to inf and keeps subnormals; a NaN becomes the quiet NaN 0x7fff. This is
   cuda_bf16.h's own path where the hardware has no bf16 cvt (sm_75), and it gives the bits of
   cvt.rn.bf16.f32 for every one of the 2^32 floats, NaNs included. */
__device__ inline uint16_t hl_bfloat16_bits_rn(uint32_t x) {
    if ((x & 0x7fffffffu) > 0x7f800000u)
        return 0x7fffu;
    return (uint16_t)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

/* __float2bfloat16_rn: the one cvt instruction from sm_80 on, as cuda_bf16.h takes it (the integer
   version is six instructions, and the apply and check passes convert up to three times an element:
   enough to slow them below the memory's pace), the integer version before */
__device__ inline hl_bfloat16 hl_float2bfloat16_rn(float f) {
    hl_bfloat16 b;
#if __CUDA_ARCH__ >= 800
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(b.bits) : "f"(f));
#else
    b.bits = hl_bfloat16_bits_rn(__float_as_uint(f));
#endif
    return b;
}

#endif
