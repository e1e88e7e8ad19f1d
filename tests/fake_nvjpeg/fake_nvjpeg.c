/* A fake nvjpeg for tests: csrc/nvjpeg.c's entry points, checking how they are called, writing a pattern as pixels. */
/* Built by the tests with `cc -shared -fPIC` and opened by path by hotloop._C.JpegDecoder, with the fake
   CUDA driver (tests/fake_cuda/fake_cuda.c) as libcuda: "device" memory is host memory and every call
   completes before it returns. Signatures and values as csrc/nvjpeg.h declares them (nvjpeg.h of CUDA 13).
   Scripted by environment variables read at each nvjpegCreateEx: FAKE_NVJPEG_ENGINES (the hardware
   backend's engines, default 7; 0: a GPU without them, where a hardware handle fails with
   NVJPEG_STATUS_ARCH_MISMATCH), FAKE_NVJPEG_HARDWARE_US (microseconds slept per image in a hardware
   handle's nvjpegDecodeBatched), FAKE_NVJPEG_HYBRID_US (microseconds slept per image in
   nvjpegDecodeJpegHost) and FAKE_NVJPEG_FAIL=name:code[:times] (that entry point returns code, every time
   or the first `times` times).

   A decode reads the JPEG's frame header only (SOF0, SOF1 or SOF2) and writes, to every pixel of the
   destination's channel[0] (RGB interleaved, width * 3 bytes a row, pitch[0] apart, height rows):
     R: who decoded it: 1 nvjpegDecodeBatched on a hardware handle, 2 nvjpegDecodeBatched on any other
        handle, 3 the decoupled API (nvjpegDecodeJpegHost, ...TransferToDevice, ...Device) with a hybrid
        decoder, 4 the decoupled API with any other decoder;
     G: the sum of the JPEG's bytes modulo 251;
     B: the JPEG's length modulo 256.
   A JPEG holding the text "FAKE-CORRUPT" fails with NVJPEG_STATUS_BAD_JPEG: the whole nvjpegDecodeBatched
   call fails, as nvjpeg's does; in the decoupled API, nvjpegDecodeJpegHost. A hardware handle does not take a
   progressive JPEG (nvjpegDecodeBatchedSupported says so; nvjpegDecodeBatched fails with
   NVJPEG_STATUS_JPEG_NOT_SUPPORTED). A failed call writes nothing.

   What nvjpeg requires of its caller is checked, so that a slip in hotloop fails here and not only on a
   GPU: objects of the right kind, made on the same handle (and decoder); nvjpegDecodeBatchedInitialize
   before nvjpegDecodeBatched; the decoupled steps in order on a state with its buffers attached and its
   output format set; nothing destroyed while an object made from it, or a state it is attached to, lives.
   Each refusal counts as a misuse (fake_nvjpeg_last_misuse says which was the last). nvjpeg wants a
   state, a jpeg stream and a pinned buffer used by one thread at a time: two calls on one at once count
   as a race. The test reads the fake_nvjpeg_* counters (ctypes.CDLL on the same path: the copy hotloop
   opened). */
#define _POSIX_C_SOURCE 200809L /* nanosleep */
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define EXPORT __attribute__((visibility("default")))

typedef int nvjpegStatus_t;
enum {
    NVJPEG_STATUS_SUCCESS = 0,
    NVJPEG_STATUS_INVALID_PARAMETER = 2,
    NVJPEG_STATUS_BAD_JPEG = 3,
    NVJPEG_STATUS_JPEG_NOT_SUPPORTED = 4,
    NVJPEG_STATUS_EXECUTION_FAILED = 6,
    NVJPEG_STATUS_ARCH_MISMATCH = 7,
};
enum { NVJPEG_BACKEND_HYBRID = 1, NVJPEG_BACKEND_HARDWARE = 3 };
enum { NVJPEG_OUTPUT_RGBI = 5 }; /* the only format the fake writes */
enum { NVJPEG_FLAGS_UPSAMPLING_WITH_INTERPOLATION = 1 << 5 };

typedef struct {
    unsigned char *channel[4];
    size_t pitch[4];
} nvjpegImage_t;

/* ---------------------------------------------------------------------------------------------
   What happened, for the test */

static atomic_long live, races, misuses, images[5];
static atomic_int host_running, host_most;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER; /* the scripted failure and the last misuse */
static char fail_name[64], last_misuse[160];
static int fail_code;
static long fail_times; /* the scripted failures left; -1: every call */

EXPORT long fake_nvjpeg_images(int tag) { return tag >= 1 && tag <= 4 ? images[tag] : -1; }
EXPORT long fake_nvjpeg_races(void) { return races; }
EXPORT int fake_nvjpeg_most_concurrent_host(void) { return host_most; }
EXPORT long fake_nvjpeg_live_objects(void) { return live; }
EXPORT long fake_nvjpeg_misuses(void) { return misuses; }
EXPORT const char *fake_nvjpeg_last_misuse(void) { return last_misuse; }

/* what happened so far forgotten; live objects stay counted (a balance of creations and destructions) */
EXPORT void fake_nvjpeg_reset(void) {
    for (int tag = 0; tag < 5; tag++)
        images[tag] = 0;
    races = misuses = 0;
    host_most = 0;
    pthread_mutex_lock(&lock);
    last_misuse[0] = '\0';
    pthread_mutex_unlock(&lock);
}

static nvjpegStatus_t misuse(const char *call, const char *why, nvjpegStatus_t code) {
    misuses++;
    pthread_mutex_lock(&lock);
    snprintf(last_misuse, sizeof last_misuse, "%s: %s", call, why);
    pthread_mutex_unlock(&lock);
    return code;
}
#define NEED(cond, code, why)                                                                      \
    do {                                                                                           \
        if (!(cond))                                                                               \
            return misuse(__func__, why, code);                                                    \
    } while (0)

static long env_long(const char *name, long fallback) {
    const char *v = getenv(name);
    return v != NULL && *v ? atol(v) : fallback;
}

static void read_fail_script(void) {
    const char *fail = getenv("FAKE_NVJPEG_FAIL");
    const char *colon = fail != NULL ? strchr(fail, ':') : NULL;
    pthread_mutex_lock(&lock);
    fail_code = 0;
    if (colon != NULL) {
        size_t n = (size_t)(colon - fail);
        n = n < sizeof fail_name - 1 ? n : sizeof fail_name - 1;
        memcpy(fail_name, fail, n);
        fail_name[n] = '\0';
        fail_code = atoi(colon + 1);
        const char *times = strchr(colon + 1, ':');
        fail_times = times != NULL ? atol(times + 1) : -1;
    }
    pthread_mutex_unlock(&lock);
}

/* the scripted failure of entry point `name`, else 0 */
static nvjpegStatus_t scripted(const char *name) {
    pthread_mutex_lock(&lock);
    nvjpegStatus_t code = fail_code != 0 && fail_times != 0 && strcmp(name, fail_name) == 0 ? fail_code : 0;
    if (code != 0 && fail_times > 0)
        fail_times--;
    pthread_mutex_unlock(&lock);
    return code;
}
#define SCRIPTED()                                                                                 \
    do {                                                                                           \
        nvjpegStatus_t r_ = scripted(__func__);                                                    \
        if (r_ != 0)                                                                               \
            return r_;                                                                             \
    } while (0)

static void sleep_us(long us) {
    struct timespec t = {us / 1000000, us % 1000000 * 1000};
    while (us > 0 && nanosleep(&t, &t) != 0) {
    }
}

/* ---------------------------------------------------------------------------------------------
   Objects: each begins with its kind, the calls on it running now and what depends on it */

enum { HANDLE = 0x4a5001, STATE, STREAM, DECODER, PARAMS, PINNED, DEVICE_BUFFER };

typedef struct {
    int kind;
    atomic_int calls; /* more than one at once: a race */
    atomic_int users; /* objects made from it, or states it is attached to, alive now */
} object;

static int is(const void *p, int kind) { return p != NULL && ((const object *)p)->kind == kind; }

static void enter(void *p) {
    if (p != NULL && atomic_fetch_add(&((object *)p)->calls, 1) != 0)
        races++;
}
static void leave(void *p) {
    if (p != NULL)
        atomic_fetch_sub(&((object *)p)->calls, 1);
}
static void use(void *p, int by) {
    if (p != NULL)
        atomic_fetch_add(&((object *)p)->users, by);
}

typedef struct { unsigned width, height; int progressive; } header;

typedef struct nvjpegHandle {
    object o;
    int backend, engines;
    long hardware_us, hybrid_us;
} *nvjpegHandle_t;

typedef struct nvjpegDecoder {
    object o;
    nvjpegHandle_t handle;
    int backend;
} *nvjpegJpegDecoder_t;

typedef struct nvjpegParams {
    object o;
    nvjpegHandle_t handle;
    int format; /* -1: never set */
} *nvjpegDecodeParams_t;

typedef struct nvjpegBuffer { /* pinned or device */
    object o;
    nvjpegHandle_t handle;
} *nvjpegBufferPinned_t, *nvjpegBufferDevice_t;

typedef struct nvjpegStream {
    object o;
    nvjpegHandle_t handle;
    int parsed; /* 0: nothing; 1: a header (nvjpegJpegStreamParseHeader); 2: a JPEG (nvjpegJpegStreamParse) */
    header info;
    const unsigned char *data; /* the caller's bytes, or `copy` (save_stream) */
    unsigned char *copy;
    size_t length;
    long parses; /* how many times parsed: a stream parsed again between two steps of one decode shows */
} *nvjpegJpegStream_t;

