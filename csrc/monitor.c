/* The NVML sampler: a Monitor type whose C threads read NVML (csrc/nvml.c opens it) without the GIL. */
#include "module.h"
#include "monitor.h"
#include "nvml.h"
#include "sample_ring.h"
#include "sampler_thread.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <time.h>

/* ---------------------------------------------------------------------------------------------
   The Monitor object. `sampler.lock` guards the rings and statistics; the sampler holds it only to push. */

typedef struct hl_monitor {
    PyObject_HEAD
    const hl_nvml *nvml;
    nvmlDevice_t device;
    unsigned int index;
    int memory_v2; /* 1: nvmlDeviceGetMemoryInfo_v2 works here; 0: the v1 call */
    int64_t interval_ns, slow_interval_ns, pcie_interval_ns;
    size_t capacity;

    hl_sampler_thread sampler, pcie_thread; /* sampler.lock guards what follows; pcie_thread's lock only its stopping */
    int ready;                       /* both initialised (dealloc tears down only what was set up) */

    sample_ring memory, slow, pcie;
    /* over every sample, kept or dropped */
    uint64_t ticks, ticks_missed, memory_samples, slow_samples, pcie_samples;
    uint64_t peak_used, reserved_at_peak, first_used, last_used, min_used;
    double peak_t, first_t, last_t;
    uint64_t util_sum, util_count, power_sum, power_count;
    uint32_t power_max, temperature_max, sm_clock_min, sm_clock_max;
    uint64_t reasons_seen;
    uint64_t pcie_rx_max, pcie_tx_max;
    int unsupported; /* bits: which slow readings the device refused with NOT_SUPPORTED */
    double started, stopped;
    uint64_t errors;
    int first_error;
    const char *first_error_call;
} hl_monitor;

enum { NO_UTIL = 1, NO_POWER = 2, NO_TEMP = 4, NO_SM_CLOCK = 8, NO_MEM_CLOCK = 16, NO_REASONS = 32, NO_JPEG = 64 };

/* called with m->sampler.lock held */
static void note_error(hl_monitor *m, nvmlReturn_t rc, const char *call) {
    if (m->errors++ == 0) {
        m->first_error = rc;
        m->first_error_call = call;
    }
}

static nvmlReturn_t read_memory(hl_monitor *m, hl_memory_sample *s) {
    if (m->memory_v2) {
        nvmlMemory_v2_t mem = {.version = HL_NVML_MEMORY_V2_VERSION};
        nvmlReturn_t rc = m->nvml->memory_v2(m->device, &mem);
        s->used = mem.used;
        s->reserved = mem.reserved;
        s->free = mem.free;
        return rc;
    }
    nvmlMemory_t mem = {0};
    nvmlReturn_t rc = m->nvml->memory_v1(m->device, &mem);
    s->used = mem.used;
    s->reserved = 0;
    s->free = mem.free;
    return rc;
}

static void sample_memory(hl_monitor *m) {
    hl_memory_sample s = {0};
    nvmlReturn_t rc = read_memory(m, &s);
    s.t = hl_seconds(hl_now_ns());
    pthread_mutex_lock(&m->sampler.lock);
    m->ticks++;
    if (rc != NVML_SUCCESS) {
        note_error(m, rc, m->memory_v2 ? "nvmlDeviceGetMemoryInfo_v2" : "nvmlDeviceGetMemoryInfo");
    } else {
        /* the peak sees every sample, including those the ring later drops */
        if (m->memory_samples == 0 || s.used > m->peak_used) {
            m->peak_used = s.used;
            m->reserved_at_peak = s.reserved;
            m->peak_t = s.t;
        }
        if (m->memory_samples == 0) {
            m->first_used = m->min_used = s.used;
            m->first_t = s.t;
        }
        if (s.used < m->min_used)
            m->min_used = s.used;
        m->last_used = s.used;
        m->last_t = s.t;
        m->memory_samples++;
        ring_push(&m->memory, &s);
    }
    pthread_mutex_unlock(&m->sampler.lock);
}

