/* NVML by dlopen (libnvidia-ml is never linked), its errors as hotloop.NvmlError, and doctor's queries. */
#include "nvml.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---------------------------------------------------------------------------------------------
   NVML, opened at run time. A library stays open and initialised for the life of the process:
   monitors hold pointers into its table, and NVML counts nvmlInit calls itself. */

#define MAX_LIBRARIES 8
static pthread_mutex_t nvml_lock = PTHREAD_MUTEX_INITIALIZER;
static hl_nvml *nvml_libraries[MAX_LIBRARIES];
static int nvml_library_count;

/* fork: hold the lock across it so the child's copy of the library table is consistent (a fork
   while another thread opens a library would leave the child a locked mutex otherwise) */
static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;
static void before_fork(void) { pthread_mutex_lock(&nvml_lock); }
static void after_fork_parent(void) { pthread_mutex_unlock(&nvml_lock); }
static void after_fork_child(void) { pthread_mutex_init(&nvml_lock, NULL); }
static void install_fork_handlers(void) { pthread_atfork(before_fork, after_fork_parent, after_fork_child); }

static void *lookup(void *lib, const char *name, const char *fallback) {
    void *f = dlsym(lib, name);
    if (f == NULL && fallback != NULL)
        f = dlsym(lib, fallback);
    return f;
}

static hl_nvml *nvml_load(const char *path, void *lib) {
    hl_nvml *n = calloc(1, sizeof(*n));
    if (n == NULL)
        return NULL;
    snprintf(n->path, sizeof(n->path), "%s", path);
    n->init = (nvmlInit_v2_fn)lookup(lib, "nvmlInit_v2", "nvmlInit");
    n->shutdown = (nvmlShutdown_fn)lookup(lib, "nvmlShutdown", NULL);
    n->error_string = (nvmlErrorString_fn)lookup(lib, "nvmlErrorString", NULL);
    n->driver_version = (nvmlSystemGetDriverVersion_fn)lookup(lib, "nvmlSystemGetDriverVersion", NULL);
    n->cuda_driver_version = (nvmlSystemGetCudaDriverVersion_fn)lookup(
        lib, "nvmlSystemGetCudaDriverVersion_v2", "nvmlSystemGetCudaDriverVersion");
    n->device_count = (nvmlDeviceGetCount_v2_fn)lookup(lib, "nvmlDeviceGetCount_v2", "nvmlDeviceGetCount");
    n->handle_by_index = (nvmlDeviceGetHandleByIndex_v2_fn)lookup(lib, "nvmlDeviceGetHandleByIndex_v2",
                                                                  "nvmlDeviceGetHandleByIndex");
    n->handle_by_uuid = (nvmlDeviceGetHandleByUUID_fn)lookup(lib, "nvmlDeviceGetHandleByUUID", NULL);
    n->name = (nvmlDeviceGetName_fn)lookup(lib, "nvmlDeviceGetName", NULL);
    n->uuid = (nvmlDeviceGetUUID_fn)lookup(lib, "nvmlDeviceGetUUID", NULL);
    n->memory_v1 = (nvmlDeviceGetMemoryInfo_fn)lookup(lib, "nvmlDeviceGetMemoryInfo", NULL);
    n->memory_v2 = (nvmlDeviceGetMemoryInfo_v2_fn)lookup(lib, "nvmlDeviceGetMemoryInfo_v2", NULL);
    n->utilization = (nvmlDeviceGetUtilizationRates_fn)lookup(lib, "nvmlDeviceGetUtilizationRates", NULL);
    n->power_usage = (nvmlDeviceGetUInt_fn)lookup(lib, "nvmlDeviceGetPowerUsage", NULL);
    n->power_limit = (nvmlDeviceGetUInt_fn)lookup(lib, "nvmlDeviceGetEnforcedPowerLimit", NULL);
    n->power_default_limit = (nvmlDeviceGetUInt_fn)lookup(lib, "nvmlDeviceGetPowerManagementDefaultLimit", NULL);
    n->temperature = (nvmlDeviceGetTemperature_fn)lookup(lib, "nvmlDeviceGetTemperature", NULL);
    n->clock = (nvmlDeviceGetClockInfo_fn)lookup(lib, "nvmlDeviceGetClockInfo", NULL);
    n->max_clock = (nvmlDeviceGetClockInfo_fn)lookup(lib, "nvmlDeviceGetMaxClockInfo", NULL);
    /* renamed in newer drivers; the older name still answers on older ones */
    n->reasons = (nvmlDeviceGetReasons_fn)lookup(lib, "nvmlDeviceGetCurrentClocksEventReasons",
                                                 "nvmlDeviceGetCurrentClocksThrottleReasons");
    n->pcie_throughput = (nvmlDeviceGetPcieThroughput_fn)lookup(lib, "nvmlDeviceGetPcieThroughput", NULL);
    n->pcie_gen = (nvmlDeviceGetUInt_fn)lookup(lib, "nvmlDeviceGetCurrPcieLinkGeneration", NULL);
    n->pcie_gen_max = (nvmlDeviceGetUInt_fn)lookup(lib, "nvmlDeviceGetMaxPcieLinkGeneration", NULL);
    n->pcie_width = (nvmlDeviceGetUInt_fn)lookup(lib, "nvmlDeviceGetCurrPcieLinkWidth", NULL);
    n->pcie_width_max = (nvmlDeviceGetUInt_fn)lookup(lib, "nvmlDeviceGetMaxPcieLinkWidth", NULL);
    n->persistence = (nvmlDeviceGetEnableState_fn)lookup(lib, "nvmlDeviceGetPersistenceMode", NULL);
    n->ecc = (nvmlDeviceGetTwoStates_fn)lookup(lib, "nvmlDeviceGetEccMode", NULL);
    n->mig = (nvmlDeviceGetMigMode_fn)lookup(lib, "nvmlDeviceGetMigMode", NULL);
    n->jpg_utilization = (nvmlDeviceGetJpgUtilization_fn)lookup(lib, "nvmlDeviceGetJpgUtilization", NULL);
    return n;
}

