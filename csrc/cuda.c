/* CUDA from C: availability and versions for Python, the device guard, table uploads. */
#include "cuda.h"

#ifdef HOTLOOP_WITH_CUDA

/* the runtime's device count, or the error that says why there is none */
static int count_devices(int *count) {
    int n = 0;
    cudaError_t err = cudaGetDeviceCount(&n);
    *count = err == cudaSuccess ? n : 0;
    return (int)err;
}

int hl_cuda_require(PyObject *module, int device) {
    int count = 0, err = count_devices(&count);
    if (err == cudaErrorInsufficientDriver || err == cudaErrorNoDevice || (err == cudaSuccess && count == 0)) {
        PyErr_Format(PyExc_RuntimeError, "no CUDA driver found (or no CUDA device): this call needs a GPU "
                     "(cudaGetDeviceCount said %s)", cudaGetErrorName((cudaError_t)err));
        return -1;
    }
    if (err != cudaSuccess) {
        hl_cuda_status status = {err, "cudaGetDeviceCount", __FILE__, __LINE__};
        return hl_raise_cuda(module, &status);
    }
    if (device < 0 || device >= count) {
        PyErr_Format(PyExc_ValueError, "no CUDA device %d: this machine has %d", device, count);
        return -1;
    }
    return 0;
}

void hl_device_enter(hl_device_guard *guard, int device, hl_cuda_status *status) {
    guard->changed = 0;
    guard->previous = device;
    HL_CUDA(status, cudaGetDevice(&guard->previous));
    if (status->code == 0 && guard->previous != device) {
        HL_CUDA(status, cudaSetDevice(device));
        guard->changed = status->code == 0;
    }
}

void hl_device_leave(hl_device_guard *guard, hl_cuda_status *status) {
    if (guard->changed)
        HL_CUDA(status, cudaSetDevice(guard->previous));
    guard->changed = 0;
}

void hl_table_upload(const hl_table *table, void *device_dst, cudaStream_t stream, hl_cuda_status *status) {
    /* from pageable memory the runtime stages the bytes before it returns, without waiting for
       the device, so the host entries can go right after */
    HL_CUDA(status, cudaMemcpyAsync(device_dst, table->entries, (size_t)table->count * sizeof(hl_table_entry),
                                    cudaMemcpyHostToDevice, stream));
}

static PyObject *why_unavailable(void) {
    int count = 0, err = count_devices(&count);
    if (err == cudaErrorInsufficientDriver || err == cudaErrorNoDevice)
        return PyUnicode_FromFormat("no CUDA driver found (%s)", cudaGetErrorName((cudaError_t)err));
    if (err != cudaSuccess)
        return PyUnicode_FromFormat("CUDA cannot be initialised: %s: %s", cudaGetErrorName((cudaError_t)err),
                                    cudaGetErrorString((cudaError_t)err));
    if (count == 0)
        return PyUnicode_FromString("no CUDA device");
    Py_RETURN_NONE;
}

static PyObject *device_count(void) {
    int count = 0;
    count_devices(&count);
    return PyLong_FromLong(count);
}

static PyObject *driver_version(void) {
    int version = 0;
    if (cudaDriverGetVersion(&version) != cudaSuccess || version == 0)
        Py_RETURN_NONE;
    return PyLong_FromLong(version);
}

static PyObject *runtime_version(void) {
    int version = 0;
    if (cudaRuntimeGetVersion(&version) != cudaSuccess)
        Py_RETURN_NONE;
    return PyLong_FromLong(version);
}

#else /* built without CUDA */

int hl_cuda_require(PyObject *module, int device) {
    (void)module;
    (void)device;
    PyErr_SetString(PyExc_RuntimeError, "hotloop was built without CUDA (HOTLOOP_CUDA=0, or no nvcc when it "
                    "was built): this call needs a GPU build; reinstall with the CUDA toolkit present");
    return -1;
}

static PyObject *why_unavailable(void) { return PyUnicode_FromString("hotloop was built without CUDA"); }
static PyObject *device_count(void) { return PyLong_FromLong(0); }
static PyObject *driver_version(void) { Py_RETURN_NONE; }
static PyObject *runtime_version(void) { Py_RETURN_NONE; }

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

PyDoc_STRVAR(cuda_runtime_version_doc, "cuda_runtime_version() -> int | None\n\n"
             "The CUDA runtime linked into hotloop (e.g. 13000), or None in a CPU-only build.");
static PyObject *py_cuda_runtime_version(PyObject *m, PyObject *Py_UNUSED(a)) {
    (void)m;
    return runtime_version();
}

static PyMethodDef cuda_methods[] = {
    {"cuda_unavailable_reason", py_cuda_unavailable_reason, METH_NOARGS, cuda_unavailable_reason_doc},
    {"cuda_device_count", py_cuda_device_count, METH_NOARGS, cuda_device_count_doc},
    {"cuda_driver_version", py_cuda_driver_version, METH_NOARGS, cuda_driver_version_doc},
    {"cuda_runtime_version", py_cuda_runtime_version, METH_NOARGS, cuda_runtime_version_doc},
    {NULL, NULL, 0, NULL},
};

int hl_cuda_exec(PyObject *module) { return PyModule_AddFunctions(module, cuda_methods); }
