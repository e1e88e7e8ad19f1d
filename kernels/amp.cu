/* Mixed-precision kernels over a tensor table: the non-finite check (the GradScaler's kernels build on it). */
#include "amp.h"
#include "table.cuh"

#define THREADS 256

/* inf or NaN: every exponent bit set, read straight from the bits so any float width works */
__device__ inline bool non_finite_bits(uint32_t bits, int dtype) {
    switch (dtype) {
    case HL_FLOAT32:
        return (bits & 0x7f800000u) == 0x7f800000u;
    case HL_FLOAT16:
        return (bits & 0x7c00u) == 0x7c00u;
    default: /* HL_BFLOAT16 */
        return (bits & 0x7f80u) == 0x7f80u;
    }
}

/* 16 bytes (4 float32 or 8 half-width values) at once */
__device__ inline bool non_finite_vec(uint4 v, int dtype) {
    uint32_t w[4] = {v.x, v.y, v.z, v.w};
    bool bad = false;
#pragma unroll
    for (int k = 0; k < 4; k++) {
        if (dtype == HL_FLOAT32)
            bad |= non_finite_bits(w[k], dtype);
        else
            bad |= non_finite_bits(w[k] & 0xffffu, dtype) | non_finite_bits(w[k] >> 16, dtype);
    }
    return bad;
}

__device__ inline uint32_t element_bits(const char *base, int64_t i, int dtype) {
    if (dtype == HL_FLOAT32)
        return ((const uint32_t *)base)[i];
    return ((const uint16_t *)base)[i];
}

/* does chunk [begin, end) of one tensor hold an inf or NaN? (this thread's share of it) */
__device__ bool chunk_has_non_finite(const hl_table_entry &e, int64_t begin, int64_t end) {
    const char *base = (const char *)e.data;
    const int elem = e.dtype == HL_FLOAT32 ? 4 : 2;
    const int per_vec = 16 / elem;
    bool bad = false;
    int64_t i = begin;
    if (((uintptr_t)base & 15) == 0) {
        /* chunks start at multiples of HL_CHUNK_ELEMS, so an aligned tensor gives aligned chunks */
        const uint4 *vec = (const uint4 *)(base + begin * elem);
        int64_t nvec = (end - begin) / per_vec;
        for (int64_t v = threadIdx.x; v < nvec; v += blockDim.x)
            bad |= non_finite_vec(__ldg(vec + v), e.dtype);
        i = begin + nvec * per_vec;
    }
    for (int64_t j = i + threadIdx.x; j < end; j += blockDim.x)
        bad |= non_finite_bits(element_bits(base, j, e.dtype), e.dtype);
    return bad;
}

__global__ void non_finite_check_kernel(const hl_table_entry *table, int64_t count, int64_t total_chunks,
                                        float *found) {
    bool bad = false;
    for (int64_t chunk = blockIdx.x; chunk < total_chunks; chunk += gridDim.x) {
        hl_table_entry e = table[hl_entry_of_chunk(table, count, chunk)];
        int64_t begin, end;
        hl_chunk_range(e, chunk, &begin, &end);
        bad |= chunk_has_non_finite(e, begin, end);
    }
    /* every writer writes the same 1.0, so a plain racing store is enough */
    if (__syncthreads_or(bad) && threadIdx.x == 0)
        *found = 1.0f;
}

extern "C" cudaError_t hl_launch_non_finite_check(const hl_table_entry *table, int64_t count, int64_t total_chunks,
                                                  float *found, int device, cudaStream_t stream) {
    if (total_chunks == 0)
        return cudaSuccess;
    int grid = hl_grid_for_chunks(total_chunks, device, 8);
    non_finite_check_kernel<<<grid, THREADS, 0, stream>>>(table, count, total_chunks, found);
    return cudaGetLastError();
}
