/* Launchers of kernels/optim.cu's entry points: the fused Adam/AdamW and SGD steps. */
#include "launch.h"

#include "kernels.h"
#include "optim.h"

#ifdef HOTLOOP_WITH_CUDA

#define OPTIM_BLOCKS_PER_SM 2
#define COUNT_THREADS 256 /* the step-count kernel: one thread per tensor */
#define COUNT_MAX_BLOCKS 1024

CUresult hl_launch_adam(const hl_adam_entry *table, int64_t count, int64_t total_chunks, const hl_adam_hyper *hyper,
                        const float *lr, const float *grad_scale, const float *found_inf, int device, CUstream stream) {
    if (count == 0)
        return CUDA_SUCCESS;
    if (total_chunks > 0) {
        int grid = hl_grid_for_chunks(total_chunks, device, OPTIM_BLOCKS_PER_SM);
        hl_adam_hyper h = *hyper; /* by value */
        void *args[] = {&table, &count, &total_chunks, &h, &lr, &grad_scale, &found_inf};
        CUresult err = hl_kernel_launch(device, HL_KERNEL_ADAM, (unsigned)grid, HL_OPTIM_THREADS, 0, stream, args);
        if (err != CUDA_SUCCESS)
            return err;
    }
    const int64_t blocks = (count + COUNT_THREADS - 1) / COUNT_THREADS;
    void *args[] = {&table, &count, &found_inf};
    return hl_kernel_launch(device, HL_KERNEL_ADAM_COUNT, (unsigned)(blocks < COUNT_MAX_BLOCKS ? blocks : COUNT_MAX_BLOCKS),
                            COUNT_THREADS, 0, stream, args);
}

CUresult hl_launch_sgd(const hl_sgd_entry *table, int64_t count, int64_t total_chunks, const hl_sgd_hyper *hyper,
                       const float *lr, const float *grad_scale, const float *found_inf, int device, CUstream stream) {
    if (count == 0 || total_chunks == 0)
        return CUDA_SUCCESS;
    int grid = hl_grid_for_chunks(total_chunks, device, OPTIM_BLOCKS_PER_SM);
    hl_sgd_hyper h = *hyper; /* by value */
    void *args[] = {&table, &count, &total_chunks, &h, &lr, &grad_scale, &found_inf};
    return hl_kernel_launch(device, HL_KERNEL_SGD, (unsigned)grid, HL_OPTIM_THREADS, 0, stream, args);
}

#endif