typedef struct nvjpegState {
    object o;
    nvjpegHandle_t handle;
    nvjpegJpegDecoder_t decoder; /* NULL: a batched state (nvjpegJpegStateCreate) */
    int batch;                   /* nvjpegDecodeBatchedInitialize's batch size; 0: not initialised */
    struct nvjpegBuffer *pinned, *device;
    /* the decoupled API's image in flight */
    int step; /* 0: none; 1: host decoded; 2: transferred */
    nvjpegJpegStream_t host_stream;
    long host_parses;
    struct nvjpegBuffer *host_pinned;
    header info;
    unsigned char rgb[3];
} *nvjpegJpegState_t;

/* A new object of `kind` made on `parent` (and `decoder`), which it keeps in use until destroyed. */
static void *make(size_t size, int kind, void *parent, void *decoder) {
    object *o = calloc(1, size);
    if (o == NULL)
        return NULL;
    o->kind = kind;
    use(parent, 1);
    use(decoder, 1);
    live++;
    return o;
}

/* Destroy `p` if it is an object of `kind` that nothing depends on; it lets go of `parent` and `decoder`. */
static nvjpegStatus_t unmake(const char *call, void *p, int kind, void *parent, void *decoder) {
    object *o = p;
    if (!is(o, kind))
        return misuse(call, "not an object of this kind (or destroyed already)", NVJPEG_STATUS_INVALID_PARAMETER);
    if (atomic_load(&o->users) != 0)
        return misuse(call, "objects made from it, or states it is attached to, still live",
                      NVJPEG_STATUS_INVALID_PARAMETER);
    if (atomic_load(&o->calls) != 0)
        races++; /* destroyed under a call running on it */
    use(parent, -1);
    use(decoder, -1);
    o->kind = 0;
    free(o);
    live--;
    return NVJPEG_STATUS_SUCCESS;
}

/* ---------------------------------------------------------------------------------------------
   JPEG bytes: the frame header, the corruption mark, the pattern */

static nvjpegStatus_t read_header(const unsigned char *p, size_t n, header *h) {
    if (p == NULL || n < 4 || p[0] != 0xFF || p[1] != 0xD8)
        return NVJPEG_STATUS_BAD_JPEG;
    size_t i = 2;
    while (i + 4 <= n) {
        unsigned marker = p[i + 1];
        if (p[i] != 0xFF)
            return NVJPEG_STATUS_BAD_JPEG;
        if (marker == 0xFF) { /* fill byte */
            i++;
            continue;
        }
        if (marker == 0x01 || (marker >= 0xD0 && marker <= 0xD7)) { /* no length follows */
            i += 2;
            continue;
        }
        if (marker == 0xDA || marker == 0xD9) /* a scan, or the end, before any frame header */
            return NVJPEG_STATUS_BAD_JPEG;
        size_t length = (size_t)p[i + 2] << 8 | p[i + 3];
        if (length < 2 || i + 2 + length > n)
            return NVJPEG_STATUS_BAD_JPEG;
        if (marker >= 0xC0 && marker <= 0xCF && marker != 0xC4 && marker != 0xC8 && marker != 0xCC) {
            if (marker > 0xC2) /* lossless, hierarchical or arithmetic */
                return NVJPEG_STATUS_JPEG_NOT_SUPPORTED;
            const unsigned char *f = p + i + 4;
            h->height = (unsigned)f[1] << 8 | f[2];
            h->width = (unsigned)f[3] << 8 | f[4];
            h->progressive = marker == 0xC2;
            if (length < 8 || h->width == 0 || h->height == 0 || f[5] == 0 || length < 8 + 3 * (size_t)f[5])
                return NVJPEG_STATUS_BAD_JPEG;
            return NVJPEG_STATUS_SUCCESS;
        }
        i += 2 + length;
    }
    return NVJPEG_STATUS_BAD_JPEG;
}

static int marked_corrupt(const unsigned char *p, size_t n) {
    static const char mark[] = "FAKE-CORRUPT";
    for (size_t i = 0; i + sizeof mark - 1 <= n; i++)
        if (memcmp(p + i, mark, sizeof mark - 1) == 0)
            return 1;
    return 0;
}

/* the G and B of every pixel of this JPEG's pattern, after R = tag */
static void pattern(const unsigned char *p, size_t n, int tag, unsigned char rgb[3]) {
    unsigned long long sum = 0;
    for (size_t i = 0; i < n; i++)
        sum += p[i];
    rgb[0] = (unsigned char)tag;
    rgb[1] = (unsigned char)(sum % 251);
    rgb[2] = (unsigned char)(n % 256);
}

static int fits(const nvjpegImage_t *dst, const header *h) {
    return dst != NULL && dst->channel[0] != NULL && dst->pitch[0] >= (size_t)h->width * 3;
}

static void paint(const nvjpegImage_t *dst, const header *h, const unsigned char rgb[3]) {
    for (unsigned y = 0; y < h->height; y++) {
        unsigned char *row = dst->channel[0] + y * dst->pitch[0];
        for (unsigned x = 0; x < h->width; x++)
            memcpy(row + 3 * x, rgb, 3);
    }
    images[rgb[0]]++;
}

