/* CUDA from C: availability and versions for Python, the device guard, table uploads, events and copies. */
#include "cuda.h"

#ifdef HOTLOOP_WITH_CUDA

/* the driver's device count, or the error that says why there is none (*why: a sentence) */
static CUresult count_devices(int *count, const char **why) {
    *count = 0;
    CUresult err = hl_driver_load(why);
    if (err == CUDA_SUCCESS)
        err = hl_cu.cuDeviceGetCount(count);
    if (err != CUDA_SUCCESS)
        *count = 0;
    return err;
}

/* the driver could not be opened or has no device: no GPU here, as opposed to a driver that failed */
static int is_absent(CUresult err) {
    return err == CUDA_ERROR_STUB_LIBRARY || err == CUDA_ERROR_NO_DEVICE || err == CUDA_ERROR_NOT_INITIALIZED;
}

int hl_cuda_require(PyObject *module, int device) {
    const char *why = "";
    int count = 0;
    CUresult err = count_devices(&count, &why);
    if (is_absent(err) || (err == CUDA_SUCCESS && count == 0)) {
        PyErr_Format(PyExc_RuntimeError, "no CUDA driver found (or no CUDA device): this call needs a GPU (%s)",
                     *why ? why : "the driver sees no device");
        return -1;
    }
    if (err != CUDA_SUCCESS) {
        if (hl_cu.cuDeviceGetCount == NULL || hl_cu.cuGetErrorName == NULL) {
            PyErr_Format(PyExc_RuntimeError, "the CUDA driver cannot be used: %s", why);
            return -1;
        }
        hl_cuda_status status = {err, "cuInit", __FILE__, __LINE__};
        return hl_cuda_raise_if(module, &status);
    }
    if (device < 0 || device >= count) {
        PyErr_Format(PyExc_ValueError, "no CUDA device %d: this machine has %d", device, count);
        return -1;
    }
    return 0;
}

void hl_device_enter(hl_device_guard *guard, int device, hl_cuda_status *status) {
    guard->changed = 0;
    guard->previous = NULL;
    CUcontext want = NULL;
    HL_CUDA(status, hl_primary_context(device, &want));
    HL_CUDA(status, hl_cu.cuCtxGetCurrent(&guard->previous));
    if (status->code == 0 && guard->previous != want) {
        HL_CUDA(status, hl_cu.cuCtxSetCurrent(want));
        guard->changed = status->code == 0;
    }
}

void hl_device_leave(hl_device_guard *guard, hl_cuda_status *status) {
    if (guard->changed)
        HL_CUDA(status, hl_cu.cuCtxSetCurrent(guard->previous));
    guard->changed = 0;
}

int hl_cuda_run(PyObject *module, int device, hl_launch_fn launch, void *ctx) {
    hl_cuda_status status = {0};
    Py_BEGIN_ALLOW_THREADS
    hl_device_guard guard;
    hl_device_enter(&guard, device, &status);
    HL_CUDA(&status, launch(ctx));
    hl_device_leave(&guard, &status);
    Py_END_ALLOW_THREADS
    return hl_cuda_raise_if(module, &status);
}

void hl_table_upload(void *device_dst, const void *src, size_t nbytes, CUstream stream, hl_cuda_status *status) {
    HL_CUDA(status, hl_cu.cuMemcpyHtoDAsync((CUdeviceptr)(uintptr_t)device_dst, src, nbytes, stream));
}

static PyObject *why_unavailable(void) {
    const char *why = "";
    int count = 0;
    CUresult err = count_devices(&count, &why);
    if (err != CUDA_SUCCESS)
        return PyUnicode_FromString(why); /* hl_driver_load's sentence names the cause */
    if (count == 0)
        return PyUnicode_FromString("no CUDA device");
    Py_RETURN_NONE;
}

static PyObject *device_count(void) {
    int count = 0;
    const char *why;
    count_devices(&count, &why);
    return PyLong_FromLong(count);
}

static PyObject *driver_version(void) {
    int version = 0;
    (void)hl_driver_load(NULL); /* a driver whose cuInit failed still says its version */
    if (hl_cu.cuDriverGetVersion == NULL || hl_cu.cuDriverGetVersion(&version) != CUDA_SUCCESS || version == 0)
        Py_RETURN_NONE;
    return PyLong_FromLong(version);
}

