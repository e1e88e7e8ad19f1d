/* NVRTC by dlopen (never linked): _C.Nvrtc, one opened libnvrtc that compiles CUDA C++ to CUBIN or PTX. */
#include "module.h"

#include <dlfcn.h>
#include <glob.h>
#include <limits.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---------------------------------------------------------------------------------------------
   The part of NVRTC's C API hotloop uses, declared here so that no CUDA header is needed to build.
   Values and signatures as nvrtc.h (CUDA 11.2 to 13) declares them. */

typedef int nvrtcResult; /* an enum in nvrtc.h; int-sized */
enum { NVRTC_SUCCESS = 0 };
typedef struct hl_nvrtc_program *nvrtcProgram;

typedef const char *(*nvrtcGetErrorString_fn)(nvrtcResult result);
typedef nvrtcResult (*nvrtcVersion_fn)(int *major, int *minor);
typedef nvrtcResult (*nvrtcGetNumSupportedArchs_fn)(int *count);
typedef nvrtcResult (*nvrtcGetSupportedArchs_fn)(int *archs);
typedef nvrtcResult (*nvrtcCreateProgram_fn)(nvrtcProgram *program, const char *source, const char *name,
                                             int header_count, const char *const *headers,
                                             const char *const *include_names);
typedef nvrtcResult (*nvrtcDestroyProgram_fn)(nvrtcProgram *program);
typedef nvrtcResult (*nvrtcCompileProgram_fn)(nvrtcProgram program, int option_count, const char *const *options);
typedef nvrtcResult (*nvrtcGetSize_fn)(nvrtcProgram program, size_t *size);
typedef nvrtcResult (*nvrtcGetText_fn)(nvrtcProgram program, char *text);

/* what one library resolved to */
typedef struct {
    nvrtcGetErrorString_fn error_string;
    nvrtcVersion_fn version;
    nvrtcGetNumSupportedArchs_fn num_supported_archs;
    nvrtcGetSupportedArchs_fn supported_archs;
    nvrtcCreateProgram_fn create_program;
    nvrtcDestroyProgram_fn destroy_program;
    nvrtcCompileProgram_fn compile_program;
    nvrtcGetSize_fn log_size;
    nvrtcGetText_fn log;
    nvrtcGetSize_fn ptx_size;
    nvrtcGetText_fn ptx;
    nvrtcGetSize_fn cubin_size;
    nvrtcGetText_fn cubin;
} hl_nvrtc_api;

/* Every entry point hotloop calls, by name and where its pointer goes; all required (the newest,
   nvrtcGetSupportedArchs, came with CUDA 11.2: older NVRTCs are refused by name). */
#define ENTRY(field, name) {offsetof(hl_nvrtc_api, field), name}
static const struct {
    size_t offset;
    const char *name;
} entries[] = {
    ENTRY(error_string, "nvrtcGetErrorString"),
    ENTRY(version, "nvrtcVersion"),
    ENTRY(num_supported_archs, "nvrtcGetNumSupportedArchs"),
    ENTRY(supported_archs, "nvrtcGetSupportedArchs"),
    ENTRY(create_program, "nvrtcCreateProgram"),
    ENTRY(destroy_program, "nvrtcDestroyProgram"),
    ENTRY(compile_program, "nvrtcCompileProgram"),
    ENTRY(log_size, "nvrtcGetProgramLogSize"),
    ENTRY(log, "nvrtcGetProgramLog"),
    ENTRY(ptx_size, "nvrtcGetPTXSize"),
    ENTRY(ptx, "nvrtcGetPTX"),
    ENTRY(cubin_size, "nvrtcGetCUBINSize"),
    ENTRY(cubin, "nvrtcGetCUBIN"),
};

typedef struct {
    PyObject_HEAD
    PyObject *path; /* str, as the caller named the library */
    void *lib;      /* never closed: a compile on another thread may still run in it, and NVRTC
                       keeps process-wide state (its builtins) that is not safe to unload */
    hl_nvrtc_api api;
    int major, minor;
} hl_nvrtc;

