/* Launchers of the mixed-precision kernels in kernels/amp.cu, callable from C. */
#ifndef HOTLOOP_KERNELS_AMP_H
#define HOTLOOP_KERNELS_AMP_H

#include <cuda_runtime_api.h>

#include "tensor_table.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Sets found[0] = 1.0f if any element of any tensor in `table` (device memory, `count` entries of
   float32, float16 or bfloat16, `total_chunks` chunks in all) is inf or NaN. Never clears it, so
   one flag can gather several calls. Launches one kernel on `stream` of `device`. */
cudaError_t hl_launch_non_finite_check(const hl_table_entry *table, int64_t count, int64_t total_chunks,
                                       float *found, int device, cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif
