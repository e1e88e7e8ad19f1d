/* The host half of every kernel: grid choice and launch of the entry points of kernels/<source>.cu, for the bindings in amp.c, optim.c, normalize.c and image_resize.c. */
#ifndef HOTLOOP_LAUNCH_H
#define HOTLOOP_LAUNCH_H

#include "amp_layout.h"
#include "cuda_driver.h"
#include "image_resize.h"
#include "normalize.h"
#include "optim_math.h"
#include "tensor_table.h"

/* Every launcher enqueues on `stream` of `device` (whose context is current: the caller runs inside
   hl_cuda_run or hl_device_enter) through hl_kernel_launch, so the kernels' source must have passed
   hl_kernels_require for `device`. Each returns the first failing launch's CUresult (CUDA_SUCCESS
   also when there was nothing to do); none waits for the device. Safe without the GIL. */

/* ---- launch_amp.c: kernels/amp.cu ---- */

/* Sets found[0] = 1.0f if any element of any tensor in `table` (device memory, `count` entries of
   float32, float16 or bfloat16, `total_chunks` chunks in all) is inf or NaN. Never clears it, so
   one flag can gather several calls. One kernel. */
CUresult hl_launch_non_finite_check(const hl_table_entry *table, int64_t count, int64_t total_chunks, float *found,
                                    int device, CUstream stream);

/* The GradScaler's check: one pass over every chunk of `table` that writes partials[chunk] =
   {norm partial of the unscaled values, 1 if a value is non-finite}, then the one-block epilogue
   that reduces the partials in a fixed order and writes aux[HL_AUX_*] (and the overflow report).
   `write` = 0: read-only scan; 1: also store the unscaled values (unscale_), mode must be NONE.
   `scale` (device float, may be NULL: values are already unscaled) divides every value.
   `max_norm` < 0: no clipping (coefficient 1). `blocks` > 0 forces the grid (tests of determinism).
   `param_index` (count int32, may be NULL) and `report` (HL_REPORT_LEN int64, may be NULL) receive
   the first non-finite parameter when one is found. `extra` (n_extra * HL_EXTRA_LEN device floats,
   may be NULL) are partials of gradients outside the table, folded in after its chunks; with
   count = 0 (table NULL, no chunks) the epilogue runs on them alone. Two kernels, in that order. */
CUresult hl_launch_amp_check(const hl_table_entry *table, int64_t count, int64_t total_chunks, float *partials,
                             const float *scale, int write, int mode, float p, float max_norm, float *aux,
                             const int32_t *param_index, int64_t *report, int64_t step, const float *extra,
                             int n_extra, int blocks, int device, CUstream stream);

/* Multiply every gradient by aux's inverse scale (when `unscale`) and then by its clip coefficient
   (when `clip`), rounding to the gradient's dtype after each, as torch's unscale_ then clip do.
   Writes nothing when aux[HL_AUX_FOUND] != 0. One kernel, none when neither is asked. */
CUresult hl_launch_amp_apply(const hl_table_entry *table, int64_t count, int64_t total_chunks, const float *aux,
                             int unscale, int clip, int device, CUstream stream);

/* One thread: the scale update of torch._amp_update_scale_, plus hysteresis, min/max scale and the
   skipped-step counter (state[HL_STATE_*]). found[0..n) are summed as torch sums them. */
CUresult hl_launch_amp_update(float *scale, int32_t *growth_tracker, int64_t *state, const hl_found_list *found,
                              double growth_factor, double backoff_factor, int64_t growth_interval, int64_t hysteresis,
                              float min_scale, float max_scale, int adjust, int device, CUstream stream);

/* ---- launch_optim.c: kernels/optim.cu ---- */

/* One Adam/AdamW step over every tensor of `table` (device memory, `count` entries, `total_chunks`
   chunks in all): each gradient divided by *grad_scale (NULL: by nothing), read once and never
   written; nothing at all changes when *found_inf != 0 (NULL: never skipped); the learning rate is *lr
   (a float32 on the device, read when the kernel runs) or, when lr is NULL, hyper->lr. Two kernels:
   the update, which takes each tensor's step as *step + 1, then one that adds 1 to the step counts
   (unless skipped), so no block reads a count another has already moved. Everything is read on the
   device and nothing is copied from the host: the launch can be captured in a graph. */
CUresult hl_launch_adam(const hl_adam_entry *table, int64_t count, int64_t total_chunks, const hl_adam_hyper *hyper,
                        const float *lr, const float *grad_scale, const float *found_inf, int device, CUstream stream);

/* One SGD step (momentum, dampening, nesterov, weight decay, maximize) over every tensor of `table`,
   with lr, grad_scale and found_inf as hl_launch_adam takes them. One kernel. */
CUresult hl_launch_sgd(const hl_sgd_entry *table, int64_t count, int64_t total_chunks, const hl_sgd_hyper *hyper,
                       const float *lr, const float *grad_scale, const float *found_inf, int device, CUstream stream);

/* ---- launch_normalize.c: kernels/normalize.cu ---- */

/* dst = ((float)src - mean[c]) / std[c], rounded once to dst's dtype (HL_FLOAT32/16, HL_BFLOAT16).
   src: uint8 [n, h, w, c] contiguous. dst: [n, c, h, w] contiguous, or, when channels_last, the
   same [n, h, w, c] memory order as src. One kernel. */
CUresult hl_launch_normalize(const uint8_t *src, void *dst, int dst_dtype, int64_t n, int64_t h, int64_t w, int64_t c,
                             int channels_last, hl_normalize_params params, int device, CUstream stream);

/* ---- launch_image_resize.c: kernels/image_resize.cu ---- */

/* Every image of `entries` (device memory, `count` checked entries) cropped, resized, windowed,
   flipped and normalised into out: `count` images of 3 x h x w of `out_dtype` (HL_UINT8, HL_FLOAT32,
   HL_FLOAT16 or HL_BFLOAT16), in [count, 3, h, w] order, or [count, h, w, 3] when channels_last.
   One kernel. */
CUresult hl_launch_image_resize(const hl_image_entry *entries, int64_t count, void *out, int out_dtype, int64_t h,
                                int64_t w, int channels_last, hl_image_resize_params params, int device,
                                CUstream stream);

#endif
