/* A fake NVML for tests: the NVML entry points hotloop uses, answering scripted values (no GPU needed). */
/* Built by the tests with `cc -shared -fPIC` and loaded through HOTLOOP_NVML_LIBRARY. Values come
   from FAKE_NVML_<FIELD> environment variables read at nvmlInit, and can be changed while a sampler
   runs through fake_nvml_set(); errors are injected with fake_nvml_fail() or FAKE_NVML_FAIL. Memory
   "used" is scripted by call count (used + step * calls, and a one-call spike at a given call or
   at the next call), so tests do not depend on timing. */
#define _POSIX_C_SOURCE 200809L /* nanosleep */
#include <ctype.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>

#define EXPORT __attribute__((visibility("default")))
#define MAX_DEVICES 4

/* every scripted value of a device; fake_nvml_set and FAKE_NVML_<NAME> address them by name */
#define FIELDS(X)                                                                                                  \
    X(total) X(reserved) X(used) X(step) X(spike_call) X(spike_value) X(memory_calls) X(util_gpu) X(util_memory)   \
    X(power_mw) X(power_limit_mw) X(power_default_mw) X(temperature_c) X(sm_clock_mhz) X(sm_clock_max_mhz)         \
    X(memory_clock_mhz) X(reasons) X(pcie_rx) X(pcie_tx) X(pcie_calls) X(pcie_delay_us) X(pcie_gen)                \
    X(pcie_gen_max) X(pcie_width) X(pcie_width_max) X(persistence) X(ecc) X(mig) X(no_v2) X(unsupported_power) X(spike_next) \
    X(util_jpeg) X(unsupported_jpeg)

#define AS_ENUM(name) F_##name,
enum { FIELDS(AS_ENUM) FIELD_COUNT };
#define AS_NAME(name) #name,
static const char *field_names[] = {FIELDS(AS_NAME)};

typedef struct {
    int index;
    _Atomic long long f[FIELD_COUNT];
} fake_device;

static fake_device devices[MAX_DEVICES];
static _Atomic int device_count = 1;

typedef struct {
    char name[64];
    int code;
    long long after;
    _Atomic long long calls;
} injected_failure;

#define MAX_FAILURES 8
static injected_failure failures[MAX_FAILURES];
static _Atomic int failure_count;

static int field_index(const char *name) {
    for (int i = 0; i < FIELD_COUNT; i++)
        if (strcasecmp(name, field_names[i]) == 0)
            return i;
    return -1;
}

static void defaults(void) {
    for (int d = 0; d < MAX_DEVICES; d++) {
        fake_device *dev = &devices[d];
        dev->index = d;
        for (int i = 0; i < FIELD_COUNT; i++)
            atomic_store(&dev->f[i], 0);
        atomic_store(&dev->f[F_total], 80LL << 30);
        atomic_store(&dev->f[F_reserved], 512LL << 20);
        atomic_store(&dev->f[F_used], 1LL << 30);
        atomic_store(&dev->f[F_spike_call], -1);
        atomic_store(&dev->f[F_util_gpu], 97);
        atomic_store(&dev->f[F_util_memory], 40);
        atomic_store(&dev->f[F_util_jpeg], 23);
        atomic_store(&dev->f[F_power_mw], 300000);
        atomic_store(&dev->f[F_power_limit_mw], 700000);
        atomic_store(&dev->f[F_power_default_mw], 700000);
        atomic_store(&dev->f[F_temperature_c], 55);
        atomic_store(&dev->f[F_sm_clock_mhz], 1980);
        atomic_store(&dev->f[F_sm_clock_max_mhz], 1980);
        atomic_store(&dev->f[F_memory_clock_mhz], 2619);
        atomic_store(&dev->f[F_pcie_rx], 1000);
        atomic_store(&dev->f[F_pcie_tx], 2000);
        atomic_store(&dev->f[F_pcie_delay_us], 20000);
        atomic_store(&dev->f[F_pcie_gen], 5);
        atomic_store(&dev->f[F_pcie_gen_max], 5);
        atomic_store(&dev->f[F_pcie_width], 16);
        atomic_store(&dev->f[F_pcie_width_max], 16);
        atomic_store(&dev->f[F_persistence], 1);
    }
    atomic_store(&device_count, 1);
    atomic_store(&failure_count, 0);
}