/* A call given only a stream (0 being the legacy default stream of the *current* context) on a
   thread where no context is current yet: device 0's primary context made current, for good, as
   the runtime API does on a thread's first call. */
static void ensure_context(hl_cuda_status *status) {
    CUcontext current = NULL;
    HL_CUDA(status, hl_driver_load(NULL)); /* these calls come without hl_cuda_require */
    HL_CUDA(status, hl_cu.cuCtxGetCurrent(&current));
    if (status->code == 0 && current == NULL) {
        HL_CUDA(status, hl_primary_context(0, &current));
        HL_CUDA(status, hl_cu.cuCtxSetCurrent(current));
    }
}

/* Events, stream waits and host-to-device copies for the loader: handles travel as ints. */
PyDoc_STRVAR(cuda_event_create_doc, "cuda_event_create(device, timing=False) -> int\n\n"
             "A CUDA event on `device` (without timing unless asked: cheaper to record and query).");
static PyObject *py_cuda_event_create(PyObject *m, PyObject *args) {
    int device, timing = 0;
    if (!PyArg_ParseTuple(args, "i|p:cuda_event_create", &device, &timing) || hl_cuda_require(m, device) < 0)
        return NULL;
    CUevent event = NULL;
    hl_cuda_status status = {0};
    Py_BEGIN_ALLOW_THREADS
    hl_device_guard guard;
    hl_device_enter(&guard, device, &status);
    HL_CUDA(&status, hl_cu.cuEventCreate(&event, timing ? CU_EVENT_DEFAULT : CU_EVENT_DISABLE_TIMING));
    hl_device_leave(&guard, &status);
    Py_END_ALLOW_THREADS
    if (hl_cuda_raise_if(m, &status) < 0)
        return NULL;
    return PyLong_FromVoidPtr(event);
}

static int parse_event(PyObject *obj, CUevent *event) {
    *event = (CUevent)PyLong_AsVoidPtr(obj);
    if (*event == NULL) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "event: expected a handle from cuda_event_create, got 0");
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(cuda_event_record_doc, "cuda_event_record(event, stream)\n\nRecord the event on `stream` (an int).");
/* the one event argument of a call taking nothing else */
static int parse_one_event(PyObject *args, const char *format, CUevent *event) {
    PyObject *obj;
    return PyArg_ParseTuple(args, format, &obj) ? parse_event(obj, event) : -1;
}