/* ---------------------------------------------------------------------------------------------
   Opening a library. NVRTC loads its builtins library (libnvrtc-builtins.so.<major>.<minor>) by
   name at the first compile; the CUDA 13 wheel's libnvrtc has no RUNPATH, so that name is not found
   next to it. Loading every builtins library of the same folder first, by absolute path and with
   RTLD_GLOBAL, makes the later load by name find the one already in the process. The ".alt."
   variants (a second ABI of the same library) are not loaded. Only for an absolute path: the folder
   of a bare name or a relative path would be the current directory, where anyone who can write it
   could plant a builtins library (Python passes the absolute paths of NOTE [ Library search ]). */

/* Load the builtins next to `path` (or next to the file it links to). 0, or -1 with `why` filled. */
static int preload_builtins(const char *path, char *why, size_t why_len) {
    if (path[0] != '/')
        return 0; /* the dynamic linker's search finds NVRTC and, by name, its builtins */
    char folders[2][PATH_MAX];
    snprintf(folders[0], sizeof(folders[0]), "%s", path);
    if (realpath(path, folders[1]) == NULL)
        snprintf(folders[1], sizeof(folders[1]), "%s", path);
    for (int f = 0; f < 2; f++) {
        char *slash = strrchr(folders[f], '/'); /* never NULL: both paths are absolute */
        if (slash == NULL)
            continue;
        *slash = '\0';
        char pattern[PATH_MAX + 32];
        glob_t found;
        if (snprintf(pattern, sizeof(pattern), "%s/libnvrtc-builtins.so.*", folders[f]) >= (int)sizeof(pattern) ||
            glob(pattern, 0, NULL, &found) != 0)
            continue; /* none here: NVRTC may still find its own (a toolkit's RUNPATH, LD_LIBRARY_PATH) */
        for (size_t i = 0; i < found.gl_pathc; i++) {
            if (dlopen(found.gl_pathv[i], RTLD_NOW | RTLD_GLOBAL) == NULL) {
                const char *error = dlerror();
                snprintf(why, why_len, "dlopen of its builtins %s: %s", found.gl_pathv[i], error ? error : "failed");
                globfree(&found);
                return -1;
            }
        }
        globfree(&found);
        return 0;
    }
    return 0;
}

/* Open and resolve the library at `path` into `n`. 0, or -1 with `why` filled. Without the GIL. */
static int library_open(hl_nvrtc *n, const char *path, char *why, size_t why_len) {
    if (preload_builtins(path, why, why_len) < 0)
        return -1;
    void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (lib == NULL) {
        const char *error = dlerror();
        snprintf(why, why_len, "dlopen: %s", error ? error : "failed");
        return -1;
    }
    for (size_t i = 0; i < sizeof(entries) / sizeof(entries[0]); i++) {
        void *f = dlsym(lib, entries[i].name);
        if (f == NULL) {
            snprintf(why, why_len, "dlsym: no %s in it (not NVRTC, or one older than CUDA 11.2)", entries[i].name);
            dlclose(lib);
            return -1;
        }
        memcpy((char *)&n->api + entries[i].offset, &f, sizeof(f)); /* a function pointer the size of void* (POSIX) */
    }
    nvrtcResult rc = n->api.version(&n->major, &n->minor);
    if (rc != NVRTC_SUCCESS) {
        snprintf(why, why_len, "nvrtcVersion failed with %s (%d)", n->api.error_string(rc), rc);
        dlclose(lib);
        return -1;
    }
    n->lib = lib;
    return 0;
}

static int raise_nvrtc(const hl_nvrtc *n, nvrtcResult rc, const char *call) {
    PyErr_Format(PyExc_RuntimeError, "%s failed with %s (%d) [NVRTC %S]", call, n->api.error_string(rc), rc, n->path);
    return -1;
}

/* ---------------------------------------------------------------------------------------------
   The type */

