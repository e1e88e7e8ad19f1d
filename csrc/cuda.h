/* CUDA from C: whether it can be used, the current-device guard, and uploads of tensor tables. */
#ifndef HOTLOOP_CUDA_H
#define HOTLOOP_CUDA_H

#include "module.h"
#include "tensor.h"

/* 0 when CUDA calls on `device` can be made; otherwise -1 with a RuntimeError that says why
   ("hotloop was built without CUDA", "no CUDA driver found", no such device). Needs the GIL. */
int hl_cuda_require(PyObject *module, int device);

#ifdef HOTLOOP_WITH_CUDA
#include "cuda_driver.h"

/* Makes `device`'s primary context (torch's) current for this thread and puts the previous one
   back on leave, so that hotloop never moves torch's notion of the current device. Safe without
   the GIL. */
typedef struct {
    CUcontext previous;
    int changed;
} hl_device_guard;

void hl_device_enter(hl_device_guard *guard, int device, hl_cuda_status *status);
void hl_device_leave(hl_device_guard *guard, hl_cuda_status *status);

/* Run launch(ctx) with `device` current and the GIL released (the GIL must be held on entry);
   0, or -1 with a CudaError naming the first failed call (the guard's included). */
typedef CUresult (*hl_launch_fn)(void *ctx);
int hl_cuda_run(PyObject *module, int device, hl_launch_fn launch, void *ctx);

/* Copy the table's entries to `device_dst` (at least count * sizeof(hl_table_entry) bytes of
   device memory) on `stream`. The host entries may be freed as soon as this returns. */
void hl_table_upload(const hl_table *table, void *device_dst, CUstream stream, hl_cuda_status *status);
#endif

#endif
