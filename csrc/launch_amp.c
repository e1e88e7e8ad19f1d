/* Launchers of kernels/amp.cu's entry points: the non-finite check and the GradScaler's check, epilogue, apply and update. */
#include "launch.h"

#include "amp.h"
#include "kernels.h"

#ifdef HOTLOOP_WITH_CUDA

CUresult hl_launch_non_finite_check(const hl_table_entry *table, int64_t count, int64_t total_chunks, float *found,
                                    int device, CUstream stream) {
    if (total_chunks == 0)
        return CUDA_SUCCESS;
    int grid = hl_grid_for_chunks(total_chunks, device, HL_AMP_BLOCKS_PER_SM);
    void *args[] = {&table, &count, &total_chunks, &found};
    return hl_kernel_launch(device, HL_KERNEL_NON_FINITE_CHECK, (unsigned)grid, HL_AMP_THREADS, 0, stream, args);
}

/* the check pass for `mode`: unscale_'s storing pass, or a read-only one per norm */
static enum hl_kernel_id check_kernel(int write, int mode) {
    if (write)
        return HL_KERNEL_AMP_CHECK_WRITE;
    switch (mode) {
    case HL_NORM_L2:
        return HL_KERNEL_AMP_CHECK_L2;
    case HL_NORM_INF:
        return HL_KERNEL_AMP_CHECK_INF;
    case HL_NORM_P:
        return HL_KERNEL_AMP_CHECK_P;
    default:
        return HL_KERNEL_AMP_CHECK_NONE;
    }
}

CUresult hl_launch_amp_check(const hl_table_entry *table, int64_t count, int64_t total_chunks, float *partials,
                             const float *scale, int write, int mode, float p, float max_norm, float *aux,
                             const int32_t *param_index, int64_t *report, int64_t step, const float *extra,
                             int n_extra, int blocks, int device, CUstream stream) {
    if (total_chunks > 0) {
        int grid = blocks > 0 ? blocks : hl_grid_for_chunks(total_chunks, device, HL_AMP_BLOCKS_PER_SM);
        void *args[] = {&table, &count, &total_chunks, &partials, &scale, &p};
        CUresult err = hl_kernel_launch(device, check_kernel(write, mode), (unsigned)grid, HL_AMP_THREADS, 0, stream,
                                        args);
        if (err != CUDA_SUCCESS)
            return err;
    }
    /* partials are float2 {norm partial, flag} on the device: the same address */
    void *args[] = {&partials, &total_chunks, &mode, &p, &max_norm, &scale, &aux, &table, &count,
                    &param_index, &report, &step, &extra, &n_extra};
    return hl_kernel_launch(device, HL_KERNEL_AMP_EPILOGUE, 1, HL_AMP_EPILOGUE_THREADS, 0, stream, args);
}

CUresult hl_launch_amp_apply(const hl_table_entry *table, int64_t count, int64_t total_chunks, const float *aux,
                             int unscale, int clip, int device, CUstream stream) {
    if (total_chunks == 0 || (!unscale && !clip))
        return CUDA_SUCCESS;
    int grid = hl_grid_for_chunks(total_chunks, device, HL_AMP_BLOCKS_PER_SM);
    enum hl_kernel_id id = unscale && clip ? HL_KERNEL_AMP_APPLY_UNSCALE_CLIP
                           : unscale       ? HL_KERNEL_AMP_APPLY_UNSCALE
                                           : HL_KERNEL_AMP_APPLY_CLIP;
    void *args[] = {&table, &count, &total_chunks, &aux};
    return hl_kernel_launch(device, id, (unsigned)grid, HL_AMP_THREADS, 0, stream, args);
}

CUresult hl_launch_amp_update(float *scale, int32_t *growth_tracker, int64_t *state, const hl_found_list *found,
                              double growth_factor, double backoff_factor, int64_t growth_interval, int64_t hysteresis,
                              float min_scale, float max_scale, int adjust, int device, CUstream stream) {
    hl_found_list list = *found; /* by value: the launch copies the argument's bytes */
    void *args[] = {&scale, &growth_tracker, &state, &list, &growth_factor, &backoff_factor,
                    &growth_interval, &hysteresis, &min_scale, &max_scale, &adjust};
    return hl_kernel_launch(device, HL_KERNEL_AMP_UPDATE, 1, 1, 0, stream, args);
}

#endif
