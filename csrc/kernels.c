/* Kernels compiled at run time: each source's module loaded once per device through the loader Python registered, and launches by entry-point id. */
#include "kernels.h"

#include "cuda.h"

#include <stdatomic.h>
#include <string.h>

#ifdef HOTLOOP_WITH_CUDA

/* Filled with the GIL held (hl_kernels_require), read without it (launches on any thread): a
   function pointer is stored with release order after its module finished loading. Modules are
   never unloaded: they live as long as the primary context they were loaded into. */
static _Atomic(CUfunction) functions[HL_MAX_DEVICES][HL_KERNEL_COUNT];
static _Atomic(int) loaded[HL_MAX_DEVICES][HL_SOURCE_COUNT];

/* load `image` (a cubin, or PTX text that the driver compiles) on `device` and resolve every entry
   point of `source`; without the GIL */
static void load_module(int device, enum hl_kernel_source source, const char *image, hl_cuda_status *status) {
    CUfunction found[HL_KERNEL_COUNT] = {0};
    hl_device_guard guard;
    hl_device_enter(&guard, device, status);
    CUmodule mod = NULL;
    HL_CUDA(status, hl_cu.cuModuleLoadData(&mod, image));
    for (int id = 0; id < HL_KERNEL_COUNT && status->code == 0; id++)
        if (hl_kernel_entries[id].source == source)
            HL_CUDA(status, hl_cu.cuModuleGetFunction(&found[id], mod, hl_kernel_entries[id].name));
    hl_device_leave(&guard, status);
    if (status->code != 0)
        return; /* a module without all of its functions is left loaded but never used */
    for (int id = 0; id < HL_KERNEL_COUNT; id++)
        if (hl_kernel_entries[id].source == source)
            atomic_store_explicit(&functions[device][id], found[id], memory_order_release);
    atomic_store_explicit(&loaded[device][source], 1, memory_order_release);
}

int hl_kernels_require(PyObject *module, int device, enum hl_kernel_source source) {
    if (device < 0 || device >= HL_MAX_DEVICES || source < 0 || source >= HL_SOURCE_COUNT) {
        PyErr_Format(PyExc_ValueError, "kernels: no device %d or source %d", device, (int)source);
        return -1;
    }
    if (atomic_load_explicit(&loaded[device][source], memory_order_acquire))
        return 0;
    PyObject *loader = hl_state_of(module)->kernel_loader;
    if (loader == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "hotloop's kernel loader is not registered (import hotloop, not "
                        "hotloop._C alone)");
        return -1;
    }
    /* the loader may release the GIL while NVRTC compiles: another thread can load the same source
       meanwhile, and the second load below is then skipped */
    PyObject *image = PyObject_CallFunction(loader, "is", device, hl_kernel_source_names[source]);
    if (image == NULL)
        return -1;
    int result = -1;
    char *data = NULL;
    Py_ssize_t size = 0;
    if (!PyBytes_Check(image)) {
        PyErr_Format(PyExc_TypeError, "the kernel loader returned %R for %s, expected bytes", image,
                     hl_kernel_source_names[source]);
        goto done;
    }
    if (PyBytes_AsStringAndSize(image, &data, &size) < 0)
        goto done;
    /* a cubin, or PTX text: that must reach the driver NUL-terminated, and a bytes object is */
    if (size == 0) {
        PyErr_Format(PyExc_ValueError, "the kernel loader returned an empty image for %s",
                     hl_kernel_source_names[source]);
        goto done;
    }
    if (atomic_load_explicit(&loaded[device][source], memory_order_acquire)) {
        result = 0;
        goto done;
    }
    hl_cuda_status status = {0};
    Py_BEGIN_ALLOW_THREADS
    load_module(device, source, data, &status);
    Py_END_ALLOW_THREADS
    result = hl_cuda_raise_if(module, &status);
done:
    Py_DECREF(image);
    return result;
}

CUresult hl_kernel_launch(int device, enum hl_kernel_id id, unsigned grid, unsigned block, unsigned shared_bytes,
                          CUstream stream, void **args) {
    if (device < 0 || device >= HL_MAX_DEVICES || id < 0 || id >= HL_KERNEL_COUNT)
        return CUDA_ERROR_INVALID_VALUE;
    CUfunction f = atomic_load_explicit(&functions[device][id], memory_order_acquire);
    if (f == NULL)
        return CUDA_ERROR_NOT_FOUND;
    return hl_cu.cuLaunchKernel(f, grid, 1, 1, block, 1, 1, shared_bytes, stream, args, NULL);
}

int hl_grid_for_chunks(int64_t chunks, int device, int blocks_per_sm) {
    /* the multiprocessor count is a constant of the hardware: asked once per device */
    static _Atomic(int) sm_count[HL_MAX_DEVICES];
    int sms = device >= 0 && device < HL_MAX_DEVICES ? atomic_load_explicit(&sm_count[device], memory_order_relaxed) : 0;
    if (sms == 0) {
        CUdevice dev = 0;
        if (hl_cu.cuDeviceGet(&dev, device) != CUDA_SUCCESS ||
            hl_cu.cuDeviceGetAttribute(&sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev) != CUDA_SUCCESS || sms <= 0)
            sms = 32; /* a grid of any size is correct; this one only fills fewer multiprocessors */
        if (device >= 0 && device < HL_MAX_DEVICES)
            atomic_store_explicit(&sm_count[device], sms, memory_order_relaxed);
    }
    int64_t grid = (int64_t)sms * blocks_per_sm;
    if (chunks < grid)
        grid = chunks;
    return grid > 0 ? (int)grid : 1;
}

