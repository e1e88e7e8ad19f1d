/* nvjpeg by dlopen (never linked): the library table, each library opened once per process, _C.nvjpeg_load and nvjpeg_status_name. */
#include "nvjpeg.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

const char *hl_nvjpeg_status_name(nvjpegStatus_t status) {
    static const char *const names[] = {
        "NVJPEG_STATUS_SUCCESS",          "NVJPEG_STATUS_NOT_INITIALIZED",
        "NVJPEG_STATUS_INVALID_PARAMETER", "NVJPEG_STATUS_BAD_JPEG",
        "NVJPEG_STATUS_JPEG_NOT_SUPPORTED", "NVJPEG_STATUS_ALLOCATOR_FAILURE",
        "NVJPEG_STATUS_EXECUTION_FAILED", "NVJPEG_STATUS_ARCH_MISMATCH",
        "NVJPEG_STATUS_INTERNAL_ERROR",   "NVJPEG_STATUS_IMPLEMENTATION_NOT_SUPPORTED",
        "NVJPEG_STATUS_INCOMPLETE_BITSTREAM",
    };
    if (status >= 0 && status < (int)(sizeof(names) / sizeof(names[0])))
        return names[status];
    return "NVJPEG_STATUS_UNKNOWN";
}

/* ---------------------------------------------------------------------------------------------
   Libraries, opened at run time. A library stays open for the life of the process: decoders hold
   pointers into its table, and unloading a library that started CUDA work is not safe. */

#define MAX_LIBRARIES 8
static pthread_mutex_t library_lock = PTHREAD_MUTEX_INITIALIZER;
static hl_nvjpeg *libraries[MAX_LIBRARIES];
static int library_count;

/* fork: hold the lock across it so the child's copy of the table is consistent */
static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;
static void before_fork(void) { pthread_mutex_lock(&library_lock); }
static void after_fork_parent(void) { pthread_mutex_unlock(&library_lock); }
static void after_fork_child(void) { pthread_mutex_init(&library_lock, NULL); }
static void install_fork_handlers(void) { pthread_atfork(before_fork, after_fork_parent, after_fork_child); }

/* Every entry point hotloop calls, by name and where its pointer goes; all required but the
   hardware backend's (added in CUDA 11.4): the engine query and pre-allocation. */
#define ENTRY(field, name, required) {offsetof(hl_nvjpeg, field), name, required}
static const struct {
    size_t offset;
    const char *name;
    int required;
} entries[] = {
    ENTRY(get_property, "nvjpegGetProperty", 1),
    ENTRY(create_ex, "nvjpegCreateEx", 1),
    ENTRY(destroy, "nvjpegDestroy", 1),
    ENTRY(hardware_info, "nvjpegGetHardwareDecoderInfo", 0),
    ENTRY(state_create, "nvjpegJpegStateCreate", 1),
    ENTRY(state_destroy, "nvjpegJpegStateDestroy", 1),
    ENTRY(batched_initialize, "nvjpegDecodeBatchedInitialize", 1),
    ENTRY(batched, "nvjpegDecodeBatched", 1),
    ENTRY(stream_create, "nvjpegJpegStreamCreate", 1),
    ENTRY(stream_destroy, "nvjpegJpegStreamDestroy", 1),
    ENTRY(parse_header, "nvjpegJpegStreamParseHeader", 1),
    ENTRY(parse, "nvjpegJpegStreamParse", 1),
    ENTRY(batched_supported, "nvjpegDecodeBatchedSupported", 1),
    ENTRY(decoder_create, "nvjpegDecoderCreate", 1),
    ENTRY(decoder_destroy, "nvjpegDecoderDestroy", 1),
    ENTRY(decoder_state_create, "nvjpegDecoderStateCreate", 1),
    ENTRY(pinned_create, "nvjpegBufferPinnedCreate", 1),
    ENTRY(pinned_destroy, "nvjpegBufferPinnedDestroy", 1),
    ENTRY(device_buffer_create, "nvjpegBufferDeviceCreate", 1),
    ENTRY(device_buffer_destroy, "nvjpegBufferDeviceDestroy", 1),
    ENTRY(attach_pinned, "nvjpegStateAttachPinnedBuffer", 1),
    ENTRY(attach_device, "nvjpegStateAttachDeviceBuffer", 1),
    ENTRY(params_create, "nvjpegDecodeParamsCreate", 1),
    ENTRY(params_destroy, "nvjpegDecodeParamsDestroy", 1),
    ENTRY(params_set_output, "nvjpegDecodeParamsSetOutputFormat", 1),
    ENTRY(decode_host, "nvjpegDecodeJpegHost", 1),
    ENTRY(decode_transfer, "nvjpegDecodeJpegTransferToDevice", 1),
    ENTRY(decode_device, "nvjpegDecodeJpegDevice", 1),
    ENTRY(batched_preallocate, "nvjpegDecodeBatchedPreAllocate", 0),
};

