/* The CUDA driver API by dlopen: libcuda.so.1 opened once, every entry point resolved and checked, primary contexts retained. */
#include "cuda_driver.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>

hl_driver_api hl_cu;

static pthread_once_t load_once = PTHREAD_ONCE_INIT;
static CUresult load_result = CUDA_ERROR_STUB_LIBRARY;
static char load_why[256] = "the CUDA driver was not loaded";

/* one entry: the symbol names to try, newest first (a driver older than the newest name has the
   older one, with the same signature) */
typedef struct {
    void **slot;
    const char *names[2];
} symbol;

#define SLOT(field) ((void **)&hl_cu.field)

static void load_driver(void) {
    const symbol symbols[] = {
        {SLOT(cuInit), {"cuInit"}},
        {SLOT(cuDriverGetVersion), {"cuDriverGetVersion"}},
        {SLOT(cuGetErrorName), {"cuGetErrorName"}},
        {SLOT(cuGetErrorString), {"cuGetErrorString"}},
        {SLOT(cuDeviceGetCount), {"cuDeviceGetCount"}},
        {SLOT(cuDeviceGet), {"cuDeviceGet"}},
        {SLOT(cuDeviceGetAttribute), {"cuDeviceGetAttribute"}},
        {SLOT(cuDevicePrimaryCtxRetain), {"cuDevicePrimaryCtxRetain"}},
        {SLOT(cuCtxGetCurrent), {"cuCtxGetCurrent"}},
        {SLOT(cuCtxSetCurrent), {"cuCtxSetCurrent"}},
        {SLOT(cuMemHostRegister), {"cuMemHostRegister_v2"}},
        {SLOT(cuMemHostUnregister), {"cuMemHostUnregister"}},
        {SLOT(cuMemcpyHtoDAsync), {"cuMemcpyHtoDAsync_v2"}},
        {SLOT(cuEventCreate), {"cuEventCreate"}},
        {SLOT(cuEventRecord), {"cuEventRecord"}},
        {SLOT(cuEventQuery), {"cuEventQuery"}},
        {SLOT(cuEventSynchronize), {"cuEventSynchronize"}},
        {SLOT(cuEventElapsedTime), {"cuEventElapsedTime_v2", "cuEventElapsedTime"}},
        {SLOT(cuEventDestroy), {"cuEventDestroy_v2"}},
        {SLOT(cuStreamWaitEvent), {"cuStreamWaitEvent"}},
        {SLOT(cuStreamSynchronize), {"cuStreamSynchronize"}},
        {SLOT(cuStreamCreate), {"cuStreamCreate"}},
        {SLOT(cuStreamDestroy), {"cuStreamDestroy_v2"}},
        {SLOT(cuModuleLoadData), {"cuModuleLoadData"}},
        {SLOT(cuModuleGetFunction), {"cuModuleGetFunction"}},
        {SLOT(cuLaunchKernel), {"cuLaunchKernel"}},
    };
    /* HOTLOOP_LIBCUDA: another driver library, for tests that load a fake or a missing one */
    const char *path = getenv("HOTLOOP_LIBCUDA");
    if (path == NULL || *path == '\0')
        path = "libcuda.so.1";
    void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (lib == NULL) {
        const char *err = dlerror();
        snprintf(load_why, sizeof load_why, "no CUDA driver found (%s)", err ? err : path);
        return;
    }
    hl_driver_api table = {0};
    hl_cu = table;
    for (size_t i = 0; i < sizeof symbols / sizeof symbols[0]; i++) {
        for (int k = 0; k < 2 && symbols[i].names[k] != NULL && *symbols[i].slot == NULL; k++)
            *symbols[i].slot = dlsym(lib, symbols[i].names[k]);
        if (*symbols[i].slot == NULL) {
            snprintf(load_why, sizeof load_why, "the CUDA driver %s lacks %s: it is older than CUDA 11", path,
                     symbols[i].names[0]);
            hl_cu = table;
            dlclose(lib);
            return;
        }
    }
    CUresult err = hl_cu.cuInit(0);
    if (err != CUDA_SUCCESS) {
        const char *name = NULL;
        if (hl_cu.cuGetErrorName(err, &name) != CUDA_SUCCESS || name == NULL)
            name = "an unknown error";
        snprintf(load_why, sizeof load_why, "cuInit failed with %s (%d)", name, err);
        load_result = err;
        return; /* the table stays: error names still work, nothing else is called */
    }
    load_result = CUDA_SUCCESS;
    load_why[0] = '\0';
}

CUresult hl_driver_load(const char **why) {
    pthread_once(&load_once, load_driver);
    if (why != NULL)
        *why = load_why;
    return load_result;
}

static _Atomic(CUcontext) primary[HL_MAX_DEVICES];
static pthread_mutex_t primary_lock = PTHREAD_MUTEX_INITIALIZER;

CUresult hl_primary_context(int device, CUcontext *context) {
    if (device < 0 || device >= HL_MAX_DEVICES)
        return CUDA_ERROR_INVALID_DEVICE;
    *context = atomic_load_explicit(&primary[device], memory_order_acquire);
    if (*context != NULL)
        return CUDA_SUCCESS;
    /* retained once and never released: torch holds the same context for the process's life */
    pthread_mutex_lock(&primary_lock);
    CUresult err = CUDA_SUCCESS;
    *context = atomic_load_explicit(&primary[device], memory_order_relaxed);
    if (*context == NULL) {
        CUdevice dev = 0;
        err = hl_cu.cuDeviceGet(&dev, device);
        if (err == CUDA_SUCCESS)
            err = hl_cu.cuDevicePrimaryCtxRetain(context, dev);
        if (err == CUDA_SUCCESS)
            atomic_store_explicit(&primary[device], *context, memory_order_release);
    }
    pthread_mutex_unlock(&primary_lock);
    return err;
}