/* one slow reading; `bit` marks the reading unsupported after NOT_SUPPORTED so it is not asked again */
static uint32_t slow_reading(nvmlReturn_t rc, uint32_t value, int bit, const char *call, int *unsupported,
                             nvmlReturn_t *err, const char **err_call) {
    if (rc == NVML_SUCCESS)
        return value;
    if (rc == NVML_ERROR_NOT_SUPPORTED || rc == NVML_ERROR_FUNCTION_NOT_FOUND || rc == NVML_ERROR_NO_PERMISSION)
        *unsupported |= bit;
    else if (*err == NVML_SUCCESS) {
        *err = rc;
        *err_call = call;
    }
    return HL_UNSUPPORTED;
}

static void sample_slow(hl_monitor *m) {
    const hl_nvml *n = m->nvml;
    hl_slow_sample s = {0};
    int skip = m->unsupported, unsupported = 0; /* only this thread writes m->unsupported */
    nvmlReturn_t err = NVML_SUCCESS, rc;
    const char *err_call = NULL;
    unsigned int v = 0;
    nvmlUtilization_t util = {0};

    rc = (skip & NO_UTIL) || !n->utilization ? NVML_ERROR_FUNCTION_NOT_FOUND : n->utilization(m->device, &util);
    s.util_gpu = slow_reading(rc, util.gpu, NO_UTIL, "nvmlDeviceGetUtilizationRates", &unsupported, &err, &err_call);
    s.util_memory = rc == NVML_SUCCESS ? util.memory : HL_UNSUPPORTED;
    rc = (skip & NO_POWER) || !n->power_usage ? NVML_ERROR_FUNCTION_NOT_FOUND : n->power_usage(m->device, &v);
    s.power_mw = slow_reading(rc, v, NO_POWER, "nvmlDeviceGetPowerUsage", &unsupported, &err, &err_call);
    rc = (skip & NO_TEMP) || !n->temperature ? NVML_ERROR_FUNCTION_NOT_FOUND
                                             : n->temperature(m->device, NVML_TEMPERATURE_GPU, &v);
    s.temperature_c = slow_reading(rc, v, NO_TEMP, "nvmlDeviceGetTemperature", &unsupported, &err, &err_call);
    rc = (skip & NO_SM_CLOCK) || !n->clock ? NVML_ERROR_FUNCTION_NOT_FOUND : n->clock(m->device, NVML_CLOCK_SM, &v);
    s.sm_clock_mhz = slow_reading(rc, v, NO_SM_CLOCK, "nvmlDeviceGetClockInfo", &unsupported, &err, &err_call);
    rc = (skip & NO_MEM_CLOCK) || !n->clock ? NVML_ERROR_FUNCTION_NOT_FOUND
                                            : n->clock(m->device, NVML_CLOCK_MEM, &v);
    s.memory_clock_mhz = slow_reading(rc, v, NO_MEM_CLOCK, "nvmlDeviceGetClockInfo", &unsupported, &err, &err_call);
    unsigned long long reasons = 0;
    rc = (skip & NO_REASONS) || !n->reasons ? NVML_ERROR_FUNCTION_NOT_FOUND : n->reasons(m->device, &reasons);
    slow_reading(rc, 0, NO_REASONS, "nvmlDeviceGetCurrentClocksEventReasons", &unsupported, &err, &err_call);
    s.reasons = rc == NVML_SUCCESS ? reasons : 0;
    unsigned int period_us = 0;
    rc = (skip & NO_JPEG) || !n->jpg_utilization ? NVML_ERROR_FUNCTION_NOT_FOUND
                                                 : n->jpg_utilization(m->device, &v, &period_us);
    s.util_jpeg = slow_reading(rc, v, NO_JPEG, "nvmlDeviceGetJpgUtilization", &unsupported, &err, &err_call);
    s.t = hl_seconds(hl_now_ns());

    pthread_mutex_lock(&m->sampler.lock);
    m->unsupported |= unsupported;
    if (err != NVML_SUCCESS)
        note_error(m, err, err_call);
    if (s.util_gpu != HL_UNSUPPORTED) {
        m->util_sum += s.util_gpu;
        m->util_count++;
    }
    if (s.power_mw != HL_UNSUPPORTED) {
        m->power_sum += s.power_mw;
        m->power_count++;
        m->power_max = s.power_mw > m->power_max ? s.power_mw : m->power_max;
    }
    if (s.temperature_c != HL_UNSUPPORTED)
        m->temperature_max = s.temperature_c > m->temperature_max ? s.temperature_c : m->temperature_max;
    if (s.sm_clock_mhz != HL_UNSUPPORTED) {
        m->sm_clock_max = s.sm_clock_mhz > m->sm_clock_max ? s.sm_clock_mhz : m->sm_clock_max;
        m->sm_clock_min = s.sm_clock_mhz < m->sm_clock_min ? s.sm_clock_mhz : m->sm_clock_min;
    }
    m->reasons_seen |= s.reasons;
    m->slow_samples++;
    ring_push(&m->slow, &s);
    pthread_mutex_unlock(&m->sampler.lock);
}