/* The library at `path`, opened and resolved (or found already open); NULL with `why` filled. */
static const hl_nvjpeg *library_open(const char *path, char *why, size_t why_len) {
    hl_nvjpeg *found = NULL, *n = NULL;
    pthread_once(&atfork_once, install_fork_handlers);
    pthread_mutex_lock(&library_lock);
    for (int i = 0; i < library_count && found == NULL; i++)
        if (strcmp(libraries[i]->path, path) == 0)
            found = libraries[i];
    if (found != NULL)
        goto done;
    void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (lib == NULL) {
        const char *error = dlerror();
        snprintf(why, why_len, "dlopen: %s", error ? error : "failed");
        goto done;
    }
    n = calloc(1, sizeof(*n));
    if (n == NULL) {
        snprintf(why, why_len, "out of memory");
        dlclose(lib);
        goto done;
    }
    snprintf(n->path, sizeof(n->path), "%s", path);
    for (size_t i = 0; i < sizeof(entries) / sizeof(entries[0]); i++) {
        void *f = dlsym(lib, entries[i].name);
        if (f == NULL && entries[i].required) {
            snprintf(why, why_len, "dlsym: no %s in it (not nvjpeg, or one too old)", entries[i].name);
            free(n);
            dlclose(lib);
            goto done;
        }
        memcpy((char *)n + entries[i].offset, &f, sizeof(f)); /* a function pointer the size of void* (POSIX) */
    }
    static const int properties[3] = {HL_LIBRARY_MAJOR_VERSION, HL_LIBRARY_MINOR_VERSION, HL_LIBRARY_PATCH_LEVEL};
    for (int i = 0; i < 3; i++) {
        nvjpegStatus_t rc = n->get_property(properties[i], &n->version[i]);
        if (rc != NVJPEG_STATUS_SUCCESS) {
            snprintf(why, why_len, "nvjpegGetProperty failed with %s", hl_nvjpeg_status_name(rc));
            free(n);
            dlclose(lib);
            goto done;
        }
    }
    if (library_count < MAX_LIBRARIES)
        libraries[library_count++] = n;
    found = n; /* past the table's size it is simply not cached (tests switching libraries) */
done:
    pthread_mutex_unlock(&library_lock);
    return found;
}

const hl_nvjpeg *hl_nvjpeg_from_paths(PyObject *paths, const char *caller) {
    PyObject *seq = PySequence_Fast(paths, "paths: expected a sequence of library paths");
    if (seq == NULL)
        return NULL;
    Py_ssize_t count = PySequence_Size(seq);
    const hl_nvjpeg *found = NULL;
    PyObject *report = NULL;
    if (count <= 0) {
        PyErr_Format(PyExc_RuntimeError, "%s: no nvjpeg library to try (paths is empty)", caller);
        goto done;
    }
    report = PyUnicode_FromFormat("%s: no nvjpeg library could be loaded; tried:", caller);
    for (Py_ssize_t i = 0; i < count && report != NULL; i++) {
        PyObject *item = PySequence_GetItem(seq, i), *encoded = NULL, *line = NULL;
        int converted = item != NULL && PyUnicode_FSConverter(item, &encoded);
        Py_XDECREF(item);
        if (!converted)
            goto done;
        char why[700] = "";
        const char *path = PyBytes_AsString(encoded);
        Py_BEGIN_ALLOW_THREADS
        found = library_open(path, why, sizeof(why));
        Py_END_ALLOW_THREADS
        if (found == NULL)
            line = PyUnicode_FromFormat("%U\n  %s: %s", report, path, why);
        Py_DECREF(encoded);
        if (found != NULL)
            break;
        Py_DECREF(report);
        report = line; /* NULL with an exception set ends the loop */
    }
    if (found == NULL && report != NULL)
        PyErr_SetObject(PyExc_RuntimeError, report);
done:
    Py_XDECREF(report);
    Py_DECREF(seq);
    return found;
}

PyDoc_STRVAR(nvjpeg_load_doc,
             "nvjpeg_load(paths) -> (path, (major, minor, patch))\n\n"
             "Open the first nvjpeg library of `paths` that loads (dlopen, every function hotloop uses found\n"
             "with dlsym, nvjpegGetProperty answering) and keep it open; RuntimeError listing each path tried\n"
             "and why it failed. Needs no GPU. hotloop.data.nvjpeg.nvjpeg_library_candidates() makes the list.");

static PyObject *py_nvjpeg_load(PyObject *module, PyObject *paths) {
    (void)module;
    const hl_nvjpeg *lib = hl_nvjpeg_from_paths(paths, "nvjpeg_load");
    if (lib == NULL)
        return NULL;
    return Py_BuildValue("(s(iii))", lib->path, lib->version[0], lib->version[1], lib->version[2]);
}

PyDoc_STRVAR(nvjpeg_status_name_doc, "nvjpeg_status_name(status) -> str\n\n\"NVJPEG_STATUS_BAD_JPEG\" for 3, ...");

static PyObject *py_nvjpeg_status_name(PyObject *module, PyObject *arg) {
    (void)module;
    long status = PyLong_AsLong(arg);
    if (status == -1 && PyErr_Occurred())
        return NULL;
    return PyUnicode_FromString(hl_nvjpeg_status_name(status < -1 || status > 1000 ? -1 : (int)status));
}

static PyMethodDef nvjpeg_methods[] = {
    {"nvjpeg_load", py_nvjpeg_load, METH_O, nvjpeg_load_doc},
    {"nvjpeg_status_name", py_nvjpeg_status_name, METH_O, nvjpeg_status_name_doc},
    {NULL, NULL, 0, NULL},
};

int hl_nvjpeg_exec(PyObject *module) { return PyModule_AddFunctions(module, nvjpeg_methods); }
