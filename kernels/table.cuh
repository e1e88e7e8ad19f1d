/* Device-side helpers for walking a tensor table chunk by chunk. */
#ifndef HOTLOOP_TABLE_CUH
#define HOTLOOP_TABLE_CUH

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

/* body(entry, chunk, begin, end) for every chunk of this block's contiguous range [b*C/G, (b+1)*C/G)
   of the table's chunks, [begin, end) being the chunk's elements in its entry; the entry is found
   once and then followed. Any entry type with first_chunk and numel. */
template <typename Entry, typename Body>
__device__ __forceinline__ void hl_for_each_chunk(const Entry *table, int64_t count, int64_t total_chunks, Body body) {
    const int64_t first = (int64_t)blockIdx.x * total_chunks / gridDim.x;
    const int64_t last = ((int64_t)blockIdx.x + 1) * total_chunks / gridDim.x;
    if (first >= last)
        return;
    int64_t t = hl_entry_of_chunk(table, count, first);
    for (int64_t chunk = first; chunk < last; chunk++) {
        while (t + 1 < count && table[t + 1].first_chunk <= chunk)
            t++;
        const Entry e = table[t];
        const int64_t begin = (chunk - e.first_chunk) * (int64_t)HL_CHUNK_ELEMS;
        body(e, chunk, begin, min(begin + (int64_t)HL_CHUNK_ELEMS, e.numel));
    }
}

#endif