static PyObject *nvrtc_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    static char *keywords[] = {"path", NULL};
    PyObject *encoded = NULL;
    char why[PATH_MAX + 512] = "";
    int rc;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O&:Nvrtc", keywords, PyUnicode_FSConverter, &encoded))
        return NULL;
    const char *path = PyBytes_AsString(encoded);
    allocfunc alloc = (allocfunc)PyType_GetSlot(type, Py_tp_alloc);
    hl_nvrtc *n = (hl_nvrtc *)alloc(type, 0);
    if (n == NULL || (n->path = PyUnicode_DecodeFSDefault(path)) == NULL)
        goto error;
    Py_BEGIN_ALLOW_THREADS
    rc = library_open(n, path, why, sizeof(why));
    Py_END_ALLOW_THREADS
    if (rc < 0) {
        PyErr_Format(PyExc_RuntimeError, "NVRTC %s cannot be used: %s", path, why);
        goto error;
    }
    Py_DECREF(encoded);
    return (PyObject *)n;
error:
    Py_XDECREF(n);
    Py_DECREF(encoded);
    return NULL;
}

static void nvrtc_dealloc(PyObject *self) {
    hl_nvrtc *n = (hl_nvrtc *)self;
    PyTypeObject *type = Py_TYPE(self);
    Py_XDECREF(n->path);
    freefunc tp_free = (freefunc)PyType_GetSlot(type, Py_tp_free);
    tp_free(self);
    Py_DECREF(type);
}

static PyObject *get_path(PyObject *self, void *Py_UNUSED(closure)) { return Py_NewRef(((hl_nvrtc *)self)->path); }

static PyObject *get_version(PyObject *self, void *Py_UNUSED(closure)) {
    hl_nvrtc *n = (hl_nvrtc *)self;
    return Py_BuildValue("(ii)", n->major, n->minor);
}

static int compare_ints(const void *a, const void *b) { return *(const int *)a - *(const int *)b; }

PyDoc_STRVAR(supported_archs_doc, "supported_archs() -> list[int]\n\n"
             "The compute capabilities this NVRTC compiles for, ascending: [75, 80, 86, ...].");

static PyObject *nvrtc_supported_archs(PyObject *self, PyObject *Py_UNUSED(ignored)) {
    hl_nvrtc *n = (hl_nvrtc *)self;
    int count = 0;
    nvrtcResult rc = n->api.num_supported_archs(&count);
    if (rc != NVRTC_SUCCESS) {
        raise_nvrtc(n, rc, "nvrtcGetNumSupportedArchs");
        return NULL;
    }
    int *archs = malloc((size_t)(count > 0 ? count : 1) * sizeof(int));
    if (archs == NULL)
        return PyErr_NoMemory();
    PyObject *list = NULL;
    rc = n->api.supported_archs(archs);
    if (rc != NVRTC_SUCCESS) {
        raise_nvrtc(n, rc, "nvrtcGetSupportedArchs");
        goto done;
    }
    qsort(archs, (size_t)count, sizeof(int), compare_ints);
    list = PyList_New(count);
    for (int i = 0; list != NULL && i < count; i++) {
        PyObject *arch = PyLong_FromLong(archs[i]);
        if (arch == NULL || PyList_SetItem(list, i, arch) < 0)
            Py_CLEAR(list);
    }
done:
    free(archs);
    return list;
}

/* One compile's inputs and outputs, in memory of its own: it runs without the GIL. */
typedef struct {
    char *source, *name;
    char **options;
    int option_count;
    int cubin;
    /* results */
    nvrtcResult rc;
    const char *call; /* the call that failed, NULL while none did */
    char *log;        /* NVRTC's log, NUL-terminated (may be empty) */
    char *image;
    size_t image_size;
} compile_job;

static void job_free(compile_job *job) {
    free(job->source);
    free(job->name);
    for (int i = 0; job->options != NULL && i < job->option_count; i++)
        free(job->options[i]);
    free(job->options);
    free(job->log);
    free(job->image);
}

static char *copy_text(const char *text, size_t size) {
    char *copy = malloc(size + 1);
    if (copy != NULL) {
        memcpy(copy, text, size);
        copy[size] = '\0';
    }
    return copy;
}