/* ---- control API, called by the tests through ctypes ---- */

static void read_environment(void);

/* back to the defaults and the environment's values; also what loading the library does */
__attribute__((constructor)) EXPORT void fake_nvml_reset(void) {
    defaults();
    read_environment();
}

EXPORT int fake_nvml_set(int device, const char *field, long long value) {
    int i = field_index(field);
    if (i < 0 || device < 0 || device >= MAX_DEVICES)
        return -1;
    atomic_store(&devices[device].f[i], value);
    return 0;
}

EXPORT long long fake_nvml_get(int device, const char *field) {
    int i = field_index(field);
    if (i < 0 || device < 0 || device >= MAX_DEVICES)
        return -1;
    return atomic_load(&devices[device].f[i]);
}

EXPORT void fake_nvml_set_device_count(int count) { atomic_store(&device_count, count); }

/* calls of `function` after the first `after` ones return `code` */
EXPORT int fake_nvml_fail(const char *function, int code, long long after) {
    int n = atomic_load(&failure_count);
    if (n >= MAX_FAILURES)
        return -1;
    snprintf(failures[n].name, sizeof(failures[n].name), "%s", function);
    failures[n].code = code;
    failures[n].after = after;
    atomic_store(&failures[n].calls, 0);
    atomic_store(&failure_count, n + 1);
    return 0;
}

static int injected(const char *function) {
    int n = atomic_load(&failure_count);
    for (int i = 0; i < n; i++)
        if (strcmp(failures[i].name, function) == 0 && atomic_fetch_add(&failures[i].calls, 1) >= failures[i].after)
            return failures[i].code;
    return 0;
}

#define INJECT(name)                                                                                               \
    do {                                                                                                           \
        int rc_ = injected(name);                                                                                  \
        if (rc_ != 0)                                                                                              \
            return rc_;                                                                                            \
    } while (0)

/* FAKE_NVML_<FIELD>=value for every device; FAKE_NVML_DEVICE_COUNT; FAKE_NVML_FAIL=function:code:after[,...] */
static void read_environment(void) {
    for (int i = 0; i < FIELD_COUNT; i++) {
        char key[64] = "FAKE_NVML_";
        size_t len = strlen(key);
        for (const char *p = field_names[i]; *p && len < sizeof(key) - 1; p++)
            key[len++] = (char)toupper((unsigned char)*p);
        key[len] = '\0';
        const char *value = getenv(key);
        if (value != NULL)
            for (int d = 0; d < MAX_DEVICES; d++)
                atomic_store(&devices[d].f[i], strtoll(value, NULL, 0));
    }
    const char *count = getenv("FAKE_NVML_DEVICE_COUNT");
    if (count != NULL)
        atomic_store(&device_count, atoi(count));
    const char *fail = getenv("FAKE_NVML_FAIL");
    while (fail != NULL && *fail) {
        char name[64];
        int code = 0;
        long long after = 0;
        if (sscanf(fail, "%63[^:]:%d:%lld", name, &code, &after) >= 2)
            fake_nvml_fail(name, code, after);
        fail = strchr(fail, ',');
        fail = fail ? fail + 1 : NULL;
    }
}

/* ---- the NVML API ---- */

typedef fake_device *nvmlDevice_t;
typedef struct {
    unsigned long long total, free, used;
} nvmlMemory_t;
typedef struct {
    unsigned int version;
    unsigned long long total, reserved, free, used;
} nvmlMemory_v2_t;
typedef struct {
    unsigned int gpu, memory;
} nvmlUtilization_t;

#define GET(dev, name) atomic_load(&(dev)->f[F_##name])

static _Atomic int initialised;

EXPORT int nvmlInit_v2(void) {
    const char *error = getenv("FAKE_NVML_INIT_ERROR");
    if (error != NULL)
        return atoi(error);
    atomic_fetch_add(&initialised, 1);
    return 0;
}

EXPORT int nvmlShutdown(void) {
    atomic_fetch_sub(&initialised, 1);
    return 0;
}

EXPORT const char *nvmlErrorString(int result) {
    switch (result) {
    case 0: return "Success";
    case 2: return "Invalid Argument";
    case 3: return "Not Supported";
    case 9: return "Driver Not Loaded";
    case 15: return "GPU is lost";
    case 999: return "Unknown Error";
    default: return "Fake NVML error";
    }
}

EXPORT int nvmlSystemGetDriverVersion(char *version, unsigned int length) {
    snprintf(version, length, "580.00.fake");
    return 0;
}

EXPORT int nvmlSystemGetCudaDriverVersion_v2(int *version) {
    *version = 13000;
    return 0;
}

EXPORT int nvmlDeviceGetCount_v2(unsigned int *count) {
    INJECT("nvmlDeviceGetCount_v2");
    *count = (unsigned int)atomic_load(&device_count);
    return 0;
}

EXPORT int nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
    INJECT("nvmlDeviceGetHandleByIndex_v2");
    if (index >= (unsigned int)atomic_load(&device_count))
        return 2;
    *device = &devices[index];
    return 0;
}

EXPORT int nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device) {
    int index = -1;
    if (sscanf(uuid, "GPU-fake-%d", &index) != 1 || index < 0 || index >= atomic_load(&device_count))
        return 6; /* not found */
    *device = &devices[index];
    return 0;
}

EXPORT int nvmlDeviceGetName(nvmlDevice_t d, char *name, unsigned int length) {
    snprintf(name, length, "Fake GPU %d", d->index);
    return 0;
}

EXPORT int nvmlDeviceGetUUID(nvmlDevice_t d, char *uuid, unsigned int length) {
    snprintf(uuid, length, "GPU-fake-%d", d->index);
    return 0;
}

/* used on this call: the scripted level, its ramp, and a spike on exactly one call */
static long long used_now(nvmlDevice_t d) {
    long long call = atomic_fetch_add(&d->f[F_memory_calls], 1);
    long long used = GET(d, used) + GET(d, step) * call;
    if (call == GET(d, spike_call))
        used = GET(d, spike_value);
    /* spike_next: the very next call spikes, whenever it comes (no race with a running sampler) */
    if (atomic_exchange(&d->f[F_spike_next], 0) != 0)
        used = GET(d, spike_value);
    return used;
}

EXPORT int nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t d, nvmlMemory_v2_t *m) {
    INJECT("nvmlDeviceGetMemoryInfo_v2");
    if (GET(d, no_v2))
        return 3;
    if (m->version != (unsigned int)(sizeof(nvmlMemory_v2_t) | (2u << 24)))
        return 25; /* argument version mismatch: what the real one says */
    long long used = used_now(d);
    m->total = (unsigned long long)GET(d, total);
    m->reserved = (unsigned long long)GET(d, reserved);
    m->used = (unsigned long long)used;
    m->free = m->total - m->reserved - m->used;
    return 0;
}

EXPORT int nvmlDeviceGetMemoryInfo(nvmlDevice_t d, nvmlMemory_t *m) {
    INJECT("nvmlDeviceGetMemoryInfo");
    long long used = used_now(d);
    m->total = (unsigned long long)GET(d, total);
    m->used = (unsigned long long)(used + GET(d, reserved)); /* v1 counts the reservation as used */
    m->free = m->total - m->used;
    return 0;
}

EXPORT int nvmlDeviceGetUtilizationRates(nvmlDevice_t d, nvmlUtilization_t *u) {
    INJECT("nvmlDeviceGetUtilizationRates");
    u->gpu = (unsigned int)GET(d, util_gpu);
    u->memory = (unsigned int)GET(d, util_memory);
    return 0;
}

/* the JPEG engines; unsupported_jpeg=1 answers NOT_SUPPORTED, as a GPU without engines does */
EXPORT int nvmlDeviceGetJpgUtilization(nvmlDevice_t d, unsigned int *utilization, unsigned int *period_us) {
    INJECT("nvmlDeviceGetJpgUtilization");
    if (GET(d, unsupported_jpeg))
        return 3; /* NVML_ERROR_NOT_SUPPORTED */
    *utilization = (unsigned int)GET(d, util_jpeg);
    *period_us = 166667;
    return 0;
}