/* ---------------------------------------------------------------------------------------------
   The library, the handle and the batched API */

EXPORT nvjpegStatus_t nvjpegGetProperty(int type, int *value) {
    SCRIPTED();
    NEED(value != NULL && type >= 0 && type <= 2, NVJPEG_STATUS_INVALID_PARAMETER, "no such property");
    *value = type == 0 ? 13 : 0;
    return NVJPEG_STATUS_SUCCESS;
}

EXPORT nvjpegStatus_t nvjpegCreateEx(int backend, void *dev_allocator, void *pinned_allocator, unsigned int flags,
                                     nvjpegHandle_t *handle) {
    (void)dev_allocator;
    (void)pinned_allocator;
    read_fail_script();
    SCRIPTED();
    NEED(handle != NULL && backend >= 0 && backend <= 3, NVJPEG_STATUS_INVALID_PARAMETER, "no such backend");
    NEED((flags & ~(unsigned)NVJPEG_FLAGS_UPSAMPLING_WITH_INTERPOLATION) == 0, NVJPEG_STATUS_INVALID_PARAMETER,
         "unknown flags");
    int engines = (int)env_long("FAKE_NVJPEG_ENGINES", 7);
    if (backend == NVJPEG_BACKEND_HARDWARE && engines <= 0)
        return NVJPEG_STATUS_ARCH_MISMATCH;
    nvjpegHandle_t h = make(sizeof *h, HANDLE, NULL, NULL);
    if (h == NULL)
        return NVJPEG_STATUS_INVALID_PARAMETER;
    h->backend = backend;
    h->engines = engines;
    h->hardware_us = env_long("FAKE_NVJPEG_HARDWARE_US", 0);
    h->hybrid_us = env_long("FAKE_NVJPEG_HYBRID_US", 0);
    *handle = h;
    return NVJPEG_STATUS_SUCCESS;
}

EXPORT nvjpegStatus_t nvjpegDestroy(nvjpegHandle_t handle) {
    SCRIPTED();
    return unmake(__func__, handle, HANDLE, NULL, NULL);
}

EXPORT nvjpegStatus_t nvjpegGetHardwareDecoderInfo(nvjpegHandle_t handle, unsigned int *engines,
                                                   unsigned int *cores_per_engine) {
    SCRIPTED();
    NEED(is(handle, HANDLE) && engines != NULL && cores_per_engine != NULL, NVJPEG_STATUS_INVALID_PARAMETER,
         "not a handle");
    if (handle->backend != NVJPEG_BACKEND_HARDWARE)
        return NVJPEG_STATUS_INVALID_PARAMETER;
    *engines = (unsigned)handle->engines;
    *cores_per_engine = 1;
    return NVJPEG_STATUS_SUCCESS;
}

EXPORT nvjpegStatus_t nvjpegJpegStateCreate(nvjpegHandle_t handle, nvjpegJpegState_t *state) {
    SCRIPTED();
    NEED(is(handle, HANDLE) && state != NULL, NVJPEG_STATUS_INVALID_PARAMETER, "not a handle");
    nvjpegJpegState_t s = make(sizeof *s, STATE, handle, NULL);
    if (s == NULL)
        return NVJPEG_STATUS_INVALID_PARAMETER;
    s->handle = handle;
    *state = s;
    return NVJPEG_STATUS_SUCCESS;
}

EXPORT nvjpegStatus_t nvjpegJpegStateDestroy(nvjpegJpegState_t state) {
    SCRIPTED();
    NEED(is(state, STATE), NVJPEG_STATUS_INVALID_PARAMETER, "not a state");
    struct nvjpegBuffer *pinned = state->pinned, *device = state->device;
    nvjpegStatus_t rc = unmake(__func__, state, STATE, state->handle, state->decoder);
    if (rc == NVJPEG_STATUS_SUCCESS) { /* the buffers it held are free to go */
        use(pinned, -1);
        use(device, -1);
    }
    return rc;
}

/* a state nvjpegJpegStateCreate made on `handle`, for the batched API */
#define NEED_BATCHED_STATE(handle, state)                                                          \
    NEED(is(handle, HANDLE) && is(state, STATE) && (state)->handle == (handle) && (state)->decoder == NULL, \
         NVJPEG_STATUS_INVALID_PARAMETER, "not a batched state of this handle")

EXPORT nvjpegStatus_t nvjpegDecodeBatchedInitialize(nvjpegHandle_t handle, nvjpegJpegState_t state, int batch_size,
                                                    int max_cpu_threads, int output_format) {
    SCRIPTED();
    NEED_BATCHED_STATE(handle, state);
    NEED(batch_size > 0 && max_cpu_threads >= 0, NVJPEG_STATUS_INVALID_PARAMETER, "batch size below 1");
    NEED(output_format == NVJPEG_OUTPUT_RGBI, NVJPEG_STATUS_INVALID_PARAMETER, "an output format the fake lacks");
    enter(state);
    state->batch = batch_size;
    leave(state);
    return NVJPEG_STATUS_SUCCESS;
}

