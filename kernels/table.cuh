/* Device-side helpers for walking a tensor table chunk by chunk. */
#ifndef HOTLOOP_TABLE_CUH
#define HOTLOOP_TABLE_CUH

#include <cuda_runtime.h>

#include "tensor_table.h"

/* the entry that holds chunk `chunk`: the last one whose first_chunk <= chunk (empty tensors
   share their first_chunk with the next tensor, so "last" skips them); any entry type with a
   first_chunk (the scaler's hl_table_entry, the optimizers' entries) */
template <typename Entry> __device__ inline int64_t hl_entry_of_chunk(const Entry *table, int64_t count, int64_t chunk) {
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

/* the element range [begin, end) of chunk `chunk` within its entry */
__device__ inline void hl_chunk_range(const hl_table_entry &e, int64_t chunk, int64_t *begin, int64_t *end) {
    *begin = (chunk - e.first_chunk) * (int64_t)HL_CHUNK_ELEMS;
    *end = min(*begin + (int64_t)HL_CHUNK_ELEMS, e.numel);
}

/* blocks for a grid-stride walk over `chunks` chunks: enough to fill every multiprocessor */
int hl_grid_for_chunks(int64_t chunks, int device, int blocks_per_sm);

#endif
