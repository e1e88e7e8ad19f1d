/* Fused image normalise: uint8 HWC batches to float32/float16/bfloat16 NCHW or channels_last in one pass. */
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "normalize.h"

#define THREADS 256

/* the same two IEEE operations as torch's x.float().sub(mean).div(std): no reciprocal, no FMA */
__device__ inline float normalize_one(uint8_t v, float mean, float std) { return __fdiv_rn(__fsub_rn((float)v, mean), std); }

__device__ inline void store(void *dst, size_t i, float x, int dtype) {
    if (dtype == HL_FLOAT16)
        ((__half *)dst)[i] = __float2half_rn(x);
    else if (dtype == HL_BFLOAT16)
        ((__nv_bfloat16 *)dst)[i] = __float2bfloat16_rn(x);
    else
        ((float *)dst)[i] = x;
}

/* channels_last: output memory order equals the input's, so element i maps to element i */
__global__ void normalize_nhwc_kernel(const uint8_t *src, void *dst, int dtype, size_t total, int c,
                                      hl_normalize_params p) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (size_t)gridDim.x * blockDim.x) {
        int ch = (int)(i % (size_t)c);
        store(dst, i, normalize_one(src[i], p.mean[ch], p.std[ch]), dtype);
    }
}

/* NCHW: each thread writes consecutive outputs (coalesced stores) and gathers its input byte */
__global__ void normalize_nchw_kernel(const uint8_t *src, void *dst, int dtype, size_t total, size_t hw, int c,
                                      hl_normalize_params p) {
    for (size_t o = (size_t)blockIdx.x * blockDim.x + threadIdx.x; o < total; o += (size_t)gridDim.x * blockDim.x) {
        size_t pixel = o % hw;
        size_t plane = o / hw; /* n * c + ch */
        int ch = (int)(plane % (size_t)c);
        size_t n = plane / (size_t)c;
        size_t in = (n * hw + pixel) * (size_t)c + (size_t)ch;
        store(dst, o, normalize_one(src[in], p.mean[ch], p.std[ch]), dtype);
    }
}

extern "C" cudaError_t hl_launch_normalize(const uint8_t *src, void *dst, int dst_dtype, int64_t n, int64_t h,
                                           int64_t w, int64_t c, int channels_last, hl_normalize_params params,
                                           cudaStream_t stream) {
    size_t total = (size_t)n * (size_t)h * (size_t)w * (size_t)c;
    if (total == 0)
        return cudaSuccess;
    size_t blocks = (total + THREADS - 1) / THREADS;
    int grid = (int)(blocks < 65535u * 16u ? blocks : 65535u * 16u);
    if (channels_last)
        normalize_nhwc_kernel<<<grid, THREADS, 0, stream>>>(src, dst, dst_dtype, total, (int)c, params);
    else
        normalize_nchw_kernel<<<grid, THREADS, 0, stream>>>(src, dst, dst_dtype, total, (size_t)h * (size_t)w,
                                                            (int)c, params);
    return cudaGetLastError();
}
