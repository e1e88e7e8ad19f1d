/* Launcher of kernels/normalize.cu: picks the channels_last vector kernel where the buffers allow it, else the gather kernel. */
#include "launch.h"

#include "kernels.h"

#ifdef HOTLOOP_WITH_CUDA

#define THREADS 256
#define MAX_BLOCKS 1024 /* a few waves on any GPU: each block builds its table once, then loops */

static unsigned blocks_for(size_t work) {
    size_t blocks = (work + THREADS - 1) / THREADS;
    return (unsigned)(blocks < MAX_BLOCKS ? blocks : MAX_BLOCKS);
}

CUresult hl_launch_normalize(const uint8_t *src, void *dst, int dst_dtype, int64_t n, int64_t h, int64_t w, int64_t c,
                             int channels_last, hl_normalize_params params, int device, CUstream stream) {
    size_t total = (size_t)n * (size_t)h * (size_t)w * (size_t)c;
    if (total == 0)
        return CUDA_SUCCESS;
    int channels = (int)c;
    /* the vector kernel maps element i to element i: channels_last only, src on a vector boundary and
       dst on the boundary of that vector's outputs */
    size_t out_vec_bytes = (size_t)HL_NORMALIZE_VEC * (dst_dtype == HL_FLOAT32 ? 4 : 2);
    if (channels_last && (uintptr_t)src % HL_NORMALIZE_VEC == 0 && (uintptr_t)dst % out_vec_bytes == 0) {
        void *args[] = {&src, &dst, &dst_dtype, &total, &channels, &params};
        return hl_kernel_launch(device, HL_KERNEL_NORMALIZE_NHWC_VECTOR, blocks_for(total / HL_NORMALIZE_VEC + 1),
                                THREADS, 0, stream, args);
    }
    size_t hw = (size_t)h * (size_t)w;
    void *args[] = {&src, &dst, &dst_dtype, &total, &hw, &channels, &channels_last, &params};
    return hl_kernel_launch(device, HL_KERNEL_NORMALIZE_GATHER, blocks_for(total), THREADS, 0, stream, args);
}

#endif
