/* hotloop._C's registry: multi-phase init, per-module state, build_info(), and every part's exec in turn. */
#include "module.h"

#include <stdlib.h>
#include <string.h>

hl_state *hl_state_of(PyObject *module) { return (hl_state *)PyModule_GetState(module); }

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

static int exec_module(PyObject *module) {
    if (hl_errors_exec(module) < 0)
        return -1;
    if (hl_tensor_exec(module) < 0 || hl_cuda_exec(module) < 0 || hl_amp_exec(module) < 0 || hl_optim_exec(module) < 0 ||
        hl_group_key_exec(module) < 0 || hl_ring_exec(module) < 0 || hl_normalize_exec(module) < 0)
        return -1;
    if (hl_jpeg_header_exec(module) < 0 || hl_nvjpeg_exec(module) < 0 || hl_jpeg_decoder_exec(module) < 0 ||
        hl_nvrtc_exec(module) < 0)
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