static void *sampler_main(void *arg) {
    hl_monitor *m = arg;
    /* Linux lets a sleeping thread wake up to 50 us late by default: too coarse below 1 ms */
    if (m->interval_ns < 1000000)
        prctl(PR_SET_TIMERSLACK, 1000UL, 0UL, 0UL, 0UL);
    /* the first readings at once, here rather than in start(): entering a monitor does not wait on NVML */
    int64_t next = hl_now_ns(), next_slow = next;
    while (!hl_sampler_stopping(&m->sampler)) {
        sample_memory(m);
        if (hl_now_ns() >= next_slow) {
            sample_slow(m);
            next_slow += m->slow_interval_ns;
        }
        next = hl_sampler_next_tick(&m->sampler, next, m->interval_ns, &m->ticks_missed);
        int64_t now = hl_now_ns();
        if (next_slow < now - m->slow_interval_ns)
            next_slow = now;
        hl_sampler_sleep_until(&m->sampler, next);
    }
    return NULL;
}

/* PCIe throughput blocks ~20 ms per counter inside NVML: its own thread keeps the memory tick on time */
static void *pcie_main(void *arg) {
    hl_monitor *m = arg;
    int64_t next = hl_now_ns();
    while (!hl_sampler_stopping(&m->pcie_thread)) {
        unsigned int rx = 0, tx = 0;
        nvmlReturn_t rc = m->nvml->pcie_throughput(m->device, NVML_PCIE_UTIL_RX_BYTES, &rx);
        if (rc == NVML_SUCCESS)
            rc = m->nvml->pcie_throughput(m->device, NVML_PCIE_UTIL_TX_BYTES, &tx);
        hl_pcie_sample s = {.t = hl_seconds(hl_now_ns()), .rx_kb_per_s = rx, .tx_kb_per_s = tx};
        pthread_mutex_lock(&m->sampler.lock);
        if (rc != NVML_SUCCESS) {
            note_error(m, rc, "nvmlDeviceGetPcieThroughput");
        } else {
            m->pcie_rx_max = rx > m->pcie_rx_max ? rx : m->pcie_rx_max;
            m->pcie_tx_max = tx > m->pcie_tx_max ? tx : m->pcie_tx_max;
            m->pcie_samples++;
            ring_push(&m->pcie, &s);
        }
        pthread_mutex_unlock(&m->sampler.lock);
        if (rc == NVML_ERROR_NOT_SUPPORTED || rc == NVML_ERROR_FUNCTION_NOT_FOUND)
            break;
        next += m->pcie_interval_ns;
        int64_t now = hl_now_ns();
        if (next < now)
            next = now;
        hl_sampler_sleep_until(&m->pcie_thread, next);
    }
    return NULL;
}

/* ---------------------------------------------------------------------------------------------
   Python methods */

static PyObject *module_of(PyObject *self) { return PyType_GetModule(Py_TYPE(self)); }