const hl_nvml *hl_nvml_open(int *code, char *text, size_t text_len, const char **call) {
    const char *path = getenv("HOTLOOP_NVML_LIBRARY");
    if (path == NULL || *path == '\0')
        path = "libnvidia-ml.so.1";
    hl_nvml *found = NULL;
    pthread_once(&atfork_once, install_fork_handlers);
    pthread_mutex_lock(&nvml_lock);
    for (int i = 0; i < nvml_library_count && found == NULL; i++)
        if (strcmp(nvml_libraries[i]->path, path) == 0)
            found = nvml_libraries[i];
    if (found != NULL)
        goto done;
    void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (lib == NULL) {
        const char *why = dlerror();
        *code = NVML_ERROR_LIBRARY_NOT_FOUND;
        *call = "dlopen";
        snprintf(text, text_len, "NVML library not found (no NVIDIA driver here?): %s", why ? why : path);
        goto done;
    }
    hl_nvml *n = nvml_load(path, lib);
    if (n == NULL || n->init == NULL || n->error_string == NULL || n->handle_by_index == NULL ||
        n->device_count == NULL || (n->memory_v1 == NULL && n->memory_v2 == NULL)) {
        *code = NVML_ERROR_FUNCTION_NOT_FOUND;
        *call = "dlsym";
        snprintf(text, text_len, "%s lacks the NVML functions hotloop needs (nvmlInit, nvmlDeviceGetCount, "
                 "nvmlDeviceGetHandleByIndex, nvmlDeviceGetMemoryInfo)", path);
        free(n);
        dlclose(lib);
        goto done;
    }
    nvmlReturn_t rc = n->init();
    if (rc != NVML_SUCCESS) {
        *code = rc;
        *call = "nvmlInit_v2";
        snprintf(text, text_len, "%s", n->error_string(rc));
        free(n);
        dlclose(lib);
        goto done;
    }
    if (nvml_library_count < MAX_LIBRARIES)
        nvml_libraries[nvml_library_count++] = n;
    found = n; /* past the cache's size it is simply not cached (tests switching libraries) */
done:
    pthread_mutex_unlock(&nvml_lock);
    return found;
}

int hl_nvml_raise_if(PyObject *module, const hl_nvml *n, nvmlReturn_t rc, const char *call, const char *detail,
                     const char *file, int line) {
    if (rc == NVML_SUCCESS)
        return 0;
    const char *text = n->error_string(rc);
    char message[300];
    snprintf(message, sizeof(message), "%s%s", text != NULL ? text : "unknown error", detail != NULL ? detail : "");
    return hl_raise_nvml(module, rc, message, call, file, line);
}