EXPORT nvjpegStatus_t nvjpegDecodeBatchedPreAllocate(nvjpegHandle_t handle, nvjpegJpegState_t state, int batch_size,
                                                     int width, int height, int chroma_subsampling,
                                                     int output_format) {
    (void)chroma_subsampling;
    SCRIPTED();
    NEED_BATCHED_STATE(handle, state);
    NEED(batch_size > 0 && width > 0 && height > 0 && output_format == NVJPEG_OUTPUT_RGBI,
         NVJPEG_STATUS_INVALID_PARAMETER, "a size below 1, or an output format the fake lacks");
    enter(state);
    leave(state);
    return NVJPEG_STATUS_SUCCESS;
}

/* nvjpegDecodeBatched is given no count: it takes as many images as the state was initialised for, as
   nvjpeg does, so a caller that passes another count has images left unwritten or written from stale
   entries, which the test's count of painted images shows */
static nvjpegStatus_t decode_batched(nvjpegHandle_t handle, nvjpegJpegState_t state, const unsigned char *const *data,
                                     const size_t *lengths, const nvjpegImage_t *destinations) {
    int hardware = handle->backend == NVJPEG_BACKEND_HARDWARE;
    NEED(state->batch > 0, NVJPEG_STATUS_INVALID_PARAMETER, "the state is not initialised");
    NEED(data != NULL && lengths != NULL && destinations != NULL, NVJPEG_STATUS_INVALID_PARAMETER, "no arrays");
    for (int k = 0; k < state->batch; k++) { /* every image checked before any is written */
        header h;
        NEED(data[k] != NULL && lengths[k] > 0, NVJPEG_STATUS_INVALID_PARAMETER, "an image without bytes");
        nvjpegStatus_t rc = read_header(data[k], lengths[k], &h);
        if (rc != NVJPEG_STATUS_SUCCESS)
            return rc;
        if (marked_corrupt(data[k], lengths[k]))
            return NVJPEG_STATUS_BAD_JPEG;
        if (hardware && h.progressive)
            return NVJPEG_STATUS_JPEG_NOT_SUPPORTED;
        NEED(fits(&destinations[k], &h), NVJPEG_STATUS_INVALID_PARAMETER, "a destination below width * 3 a row");
    }
    if (hardware)
        sleep_us(handle->hardware_us * state->batch);
    for (int k = 0; k < state->batch; k++) {
        header h;
        unsigned char rgb[3];
        read_header(data[k], lengths[k], &h);
        pattern(data[k], lengths[k], hardware ? 1 : 2, rgb);
        paint(&destinations[k], &h, rgb);
    }
    return NVJPEG_STATUS_SUCCESS;
}

EXPORT nvjpegStatus_t nvjpegDecodeBatched(nvjpegHandle_t handle, nvjpegJpegState_t state,
                                          const unsigned char *const *data, const size_t *lengths,
                                          nvjpegImage_t *destinations, void *stream) {
    (void)stream;
    SCRIPTED();
    NEED_BATCHED_STATE(handle, state);
    enter(state);
    nvjpegStatus_t rc = decode_batched(handle, state, data, lengths, destinations);
    leave(state);
    return rc;
}

/* ---------------------------------------------------------------------------------------------
   Jpeg streams */

EXPORT nvjpegStatus_t nvjpegJpegStreamCreate(nvjpegHandle_t handle, nvjpegJpegStream_t *stream) {
    SCRIPTED();
    NEED(is(handle, HANDLE) && stream != NULL, NVJPEG_STATUS_INVALID_PARAMETER, "not a handle");
    nvjpegJpegStream_t s = make(sizeof *s, STREAM, handle, NULL);
    if (s == NULL)
        return NVJPEG_STATUS_INVALID_PARAMETER;
    s->handle = handle;
    *stream = s;
    return NVJPEG_STATUS_SUCCESS;
}

EXPORT nvjpegStatus_t nvjpegJpegStreamDestroy(nvjpegJpegStream_t stream) {
    SCRIPTED();
    NEED(is(stream, STREAM), NVJPEG_STATUS_INVALID_PARAMETER, "not a jpeg stream");
    unsigned char *copy = stream->copy;
    nvjpegStatus_t rc = unmake(__func__, stream, STREAM, stream->handle, NULL);
    if (rc == NVJPEG_STATUS_SUCCESS)
        free(copy);
    return rc;
}

