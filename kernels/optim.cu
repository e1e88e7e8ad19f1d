/* Fused optimizer kernels over a table of parameter tensors: Adam, AdamW and SGD with the unscale x clip factor and the skip folded in. */
#include "optim.h"
#include "table.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

/* A block owns whole chunks (HL_CHUNK_ELEMS elements of one tensor), as kernels/amp.cu's passes do;
   the per-element maths is kernels/optim_math.h, shared with the C reference in csrc/optim.c, so the
   two do the same float operations. */

#define OPTIM_THREADS 512

/* element i of a gradient of dtype `dtype` (float32, float16, bfloat16) as float */
__device__ inline float grad_at(int dtype, uint64_t grad, int64_t i) {
    switch (dtype) {
    case HL_FLOAT32:
        return ((const float *)grad)[i];
    case HL_FLOAT16:
        return __half2float(((const __half *)grad)[i]);
    default:
        return __bfloat162float(((const __nv_bfloat16 *)grad)[i]);
    }
}

/* the entry that holds chunk `chunk`: the last one whose first_chunk <= chunk (empty tensors share
   their first_chunk with the next one, so "last" skips them) */
template <typename Entry> __device__ inline int64_t entry_of_chunk(const Entry *table, int64_t count, int64_t chunk) {
    int64_t lo = 0, hi = count - 1;
    while (lo < hi) {
        int64_t mid = (lo + hi + 1) / 2;
        if (table[mid].first_chunk <= chunk)
            lo = mid;
        else
            hi = mid - 1;
    }
    return lo;
}

__global__ void __launch_bounds__(OPTIM_THREADS)
    adam_kernel(const hl_adam_entry *table, int64_t count, int64_t total_chunks, hl_adam_hyper hyper,
                const float *lr_ptr, const float *grad_scale, const float *found_inf) {
    /* a skipped step reads no gradient and writes nothing: every block leaves at once */
    if (found_inf != NULL && *found_inf != 0.0f)
        return;
    const int has_scale = grad_scale != NULL;
    const float scale = has_scale ? *grad_scale : 1.0f;
    const double lr = lr_ptr != NULL ? (double)*lr_ptr : hyper.lr; /* read at run time: a graph replays it */
    /* this block's contiguous range of chunks [b*C/G, (b+1)*C/G) */
    const int64_t first = (int64_t)blockIdx.x * total_chunks / gridDim.x;
    const int64_t last = ((int64_t)blockIdx.x + 1) * total_chunks / gridDim.x;
    if (first >= last)
        return;
    int64_t t = entry_of_chunk(table, count, first);
    int64_t scalars_of = -1;
    hl_adam_scalars s;
    for (int64_t chunk = first; chunk < last; chunk++) {
        while (t + 1 < count && table[t + 1].first_chunk <= chunk)
            t++;
        const hl_adam_entry e = table[t];
        if (scalars_of != t) { /* the bias corrections once per tensor per block (double pow) */
            s = hl_adam_scalars_for(&hyper, lr, *(const float *)e.step);
            scalars_of = t;
        }
        const int64_t begin = (chunk - e.first_chunk) * (int64_t)HL_CHUNK_ELEMS;
        const int64_t end = min(begin + (int64_t)HL_CHUNK_ELEMS, e.numel);
        float *p = (float *)e.param, *m = (float *)e.exp_avg, *v = (float *)e.exp_avg_sq;
        float *vmax = (float *)e.max_exp_avg_sq;
        for (int64_t i = begin + threadIdx.x; i < end; i += OPTIM_THREADS)
            hl_adam_element(&s, grad_at(e.grad_dtype, e.grad, i), scale, has_scale, p + i, m + i, v + i, vmax != NULL ? vmax + i : NULL);
    }
}

__global__ void __launch_bounds__(OPTIM_THREADS)
    sgd_kernel(const hl_sgd_entry *table, int64_t count, int64_t total_chunks, hl_sgd_hyper hyper,
               const float *lr_ptr, const float *grad_scale, const float *found_inf) {
    if (found_inf != NULL && *found_inf != 0.0f)
        return; /* a skipped step reads no gradient and writes nothing */
    const int has_scale = grad_scale != NULL;
    const float scale = has_scale ? *grad_scale : 1.0f;
    const double lr = lr_ptr != NULL ? (double)*lr_ptr : hyper.lr;
    const int64_t first = (int64_t)blockIdx.x * total_chunks / gridDim.x;
    const int64_t last = ((int64_t)blockIdx.x + 1) * total_chunks / gridDim.x;
    if (first >= last)
        return;
    int64_t t = entry_of_chunk(table, count, first);
    for (int64_t chunk = first; chunk < last; chunk++) {
        while (t + 1 < count && table[t + 1].first_chunk <= chunk)
            t++;
        const hl_sgd_entry e = table[t];
        const int64_t begin = (chunk - e.first_chunk) * (int64_t)HL_CHUNK_ELEMS;
        const int64_t end = min(begin + (int64_t)HL_CHUNK_ELEMS, e.numel);
        float *p = (float *)e.param, *buf = (float *)e.momentum_buffer;
        for (int64_t i = begin + threadIdx.x; i < end; i += OPTIM_THREADS)
            hl_sgd_element(&hyper, lr, grad_at(e.grad_dtype, e.grad, i), scale, has_scale, p + i, buf != NULL ? buf + i : NULL);
    }
}

extern "C" cudaError_t hl_launch_sgd(const hl_sgd_entry *table, int64_t count, int64_t total_chunks,
                                     const hl_sgd_hyper *hyper, const float *lr, const float *grad_scale,
                                     const float *found_inf, int device, cudaStream_t stream) {
    if (count == 0 || total_chunks == 0)
        return cudaSuccess;
    int grid = hl_grid_for_chunks(total_chunks, device, 2);
    sgd_kernel<<<grid, OPTIM_THREADS, 0, stream>>>(table, count, total_chunks, *hyper, lr, grad_scale, found_inf);
    return cudaGetLastError();
}

/* after the update: every tensor's step count + 1, unless the step was skipped */
__global__ void adam_count_kernel(const hl_adam_entry *table, int64_t count, const float *found_inf) {
    if (found_inf != NULL && *found_inf != 0.0f)
        return;
    for (int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; t < count; t += (int64_t)gridDim.x * blockDim.x) {
        float *step = (float *)table[t].step;
        *step = *step + 1.0f;
    }
}

extern "C" cudaError_t hl_launch_adam(const hl_adam_entry *table, int64_t count, int64_t total_chunks,
                                      const hl_adam_hyper *hyper, const float *lr, const float *grad_scale,
                                      const float *found_inf, int device, cudaStream_t stream) {
    if (count == 0)
        return cudaSuccess;
    if (total_chunks > 0) {
        int grid = hl_grid_for_chunks(total_chunks, device, 2);
        adam_kernel<<<grid, OPTIM_THREADS, 0, stream>>>(table, count, total_chunks, *hyper, lr, grad_scale, found_inf);
        cudaError_t err = cudaGetLastError();
        if (err != cudaSuccess)
            return err;
    }
    const int threads = 256;
    const int64_t blocks = (count + threads - 1) / threads;
    adam_count_kernel<<<(unsigned)(blocks < 1024 ? blocks : 1024), threads, 0, stream>>>(table, count, found_inf);
    return cudaGetLastError();
}