const hl_nvml *hl_nvml_open_or_raise(PyObject *module) {
    int code = 0;
    char text[600] = "";
    const char *call = "";
    const hl_nvml *n = hl_nvml_open(&code, text, sizeof(text), &call);
    if (n == NULL) /* not a call's return code: the text says what failed (dlopen, dlsym, nvmlInit) */
        hl_raise_nvml(module, code, text, call, __FILE__, __LINE__);
    return n;
}

int hl_nvml_device(PyObject *module, const hl_nvml *n, PyObject *device, nvmlDevice_t *handle, unsigned int *index) {
    unsigned int count = 0;
    if (HL_NVML_RAISE_IF(module, n, n->device_count(&count), "nvmlDeviceGetCount_v2") < 0)
        return -1;
    if (PyUnicode_Check(device)) {
        const char *uuid = PyUnicode_AsUTF8AndSize(device, NULL);
        if (uuid == NULL)
            return -1;
        if (n->handle_by_uuid == NULL) {
            PyErr_SetString(PyExc_ValueError, "device: this NVML cannot look devices up by UUID; pass an index");
            return -1;
        }
        if (HL_NVML_RAISE_IF(module, n, n->handle_by_uuid(uuid, handle), "nvmlDeviceGetHandleByUUID") < 0)
            return -1;
        *index = UINT32_MAX;
        for (unsigned int i = 0; i < count; i++) { /* its index, for display */
            nvmlDevice_t other;
            if (n->handle_by_index(i, &other) == NVML_SUCCESS && other == *handle)
                *index = i;
        }
        return 0;
    }
    long i = PyLong_AsLong(device);
    if (i == -1 && PyErr_Occurred()) {
        PyErr_Format(PyExc_TypeError, "device: expected an NVML index (int) or a UUID (str), got %R", device);
        return -1;
    }
    if (i < 0 || (unsigned long)i >= count) {
        PyErr_Format(PyExc_ValueError, "device: expected an NVML index from 0 to %u, got %ld", count - 1, i);
        if (count == 0)
            PyErr_Format(PyExc_ValueError, "device: NVML sees no GPU on this machine (asked for %ld)", i);
        return -1;
    }
    if (HL_NVML_RAISE_IF(module, n, n->handle_by_index((unsigned int)i, handle), "nvmlDeviceGetHandleByIndex_v2") < 0)
        return -1;
    *index = (unsigned int)i;
    return 0;
}

/* ---------------------------------------------------------------------------------------------
   Module functions for doctor and the CLI */

PyDoc_STRVAR(nvml_unavailable_reason_doc,
             "nvml_unavailable_reason() -> str | None\n\nNone when NVML opens and initialises; else why not.");

static PyObject *nvml_unavailable_reason(PyObject *module, PyObject *Py_UNUSED(ignored)) {
    (void)module;
    int code = 0;
    char text[600] = "";
    const char *call = "";
    const hl_nvml *n;
    Py_BEGIN_ALLOW_THREADS
    n = hl_nvml_open(&code, text, sizeof(text), &call);
    Py_END_ALLOW_THREADS
    if (n != NULL)
        Py_RETURN_NONE;
    return PyUnicode_FromFormat("%s failed (NVML error %d): %s", call, code, text);
}

PyDoc_STRVAR(nvml_system_doc, "nvml_system() -> dict\n\n"
             "library, driver_version, cuda_driver_version (e.g. 13000) and device_count; NvmlError without NVML.");

static PyObject *nvml_system(PyObject *module, PyObject *Py_UNUSED(ignored)) {
    const hl_nvml *n = hl_nvml_open_or_raise(module);
    if (n == NULL)
        return NULL;
    char driver[HL_NVML_STRING_LEN] = "";
    int cuda = 0;
    unsigned int count = 0;
    if (HL_NVML_RAISE_IF(module, n, n->device_count(&count), "nvmlDeviceGetCount_v2") < 0)
        return NULL;
    int have_driver = n->driver_version && n->driver_version(driver, sizeof(driver)) == NVML_SUCCESS;
    int have_cuda = n->cuda_driver_version && n->cuda_driver_version(&cuda) == NVML_SUCCESS;
    PyObject *driver_obj = have_driver ? PyUnicode_FromString(driver) : Py_NewRef(Py_None);
    PyObject *cuda_obj = have_cuda ? PyLong_FromLong(cuda) : Py_NewRef(Py_None);
    return Py_BuildValue("{s:s, s:N, s:N, s:I}", "library", n->path, "driver_version", driver_obj,
                         "cuda_driver_version", cuda_obj, "device_count", count);
}

