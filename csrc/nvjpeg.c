/* nvjpeg by dlopen (never linked): the library table, _C.nvjpeg_load, and JpegDecoder (batched JPEG -> RGB on the GPU). */
#include "module.h"
#include "cuda.h"
#include "jpeg_header.h"
#include "nvjpeg.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* ---------------------------------------------------------------------------------------------
   Status names and the per-image outcome of a decode. */

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

/* one status byte per image in what decode() returns */
enum { HL_JPEG_DECODED = 0, HL_JPEG_UNSUPPORTED = 1, HL_JPEG_CORRUPT_DATA = 2 };

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

/* The first of `paths` (a sequence of str or os.PathLike) that opens, with the GIL released while
   libraries load; NULL with a RuntimeError that lists each path tried and why it failed. */
static const hl_nvjpeg *library_from_paths(PyObject *paths, const char *caller) {
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
    const hl_nvjpeg *lib = library_from_paths(paths, "nvjpeg_load");
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

/* ---------------------------------------------------------------------------------------------
   CUDA events through the driver API (the runtime's handles are the driver's, so they mix with
   the streams torch and nvjpeg use). Without CUDA in the build no decoder is ever made. */

#ifdef HOTLOOP_WITH_CUDA
static int event_create(void **event) { return hl_cu.cuEventCreate((CUevent *)event, CU_EVENT_DISABLE_TIMING); }
static int event_destroy(void *event) { return hl_cu.cuEventDestroy((CUevent)event); }
static int event_record(void *event, hl_stream_t stream) { return hl_cu.cuEventRecord((CUevent)event, (CUstream)stream); }
static int event_synchronize(void *event) { return hl_cu.cuEventSynchronize((CUevent)event); }
static int stream_wait(hl_stream_t stream, void *event) {
    return hl_cu.cuStreamWaitEvent((CUstream)stream, (CUevent)event, 0);
}
static int stream_synchronize(hl_stream_t stream) { return hl_cu.cuStreamSynchronize((CUstream)stream); }
#define DEVICE_GUARD hl_device_guard
#define DEVICE_ENTER(guard, device, status) hl_device_enter(guard, device, status)
#define DEVICE_LEAVE(guard, status) hl_device_leave(guard, status)
#else
static int event_create(void **event) { *event = NULL; return 100; /* CUDA_ERROR_NO_DEVICE */ }
static int event_destroy(void *event) { (void)event; return 0; }
static int event_record(void *event, hl_stream_t stream) { (void)event; (void)stream; return 100; }
static int event_synchronize(void *event) { (void)event; return 0; }
static int stream_wait(hl_stream_t stream, void *event) { (void)stream; (void)event; return 100; }
static int stream_synchronize(hl_stream_t stream) { (void)stream; return 100; }
typedef int DEVICE_GUARD;
#define DEVICE_ENTER(guard, device, status) ((void)(guard), (void)(device), (void)(status))
#define DEVICE_LEAVE(guard, status) ((void)(guard), (void)(status))
#endif

/* ---------------------------------------------------------------------------------------------
   The decoder. */

enum { BACKEND_HARDWARE = 0, BACKEND_CUDA = 1 };
static const char *const backend_names[] = {"hardware", "cuda"};

/* NOTE [ RGB out of nvjpeg ]
   The hardware backend's engines write each image into nvjpeg's own memory, and nvjpeg then brings it
   to the output format on the GPU, one image at a time, each step a CUDA call of its own: for
   interleaved RGB one small colour-conversion kernel per image. Planar YUV, which would let the resize
   kernel convert colour in the pass it makes anyway, is no cheaper there: nvjpeg copies each of the
   three planes out with a 2D device-to-device copy, three calls where RGB takes one, and the loader
   and the step it fed were slower with it. So every decode asks for NVJPEG_OUTPUT_RGBI. The same
   per-image work runs on streams nvjpeg creates for itself, ordered after the caller's by events: the
   priority of the stream a decode is given reaches only our own kernel (stage.py's _DecodeStream). */

/* NOTE [ Two handles ]
   Chroma upsampled by interpolation (NVJPEG_FLAGS_UPSAMPLING_WITH_INTERPOLATION, libjpeg-turbo's
   "fancy upsampling", which PIL applies) is a flag of the whole handle. A hardware batch decoded by
   such a handle slows down sharply when a few of its images are 4:4:4 or greyscale, as in a realistic
   photo set, and not when all are 4:2:0 or when the handle does not interpolate. 4:4:4 and greyscale
   images have no chroma to upsample, so the flag cannot change their pixels: they go to a second
   handle without it, in a batched call of their own. */

/* a handle's batched decoder */
typedef struct {
    nvjpegHandle_t handle; /* the decoder's `handle`, or a handle of its own (plain); NULL: none */
    nvjpegJpegState_t state;
    int batch; /* the batch size `state` is initialised for; 0: initialise again */
    int owns_handle;
    int alloc_width, alloc_height; /* what nvjpegDecodeBatchedPreAllocate was last given (preallocate) */
} batched_decoder;

typedef struct {
    PyObject_HEAD
    const hl_nvjpeg *lib;
    int device, backend, max_batch;
    int interpolate; /* chroma upsampled by interpolation (as libjpeg-turbo does), not replication */
    int closed;
    atomic_int busy; /* a decode() or close() is running: one thread at a time */
    pid_t pid;       /* the process that opened it: a forked copy owns none of its nvjpeg or CUDA state */
    unsigned int engines, cores_per_engine; /* hardware backend: what nvjpegGetHardwareDecoderInfo says */
    int preallocate; /* size nvjpeg's buffers for the largest image seen, ahead of the batch (NOTE [ Largest first ]) */
    int size_order;  /* hand the engines each batch's images largest first (NOTE [ Largest first ]) */

    nvjpegHandle_t handle;
    batched_decoder batched;          /* on `handle`: every image, or those with chroma to upsample */
    batched_decoder plain;            /* interpolating hardware backend: the others (NOTE [ Two handles ]) */
    nvjpegJpegStream_t header_stream; /* hardware: a parsed header, for nvjpegDecodeBatchedSupported */

    /* cuda backend: progressive JPEGs (and any the batched call refuses), one at a time through the
       decoupled API, Huffman decoding on the CPU; two pinned buffers so one fills while the other's
       copy runs, each free again once its event passed */
    nvjpegJpegDecoder_t decoder;
    nvjpegJpegState_t decoder_state;
    nvjpegDecodeParams_t params;
    nvjpegBufferDevice_t device_buffer;
    nvjpegBufferPinned_t pinned[2];
    nvjpegJpegStream_t streams[2];
    void *pinned_free[2]; /* cudaEvent_t, recorded after the copy out of pinned[k] */
    int pinned_pending[2];
    int next_pinned;

    void *done;            /* cudaEvent_t recorded at the end of every decode, on its stream */
    hl_stream_t last_stream;
    int done_pending;

    /* per-image scratch, max_batch long; malloc'd: used without the GIL */
    const unsigned char **data;
    size_t *lengths;
    nvjpegImage_t *images;
    int *order;
    int *widths, *heights; /* each image's, from its header */
    long long *keys;       /* size_order's sort keys */
} hl_jpeg_decoder;

/* The first failure of a call, raised once the GIL is back. */
typedef struct {
    nvjpegStatus_t code; /* nvjpeg status, when call is set and cuda is 0 */
    hl_cuda_status cuda;
    const char *call;
    const char *detail;
    int line;
    /* bad input found before any work: ValueError naming the image */
    Py_ssize_t bad_index;
    const char *bad_what;
    long long bad_value, bad_limit;
} decode_failure;

#define NVJPEG_FAILED(f, rc, name) ((f)->code = (rc), (f)->call = (name), (f)->line = __LINE__)

static int raise_failure(PyObject *module, const decode_failure *f) {
    if (f->bad_what != NULL) {
        PyErr_Format(PyExc_ValueError, "JpegDecoder.decode: image %zd: %s (%lld; expected %lld)", f->bad_index,
                     f->bad_what, f->bad_value, f->bad_limit);
        return -1;
    }
    if (f->cuda.code != 0)
        return hl_cuda_raise_if(module, &f->cuda);
    if (f->call != NULL)
        return hl_raise_nvjpeg(module, f->code, hl_nvjpeg_status_name(f->code), f->detail ? f->detail : "",
                               f->call, __FILE__, f->line);
    return 0;
}

/* Free what exists, in reverse order of creation; the first failure is kept in `f`. Called without
   the GIL and with the device current. */
static void release_all(hl_jpeg_decoder *d, decode_failure *f) {
    const hl_nvjpeg *n = d->lib;
    nvjpegStatus_t rc;
    /* the last decode's work must be over before its buffers go (a targeted wait, not a device sync) */
    if (d->done_pending)
        HL_CUDA(&f->cuda, event_synchronize(d->done));
    for (int k = 0; k < 2; k++) {
        if (d->pinned_free[k] != NULL)
            HL_CUDA(&f->cuda, event_destroy(d->pinned_free[k]));
        d->pinned_free[k] = NULL;
        if (d->streams[k] != NULL && (rc = n->stream_destroy(d->streams[k])) != 0 && f->call == NULL)
            NVJPEG_FAILED(f, rc, "nvjpegJpegStreamDestroy");
        d->streams[k] = NULL;
    }
    if (d->done != NULL)
        HL_CUDA(&f->cuda, event_destroy(d->done));
    d->done = NULL;
    d->done_pending = 0;
    if (d->decoder_state != NULL && (rc = n->state_destroy(d->decoder_state)) != 0 && f->call == NULL)
        NVJPEG_FAILED(f, rc, "nvjpegJpegStateDestroy");
    d->decoder_state = NULL;
    for (int k = 0; k < 2; k++) {
        if (d->pinned[k] != NULL && (rc = n->pinned_destroy(d->pinned[k])) != 0 && f->call == NULL)
            NVJPEG_FAILED(f, rc, "nvjpegBufferPinnedDestroy");
        d->pinned[k] = NULL;
    }
    if (d->device_buffer != NULL && (rc = n->device_buffer_destroy(d->device_buffer)) != 0 && f->call == NULL)
        NVJPEG_FAILED(f, rc, "nvjpegBufferDeviceDestroy");
    d->device_buffer = NULL;
    if (d->params != NULL && (rc = n->params_destroy(d->params)) != 0 && f->call == NULL)
        NVJPEG_FAILED(f, rc, "nvjpegDecodeParamsDestroy");
    d->params = NULL;
    if (d->decoder != NULL && (rc = n->decoder_destroy(d->decoder)) != 0 && f->call == NULL)
        NVJPEG_FAILED(f, rc, "nvjpegDecoderDestroy");
    d->decoder = NULL;
    if (d->header_stream != NULL && (rc = n->stream_destroy(d->header_stream)) != 0 && f->call == NULL)
        NVJPEG_FAILED(f, rc, "nvjpegJpegStreamDestroy");
    d->header_stream = NULL;
    batched_decoder *kinds[2] = {&d->plain, &d->batched};
    for (int k = 0; k < 2; k++) {
        batched_decoder *b = kinds[k];
        if (b->state != NULL && (rc = n->state_destroy(b->state)) != 0 && f->call == NULL)
            NVJPEG_FAILED(f, rc, "nvjpegJpegStateDestroy");
        b->state = NULL;
        if (b->owns_handle && b->handle != NULL && (rc = n->destroy(b->handle)) != 0 && f->call == NULL)
            NVJPEG_FAILED(f, rc, "nvjpegDestroy");
        b->handle = NULL;
        b->batch = 0;
    }
    if (d->handle != NULL && (rc = n->destroy(d->handle)) != 0 && f->call == NULL)
        NVJPEG_FAILED(f, rc, "nvjpegDestroy");
    d->handle = NULL;
}

/* Create everything; the first failure is kept in `f` (release_all frees the rest). Without the GIL. */
#define TRY(f, expr, name)                                                                         \
    do {                                                                                           \
        nvjpegStatus_t rc_ = (expr);                                                               \
        if (rc_ != NVJPEG_STATUS_SUCCESS) {                                                        \
            NVJPEG_FAILED(f, rc_, name);                                                           \
            return;                                                                                \
        }                                                                                          \
    } while (0)

static void create_all(hl_jpeg_decoder *d, decode_failure *f) {
    const hl_nvjpeg *n = d->lib;
    int backend = d->backend == BACKEND_HARDWARE ? NVJPEG_BACKEND_HARDWARE : NVJPEG_BACKEND_GPU_HYBRID;
    nvjpegStatus_t rc = NVJPEG_STATUS_INVALID_PARAMETER;
    if (d->interpolate)
        rc = n->create_ex(backend, NULL, NULL, NVJPEG_FLAGS_UPSAMPLING_WITH_INTERPOLATION, &d->handle);
    if (rc == NVJPEG_STATUS_INVALID_PARAMETER || rc == NVJPEG_STATUS_IMPLEMENTATION_NOT_SUPPORTED) {
        d->interpolate = 0; /* an nvjpeg without the flag (before CUDA 12.x), or not asked for */
        rc = n->create_ex(backend, NULL, NULL, NVJPEG_FLAGS_DEFAULT, &d->handle);
    }
    TRY(f, rc, "nvjpegCreateEx");
    d->batched.handle = d->handle;
    TRY(f, n->state_create(d->handle, &d->batched.state), "nvjpegJpegStateCreate");
    TRY(f, n->batched_initialize(d->handle, d->batched.state, d->max_batch, 1, NVJPEG_OUTPUT_RGBI),
        "nvjpegDecodeBatchedInitialize");
    d->batched.batch = d->max_batch;
    if (d->interpolate && d->backend == BACKEND_HARDWARE) { /* NOTE [ Two handles ] */
        TRY(f, n->create_ex(backend, NULL, NULL, NVJPEG_FLAGS_DEFAULT, &d->plain.handle), "nvjpegCreateEx");
        d->plain.owns_handle = 1;
        TRY(f, n->state_create(d->plain.handle, &d->plain.state), "nvjpegJpegStateCreate");
        /* initialised at its first batch, for that batch's size */
    }
    TRY(f, n->stream_create(d->handle, &d->header_stream), "nvjpegJpegStreamCreate");
    if (d->backend == BACKEND_HARDWARE && n->hardware_info != NULL &&
        n->hardware_info(d->handle, &d->engines, &d->cores_per_engine) != NVJPEG_STATUS_SUCCESS)
        d->engines = d->cores_per_engine = 0; /* only informative: hardware_engines says None */
    HL_CUDA(&f->cuda, event_create(&d->done));
    if (f->cuda.code != 0 || d->backend != BACKEND_CUDA)
        return;
    TRY(f, n->decoder_create(d->handle, NVJPEG_BACKEND_DEFAULT, &d->decoder), "nvjpegDecoderCreate");
    TRY(f, n->decoder_state_create(d->handle, d->decoder, &d->decoder_state), "nvjpegDecoderStateCreate");
    TRY(f, n->params_create(d->handle, &d->params), "nvjpegDecodeParamsCreate");
    TRY(f, n->params_set_output(d->params, NVJPEG_OUTPUT_RGBI), "nvjpegDecodeParamsSetOutputFormat");
    TRY(f, n->device_buffer_create(d->handle, NULL, &d->device_buffer), "nvjpegBufferDeviceCreate");
    TRY(f, n->attach_device(d->decoder_state, d->device_buffer), "nvjpegStateAttachDeviceBuffer");
    for (int k = 0; k < 2; k++) {
        TRY(f, n->pinned_create(d->handle, NULL, &d->pinned[k]), "nvjpegBufferPinnedCreate");
        TRY(f, n->stream_create(d->handle, &d->streams[k]), "nvjpegJpegStreamCreate");
        HL_CUDA(&f->cuda, event_create(&d->pinned_free[k]));
    }
}

/* ---------------------------------------------------------------------------------------------
   decode(): without the GIL throughout. */

typedef struct {
    const int64_t *src, *dst; /* (pointer, length) and (device pointer, pitch) per image */
    hl_stream_t stream;
    unsigned char *status;
    decode_failure *f;
    nvjpegStatus_t other;  /* the first failure no image explains (a leaf's EXECUTION_FAILED...) */
    const char *other_call;
} decode_call;

static const unsigned char *source_of(const decode_call *c, int i) {
    return (const unsigned char *)(uintptr_t)c->src[2 * i];
}

static nvjpegImage_t image_of(const decode_call *c, int i) {
    nvjpegImage_t image;
    memset(&image, 0, sizeof(image));
    image.channel[0] = (unsigned char *)(uintptr_t)c->dst[2 * i];
    image.pitch[0] = (size_t)c->dst[2 * i + 1];
    return image;
}

/* What a failure decoding one image alone says about it; `other` for failures that are not the
   image's (they raise if no image of the call decoded). */
static unsigned char leaf_status(decode_call *c, nvjpegStatus_t rc, const char *call) {
    switch (rc) {
    case NVJPEG_STATUS_BAD_JPEG:
    case NVJPEG_STATUS_INCOMPLETE_BITSTREAM:
        return HL_JPEG_CORRUPT_DATA;
    case NVJPEG_STATUS_JPEG_NOT_SUPPORTED:
    case NVJPEG_STATUS_IMPLEMENTATION_NOT_SUPPORTED:
    case NVJPEG_STATUS_ALLOCATOR_FAILURE: /* too large for this backend's buffers; the CPU may manage */
        return HL_JPEG_UNSUPPORTED;
    default:
        if (c->other_call == NULL) {
            c->other = rc;
            c->other_call = call;
        }
        return HL_JPEG_CORRUPT_DATA;
    }
}

/* One image through the decoupled API (cuda backend). 0 with status set, -1 on a failure that
   stops the call (kept in c->f). */
static int decode_one(hl_jpeg_decoder *d, decode_call *c, int i) {
    const hl_nvjpeg *n = d->lib;
    int k = d->next_pinned;
    nvjpegImage_t image = image_of(c, i);
    nvjpegStatus_t rc;
    /* pinned[k] is written by the host step: its previous copy to the device must be over */
    if (d->pinned_pending[k]) {
        HL_CUDA(&c->f->cuda, event_synchronize(d->pinned_free[k]));
        if (c->f->cuda.code != 0)
            return -1;
        d->pinned_pending[k] = 0;
    }
    const char *call = "nvjpegJpegStreamParse";
    rc = n->parse(d->handle, source_of(c, i), (size_t)c->src[2 * i + 1], 0, 0, d->streams[k]);
    if (rc == NVJPEG_STATUS_SUCCESS && (rc = n->attach_pinned(d->decoder_state, d->pinned[k])) != 0)
        call = "nvjpegStateAttachPinnedBuffer";
    if (rc == NVJPEG_STATUS_SUCCESS && (rc = n->decode_host(d->handle, d->decoder, d->decoder_state, d->params,
                                                           d->streams[k])) != 0)
        call = "nvjpegDecodeJpegHost";
    if (rc == NVJPEG_STATUS_SUCCESS &&
        (rc = n->decode_transfer(d->handle, d->decoder, d->decoder_state, d->streams[k], c->stream)) != 0)
        call = "nvjpegDecodeJpegTransferToDevice";
    if (rc == NVJPEG_STATUS_SUCCESS) {
        HL_CUDA(&c->f->cuda, event_record(d->pinned_free[k], c->stream));
        if (c->f->cuda.code != 0)
            return -1;
        d->pinned_pending[k] = 1;
        d->next_pinned = 1 - k;
        if ((rc = n->decode_device(d->handle, d->decoder, d->decoder_state, &image, c->stream)) != 0)
            call = "nvjpegDecodeJpegDevice";
    }
    c->status[i] = rc == NVJPEG_STATUS_SUCCESS ? HL_JPEG_DECODED : leaf_status(c, rc, call);
    return 0;
}

/* max_batch x width x height preallocated at most (NOTE [ Largest first ]) */
#define PREALLOCATE_PIXELS (256LL * 2048 * 2048)

/* The images order[0..count) in one batched call; a failed call is split in halves until each
   failure is one image's. 0, or -1 on a failure that stops the call (kept in c->f). */
static int decode_batch(hl_jpeg_decoder *d, batched_decoder *b, decode_call *c, const int *order, int count) {
    const hl_nvjpeg *n = d->lib;
    nvjpegStatus_t rc;
    if (b->batch != count) {
        /* nvjpegDecodeBatched takes exactly as many images as the state was initialised for */
        rc = n->batched_initialize(b->handle, b->state, count, 1, NVJPEG_OUTPUT_RGBI);
        if (rc != NVJPEG_STATUS_SUCCESS) {
            b->batch = 0;
            NVJPEG_FAILED(c->f, rc, "nvjpegDecodeBatchedInitialize");
            return -1;
        }
        b->batch = count;
    }
    int widest = 0, tallest = 0;
    for (int k = 0; k < count; k++) {
        d->data[k] = source_of(c, order[k]);
        d->lengths[k] = (size_t)c->src[2 * order[k] + 1];
        d->images[k] = image_of(c, order[k]);
        widest = d->widths[order[k]] > widest ? d->widths[order[k]] : widest;
        tallest = d->heights[order[k]] > tallest ? d->heights[order[k]] : tallest;
    }
    if (d->preallocate && n->batched_preallocate != NULL &&
        (widest > b->alloc_width || tallest > b->alloc_height)) {
        /* grown in steps of 256 px, so that a few calls cover a data set's sizes; never past the
           budget (NOTE [ Largest first ]), where nvjpeg grows its buffers itself as it would without */
        int width = ((widest > b->alloc_width ? widest : b->alloc_width) + 255) / 256 * 256;
        int height = ((tallest > b->alloc_height ? tallest : b->alloc_height) + 255) / 256 * 256;
        if ((long long)d->max_batch * width * height <= PREALLOCATE_PIXELS &&
            n->batched_preallocate(b->handle, b->state, d->max_batch, width, height, NVJPEG_CSS_444,
                                   NVJPEG_OUTPUT_RGBI) == NVJPEG_STATUS_SUCCESS) {
            b->alloc_width = width;
            b->alloc_height = height;
        }
    }
    rc = n->batched(b->handle, b->state, d->data, d->lengths, d->images, c->stream);
    if (rc == NVJPEG_STATUS_SUCCESS) {
        for (int k = 0; k < count; k++)
            c->status[order[k]] = HL_JPEG_DECODED;
        return 0;
    }
    b->batch = 0; /* a failed batch is reset by initialising again */
    if (count == 1) {
        unsigned char s = leaf_status(c, rc, "nvjpegDecodeBatched");
        /* the decoupled path may take what the batched one refused */
        if (s == HL_JPEG_UNSUPPORTED && d->backend == BACKEND_CUDA)
            return decode_one(d, c, order[0]);
        c->status[order[0]] = s;
        return 0;
    }
    int half = count / 2;
    if (decode_batch(d, b, c, order, half) < 0)
        return -1;
    return decode_batch(d, b, c, order + half, count - half);
}

/* whether a colour JPEG's chroma is subsampled (4:2:0, 4:2:2...): upsampling it is where the
   interpolation flag acts */
static int chroma_upsampled(const hl_jpeg_info *info) {
    return info->components == 3 && (info->sampling[1] != info->sampling[0] || info->sampling[2] != info->sampling[0]);
}

/* NOTE [ Known to the engines ]
   Asking nvjpeg whether its hardware backend takes an image (nvjpegJpegStreamParseHeader, then
   nvjpegDecodeBatchedSupported) costs host time for every image, a large share of the host's time in
   a batch's decode. The kinds that make up nearly every photo data set, baseline 8-bit greyscale or
   YCbCr 4:4:4, 4:2:2 or 4:2:0 up to 4096 px a side, are taken without asking: the engines decoded
   every such image of the tests and of the bench's photographs. Any other kind is asked about. Should the engines still
   refuse one, the batched call fails and decode_batch halves the batch until the image is found and
   marked unsupported (the dataset's own loader then decodes it): slower, never wrong. */
static int known_to_engines(const hl_jpeg_info *info) {
    if (info->process != HL_JPEG_BASELINE || info->precision != 8 || info->width > 4096 || info->height > 4096)
        return 0;
    if (info->components == 1)
        return 1;
    int luma = info->sampling[0];
    return info->components == 3 && info->sampling[1] == 0x11 && info->sampling[2] == 0x11 &&
           (luma == 0x11 || luma == 0x21 || luma == 0x22);
}

/* NOTE [ Largest first ]
   The engines take a batch's images in the order given; handed largest first, the small ones fill
   in at the end and the engines finish together. Measured on an H100 (nvjpeg 13.0, 256 realistic
   photos a call, .gpu/diag_sync.py on the gpu-diag branch): a call took 6.3 ms instead of 8.0, and
   the loader alone ran 5 % faster, so it is on for the hardware backend. size_order=False gives
   the caller's order.

   nvjpegDecodeBatchedPreAllocate (preallocate) sizes nvjpeg's buffers for the largest image seen so
   far, ahead of the batch; without it nvjpeg grows them inside its calls as larger images come (its
   memory still grew in a loader's third epoch). On for the hardware backend. Measured on an H100
   (15,000 realistic photos up to 1,931 px, 8 workers, one loader kept for 3 epochs,
   .gpu/diag_prealloc_mem.py on the gpu-diag branch): the loader alone ran at a median 25.5k img/s
   instead of 23.0k, and fed ResNet-50 AMP at 96.6 % of its resident speed instead of 92.7 % (88.6
   and 96.8 in two epochs). It costs device memory outside torch's allocator: 707 MiB against
   119-211 MiB without, for batches of 256 preallocated at 2048 x 2048 at most (the largest images
   rounded up). That is PREALLOCATE_PIXELS: a data set of larger images (or a larger batch) is
   preallocated no further, and nvjpeg grows its buffers itself past it. */

static int key_descending(const void *a, const void *b) {
    long long x = *(const long long *)a, y = *(const long long *)b;
    return (x < y) - (x > y);
}

/* order[0..count) by pixel count, largest first (ties by index). One qsort of packed keys, as qsort's
   comparator has no context: the area above bit 17, the index's complement below (max_batch is at
   most 65536, so it fits 16 bits), so that among equal areas the lower index sorts first. */
static void sort_largest_first(hl_jpeg_decoder *d, int *order, int count) {
    for (int k = 0; k < count; k++)
        d->keys[k] = ((long long)d->widths[order[k]] * d->heights[order[k]] << 17) | (65535 - order[k]);
    qsort(d->keys, (size_t)count, sizeof(*d->keys), key_descending);
    for (int k = 0; k < count; k++)
        order[k] = 65535 - (int)(d->keys[k] & 0x1ffff);
}

static void run_decode(hl_jpeg_decoder *d, decode_call *c, int count) {
    const hl_nvjpeg *n = d->lib;
    decode_failure *f = c->f;
    int batched = 0, singles = 0, plain = 0; /* order: batched from the front; singles or plain from the end */
    int *order = d->order;

    /* 1. every image's header, read here before nvjpeg sees it; bad input stops the call before any work */
    for (int i = 0; i < count; i++) {
        int64_t src = c->src[2 * i], length = c->src[2 * i + 1], dst = c->dst[2 * i], pitch = c->dst[2 * i + 1];
        f->bad_index = i;
        if (src == 0 || length <= 0) {
            f->bad_what = src == 0 ? "source pointer is 0" : "source length is not positive";
            f->bad_value = src == 0 ? 0 : length;
            f->bad_limit = 1;
            return;
        }
        if (dst == 0) {
            f->bad_what = "destination pointer is 0";
            f->bad_limit = 1;
            return;
        }
        hl_jpeg_info info;
        const char *why;
        if (hl_jpeg_parse(source_of(c, i), (size_t)length, &info, &why) != HL_JPEG_OK || !info.scan ||
            !info.ends_with_eoi) {
            c->status[i] = HL_JPEG_CORRUPT_DATA; /* truncated files included: PIL refuses them too */
            continue;
        }
        d->widths[i] = (int)info.width;
        d->heights[i] = (int)info.height;
        if (pitch < (int64_t)info.width * 3) {
            f->bad_what = "destination pitch is below width * 3 bytes";
            f->bad_value = pitch;
            f->bad_limit = (long long)info.width * 3;
            return;
        }
        /* nvjpeg's RGB would be wrong for these (CMYK, YCCK, RGB-coded) or it cannot read them at all */
        if ((info.components != 1 && info.components != 3) || info.precision != 8 || info.process == HL_JPEG_OTHER ||
            hl_jpeg_is_rgb(&info)) {
            c->status[i] = HL_JPEG_UNSUPPORTED;
            continue;
        }
        if (d->backend == BACKEND_HARDWARE) {
            int unsupported = 0;
            const char *call = "nvjpegJpegStreamParseHeader";
            nvjpegStatus_t rc = NVJPEG_STATUS_SUCCESS;
            if (!known_to_engines(&info)) { /* NOTE [ Known to the engines ] */
                unsupported = 1;
                rc = n->parse_header(d->handle, source_of(c, i), (size_t)length, d->header_stream);
                if (rc == NVJPEG_STATUS_SUCCESS && (rc = n->batched_supported(d->handle, d->header_stream,
                                                                              &unsupported)) != 0)
                    call = "nvjpegDecodeBatchedSupported";
            }
            if (rc != NVJPEG_STATUS_SUCCESS)
                c->status[i] = leaf_status(c, rc, call);
            else if (unsupported)
                c->status[i] = HL_JPEG_UNSUPPORTED;
            else if (d->plain.handle != NULL && !chroma_upsampled(&info))
                order[count - 1 - plain++] = i; /* NOTE [ Two handles ] */
            else
                order[batched++] = i;
        } else if (info.process == HL_JPEG_PROGRESSIVE) {
            order[count - 1 - singles++] = i; /* from the end: the batched ones fill the front */
        } else {
            order[batched++] = i;
        }
    }
    f->bad_what = NULL;
    if (d->size_order) {
        sort_largest_first(d, order, batched);
        sort_largest_first(d, order + count - plain, plain);
    }

    /* 2. the work, all on c->stream; a stream other than the last call's first waits for that call */
    if (d->done_pending && d->last_stream != c->stream) {
        HL_CUDA(&f->cuda, stream_wait(c->stream, d->done));
        if (f->cuda.code != 0)
            return;
    }
    if (batched + plain > 0 && d->backend == BACKEND_HARDWARE) {
        /* the hardware backend's batched decode was reported to write its outputs while this call
           runs, ignoring the work queued on the stream before it, a cudaStreamWaitEvent included,
           which may still use that memory (torchcodec #1634: nvjpeg 12.3 to 13.2). Only a host wait
           orders it */
        HL_CUDA(&f->cuda, stream_synchronize(c->stream));
        if (f->cuda.code != 0)
            return;
    }
    if (batched > 0 && decode_batch(d, &d->batched, c, order, batched) < 0)
        return;
    if (plain > 0 && decode_batch(d, &d->plain, c, order + count - plain, plain) < 0)
        return;
    for (int s = 0; s < singles; s++)
        if (decode_one(d, c, order[count - 1 - s]) < 0)
            return;
    if (batched + plain + singles > 0) {
        HL_CUDA(&f->cuda, event_record(d->done, c->stream));
        d->done_pending = f->cuda.code == 0;
        d->last_stream = c->stream;
    }
    if (c->other_call != NULL) { /* raise only when no image decoded: then the failure was not theirs */
        int decoded = 0;
        for (int i = 0; i < count; i++)
            decoded += c->status[i] == HL_JPEG_DECODED;
        if (decoded == 0) {
            NVJPEG_FAILED(f, c->other, c->other_call);
            f->detail = "every image of the call failed";
        }
    }
}

/* ---------------------------------------------------------------------------------------------
   Python methods */

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
    if (count < 0 || count > d->max_batch) {
        PyErr_Format(PyExc_ValueError, "JpegDecoder.decode: count: expected 0 to max_batch (%d), got %d",
                     d->max_batch, count);
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
    decode_failure f;
    memset(&f, 0, sizeof(f));
    decode_call c = {.src = (const int64_t *)src_bytes, .dst = (const int64_t *)dst_bytes,
                     .stream = (hl_stream_t)(uintptr_t)stream, .status = (unsigned char *)PyBytes_AsString(result),
                     .f = &f};
    memset(c.status, HL_JPEG_CORRUPT_DATA, (size_t)count);
    Py_BEGIN_ALLOW_THREADS
    DEVICE_GUARD guard;
    DEVICE_ENTER(&guard, d->device, &f.cuda);
    if (f.cuda.code == 0)
        run_decode(d, &c, count);
    DEVICE_LEAVE(&guard, &f.cuda);
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
    if (d->closed || d->lib == NULL || d->pid != getpid()) {
        d->closed = 1;
        return 0;
    }
    decode_failure f;
    memset(&f, 0, sizeof(f));
    Py_BEGIN_ALLOW_THREADS
    DEVICE_GUARD guard;
    DEVICE_ENTER(&guard, d->device, &f.cuda);
    release_all(d, &f);
    DEVICE_LEAVE(&guard, &f.cuda);
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
    return PyUnicode_FromString(backend_names[((hl_jpeg_decoder *)self)->backend]);
}

static PyObject *get_library(PyObject *self, void *Py_UNUSED(closure)) {
    return PyUnicode_FromString(((hl_jpeg_decoder *)self)->lib->path);
}

static PyObject *get_version(PyObject *self, void *Py_UNUSED(closure)) {
    const int *v = ((hl_jpeg_decoder *)self)->lib->version;
    return Py_BuildValue("(iii)", v[0], v[1], v[2]);
}

static PyObject *get_device(PyObject *self, void *Py_UNUSED(closure)) {
    return PyLong_FromLong(((hl_jpeg_decoder *)self)->device);
}

static PyObject *get_max_batch(PyObject *self, void *Py_UNUSED(closure)) {
    return PyLong_FromLong(((hl_jpeg_decoder *)self)->max_batch);
}

static PyObject *get_interpolate(PyObject *self, void *Py_UNUSED(closure)) {
    return PyBool_FromLong(((hl_jpeg_decoder *)self)->interpolate);
}

static PyObject *get_closed(PyObject *self, void *Py_UNUSED(closure)) {
    return PyBool_FromLong(((hl_jpeg_decoder *)self)->closed);
}

static PyObject *get_preallocate(PyObject *self, void *Py_UNUSED(closure)) {
    return PyBool_FromLong(((hl_jpeg_decoder *)self)->preallocate);
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
    return set_flag(value, &((hl_jpeg_decoder *)self)->preallocate, "preallocate");
}

static PyObject *get_size_order(PyObject *self, void *Py_UNUSED(closure)) {
    return PyBool_FromLong(((hl_jpeg_decoder *)self)->size_order);
}

static int set_size_order(PyObject *self, PyObject *value, void *Py_UNUSED(closure)) {
    return set_flag(value, &((hl_jpeg_decoder *)self)->size_order, "size_order");
}

static PyObject *get_engines(PyObject *self, void *Py_UNUSED(closure)) {
    hl_jpeg_decoder *d = (hl_jpeg_decoder *)self;
    if (d->engines == 0)
        Py_RETURN_NONE;
    return Py_BuildValue("(II)", d->engines, d->cores_per_engine);
}

static PyGetSetDef decoder_getset[] = {
    {"backend", get_backend, NULL, "\"hardware\" (the JPEG engines) or \"cuda\" (the SMs)", NULL},
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
    static char *keywords[] = {"paths", "device", "backend", "max_batch", "interpolate", NULL};
    PyObject *paths, *module = PyType_GetModule(type);
    int device, max_batch, interpolate = 1;
    const char *backend_name;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "Oisi|$p:JpegDecoder", keywords, &paths, &device, &backend_name,
                                     &max_batch, &interpolate))
        return NULL;
    int backend = strcmp(backend_name, "hardware") == 0 ? BACKEND_HARDWARE
                : strcmp(backend_name, "cuda") == 0   ? BACKEND_CUDA
                                                      : -1;
    if (backend < 0) {
        PyErr_Format(PyExc_ValueError, "JpegDecoder: backend: expected \"hardware\" or \"cuda\", got \"%s\"",
                     backend_name);
        return NULL;
    }
    if (max_batch < 1 || max_batch > 65536) {
        PyErr_Format(PyExc_ValueError, "JpegDecoder: max_batch: expected 1 to 65536 images, got %d", max_batch);
        return NULL;
    }
    if (hl_cuda_require(module, device) < 0)
        return NULL;
    const hl_nvjpeg *lib = library_from_paths(paths, "JpegDecoder");
    if (lib == NULL)
        return NULL;
    allocfunc alloc = (allocfunc)PyType_GetSlot(type, Py_tp_alloc);
    hl_jpeg_decoder *d = (hl_jpeg_decoder *)alloc(type, 0);
    if (d == NULL)
        return NULL;
    d->lib = lib;
    d->device = device;
    d->backend = backend;
    d->max_batch = max_batch;
    d->interpolate = interpolate;
    d->size_order = d->preallocate = backend == BACKEND_HARDWARE; /* NOTE [ Largest first ] */
    d->pid = getpid();
    atomic_init(&d->busy, 0);
    d->data = calloc((size_t)max_batch, sizeof(*d->data));
    d->lengths = calloc((size_t)max_batch, sizeof(*d->lengths));
    d->images = calloc((size_t)max_batch, sizeof(*d->images));
    d->order = calloc((size_t)max_batch, sizeof(*d->order));
    d->widths = calloc((size_t)max_batch, sizeof(*d->widths));
    d->heights = calloc((size_t)max_batch, sizeof(*d->heights));
    d->keys = calloc((size_t)max_batch, sizeof(*d->keys));
    if (d->data == NULL || d->lengths == NULL || d->images == NULL || d->order == NULL || d->widths == NULL ||
        d->heights == NULL || d->keys == NULL) {
        Py_DECREF(d);
        return PyErr_NoMemory();
    }
    decode_failure f;
    memset(&f, 0, sizeof(f));
    Py_BEGIN_ALLOW_THREADS
    DEVICE_GUARD guard;
    DEVICE_ENTER(&guard, device, &f.cuda);
    if (f.cuda.code == 0) {
        create_all(d, &f);
        if (f.call != NULL || f.cuda.code != 0) {
            decode_failure ignored; /* the first failure is the one to report */
            memset(&ignored, 0, sizeof(ignored));
            release_all(d, &ignored);
        }
    }
    DEVICE_LEAVE(&guard, &f.cuda);
    Py_END_ALLOW_THREADS
    if (f.call != NULL && backend == BACKEND_HARDWARE &&
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
    free(d->data);
    free(d->lengths);
    free(d->images);
    free(d->order);
    free(d->widths);
    free(d->heights);
    free(d->keys);
    freefunc tp_free = (freefunc)PyType_GetSlot(type, Py_tp_free);
    tp_free(self);
    Py_DECREF(type);
}

