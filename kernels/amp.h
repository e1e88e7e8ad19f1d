/* Launchers of the mixed-precision kernels in kernels/amp.cu (non-finite check, GradScaler passes), callable from C. */
#ifndef HOTLOOP_KERNELS_AMP_H
#define HOTLOOP_KERNELS_AMP_H

#include <cuda_runtime_api.h>

#include "amp_layout.h"
#include "tensor_table.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Sets found[0] = 1.0f if any element of any tensor in `table` (device memory, `count` entries of
   float32, float16 or bfloat16, `total_chunks` chunks in all) is inf or NaN. Never clears it, so
   one flag can gather several calls. Launches one kernel on `stream` of `device`. */
cudaError_t hl_launch_non_finite_check(const hl_table_entry *table, int64_t count, int64_t total_chunks,
                                       float *found, int device, cudaStream_t stream);

/* The GradScaler's check: one pass over every chunk of `table` that writes partials[chunk] =
   {norm partial of the unscaled values, 1 if a value is non-finite}, then the one-block epilogue
   that reduces the partials in a fixed order and writes aux[HL_AUX_*] (and the overflow report).
   `write` = 0: read-only scan; 1: also store the unscaled values (unscale_), mode must be NONE.
   `scale` (device float, may be NULL: values are already unscaled) divides every value.
   `max_norm` < 0: no clipping (coefficient 1). `blocks` > 0 forces the grid (tests of determinism).
   `param_index` (count int32, may be NULL) and `report` (HL_REPORT_LEN int64, may be NULL) receive
   the first non-finite parameter when one is found. `extra` (n_extra * HL_EXTRA_LEN device floats,
   may be NULL) are partials of gradients outside the table, folded in after its chunks; with
   count = 0 (table NULL, no chunks) the epilogue runs on them alone. */
cudaError_t hl_launch_amp_check(const hl_table_entry *table, int64_t count, int64_t total_chunks, float *partials,
                                const float *scale, int write, int mode, float p, float max_norm, float *aux,
                                const int32_t *param_index, int64_t *report, int64_t step, const float *extra,
                                int n_extra, int blocks, int device, cudaStream_t stream);

/* Multiply every gradient by aux's inverse scale (when `unscale`) and then by its clip coefficient
   (when `clip`), rounding to the gradient's dtype after each, as torch's unscale_ then clip do.
   Writes nothing when aux[HL_AUX_FOUND] != 0. */
cudaError_t hl_launch_amp_apply(const hl_table_entry *table, int64_t count, int64_t total_chunks, const float *aux,
                                int unscale, int clip, int device, cudaStream_t stream);

/* One thread: the scale update of torch._amp_update_scale_, plus hysteresis, min/max scale and the
   skipped-step counter (state[HL_STATE_*]). found[0..n) are summed as torch sums them. */
cudaError_t hl_launch_amp_update(float *scale, int32_t *growth_tracker, int64_t *state, const hl_found_list *found,
                                 double growth_factor, double backoff_factor, int64_t growth_interval,
                                 int64_t hysteresis, float min_scale, float max_scale, int adjust,
                                 cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif
