/* NVML for hotloop: the part of NVML's C API it uses (no nvml.h needed to build) and what nvml.c offers. */
#ifndef HOTLOOP_NVML_H
#define HOTLOOP_NVML_H

#include "module.h"

/* NVML is never linked: nvml.c opens libnvidia-ml.so.1 with dlopen and looks each function up
   with dlsym, so these are types of function pointers, not prototypes. */

typedef int nvmlReturn_t; /* an enum in NVML; int-sized on every platform NVML supports */
typedef struct hl_nvml_device *nvmlDevice_t; /* opaque handle */

/* return codes hotloop looks at (others are passed through to the exception as numbers) */
enum {
    NVML_SUCCESS = 0,
    NVML_ERROR_UNINITIALIZED = 1,
    NVML_ERROR_INVALID_ARGUMENT = 2,
    NVML_ERROR_NOT_SUPPORTED = 3,
    NVML_ERROR_NO_PERMISSION = 4,
    NVML_ERROR_NOT_FOUND = 6,
    NVML_ERROR_INSUFFICIENT_SIZE = 7,
    NVML_ERROR_DRIVER_NOT_LOADED = 9,
    NVML_ERROR_TIMEOUT = 10,
    NVML_ERROR_LIBRARY_NOT_FOUND = 12,
    NVML_ERROR_FUNCTION_NOT_FOUND = 13,
    NVML_ERROR_GPU_IS_LOST = 15,
    NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25,
    NVML_ERROR_UNKNOWN = 999,
};

/* memory in bytes; version 1: used counts the driver's reserved part too */
typedef struct {
    unsigned long long total;
    unsigned long long free;
    unsigned long long used;
} nvmlMemory_t;

/* version 2 splits the driver/firmware reservation out of `used`; `version` must be set to
   the struct size ORed with the version number shifted into the top byte */
typedef struct {
    unsigned int version;
    unsigned long long total;
    unsigned long long reserved;
    unsigned long long free;
    unsigned long long used;
} nvmlMemory_v2_t;

#define HL_NVML_MEMORY_V2_VERSION ((unsigned int)(sizeof(nvmlMemory_v2_t) | (2u << 24)))

/* percent of the last sample period the GPU (memory controller) was busy */
typedef struct {
    unsigned int gpu;
    unsigned int memory;
} nvmlUtilization_t;

enum { NVML_TEMPERATURE_GPU = 0 };                         /* nvmlTemperatureSensors_t */
enum { NVML_CLOCK_GRAPHICS = 0, NVML_CLOCK_SM = 1, NVML_CLOCK_MEM = 2 }; /* nvmlClockType_t */
enum { NVML_PCIE_UTIL_TX_BYTES = 0, NVML_PCIE_UTIL_RX_BYTES = 1 };       /* nvmlPcieUtilCounter_t */
enum { NVML_FEATURE_DISABLED = 0, NVML_FEATURE_ENABLED = 1 };            /* nvmlEnableState_t */

/* clock-event ("throttle") reason bits returned by nvmlDeviceGetCurrentClocksEventReasons */
#define HL_NVML_REASON_GPU_IDLE 0x1ull
#define HL_NVML_REASON_APP_CLOCKS 0x2ull
#define HL_NVML_REASON_SW_POWER_CAP 0x4ull
#define HL_NVML_REASON_HW_SLOWDOWN 0x8ull
#define HL_NVML_REASON_SYNC_BOOST 0x10ull
#define HL_NVML_REASON_SW_THERMAL 0x20ull
#define HL_NVML_REASON_HW_THERMAL 0x40ull
#define HL_NVML_REASON_HW_POWER_BRAKE 0x80ull
#define HL_NVML_REASON_DISPLAY_CLOCKS 0x100ull

#define HL_NVML_STRING_LEN 96 /* enough for a device name, UUID or driver version */

/* function pointer types, one per NVML entry point used */
typedef nvmlReturn_t (*nvmlInit_v2_fn)(void);
typedef nvmlReturn_t (*nvmlShutdown_fn)(void);
typedef const char *(*nvmlErrorString_fn)(nvmlReturn_t result);
typedef nvmlReturn_t (*nvmlSystemGetDriverVersion_fn)(char *version, unsigned int length);
typedef nvmlReturn_t (*nvmlSystemGetCudaDriverVersion_fn)(int *version);
typedef nvmlReturn_t (*nvmlDeviceGetCount_v2_fn)(unsigned int *count);
typedef nvmlReturn_t (*nvmlDeviceGetHandleByIndex_v2_fn)(unsigned int index, nvmlDevice_t *device);
typedef nvmlReturn_t (*nvmlDeviceGetHandleByUUID_fn)(const char *uuid, nvmlDevice_t *device);
typedef nvmlReturn_t (*nvmlDeviceGetName_fn)(nvmlDevice_t device, char *name, unsigned int length);
typedef nvmlReturn_t (*nvmlDeviceGetUUID_fn)(nvmlDevice_t device, char *uuid, unsigned int length);
typedef nvmlReturn_t (*nvmlDeviceGetMemoryInfo_fn)(nvmlDevice_t device, nvmlMemory_t *memory);
typedef nvmlReturn_t (*nvmlDeviceGetMemoryInfo_v2_fn)(nvmlDevice_t device, nvmlMemory_v2_t *memory);
typedef nvmlReturn_t (*nvmlDeviceGetUtilizationRates_fn)(nvmlDevice_t device, nvmlUtilization_t *utilization);
typedef nvmlReturn_t (*nvmlDeviceGetUInt_fn)(nvmlDevice_t device, unsigned int *value); /* power, limits, pcie */
typedef nvmlReturn_t (*nvmlDeviceGetTemperature_fn)(nvmlDevice_t device, int sensor, unsigned int *temp);
typedef nvmlReturn_t (*nvmlDeviceGetClockInfo_fn)(nvmlDevice_t device, int type, unsigned int *clock_mhz);
typedef nvmlReturn_t (*nvmlDeviceGetReasons_fn)(nvmlDevice_t device, unsigned long long *reasons);
typedef nvmlReturn_t (*nvmlDeviceGetPcieThroughput_fn)(nvmlDevice_t device, int counter, unsigned int *kb_per_s);
typedef nvmlReturn_t (*nvmlDeviceGetEnableState_fn)(nvmlDevice_t device, int *mode); /* persistence */
typedef nvmlReturn_t (*nvmlDeviceGetTwoStates_fn)(nvmlDevice_t device, int *current, int *pending); /* ECC */
/* percent of the sampling period the JPEG engines (NVJPG) were busy, and that period in microseconds */
typedef nvmlReturn_t (*nvmlDeviceGetJpgUtilization_fn)(nvmlDevice_t device, unsigned int *utilization,
                                                       unsigned int *sampling_period_us);
