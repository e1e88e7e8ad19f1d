/* hotloop._C: multi-phase module init, per-module state, exception types and build_info(). */
#include "module.h"

#include <stdlib.h>
#include <string.h>

#ifdef HOTLOOP_WITH_CUDA
#include "cuda_driver.h"
#endif

hl_state *hl_state_of(PyObject *module) { return (hl_state *)PyModule_GetState(module); }

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

/* Build exc_type(message) with the failure's details as attributes, and raise it. */
static int raise_with_details(PyObject *exc_type, PyObject *message, int code, const char *error_name,
                              PyObject *call, const char *file, int line) {
    PyObject *exc = NULL, *value = NULL;
    exc = PyObject_CallFunctionObjArgs(exc_type, message, NULL);
    if (exc == NULL)
        goto error;
    value = PyLong_FromLong(code);
    if (value == NULL || PyObject_SetAttrString(exc, "code", value) < 0)
        goto error;
    Py_CLEAR(value);
    value = PyUnicode_FromString(error_name);
    if (value == NULL || PyObject_SetAttrString(exc, "error_name", value) < 0)
        goto error;
    Py_CLEAR(value);
    if (PyObject_SetAttrString(exc, "call", call) < 0)
        goto error;
    value = PyUnicode_FromString(file);
    if (value == NULL || PyObject_SetAttrString(exc, "file", value) < 0)
        goto error;
    Py_CLEAR(value);
    value = PyLong_FromLong(line);
    if (value == NULL || PyObject_SetAttrString(exc, "line", value) < 0)
        goto error;
    Py_CLEAR(value);
    PyErr_SetObject(exc_type, exc);
error:
    Py_XDECREF(value);
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

int hl_add_int_constants(PyObject *module, const hl_int_constant *constants) {
    for (const hl_int_constant *c = constants; c->name != NULL; c++)
        if (PyModule_AddIntConstant(module, c->name, c->value) < 0)
            return -1;
    return 0;
}

/* "75,80,90" -> [75, 80, 90]; "address,undefined" -> ["address", "undefined"] */
static PyObject *split_commas(const char *text, int as_int) {
    PyObject *list = PyList_New(0);
    const char *p = text;
    while (list != NULL && *p) {
        size_t len = strcspn(p, ",");
        PyObject *item = as_int ? PyLong_FromLong(strtol(p, NULL, 10))
                                : PyUnicode_FromStringAndSize(p, (Py_ssize_t)len);
        if (item == NULL || PyList_Append(list, item) < 0) {
            Py_XDECREF(item);
            Py_CLEAR(list);
            break;
        }
        Py_DECREF(item);
        p += len + (p[len] == ',');
    }
    return list;
}

PyDoc_STRVAR(build_info_doc, "build_info() -> dict\n\n"
             "What this _C was built with: version, cuda (\"driver+nvrtc\": the driver API opened at run\n"
             "time, kernels compiled by NVRTC on first use; None in a HOTLOOP_CUDA=0 build), abi3,\n"
             "sanitizers.");

static PyObject *build_info(PyObject *module, PyObject *Py_UNUSED(ignored)) {
    (void)module;
    PyObject *sanitizers = split_commas(HOTLOOP_SANITIZERS, 0), *info = NULL;
    if (sanitizers == NULL)
        return NULL;
#ifdef HOTLOOP_WITH_CUDA
    info = Py_BuildValue("{s:s, s:s, s:O, s:O}", "version", HOTLOOP_VERSION, "cuda", "driver+nvrtc", "abi3", Py_True,
                         "sanitizers", sanitizers);
#else
    info = Py_BuildValue("{s:s, s:O, s:O, s:O}", "version", HOTLOOP_VERSION, "cuda", Py_None, "abi3", Py_True,
                         "sanitizers", sanitizers);
#endif
    Py_DECREF(sanitizers);
    return info;
}

static PyMethodDef module_methods[] = {
    {"build_info", build_info, METH_NOARGS, build_info_doc},
    {NULL, NULL, 0, NULL},
};

static int add_exception(PyObject *module, const char *name, const char *doc, PyObject **slot) {
    *slot = PyErr_NewExceptionWithDoc(name, doc, PyExc_RuntimeError, NULL);
    if (*slot == NULL)
        return -1;
    return PyModule_AddObjectRef(module, strrchr(name, '.') + 1, *slot);
}

static int exec_module(PyObject *module) {
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
    if (hl_tensor_exec(module) < 0 || hl_cuda_exec(module) < 0 || hl_amp_exec(module) < 0 || hl_optim_exec(module) < 0 ||
        hl_ring_exec(module) < 0 || hl_normalize_exec(module) < 0)
        return -1;
    if (hl_jpeg_header_exec(module) < 0 || hl_nvjpeg_exec(module) < 0 || hl_nvrtc_exec(module) < 0)
        return -1;
    if (hl_nvml_exec(module) < 0 || hl_monitor_exec(module) < 0 || hl_host_sampler_exec(module) < 0)
        return -1;
    if (hl_image_resize_exec(module) < 0 || hl_kernels_exec(module) < 0)
        return -1;
    return 0;
}

static int module_traverse(PyObject *module, visitproc visit, void *arg) {
    hl_state *state = hl_state_of(module);
    Py_VISIT(state->cuda_error);
    Py_VISIT(state->nvml_error);
    Py_VISIT(state->ring_type);
    Py_VISIT(state->monitor_type);
    Py_VISIT(state->host_sampler_type);
    Py_VISIT(state->nvjpeg_error);
    Py_VISIT(state->jpeg_info_type);
    Py_VISIT(state->jpeg_decoder_type);
    Py_VISIT(state->kernel_loader);
    return 0;
}

static int module_clear(PyObject *module) {
    hl_state *state = hl_state_of(module);
    Py_CLEAR(state->cuda_error);
    Py_CLEAR(state->nvml_error);
    Py_CLEAR(state->ring_type);
    Py_CLEAR(state->monitor_type);
    Py_CLEAR(state->host_sampler_type);
    Py_CLEAR(state->nvjpeg_error);
    Py_CLEAR(state->jpeg_info_type);
    Py_CLEAR(state->jpeg_decoder_type);
    Py_CLEAR(state->kernel_loader);
    return 0;
}

static void module_free(void *module) { module_clear((PyObject *)module); }

static PyModuleDef_Slot module_slots[] = {
    {Py_mod_exec, exec_module},
    {0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "hotloop._C",
    .m_doc = "hotloop's C and CUDA core: tensor shim, AMP kernels (compiled at run time), pinned ring, NVML sampler, JPEG headers and nvjpeg.",
    .m_size = sizeof(hl_state),
    .m_methods = module_methods,
    .m_slots = module_slots,
    .m_traverse = module_traverse,
    .m_clear = module_clear,
    .m_free = module_free,
};

PyMODINIT_FUNC PyInit__C(void) { return PyModuleDef_Init(&module_def); }
