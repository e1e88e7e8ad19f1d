/* Fused image normalise: uint8 HWC batches to float32/float16/bfloat16 NCHW or channels_last in one pass. */
#include "half.cuh"
#include "normalize.h"

/* The grid is chosen in csrc/launch_normalize.c, which also picks between the two entry points. */
#define VEC HL_NORMALIZE_VEC /* input bytes per vector load */

/* the same two IEEE operations as torch's x.float().sub(mean).div(std): no reciprocal, no FMA */
__device__ inline float normalize_one(uint8_t v, float mean, float std) { return __fdiv_rn(__fsub_rn((float)v, mean), std); }

__device__ inline uint32_t out_bits(float x, int dtype) {
    if (dtype == HL_FLOAT16)
        return hl_float2half_rn(x).bits;
    if (dtype == HL_BFLOAT16)
        return hl_float2bfloat16_rn(x).bits;
    return __float_as_uint(x);
}

__device__ inline void store_bits(void *dst, size_t i, uint32_t bits, int dtype) {
    if (dtype == HL_FLOAT32)
        ((uint32_t *)dst)[i] = bits;
    else
        ((uint16_t *)dst)[i] = (uint16_t)bits;
}

/* A uint8 input has 256 values per channel: every output is one of c * 256 results, computed once
   per block with the exact per-element arithmetic and looked up after, so the loop over the batch
   is pure memory traffic instead of an IEEE division per element (which made the kernel slow enough
   to slow a training step running beside it). */
__device__ inline void fill_table(uint32_t *table, int c, int dtype, const hl_normalize_params &p) {
    for (int k = threadIdx.x; k < c * 256; k += blockDim.x)
        table[k] = out_bits(normalize_one((uint8_t)(k & 255), p.mean[k >> 8], p.std[k >> 8]), dtype);
    __syncthreads();
}

/* channels_last, src 16-byte and dst 32/64-byte aligned: element i maps to element i; 16 inputs per
   load, their outputs written as whole 16-byte stores; the tail after the last full vector by scalars */
extern "C" __global__ void hl_normalize_nhwc_vector(const uint8_t *src, void *dst, int dtype, size_t total, int c,
                                                    hl_normalize_params p) {
    __shared__ uint32_t table[HL_NORMALIZE_MAX_CHANNELS * 256];
    fill_table(table, c, dtype, p);
    size_t nvec = total / VEC;
    size_t stride = (size_t)gridDim.x * blockDim.x;
    size_t first = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    for (size_t v = first; v < nvec; v += stride) {
        uint4 in = ((const uint4 *)src)[v];
        const uint8_t *b = (const uint8_t *)&in;
        int ch = (int)((v * VEC) % (size_t)c);
        uint32_t w[VEC];
        for (int k = 0; k < VEC; k++) {
            w[k] = table[(ch << 8) | b[k]];
            ch = ch + 1 == c ? 0 : ch + 1;
        }
        if (dtype == HL_FLOAT32) {
            uint4 *o = (uint4 *)dst + v * 4;
            for (int q = 0; q < 4; q++)
                o[q] = make_uint4(w[4 * q], w[4 * q + 1], w[4 * q + 2], w[4 * q + 3]);
        } else {
            uint4 *o = (uint4 *)dst + v * 2;
            o[0] = make_uint4(w[0] | w[1] << 16, w[2] | w[3] << 16, w[4] | w[5] << 16, w[6] | w[7] << 16);
            o[1] = make_uint4(w[8] | w[9] << 16, w[10] | w[11] << 16, w[12] | w[13] << 16, w[14] | w[15] << 16);
        }
    }
    for (size_t i = nvec * VEC + first; i < total; i += stride)
        store_bits(dst, i, table[(int)(i % (size_t)c) << 8 | src[i]], dtype);
}

/* any alignment, either layout: one output per thread step; NCHW writes consecutive outputs
   (coalesced stores) and gathers each one's input byte */
extern "C" __global__ void hl_normalize_gather(const uint8_t *src, void *dst, int dtype, size_t total, size_t hw, int c,
                                               int channels_last, hl_normalize_params p) {
    __shared__ uint32_t table[HL_NORMALIZE_MAX_CHANNELS * 256];
    fill_table(table, c, dtype, p);
    for (size_t o = (size_t)blockIdx.x * blockDim.x + threadIdx.x; o < total; o += (size_t)gridDim.x * blockDim.x) {
        size_t in = o;
        int ch;
        if (channels_last) {
            ch = (int)(o % (size_t)c);
        } else {
            size_t pixel = o % hw;
            size_t plane = o / hw; /* n * c + ch */
            ch = (int)(plane % (size_t)c);
            in = (plane / (size_t)c * hw + pixel) * (size_t)c + (size_t)ch;
        }
        store_bits(dst, o, table[ch << 8 | src[in]], dtype);
    }
}