static void reset_statistics(hl_monitor *m) {
    ring_clear(&m->memory);
    ring_clear(&m->slow);
    ring_clear(&m->pcie);
    m->ticks = m->ticks_missed = m->memory_samples = m->slow_samples = m->pcie_samples = 0;
    m->peak_used = m->reserved_at_peak = m->first_used = m->last_used = m->min_used = 0;
    m->peak_t = m->first_t = m->last_t = 0.0;
    m->util_sum = m->util_count = m->power_sum = m->power_count = 0;
    m->power_max = m->temperature_max = m->sm_clock_max = 0;
    m->sm_clock_min = UINT32_MAX;
    m->reasons_seen = 0;
    m->pcie_rx_max = m->pcie_tx_max = 0;
    m->errors = 0;
    m->first_error = 0;
    m->first_error_call = NULL;
    m->stopped = 0.0;
}

/* Join both threads. Called without the GIL and without the lock (the sampler takes it). */
static void join_threads(hl_monitor *m) {
    hl_sampler_stop(&m->sampler);
    hl_sampler_stop(&m->pcie_thread);
    m->stopped = hl_seconds(hl_now_ns());
}

PyDoc_STRVAR(start_doc, "start()\n\nClear the previous run and start sampling (one C thread; a second one for\n"
             "PCIe when pcie_interval_ms > 0). RuntimeError if already running.");

