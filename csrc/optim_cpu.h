/* The fused optimizers' C reference on host memory (csrc/optim_cpu.c), called by csrc/optim.c. */
#ifndef HOTLOOP_OPTIM_CPU_H
#define HOTLOOP_OPTIM_CPU_H

#include "optim_math.h"

/* One Adam/AdamW step over `count` entries (`total_chunks` chunks of HL_CHUNK_ELEMS elements), then
   every step count + 1; nothing at all when *found_inf != 0. lr_ptr, grad_scale, found_inf: NULL or one
   float each. Up to `threads` threads (the caller's included). Runs without the GIL. */
void hl_cpu_adam(const hl_adam_entry *table, int64_t count, int64_t total_chunks, const hl_adam_hyper *hyper,
                 const float *lr_ptr, const float *grad_scale, const float *found_inf, int threads);

/* One SGD step, as hl_cpu_adam's */
void hl_cpu_sgd(const hl_sgd_entry *table, int64_t count, int64_t total_chunks, const hl_sgd_hyper *hyper,
                const float *lr_ptr, const float *grad_scale, const float *found_inf, int threads);

#endif