/* the header of data[0..length) into `stream`; its bytes kept too (copied with `save`) when `whole` */
static nvjpegStatus_t parse(nvjpegJpegStream_t stream, const unsigned char *data, size_t length, int whole,
                            int save) {
    stream->parses++;
    stream->parsed = 0;
    stream->data = NULL;
    free(stream->copy);
    stream->copy = NULL;
    nvjpegStatus_t rc = read_header(data, length, &stream->info);
    if (rc != NVJPEG_STATUS_SUCCESS)
        return rc;
    if (whole && save) {
        if ((stream->copy = malloc(length)) == NULL)
            return NVJPEG_STATUS_EXECUTION_FAILED;
        memcpy(stream->copy, data, length);
    }
    stream->data = stream->copy != NULL ? stream->copy : data;
    stream->length = length;
    stream->parsed = whole ? 2 : 1;
    return NVJPEG_STATUS_SUCCESS;
}

#define NEED_STREAM(handle, stream, data, length)                                                  \
    NEED(is(handle, HANDLE) && is(stream, STREAM) && (stream)->handle == (handle) && (data) != NULL && \
             (length) > 0,                                                                         \
         NVJPEG_STATUS_INVALID_PARAMETER, "not a jpeg stream of this handle, or no bytes")

EXPORT nvjpegStatus_t nvjpegJpegStreamParseHeader(nvjpegHandle_t handle, const unsigned char *data, size_t length,
                                                  nvjpegJpegStream_t stream) {
    SCRIPTED();
    NEED_STREAM(handle, stream, data, length);
    enter(stream);
    nvjpegStatus_t rc = parse(stream, data, length, 0, 0);
    leave(stream);
    return rc;
}

EXPORT nvjpegStatus_t nvjpegJpegStreamParse(nvjpegHandle_t handle, const unsigned char *data, size_t length,
                                            int save_metadata, int save_stream, nvjpegJpegStream_t stream) {
    (void)save_metadata;
    SCRIPTED();
    NEED_STREAM(handle, stream, data, length);
    enter(stream);
    nvjpegStatus_t rc = parse(stream, data, length, 1, save_stream);
    leave(stream);
    return rc;
}

EXPORT nvjpegStatus_t nvjpegDecodeBatchedSupported(nvjpegHandle_t handle, nvjpegJpegStream_t stream,
                                                   int *is_supported) {
    SCRIPTED();
    NEED(is(handle, HANDLE) && is(stream, STREAM) && is_supported != NULL, NVJPEG_STATUS_INVALID_PARAMETER,
         "not a handle and a jpeg stream");
    enter(stream);
    nvjpegStatus_t rc = NVJPEG_STATUS_SUCCESS;
    if (stream->parsed == 0)
        rc = misuse(__func__, "the jpeg stream holds no parsed header", NVJPEG_STATUS_INVALID_PARAMETER);
    else
        *is_supported = handle->backend == NVJPEG_BACKEND_HARDWARE && stream->info.progressive; /* 0: supported */
    leave(stream);
    return rc;
}

/* ---------------------------------------------------------------------------------------------
   The decoupled API: decoders, their states, buffers, parameters and the three steps of a decode */

EXPORT nvjpegStatus_t nvjpegDecoderCreate(nvjpegHandle_t handle, int backend, nvjpegJpegDecoder_t *decoder) {
    SCRIPTED();
    NEED(is(handle, HANDLE) && decoder != NULL && backend >= 0 && backend <= 3, NVJPEG_STATUS_INVALID_PARAMETER,
         "not a handle, or no such backend");
    nvjpegJpegDecoder_t d = make(sizeof *d, DECODER, handle, NULL);
    if (d == NULL)
        return NVJPEG_STATUS_INVALID_PARAMETER;
    d->handle = handle;
    d->backend = backend;
    *decoder = d;
    return NVJPEG_STATUS_SUCCESS;
}

EXPORT nvjpegStatus_t nvjpegDecoderDestroy(nvjpegJpegDecoder_t decoder) {
    SCRIPTED();
    NEED(is(decoder, DECODER), NVJPEG_STATUS_INVALID_PARAMETER, "not a decoder");
    return unmake(__func__, decoder, DECODER, decoder->handle, NULL);
}

EXPORT nvjpegStatus_t nvjpegDecoderStateCreate(nvjpegHandle_t handle, nvjpegJpegDecoder_t decoder,
                                               nvjpegJpegState_t *state) {
    SCRIPTED();
    NEED(is(handle, HANDLE) && is(decoder, DECODER) && decoder->handle == handle && state != NULL,
         NVJPEG_STATUS_INVALID_PARAMETER, "not a decoder of this handle");
    nvjpegJpegState_t s = make(sizeof *s, STATE, handle, decoder);
    if (s == NULL)
        return NVJPEG_STATUS_INVALID_PARAMETER;
    s->handle = handle;
    s->decoder = decoder;
    *state = s;
    return NVJPEG_STATUS_SUCCESS;
}

static nvjpegStatus_t buffer_create(const char *call, nvjpegHandle_t handle, int kind, struct nvjpegBuffer **buffer) {
    if (!is(handle, HANDLE) || buffer == NULL)
        return misuse(call, "not a handle", NVJPEG_STATUS_INVALID_PARAMETER);
    struct nvjpegBuffer *b = make(sizeof *b, kind, handle, NULL);
    if (b == NULL)
        return NVJPEG_STATUS_INVALID_PARAMETER;
    b->handle = handle;
    *buffer = b;
    return NVJPEG_STATUS_SUCCESS;
}