static PyObject *monitor_start(PyObject *self, PyObject *Py_UNUSED(ignored)) {
    hl_monitor *m = (hl_monitor *)self;
    int err = 0, pcie_err = 0;
    if (m->sampler.running) {
        PyErr_SetString(PyExc_RuntimeError, "Monitor.start(): already running; call stop() first");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&m->sampler.lock);
    reset_statistics(m);
    m->unsupported = 0;
    m->started = hl_seconds(hl_now_ns());
    pthread_mutex_unlock(&m->sampler.lock);
    err = hl_sampler_start(&m->sampler, sampler_main, m);
    if (err == 0 && m->pcie_interval_ns > 0 && m->nvml->pcie_throughput != NULL) {
        pcie_err = hl_sampler_start(&m->pcie_thread, pcie_main, m);
        if (pcie_err != 0)
            join_threads(m);
    }
    Py_END_ALLOW_THREADS
    if (err != 0 || pcie_err != 0) {
        errno = err != 0 ? err : pcie_err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    Py_RETURN_NONE;
}

PyDoc_STRVAR(stop_doc, "stop()\n\nStop sampling and join the sampler thread(s), then take a last memory reading.\n"
                       "Does nothing when not running.");

static PyObject *monitor_stop(PyObject *self, PyObject *Py_UNUSED(ignored)) {
    hl_monitor *m = (hl_monitor *)self;
    if (m->sampler.running || m->pcie_thread.running) {
        Py_BEGIN_ALLOW_THREADS
        join_threads(m);
        sample_memory(m);
        Py_END_ALLOW_THREADS
    }
    Py_RETURN_NONE;
}

/* the copy snapshot() takes under the lock, turned into Python objects once the GIL is back */
typedef struct {
    char *memory, *slow, *pcie;
    size_t memory_n, slow_n, pcie_n;
    hl_monitor stats; /* a copy of the counters (its rings and lock are not used) */
} snapshot_copy;

static int take_copy(hl_monitor *m, snapshot_copy *c) {
    pthread_mutex_lock(&m->sampler.lock);
    c->stats = *m;
    c->memory_n = m->memory.count;
    c->slow_n = m->slow.count;
    c->pcie_n = m->pcie.count;
    c->memory = malloc(c->memory_n * m->memory.item + 1);
    c->slow = malloc(c->slow_n * m->slow.item + 1);
    c->pcie = malloc(c->pcie_n * m->pcie.item + 1);
    int ok = c->memory && c->slow && c->pcie;
    if (ok) {
        ring_copy(&m->memory, c->memory);
        ring_copy(&m->slow, c->slow);
        ring_copy(&m->pcie, c->pcie);
    }
    pthread_mutex_unlock(&m->sampler.lock);
    return ok ? 0 : -1;
}

static PyObject *unsigned_or_none(uint32_t value) {
    return value == HL_UNSUPPORTED ? Py_NewRef(Py_None) : PyLong_FromUnsignedLong(value);
}

PyDoc_STRVAR(snapshot_doc,
             "snapshot() -> dict\n\n"
             "The kept samples, oldest first, as bytes of packed records (memory: f8 t, u8 used, u8 reserved,\n"
             "u8 free; slow: f8 t, u4 util_gpu, util_memory, power_mw, temperature_c, sm_clock_mhz,\n"
             "memory_clock_mhz, u8 reasons, u4 util_jpeg, u4 unused; pcie: f8 t, u4 rx_kb_per_s,\n"
             "tx_kb_per_s; times are time.monotonic() seconds, 0xffffffff marks an unsupported reading) and\n"
             "statistics over every sample taken, kept or dropped. Works while running.");

static PyObject *monitor_snapshot(PyObject *self, PyObject *Py_UNUSED(ignored)) {
    hl_monitor *m = (hl_monitor *)self;
    snapshot_copy c = {0};
    PyObject *result = NULL, *memory = NULL, *slow = NULL, *pcie = NULL, *error = NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = take_copy(m, &c);
    Py_END_ALLOW_THREADS
    if (rc < 0) {
        PyErr_NoMemory();
        goto error;
    }
    memory = PyBytes_FromStringAndSize(c.memory, (Py_ssize_t)(c.memory_n * sizeof(hl_memory_sample)));
    slow = PyBytes_FromStringAndSize(c.slow, (Py_ssize_t)(c.slow_n * sizeof(hl_slow_sample)));
    pcie = PyBytes_FromStringAndSize(c.pcie, (Py_ssize_t)(c.pcie_n * sizeof(hl_pcie_sample)));
    if (memory == NULL || slow == NULL || pcie == NULL)
        goto error;
    const hl_monitor *s = &c.stats;
    if (s->errors > 0) {
        const char *text = m->nvml->error_string(s->first_error);
        error = Py_BuildValue("{s:i, s:s, s:s, s:K}", "code", s->first_error, "call", s->first_error_call,
                              "text", text ? text : "unknown", "count", (unsigned long long)s->errors);
        if (error == NULL)
            goto error;
    } else {
        error = Py_NewRef(Py_None);
    }
    result = Py_BuildValue(
        "{s:O, s:O, s:O, s:O, s:O, s:d, s:d, s:K, s:K, s:K, s:K, s:K, s:K, s:K, s:K, s:K, s:K, s:d, s:K, s:K,"
        " s:d, s:K, s:d, s:d, s:d, s:d, s:N, s:N, s:N, s:N, s:K, s:K, s:K, s:N, s:N}",
        "memory", memory, "slow", slow, "pcie", pcie, "error", error, "running",
        m->sampler.running ? Py_True : Py_False,
        "started", s->started, "stopped", s->stopped, "ticks", (unsigned long long)s->ticks, "ticks_missed",
        (unsigned long long)s->ticks_missed, "memory_samples", (unsigned long long)s->memory_samples,
        "slow_samples", (unsigned long long)s->slow_samples, "pcie_samples", (unsigned long long)s->pcie_samples,
        "memory_dropped", (unsigned long long)s->memory.dropped, "slow_dropped", (unsigned long long)s->slow.dropped,
        "pcie_dropped", (unsigned long long)s->pcie.dropped, "peak_used", (unsigned long long)s->peak_used,
        "reserved_at_peak", (unsigned long long)s->reserved_at_peak, "peak_t", s->peak_t, "first_used",
        (unsigned long long)s->first_used, "min_used", (unsigned long long)s->min_used, "first_t", s->first_t,
        "last_used", (unsigned long long)s->last_used, "last_t", s->last_t, "util_mean",
        s->util_count ? (double)s->util_sum / (double)s->util_count : -1.0, "power_mean_w",
        s->power_count ? (double)s->power_sum / (double)s->power_count / 1000.0 : -1.0, "interval_s",
        hl_seconds(m->interval_ns), "power_max_mw", unsigned_or_none(s->power_count ? s->power_max : HL_UNSUPPORTED),
        "temperature_max_c", unsigned_or_none(s->temperature_max ? s->temperature_max : HL_UNSUPPORTED),
        "sm_clock_min_mhz", unsigned_or_none(s->sm_clock_min), "sm_clock_max_mhz",
        unsigned_or_none(s->sm_clock_max ? s->sm_clock_max : HL_UNSUPPORTED), "reasons_seen",
        (unsigned long long)s->reasons_seen, "pcie_rx_max_kb_per_s", (unsigned long long)s->pcie_rx_max,
        "pcie_tx_max_kb_per_s", (unsigned long long)s->pcie_tx_max, "util_count",
        PyLong_FromUnsignedLongLong(s->util_count), "power_count", PyLong_FromUnsignedLongLong(s->power_count));
error:
    Py_XDECREF(memory);
    Py_XDECREF(slow);
    Py_XDECREF(pcie);
    Py_XDECREF(error);
    free(c.memory);
    free(c.slow);
    free(c.pcie);
    return result;
}

PyDoc_STRVAR(check_doc, "check()\n\nRaise hotloop.NvmlError for the first NVML call that failed while sampling, if any.");

static PyObject *monitor_check(PyObject *self, PyObject *Py_UNUSED(ignored)) {
    hl_monitor *m = (hl_monitor *)self;
    int code;
    const char *call;
    uint64_t errors;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&m->sampler.lock);
    code = m->first_error;
    call = m->first_error_call;
    errors = m->errors;
    pthread_mutex_unlock(&m->sampler.lock);
    Py_END_ALLOW_THREADS
    if (errors == 0)
        Py_RETURN_NONE;
    char detail[48];
    snprintf(detail, sizeof(detail), " (%llu failed samples)", (unsigned long long)errors);
    hl_nvml_raise_if(module_of(self), m->nvml, code, call, detail, __FILE__, __LINE__);
    return NULL;
}

