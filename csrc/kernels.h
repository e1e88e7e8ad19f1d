/* Kernels compiled at run time: loading a kernel source's module into a device's context, and launching its entry points. */
#ifndef HOTLOOP_KERNELS_H
#define HOTLOOP_KERNELS_H

#include "cuda_driver.h"
#include "kernel_table.h"
#include "module.h"

/* 0 once every entry point of `source` is loaded on `device`; on the first call for that pair it
   asks the loader Python registered (_C.set_kernel_loader: fn(device, source_name) -> the image
   NVRTC made, read from the cache or compiled) and loads the image with cuModuleLoadData. -1 with
   the loader's exception or a CudaError. Needs the GIL; `device` has passed hl_cuda_require. */
int hl_kernels_require(PyObject *module, int device, enum hl_kernel_source source);

/* cuLaunchKernel of entry point `id` on `stream` of `device`, a 1-D grid; `args` as cuLaunchKernel
   takes them (one pointer to each argument). CUDA_ERROR_NOT_FOUND when its source was never
   required on that device. Safe without the GIL, in the device's context. */
CUresult hl_kernel_launch(int device, enum hl_kernel_id id, unsigned grid, unsigned block, unsigned shared_bytes,
                          CUstream stream, void **args);

/* Blocks for a grid-stride walk over `chunks` chunks: `blocks_per_sm` on every multiprocessor of
   `device`, fewer when there are fewer chunks, at least 1. Safe without the GIL. */
int hl_grid_for_chunks(int64_t chunks, int device, int blocks_per_sm);

int hl_kernels_exec(PyObject *module);

#endif