PyDoc_STRVAR(decoder_doc,
             "JpegDecoder(paths, device, backend, max_batch, *, interpolate=True)\n\n"
             "Batched JPEG decoding to RGB interleaved on the GPU with nvjpeg, opened at run time from the first\n"
             "of `paths` that loads. backend \"hardware\": the JPEG engines (baseline JPEGs; nvjpeg says which);\n"
             "hotloop.NvjpegError saying \"no hardware JPEG decoder\" on a GPU without them. backend \"cuda\":\n"
             "nvjpeg's GPU-hybrid batched decoder on the SMs, progressive JPEGs one by one with Huffman decoding\n"
             "on the CPU. interpolate: subsampled chroma upsampled by interpolation, as libjpeg-turbo (PIL) does:\n"
             "pixels within 1 (hardware) or 3 (cuda) of PIL's; False, or an nvjpeg without the option:\n"
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

static PyMethodDef nvjpeg_methods[] = {
    {"nvjpeg_load", py_nvjpeg_load, METH_O, nvjpeg_load_doc},
    {"nvjpeg_status_name", py_nvjpeg_status_name, METH_O, nvjpeg_status_name_doc},
    {NULL, NULL, 0, NULL},
};

static const hl_int_constant nvjpeg_constants[] = {
    {"JPEG_DECODED", HL_JPEG_DECODED},
    {"JPEG_UNSUPPORTED", HL_JPEG_UNSUPPORTED},
    {"JPEG_CORRUPT", HL_JPEG_CORRUPT_DATA},
    {NULL, 0},
};

int hl_nvjpeg_exec(PyObject *module) {
    hl_state *state = hl_state_of(module);
    state->jpeg_decoder_type = PyType_FromModuleAndSpec(module, &decoder_spec, NULL);
    if (state->jpeg_decoder_type == NULL)
        return -1;
    if (PyModule_AddObjectRef(module, "JpegDecoder", state->jpeg_decoder_type) < 0 ||
        PyModule_AddFunctions(module, nvjpeg_methods) < 0)
        return -1;
    return hl_add_int_constants(module, nvjpeg_constants);
}