PyDoc_STRVAR(read_memory_doc, "read_memory() -> (used, reserved, free, total)\n\nOne reading now, in bytes.");

static PyObject *monitor_read_memory(PyObject *self, PyObject *Py_UNUSED(ignored)) {
    hl_monitor *m = (hl_monitor *)self;
    nvmlReturn_t rc;
    unsigned long long total = 0;
    hl_memory_sample s = {0};
    Py_BEGIN_ALLOW_THREADS
    rc = read_memory(m, &s);
    Py_END_ALLOW_THREADS
    if (HL_NVML_RAISE_IF(module_of(self), m->nvml, rc,
                         m->memory_v2 ? "nvmlDeviceGetMemoryInfo_v2" : "nvmlDeviceGetMemoryInfo") < 0)
        return NULL;
    total = s.used + s.reserved + s.free;
    return Py_BuildValue("(KKKK)", (unsigned long long)s.used, (unsigned long long)s.reserved,
                         (unsigned long long)s.free, total);
}

static PyObject *get_running(PyObject *self, void *Py_UNUSED(closure)) {
    return PyBool_FromLong(((hl_monitor *)self)->sampler.running);
}

static PyObject *get_device(PyObject *self, void *Py_UNUSED(closure)) {
    return PyLong_FromUnsignedLong(((hl_monitor *)self)->index);
}

static PyObject *get_interval_ms(PyObject *self, void *Py_UNUSED(closure)) {
    return PyFloat_FromDouble((double)((hl_monitor *)self)->interval_ns * 1e-6);
}

static PyObject *get_capacity(PyObject *self, void *Py_UNUSED(closure)) {
    return PyLong_FromSize_t(((hl_monitor *)self)->capacity);
}

static PyObject *get_library(PyObject *self, void *Py_UNUSED(closure)) {
    return PyUnicode_FromString(((hl_monitor *)self)->nvml->path);
}

static PyObject *get_memory_v2(PyObject *self, void *Py_UNUSED(closure)) {
    return PyBool_FromLong(((hl_monitor *)self)->memory_v2);
}

