/* The JpegDecoder Python type: nvjpeg's batched decode engine (nvjpeg_engine.c) held by one thread at a time, in the process that opened it. */
#include "nvjpeg_engine.h"
#include "cuda.h"

#include <sched.h> /* sched_getaffinity (setup.py defines _GNU_SOURCE) */
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static const char *const backend_names[] = {"hardware", "cuda", "hybrid"};

typedef struct {
    PyObject_HEAD
    hl_jpeg_engine engine;
    int closed;
    atomic_int busy; /* a decode() or close() is running: one thread at a time */
    pid_t pid;       /* the process that opened it: a forked copy owns none of its nvjpeg or CUDA state */
} hl_jpeg_decoder;

/* An engine's failure as the exception it names, once the GIL is back: 0 when there was none */
static int raise_failure(PyObject *module, const hl_jpeg_failure *f) {
    if (f->bad_what != NULL) {
        PyErr_Format(PyExc_ValueError, "JpegDecoder.decode: image %zd: %s (%lld; expected %lld)", f->bad_index,
                     f->bad_what, f->bad_value, f->bad_limit);
        return -1;
    }
    if (f->cuda.code != 0)
        return hl_cuda_raise_if(module, &f->cuda);
    if (f->call != NULL)
        return hl_raise_nvjpeg(module, f->code, hl_nvjpeg_status_name(f->code), f->detail ? f->detail : "",
                               f->call, f->file, f->line);
    return 0;
}

static PyObject *module_of(PyObject *self) { return PyType_GetModule(Py_TYPE(self)); }

