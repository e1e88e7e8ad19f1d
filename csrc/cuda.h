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

/* NOTE [ Table uploads ]
   A kernel walks a table of entries (tensors, images, parameters) that the host wrote; it reaches the
   device in one copy on the stream whose kernel reads it, so that stream order alone makes the kernel
   see it, and a graph never captures one (a captured copy would replay from host memory long gone).
   From page-locked memory the copy is a DMA queued on the stream: the host goes on at once, and the
   source must stay unchanged until the stream has passed the copy. From pageable memory the driver
   copies the bytes out before it returns, so the source may go right after, but it may first wait for
   the stream's earlier work: fine for a table written once and reused, not for one written per batch
   on a stream that waits for other work (the images' decode). In C every table goes up through
   hl_table_upload; the tables Python keeps (the GradScaler's gradients, an optimizer's step) go up
   through tensor_table.upload, torch's non-blocking copy from page-locked memory, since torch's host
   allocator then keeps that buffer from being handed out again until the copy has run. */

/* Copy `nbytes` of a table from host memory `src` to `device_dst` on `stream` (NOTE [ Table
   uploads ]): pageable `src` may be freed when this returns; page-locked `src` must stay unchanged
   until `stream` passed the copy. Safe without the GIL. */
void hl_table_upload(void *device_dst, const void *src, size_t nbytes, CUstream stream, hl_cuda_status *status);
#endif

#endif