static PyGetSetDef monitor_getset[] = {
    {"running", get_running, NULL, "whether the sampler thread runs", NULL},
    {"device", get_device, NULL, "the NVML device index sampled", NULL},
    {"interval_ms", get_interval_ms, NULL, "the memory tick, milliseconds", NULL},
    {"capacity", get_capacity, NULL, "memory samples the ring keeps", NULL},
    {"library", get_library, NULL, "the NVML library in use", NULL},
    {"memory_v2", get_memory_v2, NULL, "whether nvmlDeviceGetMemoryInfo_v2 (used and reserved) is read", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMethodDef monitor_methods[] = {
    {"start", monitor_start, METH_NOARGS, start_doc},
    {"stop", monitor_stop, METH_NOARGS, stop_doc},
    {"snapshot", monitor_snapshot, METH_NOARGS, snapshot_doc},
    {"check", monitor_check, METH_NOARGS, check_doc},
    {"read_memory", monitor_read_memory, METH_NOARGS, read_memory_doc},
    {NULL, NULL, 0, NULL},
};

static PyObject *monitor_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    static char *keywords[] = {"device", "interval_ms", "slow_interval_ms", "pcie_interval_ms", "capacity", NULL};
    PyObject *device = NULL;
    double interval_ms = 1.0, slow_ms = 50.0, pcie_ms = 0.0;
    Py_ssize_t capacity = 131072;
    hl_monitor *m = NULL;
    PyObject *module = PyType_GetModule(type);
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|Odddn:Monitor", keywords, &device, &interval_ms, &slow_ms,
                                     &pcie_ms, &capacity))
        return NULL;
    if (!(interval_ms >= 0.01 && interval_ms <= 3.6e6)) {
        char message[120];
        snprintf(message, sizeof(message), "interval_ms: expected 0.01 to 3600000 milliseconds, got %g", interval_ms);
        PyErr_SetString(PyExc_ValueError, message);
        return NULL;
    }
    if (!(slow_ms >= interval_ms) || !(pcie_ms >= 0.0)) {
        PyErr_SetString(PyExc_ValueError, "slow_interval_ms: expected at least interval_ms; pcie_interval_ms: "
                        "expected 0 (off) or a positive number of milliseconds");
        return NULL;
    }
    if (capacity < 1 || capacity > ((Py_ssize_t)1 << 28)) {
        PyErr_Format(PyExc_ValueError, "capacity: expected 1 to 2**28 samples, got %zd", capacity);
        return NULL;
    }
    const hl_nvml *n = hl_nvml_open_or_raise(module);
    if (n == NULL)
        return NULL;
    nvmlDevice_t handle = NULL;
    unsigned int index = 0;
    PyObject *zero = NULL;
    if (device == NULL || device == Py_None)
        device = zero = PyLong_FromLong(0);
    if (device == NULL)
        return NULL;
    int rc = hl_nvml_device(module, n, device, &handle, &index);
    Py_XDECREF(zero);
    if (rc < 0)
        return NULL;

    allocfunc alloc = (allocfunc)PyType_GetSlot(type, Py_tp_alloc);
    m = (hl_monitor *)alloc(type, 0);
    if (m == NULL)
        return NULL;
    m->nvml = n;
    m->device = handle;
    m->index = index;
    m->interval_ns = (int64_t)(interval_ms * 1e6);
    m->slow_interval_ns = (int64_t)(slow_ms * 1e6);
    m->pcie_interval_ns = (int64_t)(pcie_ms * 1e6);
    m->capacity = (size_t)capacity;
    /* the slow and PCIe rings hold as many seconds as the memory ring, at their slower rates */
    size_t slow_capacity = (size_t)((double)capacity * interval_ms / slow_ms) + 16;
    size_t pcie_capacity = pcie_ms > 0 ? (size_t)((double)capacity * interval_ms / pcie_ms) + 16 : 1;
    if (ring_init(&m->memory, sizeof(hl_memory_sample), (size_t)capacity) < 0 ||
        ring_init(&m->slow, sizeof(hl_slow_sample), slow_capacity) < 0 ||
        ring_init(&m->pcie, sizeof(hl_pcie_sample), pcie_capacity) < 0) {
        Py_DECREF(m); /* dealloc frees what was allocated */
        return PyErr_NoMemory();
    }
    /* prefer the v2 call (it splits the driver's reservation out of `used`); fall back when absent */
    if (n->memory_v2 != NULL) {
        nvmlMemory_v2_t mem = {.version = HL_NVML_MEMORY_V2_VERSION};
        m->memory_v2 = n->memory_v2(handle, &mem) == NVML_SUCCESS || n->memory_v1 == NULL;
    }
    reset_statistics(m);
    if (hl_sampler_init(&m->sampler) < 0) {
        Py_DECREF(m);
        return PyErr_NoMemory();
    }
    if (hl_sampler_init(&m->pcie_thread) < 0) {
        hl_sampler_destroy(&m->sampler);
        Py_DECREF(m);
        return PyErr_NoMemory();
    }
    m->ready = 1;
    return (PyObject *)m;
}

