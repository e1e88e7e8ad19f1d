/* The fused uint8 HWC -> normalised float image kernel's parameters, and its launcher in kernels/normalize.cu. */
#ifndef HOTLOOP_KERNELS_NORMALIZE_H
#define HOTLOOP_KERNELS_NORMALIZE_H

#include <stdint.h>

#include "tensor_table.h"

/* the launcher exists only where CUDA does (nvcc, or a C file of a CUDA build); the parameters
   serve the C reference of a CPU-only build too */
#if defined(__CUDACC__) || defined(HOTLOOP_WITH_CUDA)
#include <cuda_runtime_api.h>
#endif

/* the one definition: the kernel's shared-memory table, normalize.c's check and _C.NORMALIZE_MAX_CHANNELS */
#define HL_NORMALIZE_MAX_CHANNELS 16

#ifdef __cplusplus
extern "C" {
#endif

/* per-channel constants, passed by value */
typedef struct {
    float mean[HL_NORMALIZE_MAX_CHANNELS];
    float std[HL_NORMALIZE_MAX_CHANNELS];
} hl_normalize_params;

#if defined(__CUDACC__) || defined(HOTLOOP_WITH_CUDA)
/* dst = ((float)src - mean[c]) / std[c], rounded once to dst's dtype (HL_FLOAT32/16, HL_BFLOAT16).
   src: uint8 [n, h, w, c] contiguous. dst: [n, c, h, w] contiguous, or, when channels_last, the
   same [n, h, w, c] memory order as src. One kernel on `stream`. */
cudaError_t hl_launch_normalize(const uint8_t *src, void *dst, int dst_dtype, int64_t n, int64_t h, int64_t w,
                                int64_t c, int channels_last, hl_normalize_params params, cudaStream_t stream);
#endif

#ifdef __cplusplus
}
#endif

#endif