static int set_item(PyObject *dict, const char *key, PyObject *value) {
    if (value == NULL)
        return -1;
    int rc = PyDict_SetItemString(dict, key, value);
    Py_DECREF(value);
    return rc;
}

static PyObject *uint_reading(nvmlDeviceGetUInt_fn f, nvmlDevice_t d) {
    unsigned int v = 0;
    if (f == NULL || f(d, &v) != NVML_SUCCESS)
        return Py_NewRef(Py_None);
    return PyLong_FromUnsignedLong(v);
}

PyDoc_STRVAR(nvml_device_info_doc,
             "nvml_device_info(index) -> dict\n\n"
             "What NVML says about one device now: name, uuid, memory (total/used/reserved/free bytes),\n"
             "pcie (gen, gen_max, width, width_max), power_mw, power_limit_mw, power_default_limit_mw,\n"
             "temperature_c, sm_clock_mhz, sm_clock_max_mhz, utilization_gpu, utilization_jpeg (the JPEG\n"
             "engines, percent), reasons, persistence_mode,\n"
             "ecc (current, pending), mig (current, pending). None where the device does not say. Reads only.");

static PyObject *nvml_device_info(PyObject *module, PyObject *arg) {
    const hl_nvml *n = hl_nvml_open_or_raise(module);
    if (n == NULL)
        return NULL;
    nvmlDevice_t d;
    unsigned int index = 0;
    if (hl_nvml_device(module, n, arg, &d, &index) < 0)
        return NULL;
    PyObject *info = PyDict_New();
    if (info == NULL)
        return NULL;
    char text[HL_NVML_STRING_LEN];
    unsigned int v = 0, v2 = 0;
    int e = 0, e2 = 0;
    unsigned long long reasons = 0;
    nvmlUtilization_t util = {0};
    nvmlMemory_v2_t mem2 = {.version = HL_NVML_MEMORY_V2_VERSION};
    nvmlMemory_t mem1 = {0};
    PyObject *memory;
    if (n->memory_v2 && n->memory_v2(d, &mem2) == NVML_SUCCESS)
        memory = Py_BuildValue("{s:K, s:K, s:K, s:K}", "total", mem2.total, "used", mem2.used, "reserved",
                               mem2.reserved, "free", mem2.free);
    else if (n->memory_v1 && n->memory_v1(d, &mem1) == NVML_SUCCESS)
        memory = Py_BuildValue("{s:K, s:K, s:O, s:K}", "total", mem1.total, "used", mem1.used, "reserved", Py_None,
                               "free", mem1.free);
    else
        memory = Py_NewRef(Py_None);
    if (set_item(info, "index", PyLong_FromUnsignedLong(index)) < 0 ||
        set_item(info, "name", n->name && n->name(d, text, sizeof(text)) == NVML_SUCCESS ? PyUnicode_FromString(text)
                                                                                        : Py_NewRef(Py_None)) < 0 ||
        set_item(info, "uuid", n->uuid && n->uuid(d, text, sizeof(text)) == NVML_SUCCESS ? PyUnicode_FromString(text)
                                                                                        : Py_NewRef(Py_None)) < 0 ||
        set_item(info, "memory", memory) < 0 ||
        set_item(info, "pcie", Py_BuildValue("{s:N, s:N, s:N, s:N}", "gen", uint_reading(n->pcie_gen, d), "gen_max",
                                             uint_reading(n->pcie_gen_max, d), "width", uint_reading(n->pcie_width, d),
                                             "width_max", uint_reading(n->pcie_width_max, d))) < 0 ||
        set_item(info, "power_mw", uint_reading(n->power_usage, d)) < 0 ||
        set_item(info, "power_limit_mw", uint_reading(n->power_limit, d)) < 0 ||
        set_item(info, "power_default_limit_mw", uint_reading(n->power_default_limit, d)) < 0 ||
        set_item(info, "temperature_c", n->temperature && n->temperature(d, NVML_TEMPERATURE_GPU, &v) == NVML_SUCCESS
                                            ? PyLong_FromUnsignedLong(v) : Py_NewRef(Py_None)) < 0 ||
        set_item(info, "sm_clock_mhz", n->clock && n->clock(d, NVML_CLOCK_SM, &v) == NVML_SUCCESS
                                           ? PyLong_FromUnsignedLong(v) : Py_NewRef(Py_None)) < 0 ||
        set_item(info, "sm_clock_max_mhz", n->max_clock && n->max_clock(d, NVML_CLOCK_SM, &v) == NVML_SUCCESS
                                               ? PyLong_FromUnsignedLong(v) : Py_NewRef(Py_None)) < 0 ||
        set_item(info, "utilization_gpu", n->utilization && n->utilization(d, &util) == NVML_SUCCESS
                                              ? PyLong_FromUnsignedLong(util.gpu) : Py_NewRef(Py_None)) < 0 ||
        set_item(info, "utilization_jpeg", n->jpg_utilization && n->jpg_utilization(d, &v, &v2) == NVML_SUCCESS
                                               ? PyLong_FromUnsignedLong(v) : Py_NewRef(Py_None)) < 0 ||
        set_item(info, "reasons", n->reasons && n->reasons(d, &reasons) == NVML_SUCCESS
                                      ? PyLong_FromUnsignedLongLong(reasons) : Py_NewRef(Py_None)) < 0 ||
        set_item(info, "persistence_mode", n->persistence && n->persistence(d, &e) == NVML_SUCCESS
                                               ? PyBool_FromLong(e == NVML_FEATURE_ENABLED) : Py_NewRef(Py_None)) < 0 ||
        set_item(info, "ecc", n->ecc && n->ecc(d, &e, &e2) == NVML_SUCCESS
                                  ? Py_BuildValue("(OO)", e ? Py_True : Py_False, e2 ? Py_True : Py_False)
                                  : Py_NewRef(Py_None)) < 0 ||
        set_item(info, "mig", n->mig && n->mig(d, &v, &v2) == NVML_SUCCESS
                                  ? Py_BuildValue("(OO)", v ? Py_True : Py_False, v2 ? Py_True : Py_False)
                                  : Py_NewRef(Py_None)) < 0) {
        Py_DECREF(info);
        return NULL;
    }
    return info;
}

