/* A fake CUDA driver for tests: the driver entry points hotloop opens, answering scripted values without a GPU. */
/* Built by the tests with `cc -shared -fPIC` and loaded through HOTLOOP_LIBCUDA. Scripted by
   environment variables read at cuInit: FAKE_CUDA_DEVICES (count, default 1), FAKE_CUDA_CC (compute
   capability as 10 * major + minor, default 90), FAKE_CUDA_VERSION (default 12080), FAKE_CUDA_INIT
   (cuInit's result, default 0) and FAKE_CUDA_FAIL=name:code (that entry point returns code).
   "Device" memory is host memory: a copy is a memcpy. A module accepts a cubin (ELF) or PTX text,
   and finds a function only if the image holds its name, so a test sees a kernel image that lacks
   an entry point. An event records the host's clock, so that the time between two is what the
   synchronous work between their records took. The test reads what happened through the fake_cuda_*
   counters. */
#define _POSIX_C_SOURCE 200809L
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define EXPORT __attribute__((visibility("default")))

typedef int CUresult;
typedef void *handle;

static int device_count = 1, capability = 90, driver_version = 12080;
static char fail_name[64];
static int fail_code;
static _Thread_local handle current_context;

static _Atomic long modules_loaded, functions_found, kernels_launched, host_registered, events_live, streams_live,
    copies;
static char last_launch[128];

EXPORT long fake_cuda_modules_loaded(void) { return modules_loaded; }
EXPORT long fake_cuda_functions_found(void) { return functions_found; }
EXPORT long fake_cuda_kernels_launched(void) { return kernels_launched; }
EXPORT long fake_cuda_host_registered(void) { return host_registered; }
EXPORT long fake_cuda_events_live(void) { return events_live; }
EXPORT long fake_cuda_copies(void) { return copies; }
EXPORT long fake_cuda_streams_live(void) { return streams_live; }
EXPORT const char *fake_cuda_last_launch(void) { return last_launch; }

static int env_int(const char *name, int fallback) {
    const char *v = getenv(name);
    return v != NULL && *v ? atoi(v) : fallback;
}

/* the scripted failure of entry point `name`, else 0 */
static CUresult scripted(const char *name) { return fail_code != 0 && strcmp(name, fail_name) == 0 ? fail_code : 0; }
#define SCRIPTED()                                                                                                 \
    do {                                                                                                           \
        CUresult r_ = scripted(__func__);                                                                          \
        if (r_ != 0)                                                                                               \
            return r_;                                                                                             \
    } while (0)

EXPORT CUresult cuInit(unsigned flags) {
    (void)flags;
    device_count = env_int("FAKE_CUDA_DEVICES", 1);
    capability = env_int("FAKE_CUDA_CC", 90);
    driver_version = env_int("FAKE_CUDA_VERSION", 12080);
    const char *fail = getenv("FAKE_CUDA_FAIL");
    if (fail != NULL && strchr(fail, ':') != NULL) {
        size_t n = (size_t)(strchr(fail, ':') - fail);
        n = n < sizeof fail_name - 1 ? n : sizeof fail_name - 1;
        memcpy(fail_name, fail, n);
        fail_name[n] = '\0';
        fail_code = atoi(strchr(fail, ':') + 1);
    }
    return env_int("FAKE_CUDA_INIT", 0);
}

EXPORT CUresult cuDriverGetVersion(int *v) { *v = env_int("FAKE_CUDA_VERSION", driver_version); return 0; }

struct error_name { int code; const char *name, *text; };
static const struct error_name errors[] = {
    {0, "CUDA_SUCCESS", "no error"},
    {1, "CUDA_ERROR_INVALID_VALUE", "invalid argument"},
    {100, "CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected"},
    {200, "CUDA_ERROR_INVALID_IMAGE", "device kernel image is invalid"},
    {500, "CUDA_ERROR_NOT_FOUND", "named symbol not found"},
    {600, "CUDA_ERROR_NOT_READY", "device not ready"},
    {700, "CUDA_ERROR_ILLEGAL_ADDRESS", "an illegal memory access was encountered"},
};
static const struct error_name *find_error(CUresult e) {
    for (size_t i = 0; i < sizeof errors / sizeof errors[0]; i++)
        if (errors[i].code == e)
            return &errors[i];
    return NULL;
}
EXPORT CUresult cuGetErrorName(CUresult e, const char **name) {
    const struct error_name *f = find_error(e);
    *name = f ? f->name : NULL;
    return f ? 0 : 1;
}
EXPORT CUresult cuGetErrorString(CUresult e, const char **text) {
    const struct error_name *f = find_error(e);
    *text = f ? f->text : NULL;
    return f ? 0 : 1;
}

EXPORT CUresult cuDeviceGetCount(int *n) { SCRIPTED(); *n = device_count; return 0; }
EXPORT CUresult cuDeviceGet(int *d, int ordinal) {
    if (ordinal < 0 || ordinal >= device_count)
        return 101;
    *d = ordinal;
    return 0;
}
EXPORT CUresult cuDeviceGetAttribute(int *value, int attribute, int device) {
    (void)device;
    switch (attribute) {
    case 16: *value = 132; return 0;             /* multiprocessors */
    case 75: *value = capability / 10; return 0; /* major */
    case 76: *value = capability % 10; return 0; /* minor */
    default: return 1;
    }
}
static char contexts[16];
EXPORT CUresult cuDevicePrimaryCtxRetain(handle *ctx, int device) { *ctx = &contexts[device & 15]; return 0; }
EXPORT CUresult cuCtxGetCurrent(handle *ctx) { *ctx = current_context; return 0; }
EXPORT CUresult cuCtxSetCurrent(handle ctx) { current_context = ctx; return 0; }