static PyObject *py_cuda_event_record(PyObject *m, PyObject *args) {
    PyObject *obj;
    unsigned long long stream;
    CUevent event;
    if (!PyArg_ParseTuple(args, "OK:cuda_event_record", &obj, &stream) || parse_event(obj, &event) < 0)
        return NULL;
    hl_cuda_status status = {0};
    ensure_context(&status);
    HL_CUDA(&status, hl_cu.cuEventRecord(event, hl_stream(stream)));
    if (hl_cuda_raise_if(m, &status) < 0)
        return NULL;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(cuda_event_query_doc, "cuda_event_query(event) -> bool\n\nTrue once all work before the record completed.");
static PyObject *py_cuda_event_query(PyObject *m, PyObject *args) {
    CUevent event;
    if (parse_one_event(args, "O:cuda_event_query", &event) < 0)
        return NULL;
    CUresult err = hl_cu.cuEventQuery(event);
    if (err == CUDA_ERROR_NOT_READY) /* not an error, and the driver API keeps no sticky last error */
        Py_RETURN_FALSE;
    hl_cuda_status status = {0};
    HL_CUDA(&status, err);
    if (hl_cuda_raise_if(m, &status) < 0)
        return NULL;
    Py_RETURN_TRUE;
}

PyDoc_STRVAR(cuda_event_synchronize_doc, "cuda_event_synchronize(event)\n\nWait (GIL released) for the event.");
static PyObject *py_cuda_event_synchronize(PyObject *m, PyObject *args) {
    CUevent event;
    if (parse_one_event(args, "O:cuda_event_synchronize", &event) < 0)
        return NULL;
    hl_cuda_status status = {0};
    Py_BEGIN_ALLOW_THREADS
    HL_CUDA(&status, hl_cu.cuEventSynchronize(event));
    Py_END_ALLOW_THREADS
    if (hl_cuda_raise_if(m, &status) < 0)
        return NULL;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(cuda_event_elapsed_doc, "cuda_event_elapsed(start, end) -> float\n\n"
             "Milliseconds between two completed timing events.");
static PyObject *py_cuda_event_elapsed(PyObject *m, PyObject *args) {
    PyObject *a, *b;
    CUevent start, end;
    float ms = 0.0f;
    if (!PyArg_ParseTuple(args, "OO:cuda_event_elapsed", &a, &b) || parse_event(a, &start) < 0 ||
        parse_event(b, &end) < 0)
        return NULL;
    hl_cuda_status status = {0};
    HL_CUDA(&status, hl_cu.cuEventElapsedTime(&ms, start, end));
    if (hl_cuda_raise_if(m, &status) < 0)
        return NULL;
    return PyFloat_FromDouble((double)ms);
}

PyDoc_STRVAR(cuda_event_destroy_doc, "cuda_event_destroy(event)");
static PyObject *py_cuda_event_destroy(PyObject *m, PyObject *args) {
    CUevent event;
    if (parse_one_event(args, "O:cuda_event_destroy", &event) < 0)
        return NULL;
    hl_cuda_status status = {0};
    HL_CUDA(&status, hl_cu.cuEventDestroy(event));
    if (hl_cuda_raise_if(m, &status) < 0)
        return NULL;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(cuda_stream_wait_event_doc, "cuda_stream_wait_event(stream, event)\n\n"
             "Work queued on `stream` after this waits for the event (nothing blocks the host).");
static PyObject *py_cuda_stream_wait_event(PyObject *m, PyObject *args) {
    PyObject *obj;
    unsigned long long stream;
    CUevent event;
    if (!PyArg_ParseTuple(args, "KO:cuda_stream_wait_event", &stream, &obj) || parse_event(obj, &event) < 0)
        return NULL;
    hl_cuda_status status = {0};
    ensure_context(&status);
    HL_CUDA(&status, hl_cu.cuStreamWaitEvent(hl_stream(stream), event, 0));
    if (hl_cuda_raise_if(m, &status) < 0)
        return NULL;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(cuda_memcpy_htod_async_doc, "cuda_memcpy_htod_async(dst, src, nbytes, stream)\n\n"
             "cuMemcpyHtoDAsync on `stream` (addresses as ints). Pinned `src` makes it a DMA\n"
             "that returns at once; the caller keeps both alive until an event after it completes.");
static PyObject *py_cuda_memcpy_htod_async(PyObject *m, PyObject *args) {
    unsigned long long dst, src, nbytes, stream;
    if (!PyArg_ParseTuple(args, "KKKK:cuda_memcpy_htod_async", &dst, &src, &nbytes, &stream))
        return NULL;
    hl_cuda_status status = {0};
    Py_BEGIN_ALLOW_THREADS
    ensure_context(&status);
    HL_CUDA(&status, hl_cu.cuMemcpyHtoDAsync((CUdeviceptr)dst, (const void *)(uintptr_t)src, (size_t)nbytes,
                                             hl_stream(stream)));
    Py_END_ALLOW_THREADS
    if (hl_cuda_raise_if(m, &status) < 0)
        return NULL;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(cuda_host_register_doc, "cuda_host_register(ptr, nbytes)\n\ncuMemHostRegister (portable) host memory.");
static PyObject *py_cuda_host_register(PyObject *m, PyObject *args) {
    unsigned long long ptr, nbytes;
    if (!PyArg_ParseTuple(args, "KK:cuda_host_register", &ptr, &nbytes))
        return NULL;
    hl_cuda_status status = {0};
    Py_BEGIN_ALLOW_THREADS
    ensure_context(&status); /* registration needs a context, though the pages serve every one */
    HL_CUDA(&status, hl_cu.cuMemHostRegister((void *)(uintptr_t)ptr, (size_t)nbytes, CU_MEMHOSTREGISTER_PORTABLE));
    Py_END_ALLOW_THREADS
    if (hl_cuda_raise_if(m, &status) < 0)
        return NULL;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(cuda_host_unregister_doc, "cuda_host_unregister(ptr)");
static PyObject *py_cuda_host_unregister(PyObject *m, PyObject *args) {
    unsigned long long ptr;
    if (!PyArg_ParseTuple(args, "K:cuda_host_unregister", &ptr))
        return NULL;
    hl_cuda_status status = {0};
    Py_BEGIN_ALLOW_THREADS
    ensure_context(&status);
    HL_CUDA(&status, hl_cu.cuMemHostUnregister((void *)(uintptr_t)ptr));
    Py_END_ALLOW_THREADS
    if (hl_cuda_raise_if(m, &status) < 0)
        return NULL;
    Py_RETURN_NONE;
}

#define HL_LOADER_CUDA_METHODS                                                                                 \
    {"cuda_event_create", py_cuda_event_create, METH_VARARGS, cuda_event_create_doc},                          \
    {"cuda_event_record", py_cuda_event_record, METH_VARARGS, cuda_event_record_doc},                          \
    {"cuda_event_query", py_cuda_event_query, METH_VARARGS, cuda_event_query_doc},                             \
    {"cuda_event_synchronize", py_cuda_event_synchronize, METH_VARARGS, cuda_event_synchronize_doc},           \
    {"cuda_event_elapsed", py_cuda_event_elapsed, METH_VARARGS, cuda_event_elapsed_doc},                       \
    {"cuda_event_destroy", py_cuda_event_destroy, METH_VARARGS, cuda_event_destroy_doc},                       \
    {"cuda_stream_wait_event", py_cuda_stream_wait_event, METH_VARARGS, cuda_stream_wait_event_doc},           \
    {"cuda_memcpy_htod_async", py_cuda_memcpy_htod_async, METH_VARARGS, cuda_memcpy_htod_async_doc},           \
    {"cuda_host_register", py_cuda_host_register, METH_VARARGS, cuda_host_register_doc},                       \
    {"cuda_host_unregister", py_cuda_host_unregister, METH_VARARGS, cuda_host_unregister_doc},

#else /* built without CUDA */

int hl_cuda_require(PyObject *module, int device) {
    (void)module;
    (void)device;
    PyErr_SetString(PyExc_RuntimeError, "hotloop was built without CUDA (HOTLOOP_CUDA=0): this call needs a GPU "
                    "build; reinstall without HOTLOOP_CUDA=0");
    return -1;
}

static PyObject *why_unavailable(void) { return PyUnicode_FromString("hotloop was built without CUDA"); }
static PyObject *device_count(void) { return PyLong_FromLong(0); }
static PyObject *driver_version(void) { Py_RETURN_NONE; }
#define HL_LOADER_CUDA_METHODS

#endif

PyDoc_STRVAR(cuda_unavailable_reason_doc, "cuda_unavailable_reason() -> str | None\n\n"
             "None when hotloop can use CUDA here; otherwise why not.");
static PyObject *py_cuda_unavailable_reason(PyObject *m, PyObject *Py_UNUSED(a)) {
    (void)m;
    return why_unavailable();
}

PyDoc_STRVAR(cuda_device_count_doc, "cuda_device_count() -> int\n\nCUDA devices hotloop can see (0 without a driver).");
static PyObject *py_cuda_device_count(PyObject *m, PyObject *Py_UNUSED(a)) {
    (void)m;
    return device_count();
}

PyDoc_STRVAR(cuda_driver_version_doc, "cuda_driver_version() -> int | None\n\n"
             "The CUDA version the driver supports (e.g. 13000), or None without a driver.");
static PyObject *py_cuda_driver_version(PyObject *m, PyObject *Py_UNUSED(a)) {
    (void)m;
    return driver_version();
}

static PyMethodDef cuda_methods[] = {
    {"cuda_unavailable_reason", py_cuda_unavailable_reason, METH_NOARGS, cuda_unavailable_reason_doc},
    {"cuda_device_count", py_cuda_device_count, METH_NOARGS, cuda_device_count_doc},
    {"cuda_driver_version", py_cuda_driver_version, METH_NOARGS, cuda_driver_version_doc},
    HL_LOADER_CUDA_METHODS
    {NULL, NULL, 0, NULL},
};

int hl_cuda_exec(PyObject *module) { return PyModule_AddFunctions(module, cuda_methods); }