/* Fill `job` from the Python arguments: 0, or -1 with an exception set. */
static int job_from_arguments(compile_job *job, PyObject *source, PyObject *name, PyObject *options) {
    char *text;
    Py_ssize_t size;
    if (PyBytes_AsStringAndSize(source, &text, &size) < 0)
        return -1;
    if (memchr(text, '\0', (size_t)size) != NULL) {
        PyErr_SetString(PyExc_ValueError, "compile: source: holds a NUL byte (NVRTC reads it as C text)");
        return -1;
    }
    job->source = copy_text(text, (size_t)size);
    const char *name_text = PyUnicode_AsUTF8AndSize(name, &size);
    if (name_text == NULL)
        return -1;
    job->name = copy_text(name_text, (size_t)size);
    if (job->source == NULL || job->name == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    PyObject *seq = PySequence_Fast(options, "compile: options: expected a list of str");
    if (seq == NULL)
        return -1;
    Py_ssize_t count = PySequence_Size(seq);
    job->options = calloc((size_t)(count > 0 ? count : 1), sizeof(char *));
    if (count < 0 || count > INT_MAX || job->options == NULL) {
        if (!PyErr_Occurred())
            PyErr_NoMemory();
        Py_DECREF(seq);
        return -1;
    }
    int rc = 0;
    for (Py_ssize_t i = 0; i < count && rc == 0; i++) {
        PyObject *item = PySequence_GetItem(seq, i);
        const char *option = item != NULL ? PyUnicode_AsUTF8AndSize(item, &size) : NULL;
        if (option == NULL) {
            if (item != NULL)
                PyErr_Format(PyExc_TypeError, "compile: options[%zd]: expected str, got %R", i, item);
            rc = -1;
        } else {
            job->options[i] = copy_text(option, (size_t)size);
            job->option_count = (int)i + 1; /* job_free frees it, copied or not */
            if (job->options[i] == NULL) {
                PyErr_NoMemory();
                rc = -1;
            }
        }
        Py_XDECREF(item);
    }
    Py_DECREF(seq);
    return rc;
}

/* Read a program's log or output into a buffer of its own: 0, or the failing call's code. */
static nvrtcResult read_text(nvrtcProgram program, nvrtcGetSize_fn get_size, nvrtcGetText_fn get_text,
                             char **out, size_t *out_size) {
    size_t size = 0;
    nvrtcResult rc = get_size(program, &size);
    if (rc != NVRTC_SUCCESS)
        return rc;
    *out = malloc(size + 1);
    if (*out == NULL)
        return -1; /* reported as out of memory */
    (*out)[size] = '\0';
    *out_size = size;
    return size > 0 ? get_text(program, *out) : NVRTC_SUCCESS;
}

/* The compile itself, without the GIL; the program is destroyed on every path. */
static void run_compile(const hl_nvrtc_api *api, compile_job *job) {
    nvrtcProgram program = NULL;
    size_t log_size = 0;
    job->rc = api->create_program(&program, job->source, job->name, 0, NULL, NULL);
    if (job->rc != NVRTC_SUCCESS) {
        job->call = "nvrtcCreateProgram";
        return;
    }
    job->rc = api->compile_program(program, job->option_count, (const char *const *)job->options);
    if (job->rc != NVRTC_SUCCESS)
        job->call = "nvrtcCompileProgram";
    /* the log explains a failure; a log that cannot be read leaves the failure's code to speak */
    if (read_text(program, api->log_size, api->log, &job->log, &log_size) != NVRTC_SUCCESS) {
        free(job->log);
        job->log = NULL;
    }
    if (job->call == NULL) {
        nvrtcResult rc = job->cubin ? read_text(program, api->cubin_size, api->cubin, &job->image, &job->image_size)
                                    : read_text(program, api->ptx_size, api->ptx, &job->image, &job->image_size);
        if (rc != NVRTC_SUCCESS) {
            job->rc = rc;
            job->call = job->cubin ? "nvrtcGetCUBIN" : "nvrtcGetPTX";
        }
    }
    api->destroy_program(&program);
}

PyDoc_STRVAR(compile_doc,
             "compile(source, name, options, cubin) -> bytes\n\n"
             "Compile CUDA C++ `source` (bytes), called `name` in messages, with NVRTC `options` (list of str,\n"
             "e.g. [\"-std=c++17\", \"-arch=sm_90\"]). cubin=True: the CUBIN (an ELF file; needs -arch=sm_XX);\n"
             "False: the PTX text without its trailing NUL (a bytes object keeps one in memory, as\n"
             "cuModuleLoadData needs). The GIL is released while NVRTC runs. RuntimeError with NVRTC's whole\n"
             "log on a compile error.");

static PyObject *nvrtc_compile(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *keywords[] = {"source", "name", "options", "cubin", NULL};
    hl_nvrtc *n = (hl_nvrtc *)self;
    PyObject *source, *name, *options, *result = NULL;
    int cubin;
    compile_job job;
    memset(&job, 0, sizeof(job));
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "SUOp:compile", keywords, &source, &name, &options, &cubin))
        return NULL;
    job.cubin = cubin;
    if (job_from_arguments(&job, source, name, options) < 0)
        goto done;
    Py_BEGIN_ALLOW_THREADS
    run_compile(&n->api, &job);
    Py_END_ALLOW_THREADS
    if (job.rc == -1) {
        PyErr_NoMemory();
    } else if (job.call != NULL) {
        const char *log = job.log != NULL && job.log[0] != '\0' ? job.log : "(NVRTC wrote no log)";
        PyErr_Format(PyExc_RuntimeError, "%s failed for %s with %s (%d) [NVRTC %S]:\n%s", job.call, job.name,
                     n->api.error_string(job.rc), job.rc, n->path, log);
    } else if (job.image_size == 0) {
        PyErr_Format(PyExc_RuntimeError, "%s: NVRTC made no %s (a CUBIN needs -arch=sm_XX, not compute_XX)",
                     job.name, cubin ? "CUBIN" : "PTX");
    } else {
        size_t size = job.image_size;
        if (!cubin && job.image[size - 1] == '\0')
            size--; /* PTX comes NUL-terminated */
        result = PyBytes_FromStringAndSize(job.image, (Py_ssize_t)size);
    }
