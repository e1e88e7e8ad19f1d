/* The tensor table as kernels and C read it: dtype codes, the chunking rule and one entry per tensor. */
#ifndef HOTLOOP_TENSOR_TABLE_H
#define HOTLOOP_TENSOR_TABLE_H

#include "rtc_prelude.h"

/* dtype codes shared with python/hotloop/amp/tensor_table.py (exported as _C.DTYPE_CODES, keyed by
   torch's dtype name, with _C.DTYPE_UNKNOWN and _C.FLOATING_DTYPE_MASK); kernels take the first three */
enum hl_dtype {
    HL_DTYPE_UNKNOWN = -1, /* one C does not know (Python packs it for such a tensor): a TypeError */
    HL_FLOAT32 = 0,
    HL_FLOAT16 = 1,
    HL_BFLOAT16 = 2,
    HL_UINT8 = 3,
    HL_INT32 = 4,
    HL_INT64 = 5,
    HL_FLOAT64 = 6, /* known so that errors can name it; no kernel takes it */
    HL_INT8 = 7,
    HL_INT16 = 8,
    HL_BOOL = 9,
    HL_COMPLEX64 = 10,
    HL_COMPLEX128 = 11,
    HL_DTYPE_COUNT = 12,
};

#define HL_DTYPE_BIT(code) (1u << (code))
#define HL_FLOATING_MASK (HL_DTYPE_BIT(HL_FLOAT32) | HL_DTYPE_BIT(HL_FLOAT16) | HL_DTYPE_BIT(HL_BFLOAT16))

/* Kernels cut every tensor into chunks of this many elements, and chunk c of the whole table
   belongs to the last entry whose first_chunk <= c. A fixed cut (not one that depends on the grid)
   keeps per-chunk partial results, and so reductions, identical from run to run. */
#define HL_CHUNK_ELEMS 32768

typedef struct {
    uint64_t data;       /* address of element 0 */
    int64_t numel;       /* elements, >= 0 */
    int64_t first_chunk; /* this tensor's first chunk among all chunks of the table */
    int32_t dtype;       /* enum hl_dtype */
    int32_t device;      /* CUDA device index, -1 for host memory */
} hl_table_entry;

#ifndef __CUDACC_RTC__ /* the C side packs tables; NVRTC refuses a host function */
static inline int64_t hl_chunks_of(int64_t numel) { return (numel + HL_CHUNK_ELEMS - 1) / HL_CHUNK_ELEMS; }
#endif

#endif