EXPORT int nvmlDeviceGetPowerUsage(nvmlDevice_t d, unsigned int *v) {
    INJECT("nvmlDeviceGetPowerUsage");
    if (GET(d, unsupported_power))
        return 3;
    *v = (unsigned int)GET(d, power_mw);
    return 0;
}

EXPORT int nvmlDeviceGetEnforcedPowerLimit(nvmlDevice_t d, unsigned int *v) {
    *v = (unsigned int)GET(d, power_limit_mw);
    return 0;
}

EXPORT int nvmlDeviceGetPowerManagementDefaultLimit(nvmlDevice_t d, unsigned int *v) {
    *v = (unsigned int)GET(d, power_default_mw);
    return 0;
}

EXPORT int nvmlDeviceGetTemperature(nvmlDevice_t d, int sensor, unsigned int *v) {
    INJECT("nvmlDeviceGetTemperature");
    if (sensor != 0)
        return 2;
    *v = (unsigned int)GET(d, temperature_c);
    return 0;
}

EXPORT int nvmlDeviceGetClockInfo(nvmlDevice_t d, int type, unsigned int *v) {
    *v = (unsigned int)(type == 2 ? GET(d, memory_clock_mhz) : GET(d, sm_clock_mhz));
    return 0;
}

EXPORT int nvmlDeviceGetMaxClockInfo(nvmlDevice_t d, int type, unsigned int *v) {
    *v = (unsigned int)(type == 2 ? GET(d, memory_clock_mhz) : GET(d, sm_clock_max_mhz));
    return 0;
}

EXPORT int nvmlDeviceGetCurrentClocksEventReasons(nvmlDevice_t d, unsigned long long *v) {
    *v = (unsigned long long)GET(d, reasons);
    return 0;
}

/* like the real call, blocks for its sampling window (pcie_delay_us) before answering */
EXPORT int nvmlDeviceGetPcieThroughput(nvmlDevice_t d, int counter, unsigned int *v) {
    INJECT("nvmlDeviceGetPcieThroughput");
    long long delay = GET(d, pcie_delay_us);
    struct timespec ts = {.tv_sec = delay / 1000000, .tv_nsec = (delay % 1000000) * 1000};
    nanosleep(&ts, NULL);
    atomic_fetch_add(&d->f[F_pcie_calls], 1);
    *v = (unsigned int)(counter == 1 ? GET(d, pcie_rx) : GET(d, pcie_tx));
    return 0;
}

EXPORT int nvmlDeviceGetCurrPcieLinkGeneration(nvmlDevice_t d, unsigned int *v) {
    *v = (unsigned int)GET(d, pcie_gen);
    return 0;
}

EXPORT int nvmlDeviceGetMaxPcieLinkGeneration(nvmlDevice_t d, unsigned int *v) {
    *v = (unsigned int)GET(d, pcie_gen_max);
    return 0;
}

EXPORT int nvmlDeviceGetCurrPcieLinkWidth(nvmlDevice_t d, unsigned int *v) {
    *v = (unsigned int)GET(d, pcie_width);
    return 0;
}

EXPORT int nvmlDeviceGetMaxPcieLinkWidth(nvmlDevice_t d, unsigned int *v) {
    *v = (unsigned int)GET(d, pcie_width_max);
    return 0;
}

EXPORT int nvmlDeviceGetPersistenceMode(nvmlDevice_t d, int *mode) {
    *mode = (int)GET(d, persistence);
    return 0;
}

EXPORT int nvmlDeviceGetEccMode(nvmlDevice_t d, int *current, int *pending) {
    *current = *pending = (int)GET(d, ecc);
    return 0;
}

EXPORT int nvmlDeviceGetMigMode(nvmlDevice_t d, unsigned int *current, unsigned int *pending) {
    *current = *pending = (unsigned int)GET(d, mig);
    return 0;
}
