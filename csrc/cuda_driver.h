/* The CUDA driver API by dlopen: the few types hotloop uses, and one table of checked function pointers. */
#ifndef HOTLOOP_CUDA_DRIVER_H
#define HOTLOOP_CUDA_DRIVER_H

#include <stddef.h>

/* Declared here rather than taken from cuda.h: the build needs no CUDA header. These are the
   driver API's own types and numbers (stable across every CUDA release since 11). */
typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef struct CUctx_st *CUcontext;
typedef struct CUstream_st *CUstream;
typedef struct CUevent_st *CUevent;
typedef struct CUmod_st *CUmodule;
typedef struct CUfunc_st *CUfunction;

#define CUDA_SUCCESS 0
#define CUDA_ERROR_INVALID_VALUE 1
#define CUDA_ERROR_NOT_INITIALIZED 3
#define CUDA_ERROR_STUB_LIBRARY 34
#define CUDA_ERROR_NO_DEVICE 100
#define CUDA_ERROR_INVALID_DEVICE 101
#define CUDA_ERROR_NOT_FOUND 500
#define CUDA_ERROR_NOT_READY 600
#define CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED 712
#define CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED 713
#define CUDA_ERROR_SYSTEM_DRIVER_MISMATCH 803
#define CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE 804
#define CUDA_ERROR_UNKNOWN 999

#define CU_EVENT_DEFAULT 0x0
#define CU_EVENT_DISABLE_TIMING 0x2
#define CU_STREAM_NON_BLOCKING 0x1
#define CU_MEMHOSTREGISTER_PORTABLE 0x1
#define CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT 16
#define CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR 75
#define CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR 76

/* Every driver entry point hotloop calls, by the name cuda.h gives it (the _v2 symbols where cuda.h
   maps a name to one), so that HL_CUDA's message names the call as a CUDA user knows it. */
typedef struct {
    CUresult (*cuInit)(unsigned int flags);
    CUresult (*cuDriverGetVersion)(int *version);
    CUresult (*cuGetErrorName)(CUresult error, const char **name);
    CUresult (*cuGetErrorString)(CUresult error, const char **text);
    CUresult (*cuDeviceGetCount)(int *count);
    CUresult (*cuDeviceGet)(CUdevice *device, int ordinal);
    CUresult (*cuDeviceGetAttribute)(int *value, int attribute, CUdevice device);
    CUresult (*cuDevicePrimaryCtxRetain)(CUcontext *context, CUdevice device);
    CUresult (*cuCtxGetCurrent)(CUcontext *context);
    CUresult (*cuCtxSetCurrent)(CUcontext context);
    CUresult (*cuMemHostRegister)(void *ptr, size_t bytes, unsigned int flags);
    CUresult (*cuMemHostUnregister)(void *ptr);
    CUresult (*cuMemcpyHtoDAsync)(CUdeviceptr dst, const void *src, size_t bytes, CUstream stream);
    CUresult (*cuEventCreate)(CUevent *event, unsigned int flags);
    CUresult (*cuEventRecord)(CUevent event, CUstream stream);
    CUresult (*cuEventQuery)(CUevent event);
    CUresult (*cuEventSynchronize)(CUevent event);
    CUresult (*cuEventElapsedTime)(float *ms, CUevent start, CUevent end);
    CUresult (*cuEventDestroy)(CUevent event);
    CUresult (*cuStreamWaitEvent)(CUstream stream, CUevent event, unsigned int flags);
    CUresult (*cuStreamSynchronize)(CUstream stream);
    CUresult (*cuStreamCreate)(CUstream *stream, unsigned int flags);
    CUresult (*cuStreamDestroy)(CUstream stream);
    CUresult (*cuModuleLoadData)(CUmodule *module, const void *image);
    CUresult (*cuModuleGetFunction)(CUfunction *function, CUmodule module, const char *name);
    CUresult (*cuLaunchKernel)(CUfunction f, unsigned int grid_x, unsigned int grid_y, unsigned int grid_z,
                               unsigned int block_x, unsigned int block_y, unsigned int block_z,
                               unsigned int shared_bytes, CUstream stream, void **params, void **extra);
} hl_driver_api;

/* The table. Its entries are NULL until hl_driver_load() succeeded; every caller outside cuda.c
   reaches the driver after hl_cuda_require (cuda.h), which loads it. */
extern hl_driver_api hl_cu;

/* Open libcuda.so.1 and cuInit once per process (later calls return the first result): 0, or the
   CUresult that says why not (CUDA_ERROR_STUB_LIBRARY when no driver library could be opened or a
   symbol is missing), with a sentence in *why. Thread-safe; needs no GIL. */
CUresult hl_driver_load(const char **why);

/* devices hotloop keeps per-device state for (contexts, kernels, multiprocessor counts) */
#define HL_MAX_DEVICES 64

/* `device`'s primary context, the one torch and the runtime API use, retained once per process. */
CUresult hl_primary_context(int device, CUcontext *context);

/* a stream handle as Python passes it (torch.cuda.Stream.cuda_stream): a CUstream, 0 being the
   legacy default stream in both APIs */
static inline CUstream hl_stream(unsigned long long handle) { return (CUstream)(size_t)handle; }

#endif
