/* Launchers of the fused optimizer kernels in kernels/optim.cu, callable from C. */
#ifndef HOTLOOP_KERNELS_OPTIM_H
#define HOTLOOP_KERNELS_OPTIM_H

#include <cuda_runtime_api.h>

#include "optim_math.h"
#include "tensor_table.h"

#ifdef __cplusplus
extern "C" {
#endif

/* One Adam/AdamW step over every tensor of `table` (device memory, `count` entries, `total_chunks`
   chunks in all): each gradient divided by *grad_scale (NULL: by nothing), read once and never
   written; nothing at all changes when *found_inf != 0 (NULL: never skipped); the learning rate is *lr
   (a float32 on the device, read when the kernel runs) or, when lr is NULL, hyper->lr. Two kernels on
   `stream`: the update, which takes each tensor's step as *step + 1, then one that adds 1 to the
   step counts (unless skipped), so no block reads a count another has already moved. Everything is
   read on the device and nothing is copied from the host: the launch can be captured in a graph. */
cudaError_t hl_launch_adam(const hl_adam_entry *table, int64_t count, int64_t total_chunks, const hl_adam_hyper *hyper,
                           const float *lr, const float *grad_scale, const float *found_inf, int device,
                           cudaStream_t stream);

/* One SGD step (momentum, dampening, nesterov, weight decay, maximize) over every tensor of `table`,
   with lr, grad_scale and found_inf as hl_launch_adam takes them. One kernel on `stream`. */
cudaError_t hl_launch_sgd(const hl_sgd_entry *table, int64_t count, int64_t total_chunks, const hl_sgd_hyper *hyper,
                          const float *lr, const float *grad_scale, const float *found_inf, int device,
                          cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif
