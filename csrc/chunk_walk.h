/* Finding a table's entries by chunk (kernels/tensor_table.h's cut), for the C reference's passes in csrc/amp_cpu.c and csrc/optim_cpu.c. */
#ifndef HOTLOOP_CHUNK_WALK_H
#define HOTLOOP_CHUNK_WALK_H

#include <stdint.h>

#include "tensor_table.h"

/* `t` becomes the entry of `table` (`count` entries, each with a first_chunk) that holds `chunk`: the
   last one from `t` on whose first_chunk <= chunk, so an empty entry, which shares the next one's first
   chunk, is skipped. Searched by halving from `t`: start at 0, and a walk over increasing chunks may
   keep `t` from one to the next. */
#define HL_ENTRY_OF_CHUNK(table, count, t, chunk)                                                                \
    do {                                                                                                        \
        int64_t lo_ = (t), hi_ = (count) - 1;                                                                   \
        while (lo_ < hi_) {                                                                                     \
            const int64_t mid_ = lo_ + (hi_ - lo_ + 1) / 2;                                                     \
            if ((table)[mid_].first_chunk <= (chunk))                                                           \
                lo_ = mid_;                                                                                     \
            else                                                                                                \
                hi_ = mid_ - 1;                                                                                 \
        }                                                                                                       \
        (t) = lo_;                                                                                              \
    } while (0)

/* the elements [*begin, *end) of `chunk` in the entry that holds it */
static inline void hl_chunk_elems(int64_t numel, int64_t first_chunk, int64_t chunk, int64_t *begin, int64_t *end) {
    *begin = (chunk - first_chunk) * (int64_t)HL_CHUNK_ELEMS;
    *end = *begin + HL_CHUNK_ELEMS < numel ? *begin + HL_CHUNK_ELEMS : numel;
}

#endif