static PyMethodDef nvml_methods[] = {
    {"nvml_unavailable_reason", nvml_unavailable_reason, METH_NOARGS, nvml_unavailable_reason_doc},
    {"nvml_system", nvml_system, METH_NOARGS, nvml_system_doc},
    {"nvml_device_info", nvml_device_info, METH_O, nvml_device_info_doc},
    {NULL, NULL, 0, NULL},
};

/* the clock-event ("throttle") reason bits of nvml.h, which the sampler's readings and
   nvml_device_info's "reasons" hold */
static const hl_int_constant nvml_constants[] = {
    {"NVML_REASON_GPU_IDLE", (long)HL_NVML_REASON_GPU_IDLE},
    {"NVML_REASON_APP_CLOCKS", (long)HL_NVML_REASON_APP_CLOCKS},
    {"NVML_REASON_SW_POWER_CAP", (long)HL_NVML_REASON_SW_POWER_CAP},
    {"NVML_REASON_HW_SLOWDOWN", (long)HL_NVML_REASON_HW_SLOWDOWN},
    {"NVML_REASON_SYNC_BOOST", (long)HL_NVML_REASON_SYNC_BOOST},
    {"NVML_REASON_SW_THERMAL", (long)HL_NVML_REASON_SW_THERMAL},
    {"NVML_REASON_HW_THERMAL", (long)HL_NVML_REASON_HW_THERMAL},
    {"NVML_REASON_HW_POWER_BRAKE", (long)HL_NVML_REASON_HW_POWER_BRAKE},
    {"NVML_REASON_DISPLAY_CLOCKS", (long)HL_NVML_REASON_DISPLAY_CLOCKS},
    {NULL, 0},
};

int hl_nvml_exec(PyObject *module) {
    if (PyModule_AddFunctions(module, nvml_methods) < 0)
        return -1;
    return hl_add_int_constants(module, nvml_constants);
}