static nvjpegStatus_t buffer_destroy(const char *call, struct nvjpegBuffer *buffer, int kind) {
    return unmake(call, buffer, kind, is(buffer, kind) ? buffer->handle : NULL, NULL);
}

EXPORT nvjpegStatus_t nvjpegBufferPinnedCreate(nvjpegHandle_t handle, void *allocator, nvjpegBufferPinned_t *buffer) {
    (void)allocator;
    SCRIPTED();
    return buffer_create(__func__, handle, PINNED, buffer);
}

EXPORT nvjpegStatus_t nvjpegBufferPinnedDestroy(nvjpegBufferPinned_t buffer) {
    SCRIPTED();
    return buffer_destroy(__func__, buffer, PINNED);
}

EXPORT nvjpegStatus_t nvjpegBufferDeviceCreate(nvjpegHandle_t handle, void *allocator, nvjpegBufferDevice_t *buffer) {
    (void)allocator;
    SCRIPTED();
    return buffer_create(__func__, handle, DEVICE_BUFFER, buffer);
}

EXPORT nvjpegStatus_t nvjpegBufferDeviceDestroy(nvjpegBufferDevice_t buffer) {
    SCRIPTED();
    return buffer_destroy(__func__, buffer, DEVICE_BUFFER);
}

/* `buffer` in the place of the one `slot` held, kept in use while attached */
static nvjpegStatus_t attach(const char *call, nvjpegJpegState_t state, struct nvjpegBuffer *buffer, int kind,
                             struct nvjpegBuffer **slot) {
    if (!is(state, STATE) || state->decoder == NULL || !is(buffer, kind) || buffer->handle != state->handle)
        return misuse(call, "not a decoder state and a buffer of its handle", NVJPEG_STATUS_INVALID_PARAMETER);
    enter(state);
    use(*slot, -1);
    use(buffer, 1);
    *slot = buffer;
    leave(state);
    return NVJPEG_STATUS_SUCCESS;
}

EXPORT nvjpegStatus_t nvjpegStateAttachPinnedBuffer(nvjpegJpegState_t state, nvjpegBufferPinned_t buffer) {
    SCRIPTED();
    return attach(__func__, state, buffer, PINNED, is(state, STATE) ? &state->pinned : NULL);
}

EXPORT nvjpegStatus_t nvjpegStateAttachDeviceBuffer(nvjpegJpegState_t state, nvjpegBufferDevice_t buffer) {
    SCRIPTED();
    return attach(__func__, state, buffer, DEVICE_BUFFER, is(state, STATE) ? &state->device : NULL);
}

EXPORT nvjpegStatus_t nvjpegDecodeParamsCreate(nvjpegHandle_t handle, nvjpegDecodeParams_t *params) {
    SCRIPTED();
    NEED(is(handle, HANDLE) && params != NULL, NVJPEG_STATUS_INVALID_PARAMETER, "not a handle");
    nvjpegDecodeParams_t p = make(sizeof *p, PARAMS, handle, NULL);
    if (p == NULL)
        return NVJPEG_STATUS_INVALID_PARAMETER;
    p->handle = handle;
    p->format = -1;
    *params = p;
    return NVJPEG_STATUS_SUCCESS;
}

EXPORT nvjpegStatus_t nvjpegDecodeParamsDestroy(nvjpegDecodeParams_t params) {
    SCRIPTED();
    NEED(is(params, PARAMS), NVJPEG_STATUS_INVALID_PARAMETER, "not decode parameters");
    return unmake(__func__, params, PARAMS, params->handle, NULL);
}

EXPORT nvjpegStatus_t nvjpegDecodeParamsSetOutputFormat(nvjpegDecodeParams_t params, int output_format) {
    SCRIPTED();
    NEED(is(params, PARAMS), NVJPEG_STATUS_INVALID_PARAMETER, "not decode parameters");
    params->format = output_format;
    return NVJPEG_STATUS_SUCCESS;
}

/* a decoder of `handle` and one of its states */
#define NEED_DECODER_STATE(handle, decoder, state)                                                 \
    NEED(is(handle, HANDLE) && is(decoder, DECODER) && (decoder)->handle == (handle) && is(state, STATE) && \
             (state)->decoder == (decoder),                                                        \
         NVJPEG_STATUS_INVALID_PARAMETER, "not a decoder of this handle and one of its states")

static void host_decode(nvjpegJpegDecoder_t decoder, nvjpegJpegState_t state, nvjpegJpegStream_t stream,
                        long sleep) {
    int running = atomic_fetch_add(&host_running, 1) + 1, most = atomic_load(&host_most);
    while (running > most && !atomic_compare_exchange_weak(&host_most, &most, running)) {
    }
    sleep_us(sleep);
    state->info = stream->info;
    pattern(stream->data, stream->length, decoder->backend == NVJPEG_BACKEND_HYBRID ? 3 : 4, state->rgb);
    atomic_fetch_sub(&host_running, 1);
}

