/* hotloop._C's exceptions: the types it raises and the one way each library's failure becomes one. */
#include "module.h"

#include <string.h>

#ifdef HOTLOOP_WITH_CUDA
#include "cuda_driver.h"
#endif

/* "hl_cu.cuMemcpyHtoDAsync(dst, ...)" -> "cuMemcpyHtoDAsync": the message names the call, not its
   arguments nor the table it was called through */
static PyObject *call_name(const char *call) {
    size_t len = strcspn(call, "( ");
    for (size_t i = len; i > 0; i--)
        if (call[i - 1] == '.' || call[i - 1] == '>') {
            call += i;
            len -= i;
            break;
        }
    return PyUnicode_FromStringAndSize(call, (Py_ssize_t)len);
}

/* obj.name = value, the new reference `value` (NULL: its maker's error stands) released */
static int set_new_attr(PyObject *obj, const char *name, PyObject *value) {
    int rc = value == NULL ? -1 : PyObject_SetAttrString(obj, name, value);
    Py_XDECREF(value);
    return rc;
}

/* Build exc_type(message) with the failure's details as attributes, and raise it. */
static int raise_with_details(PyObject *exc_type, PyObject *message, int code, const char *error_name,
                              PyObject *call, const char *file, int line) {
    PyObject *exc = PyObject_CallFunctionObjArgs(exc_type, message, NULL);
    if (exc != NULL && set_new_attr(exc, "code", PyLong_FromLong(code)) == 0 &&
        set_new_attr(exc, "error_name", PyUnicode_FromString(error_name)) == 0 &&
        PyObject_SetAttrString(exc, "call", call) == 0 && set_new_attr(exc, "file", PyUnicode_FromString(file)) == 0 &&
        set_new_attr(exc, "line", PyLong_FromLong(line)) == 0)
        PyErr_SetObject(exc_type, exc);
    Py_XDECREF(exc);
    return -1;
}

int hl_cuda_raise_if(PyObject *module, const hl_cuda_status *status) {
    if (status->code == 0)
        return 0;
    const char *name = NULL, *text = NULL;
#ifdef HOTLOOP_WITH_CUDA
    /* the driver names its own errors; a code it does not know (or no driver) keeps the fallbacks */
    if (hl_cu.cuGetErrorName == NULL || hl_cu.cuGetErrorName(status->code, &name) != CUDA_SUCCESS)
        name = NULL;
    if (hl_cu.cuGetErrorString == NULL || hl_cu.cuGetErrorString(status->code, &text) != CUDA_SUCCESS)
        text = NULL;
#endif
    if (name == NULL)
        name = "CUDA_ERROR_UNKNOWN";
    if (text == NULL)
        text = "unknown error";
    PyObject *call = call_name(status->call), *message = NULL;
    if (call == NULL)
        return -1;
    message = PyUnicode_FromFormat("%U failed with %s (%d): %s [%s:%d]", call, name, status->code, text,
                                   status->file, status->line);
    if (message != NULL)
        raise_with_details(hl_state_of(module)->cuda_error, message, status->code, name, call,
                           status->file, status->line);
    Py_XDECREF(message);
    Py_DECREF(call);
    return -1;
}

int hl_raise_nvml(PyObject *module, int code, const char *text, const char *call, const char *file,
                  int line) {
    PyObject *name = call_name(call), *message = NULL;
    if (name == NULL)
        return -1;
    message = PyUnicode_FromFormat("%U failed with NVML error %d: %s [%s:%d]", name, code, text, file, line);
    if (message != NULL)
        raise_with_details(hl_state_of(module)->nvml_error, message, code, text, name, file, line);
    Py_XDECREF(message);
    Py_DECREF(name);
    return -1;
}

int hl_raise_nvjpeg(PyObject *module, int code, const char *name, const char *detail, const char *call,
                    const char *file, int line) {
    PyObject *call_obj = call_name(call), *message = NULL;
    if (call_obj == NULL)
        return -1;
    message = PyUnicode_FromFormat("%U failed with %s (%d)%s%s [%s:%d]", call_obj, name, code, *detail ? ": " : "",
                                   detail, file, line);
    if (message != NULL)
        raise_with_details(hl_state_of(module)->nvjpeg_error, message, code, name, call_obj, file, line);
    Py_XDECREF(message);
    Py_DECREF(call_obj);
    return -1;
}

static int add_exception(PyObject *module, const char *name, const char *doc, PyObject **slot) {
    *slot = PyErr_NewExceptionWithDoc(name, doc, PyExc_RuntimeError, NULL);
    if (*slot == NULL)
        return -1;
    return PyModule_AddObjectRef(module, strrchr(name, '.') + 1, *slot);
}

int hl_errors_exec(PyObject *module) {
    hl_state *state = hl_state_of(module);
    if (add_exception(module, "hotloop.CudaError",
                      "A CUDA call failed; the message names the call, the error and where it happened.\n"
                      "Attributes: code, error_name, call, file, line.",
                      &state->cuda_error) < 0)
        return -1;
    if (add_exception(module, "hotloop.NvmlError",
                      "An NVML call failed; the message names the call and NVML's error.\n"
                      "Attributes: code, error_name, call, file, line.",
                      &state->nvml_error) < 0)
        return -1;
    if (add_exception(module, "hotloop.NvjpegError",
                      "An nvjpeg call failed; the message names the call and its NVJPEG_STATUS_* name.\n"
                      "Attributes: code, error_name, call, file, line.",
                      &state->nvjpeg_error) < 0)
        return -1;
    return 0;
}