done:
    job_free(&job);
    return result;
}

static PyGetSetDef nvrtc_getset[] = {
    {"path", get_path, NULL, "the library, as it was named when opened", NULL},
    {"version", get_version, NULL, "NVRTC's (major, minor), as nvrtcVersion says", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMethodDef nvrtc_methods[] = {
    {"supported_archs", nvrtc_supported_archs, METH_NOARGS, supported_archs_doc},
    {"compile", (PyCFunction)(void (*)(void))nvrtc_compile, METH_VARARGS | METH_KEYWORDS, compile_doc},
    {NULL, NULL, 0, NULL},
};

PyDoc_STRVAR(nvrtc_doc,
             "Nvrtc(path)\n\n"
             "One NVRTC library (libnvrtc.so.*), opened at run time with the builtins library of its folder\n"
             "loaded first. Needs no GPU. RuntimeError naming the path and why when it cannot be used.\n"
             "Several may live in one process; each stays loaded for the life of the process.");

static PyType_Slot nvrtc_slots[] = {
    {Py_tp_new, nvrtc_new},
    {Py_tp_dealloc, nvrtc_dealloc},
    {Py_tp_methods, nvrtc_methods},
    {Py_tp_getset, nvrtc_getset},
    {Py_tp_doc, (void *)nvrtc_doc},
    {0, NULL},
};

static PyType_Spec nvrtc_spec = {
    .name = "hotloop._C.Nvrtc",
    .basicsize = sizeof(hl_nvrtc),
    .flags = Py_TPFLAGS_DEFAULT,
    .slots = nvrtc_slots,
};

int hl_nvrtc_exec(PyObject *module) {
    PyObject *type = PyType_FromModuleAndSpec(module, &nvrtc_spec, NULL);
    if (type == NULL)
        return -1;
    int rc = PyModule_AddObjectRef(module, "Nvrtc", type);
    Py_DECREF(type);
    return rc;
}