/* 0 when this thread now holds the decoder; -1 with an exception when closed or in use */
static int acquire(hl_jpeg_decoder *d, const char *method) {
    if (d->pid != getpid()) {
        PyErr_Format(PyExc_RuntimeError, "JpegDecoder.%s: the decoder was opened in process %d and this is a "
                     "forked copy (process %d), where CUDA cannot run: open one in this process", method,
                     (int)d->pid, (int)getpid());
        return -1;
    }
    if (d->closed) {
        PyErr_Format(PyExc_ValueError, "JpegDecoder.%s: the decoder is closed", method);
        return -1;
    }
    int expected = 0;
    if (!atomic_compare_exchange_strong(&d->busy, &expected, 1)) {
        PyErr_Format(PyExc_RuntimeError, "JpegDecoder.%s: the decoder is in use by another thread (a decoder "
                     "serves one thread at a time: make one per thread)", method);
        return -1;
    }
    if (d->closed) { /* closed by the thread that held it until now */
        atomic_store(&d->busy, 0);
        PyErr_Format(PyExc_ValueError, "JpegDecoder.%s: the decoder is closed", method);
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(decode_doc,
             "decode(sources, dests, count, stream) -> bytes\n\n"
             "Decode `count` JPEGs to RGB interleaved on the GPU, queued on `stream` (an int handle).\n"
             "sources: int64 pairs (host pointer, byte length) per image, in pinned host memory that stays\n"
             "alive and unchanged until `stream` passes this work. dests: int64 pairs (device pointer,\n"
             "pitch in bytes) per image, each a buffer of height * pitch bytes with pitch >= width * 3.\n"
             "Returns one status byte per image: JPEG_DECODED; JPEG_UNSUPPORTED (not by this backend: CMYK,\n"
             "YCCK, RGB-coded, 12-bit, lossless or arithmetic JPEGs, and what nvjpeg refuses, e.g. progressive\n"
             "ones on the hardware backend); JPEG_CORRUPT (truncated, or nvjpeg found it corrupt). A failed\n"
             "image never loses the others. The GIL is released for the whole call; the host blocks while\n"
             "nvjpeg works through the batch, longer where the cuda backend decodes Huffman codes on the CPU:\n"
             "progressive JPEGs, and batches of 50 or fewer (nvjpeg's rule). ValueError for bad pointers or\n"
             "pitches before any work is queued.");

static PyObject *decoder_decode(PyObject *self, PyObject *args) {
    hl_jpeg_decoder *d = (hl_jpeg_decoder *)self;
    const char *src_bytes, *dst_bytes;
    Py_ssize_t src_len, dst_len;
    int count;
    unsigned long long stream;
    if (!PyArg_ParseTuple(args, "y#y#iK:decode", &src_bytes, &src_len, &dst_bytes, &dst_len, &count, &stream))
        return NULL;
    if (count < 0 || count > d->engine.max_batch) {
        PyErr_Format(PyExc_ValueError, "JpegDecoder.decode: count: expected 0 to max_batch (%d), got %d",
                     d->engine.max_batch, count);
        return NULL;
    }
    if (src_len != (Py_ssize_t)count * 16 || dst_len != (Py_ssize_t)count * 16) {
        PyErr_Format(PyExc_ValueError, "JpegDecoder.decode: sources and dests: expected %d bytes each (two int64 "
                     "per image), got %zd and %zd", count * 16, src_len, dst_len);
        return NULL;
    }
    PyObject *result = PyBytes_FromStringAndSize(NULL, count);
    if (result == NULL || count == 0)
        return result;
    if (acquire(d, "decode") < 0) {
        Py_DECREF(result);
        return NULL;
    }
    hl_jpeg_failure f = {0};
    unsigned char *status = (unsigned char *)PyBytes_AsString(result);
    memset(status, HL_JPEG_CORRUPT_DATA, (size_t)count);
    Py_BEGIN_ALLOW_THREADS
    hl_jpeg_engine_decode(&d->engine, (const int64_t *)src_bytes, (const int64_t *)dst_bytes, count,
                          (hl_stream_t)(uintptr_t)stream, status, &f);
    Py_END_ALLOW_THREADS
    atomic_store(&d->busy, 0);
    if (raise_failure(module_of(self), &f) < 0) {
        Py_DECREF(result);
        return NULL;
    }
    return result;
}

/* close the decoder: 0, or -1 with an exception (it is closed either way) */
static int close_decoder(hl_jpeg_decoder *d, PyObject *module) {
    /* a forked copy (a DataLoader worker that garbage-collects the parent's decoder) leaves the state to
       the parent: nvjpeg's destroy calls there threw "Memory allocator error" and aborted the worker */
    if (d->closed || d->engine.lib == NULL || d->pid != getpid()) {
        d->closed = 1;
        return 0;
    }
    hl_jpeg_failure f = {0};
    Py_BEGIN_ALLOW_THREADS
    hl_jpeg_engine_close(&d->engine, &f);
    Py_END_ALLOW_THREADS
    d->closed = 1;
    return module != NULL ? raise_failure(module, &f) : 0;
}

PyDoc_STRVAR(close_doc, "close()\n\nWait for the last decode's work, then free the handle, states and buffers.\n"
             "Safe to call again; decode() afterwards raises ValueError.");

static PyObject *decoder_close(PyObject *self, PyObject *Py_UNUSED(ignored)) {
    hl_jpeg_decoder *d = (hl_jpeg_decoder *)self;
    if (d->closed || d->pid != getpid()) { /* a forked copy's close lets go of it only (close_decoder) */
        d->closed = 1;
        Py_RETURN_NONE;
    }
    if (acquire(d, "close") < 0)
        return NULL;
    int rc = close_decoder(d, module_of(self));
    atomic_store(&d->busy, 0);
    if (rc < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *decoder_enter(PyObject *self, PyObject *Py_UNUSED(ignored)) { return Py_NewRef(self); }

static PyObject *decoder_exit(PyObject *self, PyObject *Py_UNUSED(args)) { return decoder_close(self, NULL); }

static PyObject *get_backend(PyObject *self, void *Py_UNUSED(closure)) {
    return PyUnicode_FromString(backend_names[((hl_jpeg_decoder *)self)->engine.backend]);
}

static PyObject *get_library(PyObject *self, void *Py_UNUSED(closure)) {
    return PyUnicode_FromString(((hl_jpeg_decoder *)self)->engine.lib->path);
}

static PyObject *get_version(PyObject *self, void *Py_UNUSED(closure)) {
    const int *v = ((hl_jpeg_decoder *)self)->engine.lib->version;
    return Py_BuildValue("(iii)", v[0], v[1], v[2]);
}

static PyObject *get_device(PyObject *self, void *Py_UNUSED(closure)) {
    return PyLong_FromLong(((hl_jpeg_decoder *)self)->engine.device);
}

static PyObject *get_max_batch(PyObject *self, void *Py_UNUSED(closure)) {
    return PyLong_FromLong(((hl_jpeg_decoder *)self)->engine.max_batch);
}

static PyObject *get_interpolate(PyObject *self, void *Py_UNUSED(closure)) {
    return PyBool_FromLong(((hl_jpeg_decoder *)self)->engine.interpolate);
}

static PyObject *get_closed(PyObject *self, void *Py_UNUSED(closure)) {
    return PyBool_FromLong(((hl_jpeg_decoder *)self)->closed);
}

static PyObject *get_preallocate(PyObject *self, void *Py_UNUSED(closure)) {
    return PyBool_FromLong(((hl_jpeg_decoder *)self)->engine.preallocate);
}

static int set_flag(PyObject *value, int *flag, const char *name) {
    int truth = value != NULL ? PyObject_IsTrue(value) : -1;
    if (value == NULL)
        PyErr_Format(PyExc_AttributeError, "JpegDecoder.%s cannot be deleted", name);
    if (truth < 0)
        return -1;
    *flag = truth;
    return 0;
}

static int set_preallocate(PyObject *self, PyObject *value, void *Py_UNUSED(closure)) {
    return set_flag(value, &((hl_jpeg_decoder *)self)->engine.preallocate, "preallocate");
}

static PyObject *get_size_order(PyObject *self, void *Py_UNUSED(closure)) {
    return PyBool_FromLong(((hl_jpeg_decoder *)self)->engine.size_order);
}

static int set_size_order(PyObject *self, PyObject *value, void *Py_UNUSED(closure)) {
    return set_flag(value, &((hl_jpeg_decoder *)self)->engine.size_order, "size_order");
}

static PyObject *get_threads(PyObject *self, void *Py_UNUSED(closure)) {
    return PyLong_FromLong(((hl_jpeg_decoder *)self)->engine.threads);
}

static int set_threads(PyObject *self, PyObject *value, void *Py_UNUSED(closure)) {
    if (value == NULL) {
        PyErr_SetString(PyExc_AttributeError, "JpegDecoder.threads cannot be deleted");
        return -1;
    }
    long threads = PyLong_AsLong(value);
    if (threads == -1 && PyErr_Occurred())
        return -1;
    int least = ((hl_jpeg_decoder *)self)->engine.backend == HL_JPEG_HARDWARE ? 0 : 1; /* 0: the engines alone */
    if (threads < least || threads > HL_JPEG_MAX_LANES) {
        PyErr_Format(PyExc_ValueError, "JpegDecoder.threads: expected %d to %d, got %ld", least, HL_JPEG_MAX_LANES,
                     threads);
        return -1;
    }
    ((hl_jpeg_decoder *)self)->engine.threads = (int)threads;
    return 0;
}

static PyObject *get_lane_share(PyObject *self, void *Py_UNUSED(closure)) {
    const hl_jpeg_engine *e = &((hl_jpeg_decoder *)self)->engine;
    if (e->beside.handle == NULL)
        Py_RETURN_NONE;
    return PyFloat_FromDouble(e->beside.share);
}

static PyObject *get_lane_failure(PyObject *self, void *Py_UNUSED(closure)) {
    const hl_jpeg_beside *b = &((hl_jpeg_decoder *)self)->engine.beside;
    if (b->failed_call == NULL)
        Py_RETURN_NONE;
    return PyUnicode_FromFormat("%s failed with %s (%d)", b->failed_call, hl_nvjpeg_status_name(b->failed_status),
                                (int)b->failed_status);
}

static PyObject *get_lane_images(PyObject *self, void *Py_UNUSED(closure)) {
    return PyLong_FromLongLong(((hl_jpeg_decoder *)self)->engine.beside.images);
}

/* the CPUs this process may run on, at most HL_JPEG_MAX_LANES: the hybrid backend's threads by default */
static int available_cpus(void) {
    cpu_set_t set;
    int count = sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set) : (int)sysconf(_SC_NPROCESSORS_ONLN);
    return count < 1 ? 1 : count > HL_JPEG_MAX_LANES ? HL_JPEG_MAX_LANES : count;
}

static PyObject *get_engines(PyObject *self, void *Py_UNUSED(closure)) {
    hl_jpeg_decoder *d = (hl_jpeg_decoder *)self;
    if (d->engine.engines == 0)
        Py_RETURN_NONE;
    return Py_BuildValue("(II)", d->engine.engines, d->engine.cores_per_engine);
}

static PyGetSetDef decoder_getset[] = {
    {"backend", get_backend, NULL,
     "\"hardware\" (the JPEG engines), \"cuda\" (the SMs) or \"hybrid\" (host threads and the SMs)", NULL},
    {"library", get_library, NULL, "the nvjpeg library in use (the path it was opened by)", NULL},
    {"version", get_version, NULL, "nvjpeg's (major, minor, patch)", NULL},
    {"device", get_device, NULL, "the CUDA device it decodes on", NULL},
    {"max_batch", get_max_batch, NULL, "the most images one decode() takes", NULL},
    {"closed", get_closed, NULL, "whether close() ran", NULL},
    {"interpolate", get_interpolate, NULL, "chroma upsampled by interpolation (False: replicated)", NULL},
    {"hardware_engines", get_engines, NULL, "(engines, cores per engine) of the hardware backend, else None", NULL},
    {"preallocate", get_preallocate, set_preallocate,
     "size nvjpeg's buffers ahead for the largest image seen (nvjpegDecodeBatchedPreAllocate)", NULL},
    {"size_order", get_size_order, set_size_order,
     "hand each batch's images to the decoder largest first (on by default for the hardware backend)", NULL},
    {"threads", get_threads, set_threads,
     "the most host threads a decode() decodes Huffman codes on, the caller's included; hardware backend: "
     "beside the engines, 0 for none", NULL},
    {"lane_share", get_lane_share, NULL,
     "hardware backend with threads: the share of a batch's pixels the host threads take now (learnt from the "
     "batches before); else None", NULL},
    {"lane_images", get_lane_images, NULL, "hardware backend: images the host threads decoded beside the engines",
     NULL},
    {"lane_failure", get_lane_failure, NULL,
     "hardware backend: the nvjpeg call that failed every image of the host threads' share, after which the "
     "engines decode alone; else None", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMethodDef decoder_methods[] = {
    {"decode", decoder_decode, METH_VARARGS, decode_doc},
    {"close", decoder_close, METH_NOARGS, close_doc},
    {"__enter__", decoder_enter, METH_NOARGS, NULL},
    {"__exit__", decoder_exit, METH_VARARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyObject *decoder_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    static char *keywords[] = {"paths", "device", "backend", "max_batch", "interpolate", "threads", NULL};
    PyObject *paths, *module = PyType_GetModule(type);
    int device, max_batch, interpolate = 1, threads = 0;
    const char *backend_name;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "Oisi|$pi:JpegDecoder", keywords, &paths, &device, &backend_name,
                                     &max_batch, &interpolate, &threads))
        return NULL;
    int backend = strcmp(backend_name, "hardware") == 0 ? HL_JPEG_HARDWARE
                : strcmp(backend_name, "cuda") == 0   ? HL_JPEG_CUDA
                : strcmp(backend_name, "hybrid") == 0 ? HL_JPEG_HYBRID
                                                      : -1;
    if (backend < 0) {
        PyErr_Format(PyExc_ValueError,
                     "JpegDecoder: backend: expected \"hardware\", \"cuda\" or \"hybrid\", got \"%s\"", backend_name);
        return NULL;
    }
    if (threads < 0 || threads > HL_JPEG_MAX_LANES) {
        PyErr_Format(PyExc_ValueError, "JpegDecoder: threads: expected 0 to %d, got %d", HL_JPEG_MAX_LANES, threads);
        return NULL;
    }
    if (max_batch < 1 || max_batch > 65536) {
        PyErr_Format(PyExc_ValueError, "JpegDecoder: max_batch: expected 1 to 65536 images, got %d", max_batch);
        return NULL;
    }
    if (hl_cuda_require(module, device) < 0)
        return NULL;
    const hl_nvjpeg *lib = hl_nvjpeg_from_paths(paths, "JpegDecoder");
    if (lib == NULL)
        return NULL;
    allocfunc alloc = (allocfunc)PyType_GetSlot(type, Py_tp_alloc);
    hl_jpeg_decoder *d = (hl_jpeg_decoder *)alloc(type, 0);
    if (d == NULL)
        return NULL;
    d->pid = getpid();
    atomic_init(&d->busy, 0);
    if (hl_jpeg_engine_init(&d->engine, lib, device, backend, max_batch, interpolate) < 0) {
        d->closed = 1;
        Py_DECREF(d);
        return PyErr_NoMemory();
    }
    d->engine.threads = threads > 0 || backend != HL_JPEG_HYBRID ? threads : available_cpus();
    hl_jpeg_failure f = {0};
    Py_BEGIN_ALLOW_THREADS
    hl_jpeg_engine_open(&d->engine, &f);
    Py_END_ALLOW_THREADS
    if (f.call != NULL && backend == HL_JPEG_HARDWARE &&
        (f.code == NVJPEG_STATUS_ARCH_MISMATCH || f.code == NVJPEG_STATUS_JPEG_NOT_SUPPORTED ||
         f.code == NVJPEG_STATUS_IMPLEMENTATION_NOT_SUPPORTED)) {
        f.detail = "no hardware JPEG decoder on this GPU (only A100, H100, H200, GB200... have JPEG engines); "
                   "use backend=\"cuda\"";
    }
    if (raise_failure(module, &f) < 0) {
        d->closed = 1;
        Py_DECREF(d);
        return NULL;
    }
    return (PyObject *)d;
}

static void decoder_dealloc(PyObject *self) {
    hl_jpeg_decoder *d = (hl_jpeg_decoder *)self;
    PyTypeObject *type = Py_TYPE(self);
    close_decoder(d, NULL); /* failures while freeing cannot be raised from here */
    hl_jpeg_engine_free(&d->engine);
    freefunc tp_free = (freefunc)PyType_GetSlot(type, Py_tp_free);
    tp_free(self);
    Py_DECREF(type);
}

PyDoc_STRVAR(decoder_doc,
             "JpegDecoder(paths, device, backend, max_batch, *, interpolate=True, threads=0)\n\n"
             "Batched JPEG decoding to RGB interleaved on the GPU with nvjpeg, opened at run time from the first\n"
             "of `paths` that loads. backend \"hardware\": the JPEG engines (baseline JPEGs; nvjpeg says which);\n"
             "hotloop.NvjpegError saying \"no hardware JPEG decoder\" on a GPU without them. backend \"cuda\":\n"
             "nvjpeg's GPU-hybrid batched decoder on the SMs, progressive JPEGs one by one with Huffman decoding\n"
             "on the CPU. backend \"hybrid\": nvjpeg's hybrid decoder, Huffman codes decoded on up to `threads`\n"
             "host threads (0: one per CPU available), the rest on the SMs. The hardware backend with `threads`\n"
             "above 0 also decodes a share of each batch, learnt from the batches before, and the JPEGs the\n"
             "engines refuse, on that many host threads with the hybrid decoder. interpolate: subsampled chroma\n"
             "upsampled by interpolation, as libjpeg-turbo (PIL) does: pixels within 1 (hardware) or 3 (cuda)\n"
             "of PIL's, hybrid within the cuda backend's test bounds; False, or an nvjpeg without the option:\n"
             "replicated, up to ~70 off at colour edges. Made on `device`, the current device left\n"
             "as it was. One thread at a time: a second thread calling decode() meanwhile gets RuntimeError;\n"
             "make one decoder per thread.");

static PyType_Slot decoder_slots[] = {
    {Py_tp_new, decoder_new},
    {Py_tp_dealloc, decoder_dealloc},
    {Py_tp_methods, decoder_methods},
    {Py_tp_getset, decoder_getset},
    {Py_tp_doc, (void *)decoder_doc},
    {0, NULL},
};

static PyType_Spec decoder_spec = {
    .name = "hotloop._C.JpegDecoder",
    .basicsize = sizeof(hl_jpeg_decoder),
    .flags = Py_TPFLAGS_DEFAULT,
    .slots = decoder_slots,
};

static const hl_int_constant jpeg_decoder_constants[] = {
    {"JPEG_DECODED", HL_JPEG_DECODED},
    {"JPEG_UNSUPPORTED", HL_JPEG_UNSUPPORTED},
    {"JPEG_CORRUPT", HL_JPEG_CORRUPT_DATA},
    {"JPEG_MAX_THREADS", HL_JPEG_MAX_LANES}, /* JpegDecoder.threads' most */
    {NULL, 0},
};

int hl_jpeg_decoder_exec(PyObject *module) {
    hl_state *state = hl_state_of(module);
    state->jpeg_decoder_type = PyType_FromModuleAndSpec(module, &decoder_spec, NULL);
    if (state->jpeg_decoder_type == NULL)
        return -1;
    if (PyModule_AddObjectRef(module, "JpegDecoder", state->jpeg_decoder_type) < 0)
        return -1;
    return hl_add_int_constants(module, jpeg_decoder_constants);
}
