/* The GradScaler's passes over CPU tensors: vectorisable loops, spread over threads by whole chunks. */
#ifndef HOTLOOP_AMP_CPU_H
#define HOTLOOP_AMP_CPU_H

#include <stdint.h>

#include "tensor_table.h"

/* Does any element of any entry hold an inf or NaN? `threads` <= 0: as many as the CPUs this process
   may run on (a few chunks per thread at least, whatever is asked). */
int hl_cpu_has_non_finite(const hl_table_entry *table, int64_t count, int64_t total_chunks, int threads);

/* The check pass of kernels/amp.cu on the CPU: per chunk, the values times `inv` rounded to the
   gradient's dtype (stored back with `write`), their norm accumulator in double and their found flag,
   written to partials[2 * chunk] and partials[2 * chunk + 1]. Each chunk is added in one fixed order
   whatever the thread count, so the partials, and what is reduced from them, are the same every run. */
void hl_cpu_amp_check(const hl_table_entry *table, int64_t count, int64_t total_chunks, float *partials, float inv,
                      int write, int mode, float p, int threads);

/* The apply pass: every element times `inv` (with `unscale`) then times `coef` (with `clip`), rounded
   to the gradient's dtype after each, in place. */
void hl_cpu_amp_apply(const hl_table_entry *table, int64_t count, int64_t total_chunks, float inv, float coef,
                      int unscale, int clip, int threads);

#endif