/* calls that work on the current context fail without one, as the driver's do */
#define NEEDS_CONTEXT()                                                                                            \
    do {                                                                                                           \
        if (current_context == NULL)                                                                               \
            return 201; /* CUDA_ERROR_INVALID_CONTEXT */                                                           \
    } while (0)

EXPORT CUresult cuMemHostRegister_v2(void *p, size_t n, unsigned flags) {
    (void)p; (void)n; (void)flags;
    SCRIPTED();
    NEEDS_CONTEXT();
    host_registered++;
    return 0;
}
EXPORT CUresult cuMemHostUnregister(void *p) { (void)p; NEEDS_CONTEXT(); host_registered--; return 0; }
EXPORT CUresult cuMemcpyHtoDAsync_v2(unsigned long long dst, const void *src, size_t n, handle stream) {
    (void)stream;
    SCRIPTED();
    NEEDS_CONTEXT();
    memcpy((void *)(uintptr_t)dst, src, n);
    copies++;
    return 0;
}
EXPORT CUresult cuEventCreate(handle *e, unsigned flags) {
    (void)flags;
    SCRIPTED();
    NEEDS_CONTEXT();
    *e = calloc(1, sizeof(double));
    events_live++;
    return 0;
}
EXPORT CUresult cuEventRecord(handle e, handle s) {
    (void)s;
    SCRIPTED();
    NEEDS_CONTEXT();
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    *(double *)e = (double)now.tv_sec + 1e-9 * (double)now.tv_nsec;
    return 0;
}
EXPORT CUresult cuEventQuery(handle e) { (void)e; SCRIPTED(); return 0; }
EXPORT CUresult cuEventSynchronize(handle e) { (void)e; SCRIPTED(); return 0; }
EXPORT CUresult cuEventElapsedTime(float *ms, handle a, handle b) {
    *ms = (float)(1e3 * (*(double *)b - *(double *)a));
    return 0;
}
EXPORT CUresult cuEventDestroy_v2(handle e) { free(e); events_live--; return 0; }
EXPORT CUresult cuStreamWaitEvent(handle s, handle e, unsigned f) { (void)s; (void)e; (void)f; NEEDS_CONTEXT(); return 0; }
EXPORT CUresult cuStreamSynchronize(handle s) { (void)s; return 0; }
EXPORT CUresult cuStreamCreate(handle *s, unsigned flags) {
    (void)flags;
    SCRIPTED();
    NEEDS_CONTEXT();
    *s = malloc(8);
    streams_live++;
    return 0;
}
EXPORT CUresult cuStreamDestroy_v2(handle s) { free(s); streams_live--; return 0; }

/* a module remembers its image: an ELF's size is the end of its section headers */
typedef struct {
    const char *image;
    size_t size;
} fake_module;

EXPORT CUresult cuModuleLoadData(handle *module, const void *image) {
    SCRIPTED();
    NEEDS_CONTEXT();
    const unsigned char *p = image;
    size_t size;
    if (memcmp(p, "\x7f" "ELF", 4) == 0 && p[4] == 2) {
        uint64_t shoff;
        uint16_t shentsize, shnum;
        memcpy(&shoff, p + 0x28, 8);
        memcpy(&shentsize, p + 0x3a, 2);
        memcpy(&shnum, p + 0x3c, 2);
        size = (size_t)(shoff + (uint64_t)shentsize * shnum);
    } else if (strstr(image, ".version") != NULL && strstr(image, ".entry") != NULL) {
        size = strlen(image);
    } else {
        return 200; /* CUDA_ERROR_INVALID_IMAGE */
    }
    fake_module *m = malloc(sizeof *m);
    m->image = malloc(size);
    memcpy((char *)m->image, image, size);
    m->size = size;
    *module = m;
    modules_loaded++;
    return 0;
}

EXPORT CUresult cuModuleGetFunction(handle *function, handle module, const char *name) {
    fake_module *m = module;
    size_t n = strlen(name);
    for (size_t i = 0; i + n <= m->size; i++)
        if (memcmp(m->image + i, name, n) == 0 && (i + n == m->size || m->image[i + n] == '\0' ||
                                                   m->image[i + n] == '(' || m->image[i + n] == ' ')) {
            *function = strdup(name);
            functions_found++;
            return 0;
        }
    return 500; /* CUDA_ERROR_NOT_FOUND */
}

EXPORT CUresult cuLaunchKernel(handle f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                               unsigned shared, handle stream, void **params, void **extra) {
    (void)gy; (void)gz; (void)by; (void)bz; (void)stream; (void)params; (void)extra;
    SCRIPTED();
    NEEDS_CONTEXT();
    snprintf(last_launch, sizeof last_launch, "%s<<<%u, %u, %u>>>", (const char *)f, gx, bx, shared);
    kernels_launched++;
    return 0;
}