static void monitor_dealloc(PyObject *self) {
    hl_monitor *m = (hl_monitor *)self;
    PyTypeObject *type = Py_TYPE(self);
    if (m->ready) {
        Py_BEGIN_ALLOW_THREADS
        join_threads(m); /* both threads gone before either lock is destroyed: the PCIe thread takes the sampler's */
        hl_sampler_destroy(&m->sampler);
        hl_sampler_destroy(&m->pcie_thread);
        Py_END_ALLOW_THREADS
    }
    ring_free(&m->memory);
    ring_free(&m->slow);
    ring_free(&m->pcie);
    freefunc tp_free = (freefunc)PyType_GetSlot(type, Py_tp_free);
    tp_free(self);
    Py_DECREF(type);
}

PyDoc_STRVAR(monitor_doc,
             "Monitor(device=0, interval_ms=1.0, slow_interval_ms=50.0, pcie_interval_ms=0.0, capacity=131072)\n\n"
             "An NVML sampler run by a C thread without the GIL: device memory every interval_ms; utilisation\n"
             "(SMs, memory, JPEG engines), power, temperature, clocks and clock-event reasons every\n"
             "slow_interval_ms; PCIe throughput on a thread of its own every pcie_interval_ms (0: off). `device` is an NVML index or a UUID. The ring\n"
             "keeps the newest `capacity` memory samples; peaks and means cover every sample.\n"
             "Raises hotloop.NvmlError when NVML is missing or fails.");

static PyType_Slot monitor_slots[] = {
    {Py_tp_new, monitor_new},
    {Py_tp_dealloc, monitor_dealloc},
    {Py_tp_methods, monitor_methods},
    {Py_tp_getset, monitor_getset},
    {Py_tp_doc, (void *)monitor_doc},
    {0, NULL},
};

static PyType_Spec monitor_spec = {
    .name = "hotloop._C.Monitor",
    .basicsize = sizeof(hl_monitor),
    .flags = Py_TPFLAGS_DEFAULT,
    .slots = monitor_slots,
};

static const hl_int_constant monitor_constants[] = {
    {"MONITOR_MEMORY_SAMPLE_BYTES", (long)sizeof(hl_memory_sample)},
    {"MONITOR_SLOW_SAMPLE_BYTES", (long)sizeof(hl_slow_sample)},
    {"MONITOR_PCIE_SAMPLE_BYTES", (long)sizeof(hl_pcie_sample)},
    {"MONITOR_UNSUPPORTED", (long)HL_UNSUPPORTED}, /* a u4 reading of a slow sample the device does not offer */
    {NULL, 0},
};

int hl_monitor_exec(PyObject *module) {
    hl_state *state = hl_state_of(module);
    state->monitor_type = PyType_FromModuleAndSpec(module, &monitor_spec, NULL);
    if (state->monitor_type == NULL)
        return -1;
    if (hl_add_int_constants(module, monitor_constants) < 0)
        return -1;
    return PyModule_AddObjectRef(module, "Monitor", state->monitor_type);
}