typedef nvmlReturn_t (*nvmlDeviceGetMigMode_fn)(nvmlDevice_t device, unsigned int *current, unsigned int *pending);

/* what nvml.c resolved from one library; optional entry points may be NULL */
typedef struct {
    char path[512];
    nvmlInit_v2_fn init;
    nvmlShutdown_fn shutdown;
    nvmlErrorString_fn error_string;
    nvmlSystemGetDriverVersion_fn driver_version;
    nvmlSystemGetCudaDriverVersion_fn cuda_driver_version;
    nvmlDeviceGetCount_v2_fn device_count;
    nvmlDeviceGetHandleByIndex_v2_fn handle_by_index;
    nvmlDeviceGetHandleByUUID_fn handle_by_uuid;
    nvmlDeviceGetName_fn name;
    nvmlDeviceGetUUID_fn uuid;
    nvmlDeviceGetMemoryInfo_fn memory_v1;
    nvmlDeviceGetMemoryInfo_v2_fn memory_v2;
    nvmlDeviceGetUtilizationRates_fn utilization;
    nvmlDeviceGetUInt_fn power_usage;          /* milliwatts */
    nvmlDeviceGetUInt_fn power_limit;          /* enforced limit, milliwatts */
    nvmlDeviceGetUInt_fn power_default_limit;  /* milliwatts */
    nvmlDeviceGetTemperature_fn temperature;   /* degrees C */
    nvmlDeviceGetClockInfo_fn clock;           /* MHz */
    nvmlDeviceGetClockInfo_fn max_clock;       /* MHz */
    nvmlDeviceGetReasons_fn reasons;           /* clock-event reasons (or the older throttle-reasons name) */
    nvmlDeviceGetPcieThroughput_fn pcie_throughput; /* KB/s over ~20 ms; blocks that long */
    nvmlDeviceGetUInt_fn pcie_gen, pcie_gen_max, pcie_width, pcie_width_max;
    nvmlDeviceGetEnableState_fn persistence;
    nvmlDeviceGetTwoStates_fn ecc;
    nvmlDeviceGetMigMode_fn mig;
    nvmlDeviceGetJpgUtilization_fn jpg_utilization; /* drivers before 520 lack it */
} hl_nvml;

/* The NVML library named by HOTLOOP_NVML_LIBRARY (else libnvidia-ml.so.1), opened and initialised
   once per process and kept. NULL when that fails: then *code is an NVML return code
   (NVML_ERROR_LIBRARY_NOT_FOUND when dlopen failed), `text` says why and *call names what failed.
   Safe without the GIL. */
const hl_nvml *hl_nvml_open(int *code, char *text, size_t text_len, const char **call);

/* The one function that turns an NVML return code into an exception, as CPython's catch_bz2_error
   does for bz2: 0 for NVML_SUCCESS; otherwise -1 with hotloop.NvmlError naming `call`, `file` and
   `line`, its message nvmlErrorString's text followed by `detail` (may be NULL). Needs the GIL. */
int hl_nvml_raise_if(PyObject *module, const hl_nvml *n, nvmlReturn_t rc, const char *call, const char *detail,
                     const char *file, int line);
#define HL_NVML_RAISE_IF(module, n, rc, call) hl_nvml_raise_if((module), (n), (rc), (call), NULL, __FILE__, __LINE__)

/* hl_nvml_open, or NULL with hotloop.NvmlError saying why. Needs the GIL. */
const hl_nvml *hl_nvml_open_or_raise(PyObject *module);

/* The handle of `device`: an NVML index, or a UUID string ("GPU-...") so Python can name the device
   torch uses whatever CUDA_VISIBLE_DEVICES says; *index is its NVML index (UINT32_MAX when a UUID
   matches no index). 0, or -1 with NvmlError/TypeError/ValueError. Needs the GIL. */
int hl_nvml_device(PyObject *module, const hl_nvml *n, PyObject *device, nvmlDevice_t *handle, unsigned int *index);

#endif