static nvjpegStatus_t decode_host(nvjpegHandle_t handle, nvjpegJpegDecoder_t decoder, nvjpegJpegState_t state,
                                  nvjpegDecodeParams_t params, nvjpegJpegStream_t stream) {
    NEED(state->pinned != NULL, NVJPEG_STATUS_INVALID_PARAMETER, "no pinned buffer attached to the state");
    NEED(params->format == NVJPEG_OUTPUT_RGBI, NVJPEG_STATUS_INVALID_PARAMETER,
         "no output format set on the parameters, or one the fake lacks");
    NEED(stream->parsed == 2, NVJPEG_STATUS_INVALID_PARAMETER,
         "the jpeg stream holds no JPEG parsed by nvjpegJpegStreamParse");
    state->step = 0; /* a new image: the state's last one is gone, finished or not */
    if (marked_corrupt(stream->data, stream->length))
        return NVJPEG_STATUS_BAD_JPEG;
    struct nvjpegBuffer *pinned = state->pinned;
    enter(pinned); /* the Huffman decode writes it */
    host_decode(decoder, state, stream, handle->hybrid_us);
    leave(pinned);
    state->step = 1;
    state->host_stream = stream;
    state->host_parses = stream->parses;
    state->host_pinned = pinned;
    return NVJPEG_STATUS_SUCCESS;
}

EXPORT nvjpegStatus_t nvjpegDecodeJpegHost(nvjpegHandle_t handle, nvjpegJpegDecoder_t decoder,
                                           nvjpegJpegState_t state, nvjpegDecodeParams_t params,
                                           nvjpegJpegStream_t stream) {
    SCRIPTED();
    NEED_DECODER_STATE(handle, decoder, state);
    NEED(is(params, PARAMS) && params->handle == handle && is(stream, STREAM) && stream->handle == handle,
         NVJPEG_STATUS_INVALID_PARAMETER, "not parameters and a jpeg stream of this handle");
    enter(state);
    enter(stream);
    nvjpegStatus_t rc = decode_host(handle, decoder, state, params, stream);
    leave(stream);
    leave(state);
    return rc;
}

static nvjpegStatus_t transfer(nvjpegJpegState_t state, nvjpegJpegStream_t stream) {
    NEED(state->step == 1, NVJPEG_STATUS_EXECUTION_FAILED, "no host decode on the state since its last transfer");
    NEED(stream == state->host_stream && stream->parses == state->host_parses, NVJPEG_STATUS_EXECUTION_FAILED,
         "not the jpeg stream of the host decode, or parsed again since");
    NEED(state->pinned == state->host_pinned, NVJPEG_STATUS_EXECUTION_FAILED,
         "another pinned buffer attached since the host decode");
    NEED(state->device != NULL, NVJPEG_STATUS_INVALID_PARAMETER, "no device buffer attached to the state");
    enter(state->pinned); /* the copy reads it */
    leave(state->pinned);
    state->step = 2;
    return NVJPEG_STATUS_SUCCESS;
}

EXPORT nvjpegStatus_t nvjpegDecodeJpegTransferToDevice(nvjpegHandle_t handle, nvjpegJpegDecoder_t decoder,
                                                       nvjpegJpegState_t state, nvjpegJpegStream_t jpeg_stream,
                                                       void *stream) {
    (void)stream;
    SCRIPTED();
    NEED_DECODER_STATE(handle, decoder, state);
    NEED(is(jpeg_stream, STREAM), NVJPEG_STATUS_INVALID_PARAMETER, "not a jpeg stream");
    enter(state);
    enter(jpeg_stream);
    nvjpegStatus_t rc = transfer(state, jpeg_stream);
    leave(jpeg_stream);
    leave(state);
    return rc;
}

static nvjpegStatus_t decode_device(nvjpegJpegState_t state, const nvjpegImage_t *destination) {
    NEED(state->step == 2, NVJPEG_STATUS_EXECUTION_FAILED,
         "no transfer to the device on the state since its last device decode");
    NEED(fits(destination, &state->info), NVJPEG_STATUS_INVALID_PARAMETER, "a destination below width * 3 a row");
    paint(destination, &state->info, state->rgb);
    state->step = 0;
    return NVJPEG_STATUS_SUCCESS;
}

EXPORT nvjpegStatus_t nvjpegDecodeJpegDevice(nvjpegHandle_t handle, nvjpegJpegDecoder_t decoder,
                                             nvjpegJpegState_t state, nvjpegImage_t *destination, void *stream) {
    (void)stream;
    SCRIPTED();
    NEED_DECODER_STATE(handle, decoder, state);
    enter(state);
    nvjpegStatus_t rc = decode_device(state, destination);
    leave(state);
    return rc;
}