/* ---- Python: what is loaded, the device's capability ---- */

PyDoc_STRVAR(kernels_loaded_doc, "kernels_loaded(device) -> list[str]\n\nThe kernel sources loaded on `device` so far.");
static PyObject *py_kernels_loaded(PyObject *m, PyObject *arg) {
    (void)m;
    int device = PyLong_AsLong(arg);
    if (device == -1 && PyErr_Occurred())
        return NULL;
    PyObject *list = PyList_New(0);
    for (int s = 0; list != NULL && s < HL_SOURCE_COUNT; s++) {
        if (device < 0 || device >= HL_MAX_DEVICES || !atomic_load(&loaded[device][s]))
            continue;
        PyObject *name = PyUnicode_FromString(hl_kernel_source_names[s]);
        if (name == NULL || PyList_Append(list, name) < 0)
            Py_CLEAR(list);
        Py_XDECREF(name);
    }
    return list;
}

PyDoc_STRVAR(cuda_device_capability_doc, "cuda_device_capability(device) -> (major, minor)\n\n"
             "The device's compute capability, from the driver.");
static PyObject *py_cuda_device_capability(PyObject *m, PyObject *arg) {
    int device = PyLong_AsLong(arg);
    if ((device == -1 && PyErr_Occurred()) || hl_cuda_require(m, device) < 0)
        return NULL;
    int major = 0, minor = 0;
    CUdevice dev = 0;
    hl_cuda_status status = {0};
    HL_CUDA(&status, hl_cu.cuDeviceGet(&dev, device));
    HL_CUDA(&status, hl_cu.cuDeviceGetAttribute(&major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev));
    HL_CUDA(&status, hl_cu.cuDeviceGetAttribute(&minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev));
    if (hl_cuda_raise_if(m, &status) < 0)
        return NULL;
    return Py_BuildValue("(ii)", major, minor);
}

PyDoc_STRVAR(kernels_load_doc, "kernels_load(device, source)\n\n"
             "Load every kernel of kernels/<source>.cu on `device` now (compiled or read from the cache by\n"
             "the registered loader), as the first call that needs one would.");
static PyObject *py_kernels_load(PyObject *m, PyObject *args) {
    int device;
    const char *name;
    if (!PyArg_ParseTuple(args, "is:kernels_load", &device, &name) || hl_cuda_require(m, device) < 0)
        return NULL;
    for (int s = 0; s < HL_SOURCE_COUNT; s++)
        if (strcmp(name, hl_kernel_source_names[s]) == 0)
            return hl_kernels_require(m, device, (enum hl_kernel_source)s) < 0 ? NULL : Py_NewRef(Py_None);
    PyErr_Format(PyExc_ValueError, "kernels_load: no kernel source %R", PyTuple_GetItem(args, 1));
    return NULL;
}

#define HL_CUDA_KERNEL_METHODS                                                                                  \
    {"kernels_load", py_kernels_load, METH_VARARGS, kernels_load_doc},                                          \
    {"kernels_loaded", py_kernels_loaded, METH_O, kernels_loaded_doc},                                          \
    {"cuda_device_capability", py_cuda_device_capability, METH_O, cuda_device_capability_doc},
#else
#define HL_CUDA_KERNEL_METHODS
#endif

/* ---- Python: the loader's registration and the tables' names (a CPU-only build has them too: the
   compile command needs no GPU) ---- */

PyDoc_STRVAR(set_kernel_loader_doc, "set_kernel_loader(fn)\n\n"
             "fn(device: int, source: str) -> bytes: the cubin or PTX of kernels/<source>.cu for that\n"
             "device, called with the GIL the first time a kernel of that source is needed there.");
static PyObject *py_set_kernel_loader(PyObject *m, PyObject *fn) {
    if (!PyCallable_Check(fn)) {
        PyErr_Format(PyExc_TypeError, "set_kernel_loader: expected a callable, got %R", fn);
        return NULL;
    }
    PyObject *old = hl_state_of(m)->kernel_loader;
    hl_state_of(m)->kernel_loader = Py_NewRef(fn);
    Py_XDECREF(old);
    Py_RETURN_NONE;
}

static PyMethodDef kernels_methods[] = {
    {"set_kernel_loader", py_set_kernel_loader, METH_O, set_kernel_loader_doc},
    HL_CUDA_KERNEL_METHODS
    {NULL, NULL, 0, NULL},
};

int hl_kernels_exec(PyObject *module) {
    PyObject *sources = PyTuple_New(HL_SOURCE_COUNT), *names = PyTuple_New(HL_KERNEL_COUNT);
    if (sources == NULL || names == NULL)
        goto error;
    for (int s = 0; s < HL_SOURCE_COUNT; s++) {
        PyObject *name = PyUnicode_FromString(hl_kernel_source_names[s]);
        if (name == NULL)
            goto error;
        PyTuple_SetItem(sources, s, name);
    }
    for (int id = 0; id < HL_KERNEL_COUNT; id++) {
        PyObject *pair = Py_BuildValue("(ss)", hl_kernel_source_names[hl_kernel_entries[id].source],
                                       hl_kernel_entries[id].name);
        if (pair == NULL)
            goto error;
        PyTuple_SetItem(names, id, pair);
    }
    if (PyModule_AddObjectRef(module, "KERNEL_SOURCES", sources) < 0 ||
        PyModule_AddObjectRef(module, "KERNEL_NAMES", names) < 0)
        goto error;
    Py_DECREF(sources);
    Py_DECREF(names);
    return PyModule_AddFunctions(module, kernels_methods);
error:
    Py_XDECREF(sources);
    Py_XDECREF(names);
    return -1;
}
