/* The batched JPEG decode engine: nvjpeg's handles, states and buffers, and a decode of a batch without the GIL. */
#include "nvjpeg_engine.h"
#include "cuda.h"
#include "jpeg_header.h"
#include "nvjpeg_cuda.h"
#include "nvjpeg_hybrid.h"

#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>

/* NOTE [ RGB out of nvjpeg ]
   The hardware backend's engines write each image into nvjpeg's own memory, and nvjpeg then brings it
   to the output format on the GPU, one image at a time, each step a CUDA call of its own: for
   interleaved RGB one small colour-conversion kernel per image. Planar YUV, which would let the resize
   kernel convert colour in the pass it makes anyway, is no cheaper there: nvjpeg copies each of the
   three planes out with a 2D device-to-device copy, three calls where RGB takes one, and the loader
   and the step it fed were slower with it. So every decode asks for NVJPEG_OUTPUT_RGBI. The same
   per-image work runs on streams nvjpeg creates for itself, ordered after the caller's by events: the
   priority of the stream a decode is given reaches only our own kernel (image/maker.py's _DecodeStream). */

/* NOTE [ Two handles ]
   Chroma upsampled by interpolation (NVJPEG_FLAGS_UPSAMPLING_WITH_INTERPOLATION, libjpeg-turbo's
   "fancy upsampling", which PIL applies) is a flag of the whole handle. A hardware batch decoded by
   such a handle slows down sharply when a few of its images are 4:4:4 or greyscale, as in a realistic
   photo set, and not when all are 4:2:0 or when the handle does not interpolate. 4:4:4 and greyscale
   images have no chroma to upsample, so the flag cannot change their pixels: they go to a second
   handle without it, in a batched call of their own. */

#define NVJPEG_FAILED(f, rc, name) ((f)->code = (rc), (f)->call = (name), (f)->file = __FILE__, (f)->line = __LINE__)

/* Free what exists, in reverse order of creation; the first failure is kept in `f`. Called without
   the GIL and with the device current. */
static void release_all(hl_jpeg_engine *d, hl_jpeg_failure *f) {
    const hl_nvjpeg *n = d->lib;
    nvjpegStatus_t rc;
    /* the last decode's work must be over before its buffers go (a targeted wait, not a device sync) */
    if (d->done_pending)
        HL_CUDA(&f->cuda, event_synchronize(d->done));
    if (d->beside.handle != NULL) { /* its lanes with it */
        const char *call = NULL;
        if ((rc = hl_jpeg_beside_close(&d->beside, &d->lanes, n, &f->cuda, &call)) != 0 && f->call == NULL)
            NVJPEG_FAILED(f, rc, call);
    }
    if (d->lanes.lib != NULL) {
        const char *call = NULL;
        if ((rc = hl_jpeg_lanes_close(&d->lanes, &f->cuda, &call)) != 0 && f->call == NULL)
            NVJPEG_FAILED(f, rc, call);
        d->lanes.lib = NULL;
    }
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
    hl_jpeg_batched *kinds[2] = {&d->plain, &d->batched};
    for (int k = 0; k < 2; k++) {
        hl_jpeg_batched *b = kinds[k];
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

static void create_all(hl_jpeg_engine *d, hl_jpeg_failure *f) {
    const hl_nvjpeg *n = d->lib;
    int backend = d->backend == HL_JPEG_HARDWARE ? NVJPEG_BACKEND_HARDWARE
                : d->backend == HL_JPEG_HYBRID   ? NVJPEG_BACKEND_HYBRID
                                                 : NVJPEG_BACKEND_GPU_HYBRID;
    nvjpegStatus_t rc = NVJPEG_STATUS_INVALID_PARAMETER;
    if (d->interpolate)
        rc = n->create_ex(backend, NULL, NULL, NVJPEG_FLAGS_UPSAMPLING_WITH_INTERPOLATION, &d->handle);
    if (rc == NVJPEG_STATUS_INVALID_PARAMETER || rc == NVJPEG_STATUS_IMPLEMENTATION_NOT_SUPPORTED) {
        d->interpolate = 0; /* an nvjpeg without the flag (before CUDA 12.x), or not asked for */
        rc = n->create_ex(backend, NULL, NULL, NVJPEG_FLAGS_DEFAULT, &d->handle);
    }
    TRY(f, rc, "nvjpegCreateEx");
    if (d->backend == HL_JPEG_HYBRID) { /* NOTE [ Hybrid lanes ] (nvjpeg_hybrid.c): no batched state */
        const char *call = NULL;
        HL_CUDA(&f->cuda, event_create(&d->done));
        if (f->cuda.code == 0 && (rc = hl_jpeg_lanes_open(&d->lanes, n, d->handle, &call)) != 0)
            NVJPEG_FAILED(f, rc, call);
        return;
    }
    d->batched.handle = d->handle;
    TRY(f, n->state_create(d->handle, &d->batched.state), "nvjpegJpegStateCreate");
    TRY(f, n->batched_initialize(d->handle, d->batched.state, d->max_batch, 1, NVJPEG_OUTPUT_RGBI),
        "nvjpegDecodeBatchedInitialize");
    d->batched.batch = d->max_batch;
    if (d->interpolate && d->backend == HL_JPEG_HARDWARE) { /* NOTE [ Two handles ] */
        TRY(f, n->create_ex(backend, NULL, NULL, NVJPEG_FLAGS_DEFAULT, &d->plain.handle), "nvjpegCreateEx");
        d->plain.owns_handle = 1;
        TRY(f, n->state_create(d->plain.handle, &d->plain.state), "nvjpegJpegStateCreate");
        /* initialised at its first batch, for that batch's size */
    }
    TRY(f, n->stream_create(d->handle, &d->header_stream), "nvjpegJpegStreamCreate");
    if (d->backend == HL_JPEG_HARDWARE && n->hardware_info != NULL &&
        n->hardware_info(d->handle, &d->engines, &d->cores_per_engine) != NVJPEG_STATUS_SUCCESS)
        d->engines = d->cores_per_engine = 0; /* only informative: hardware_engines says None */
    HL_CUDA(&f->cuda, event_create(&d->done));
    if (f->cuda.code != 0 || d->backend != HL_JPEG_CUDA)
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
   A decode: without the GIL throughout. */

typedef struct {
    const int64_t *src, *dst; /* (pointer, length) and (device pointer, pitch) per image */
    hl_stream_t stream;
    unsigned char *status;
    hl_jpeg_failure *f;
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

/* whether nvjpeg's status is the image's own doing: decoded, corrupt, or a kind (or size) this
   backend does not take */
static int image_fault(nvjpegStatus_t rc) {
    switch (rc) {
    case NVJPEG_STATUS_SUCCESS:
    case NVJPEG_STATUS_BAD_JPEG:
    case NVJPEG_STATUS_INCOMPLETE_BITSTREAM:
    case NVJPEG_STATUS_JPEG_NOT_SUPPORTED:
    case NVJPEG_STATUS_IMPLEMENTATION_NOT_SUPPORTED:
    case NVJPEG_STATUS_ALLOCATOR_FAILURE: /* too large for this backend's buffers; the CPU may manage */
        return 1;
    default:
        return 0;
    }
}

/* What a failure decoding one image alone says about it; `other` for failures that are not the
   image's (they raise if no image of the call decoded). */
static unsigned char leaf_status(decode_call *c, nvjpegStatus_t rc, const char *call) {
    if (!image_fault(rc)) {
        if (c->other_call == NULL) {
            c->other = rc;
            c->other_call = call;
        }
        return HL_JPEG_CORRUPT_DATA;
    }
    return rc == NVJPEG_STATUS_BAD_JPEG || rc == NVJPEG_STATUS_INCOMPLETE_BITSTREAM ? HL_JPEG_CORRUPT_DATA
                                                                                    : HL_JPEG_UNSUPPORTED;
}

/* One image through the decoupled API (cuda backend). 0 with status set, -1 on a failure that
   stops the call (kept in c->f). */
static int decode_one(hl_jpeg_engine *d, decode_call *c, int i) {
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
static int decode_batch(hl_jpeg_engine *d, hl_jpeg_batched *b, decode_call *c, const int *order, int count) {
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
        if (s == HL_JPEG_UNSUPPORTED && d->backend == HL_JPEG_CUDA)
            return decode_one(d, c, order[0]);
        c->status[order[0]] = s;
        return 0;
    }
    int half = count / 2;
    if (decode_batch(d, b, c, order, half) < 0)
        return -1;
    return decode_batch(d, b, c, order + half, count - half);
}

/* The images order[0..count) on the hybrid backend's lanes (NOTE [ Hybrid lanes ] in nvjpeg_hybrid.c).
   0, or -1 on a CUDA failure (kept in c->f). */
static int decode_lanes(hl_jpeg_engine *d, decode_call *c, const int *order, int count, hl_stream_t stream) {
    for (int k = 0; k < count; k++) {
        d->jobs[k].data = source_of(c, order[k]);
        d->jobs[k].length = (size_t)c->src[2 * order[k] + 1];
        d->jobs[k].image = image_of(c, order[k]);
    }
    hl_jpeg_lanes_decode(&d->lanes, d->device, d->jobs, count, stream, d->threads, d->rcs, d->calls, &c->f->cuda);
    for (int k = 0; k < count; k++)
        c->status[order[k]] = d->rcs[k] == NVJPEG_STATUS_SUCCESS ? HL_JPEG_DECODED
                                                                 : leaf_status(c, d->rcs[k], d->calls[k]);
    return c->f->cuda.code != 0 ? -1 : 0;
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
   The engines take a batch's images in the order given; handed largest first, the small ones fill in
   at the end and the engines finish together, instead of idling while one large image started last
   completes. So size_order is on for the hardware backend; size_order=False gives the caller's order.

   nvjpegDecodeBatchedPreAllocate (preallocate) sizes nvjpeg's buffers for the largest image seen so
   far, ahead of the batch; without it nvjpeg grows them inside its calls as larger images come, and a
   call that grows them waits for it (its memory kept growing epochs into a run). On for the hardware
   backend. It costs device memory outside torch's allocator, so it stops at PREALLOCATE_PIXELS, a
   batch of 256 at 2048 x 2048 (the largest images rounded up): a data set of larger images (or a larger
   batch) is preallocated no further, and nvjpeg grows its buffers itself past it. docs/gpu-decode.md
   gives what both were measured to do. */

static int key_descending(const void *a, const void *b) {
    long long x = *(const long long *)a, y = *(const long long *)b;
    return (x < y) - (x > y);
}

/* order[0..count) by pixel count, largest first (ties by index). One qsort of packed keys, as qsort's
   comparator has no context: the area above bit 17, the index's complement below (max_batch is at
   most 65536, so it fits 16 bits), so that among equal areas the lower index sorts first. */
static void sort_largest_first(hl_jpeg_engine *d, int *order, int count) {
    for (int k = 0; k < count; k++)
        d->keys[k] = ((long long)d->widths[order[k]] * d->heights[order[k]] << 17) | (65535 - order[k]);
    qsort(d->keys, (size_t)count, sizeof(*d->keys), key_descending);
    for (int k = 0; k < count; k++)
        order[k] = 65535 - (int)(d->keys[k] & 0x1ffff);
}

/* ---------------------------------------------------------------------------------------------
   The hardware backend with lanes beside the engines (NOTE [ Lanes beside the engines ] in
   nvjpeg_beside.c). */

/* The engines' half of a call, on a thread of its own: a decode_call and a failure of its own, merged
   into the caller's once the thread is joined. */
typedef struct {
    hl_jpeg_engine *d;
    decode_call c;
    hl_jpeg_failure f;
    const int *order, *plain_order;
    int batched, plain;
} engines_part;

static void engines_decode(engines_part *p) {
    hl_jpeg_engine *d = p->d;
    DEVICE_GUARD guard;
    DEVICE_ENTER(&guard, d->device, &p->f.cuda);
    if (p->f.cuda.code == 0 && (p->batched == 0 || decode_batch(d, &d->batched, &p->c, p->order, p->batched) == 0) &&
        (p->plain == 0 || decode_batch(d, &d->plain, &p->c, p->plain_order, p->plain) == 0))
        HL_CUDA(&p->f.cuda, event_record(d->beside.marks[1], p->c.stream));
    DEVICE_LEAVE(&guard, &p->f.cuda);
}

static void *engines_thread(void *arg) {
    engines_decode(arg);
    return NULL;
}

static long long pixels_of(const hl_jpeg_engine *d, const int *order, int count) {
    long long pixels = 0;
    for (int k = 0; k < count; k++)
        pixels += (long long)d->widths[order[k]] * d->heights[order[k]];
    return pixels;
}

/* NOTE [ Lanes beside the engines ]: lanes that decoded none of their images, some for a failure not
   the images' own, while the engines decoded theirs, stop for good; those images come back refused.
   Whether they stopped. */
static int stop_failed_lanes(hl_jpeg_engine *d, decode_call *c, const int *order, int batched,
                             const int *plain_order, int plain, int lanes) {
    int failed = 0, decoded = 0, engines_decoded = 0;
    for (int k = 0; k < lanes; k++) {
        failed += !image_fault(d->rcs[k]);
        decoded += d->rcs[k] == NVJPEG_STATUS_SUCCESS;
    }
    for (int k = 0; k < batched; k++)
        engines_decoded += c->status[order[k]] == HL_JPEG_DECODED;
    for (int k = 0; k < plain; k++)
        engines_decoded += c->status[plain_order[k]] == HL_JPEG_DECODED;
    if (failed == 0 || decoded > 0 || engines_decoded == 0)
        return 0;
    for (int k = 0; k < lanes; k++)
        if (!image_fault(d->rcs[k])) { /* a corrupt image stays corrupt */
            d->beside.failed_call = d->calls[k];
            d->beside.failed_status = d->rcs[k];
            c->status[d->lane_order[k]] = HL_JPEG_UNSUPPORTED;
        }
    return 1;
}

/* The engines' images (order[0..batched), plain_order[0..plain)) on a thread of their own while this
   one decodes lane_order[0..lanes) on the lanes; both timed. 0, or -1 on a failure (kept in c->f). */
static int decode_beside(hl_jpeg_engine *d, decode_call *c, const int *order, int batched, const int *plain_order,
                         int plain, int lanes) {
    hl_jpeg_beside *b = &d->beside;
    hl_jpeg_failure *f = c->f;
    engines_part p = {.d = d, .c = *c, .order = order, .plain_order = plain_order, .batched = batched,
                      .plain = plain};
    p.c.f = &p.f;
    p.c.other_call = NULL;
    HL_CUDA(&f->cuda, event_record(b->go, c->stream));
    HL_CUDA(&f->cuda, stream_wait(b->stream, b->go));
    HL_CUDA(&f->cuda, event_record(b->marks[0], c->stream));
    HL_CUDA(&f->cuda, event_record(b->marks[2], b->stream));
    if (f->cuda.code != 0)
        return -1;
    const char *other_call = c->other_call; /* the header pass's, kept should the lanes fail for good */
    nvjpegStatus_t other = c->other;
    pthread_t thread;
    int started = 0;
    if (batched + plain > 0) {
        sigset_t all, old; /* the thread blocks every signal: the main thread takes them, as without it */
        sigfillset(&all);
        pthread_sigmask(SIG_BLOCK, &all, &old);
        started = pthread_create(&thread, NULL, engines_thread, &p) == 0;
        pthread_sigmask(SIG_SETMASK, &old, NULL);
        if (!started)
            engines_decode(&p); /* one pool after the other: slower, never wrong */
    }
    if (decode_lanes(d, c, d->lane_order, lanes, b->stream) == 0)
        HL_CUDA(&f->cuda, event_record(b->marks[3], b->stream));
    if (started)
        pthread_join(thread, NULL);
    if (stop_failed_lanes(d, c, order, batched, plain_order, plain, lanes)) {
        c->other_call = other_call; /* the lanes' failure is said by lane_failure, not raised */
        c->other = other;
    }
    if (f->cuda.code == 0 && f->call == NULL && (p.f.cuda.code != 0 || p.f.call != NULL))
        *f = p.f;
    if (c->other_call == NULL && p.c.other_call != NULL) {
        c->other = p.c.other;
        c->other_call = p.c.other_call;
    }
    if (f->cuda.code != 0 || f->call != NULL)
        return -1;
    HL_CUDA(&f->cuda, stream_wait(c->stream, b->marks[3])); /* the batch is whole on the caller's stream */
    if (f->cuda.code != 0)
        return -1;
    for (int k = 0; k < lanes; k++)
        b->images += d->rcs[k] == NVJPEG_STATUS_SUCCESS;
    b->pixels[0] = pixels_of(d, order, batched) + pixels_of(d, plain_order, plain);
    b->pixels[1] = pixels_of(d, d->lane_order, lanes);
    b->marks_pending = b->pixels[0] > 0 && b->pixels[1] > 0;
    return 0;
}

/* the lanes' handle, stream and events, made at the first call that wants them; 0, or -1 with the
   failure in f (and nothing of them left) */
static int open_beside(hl_jpeg_engine *d, hl_jpeg_failure *f) {
    const char *call = NULL;
    nvjpegStatus_t rc = hl_jpeg_beside_open(&d->beside, &d->lanes, d->lib, d->interpolate, &f->cuda, &call);
    if (rc == NVJPEG_STATUS_SUCCESS && f->cuda.code == 0)
        return 0;
    if (rc != NVJPEG_STATUS_SUCCESS)
        NVJPEG_FAILED(f, rc, call);
    hl_cuda_status ignored = {0}; /* the first failure is the one to report */
    hl_jpeg_beside_close(&d->beside, &d->lanes, d->lib, &ignored, &call);
    return -1;
}

static void run_decode(hl_jpeg_engine *d, decode_call *c, int count) {
    const hl_nvjpeg *n = d->lib;
    hl_jpeg_failure *f = c->f;
    int batched = 0, singles = 0, plain = 0; /* order: batched from the front; singles or plain from the end */
    int *order = d->order;
    int lanes_on = d->backend == HL_JPEG_HARDWARE && d->threads > 0 && d->beside.failed_call == NULL;
    int lanes = 0; /* in d->lane_order */
    if (lanes_on && d->beside.handle == NULL && open_beside(d, f) < 0)
        return;

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
        if (d->backend == HL_JPEG_HARDWARE) {
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
            else if (unsupported && lanes_on)
                d->lane_order[lanes++] = i; /* the hybrid decoder takes what the engines do not */
            else if (unsupported)
                c->status[i] = HL_JPEG_UNSUPPORTED;
            else if (d->plain.handle != NULL && !chroma_upsampled(&info))
                order[count - 1 - plain++] = i; /* NOTE [ Two handles ] */
            else
                order[batched++] = i;
        } else if (info.process == HL_JPEG_PROGRESSIVE && d->backend == HL_JPEG_CUDA) {
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
    if (batched + plain > 0 && d->backend == HL_JPEG_HARDWARE) {
        /* the hardware backend's batched decode was reported to write its outputs while this call
           runs, ignoring the work queued on the stream before it, a cudaStreamWaitEvent included,
           which may still use that memory (torchcodec #1634: nvjpeg 12.3 to 13.2). Only a host wait
           orders it */
        HL_CUDA(&f->cuda, stream_synchronize(c->stream));
        if (f->cuda.code != 0)
            return;
    }
    if (lanes_on) { /* NOTE [ Lanes beside the engines ] (nvjpeg_beside.c) */
        int *plain_order = order + count - plain;
        hl_jpeg_beside_learn(&d->beside);
        hl_jpeg_beside_split(&d->beside, d->widths, d->heights, order, &batched, plain_order, &plain, d->lane_order,
                             &lanes);
        if (lanes > 0) {
            if (d->size_order)
                sort_largest_first(d, d->lane_order, lanes);
            if (decode_beside(d, c, order, batched, plain_order, plain, lanes) < 0)
                return;
            batched = plain = 0; /* decoded; `lanes` has the done event below recorded */
        }
    }
    if (batched > 0 && d->backend == HL_JPEG_HYBRID && decode_lanes(d, c, order, batched, c->stream) < 0)
        return;
    if (batched > 0 && d->backend != HL_JPEG_HYBRID && decode_batch(d, &d->batched, c, order, batched) < 0)
        return;
    if (plain > 0 && decode_batch(d, &d->plain, c, order + count - plain, plain) < 0)
        return;
    for (int s = 0; s < singles; s++)
        if (decode_one(d, c, order[count - 1 - s]) < 0)
            return;
    if (batched + plain + singles + lanes > 0) {
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
   The engine's life and its calls, each on its device. */

int hl_jpeg_engine_init(hl_jpeg_engine *e, const hl_nvjpeg *lib, int device, int backend, int max_batch,
                        int interpolate) {
    memset(e, 0, sizeof(*e));
    e->lib = lib;
    e->device = device;
    e->backend = backend;
    e->max_batch = max_batch;
    e->interpolate = interpolate;
    e->size_order = e->preallocate = backend == HL_JPEG_HARDWARE; /* NOTE [ Largest first ] */
    e->size_order |= backend == HL_JPEG_HYBRID; /* the threads finish together (NOTE [ Hybrid lanes ]) */
    e->threads = 1;
    e->data = calloc((size_t)max_batch, sizeof(*e->data));
    e->lengths = calloc((size_t)max_batch, sizeof(*e->lengths));
    e->images = calloc((size_t)max_batch, sizeof(*e->images));
    e->order = calloc((size_t)max_batch, sizeof(*e->order));
    e->widths = calloc((size_t)max_batch, sizeof(*e->widths));
    e->heights = calloc((size_t)max_batch, sizeof(*e->heights));
    e->keys = calloc((size_t)max_batch, sizeof(*e->keys));
    e->lane_order = calloc((size_t)max_batch, sizeof(*e->lane_order));
    e->jobs = calloc((size_t)max_batch, sizeof(*e->jobs));
    e->rcs = calloc((size_t)max_batch, sizeof(*e->rcs));
    e->calls = calloc((size_t)max_batch, sizeof(*e->calls));
    return e->data == NULL || e->lengths == NULL || e->images == NULL || e->order == NULL || e->widths == NULL ||
                   e->heights == NULL || e->keys == NULL || e->lane_order == NULL || e->jobs == NULL ||
                   e->rcs == NULL || e->calls == NULL
               ? -1
               : 0;
}

void hl_jpeg_engine_free(hl_jpeg_engine *e) {
    free(e->data);
    free(e->lengths);
    free(e->images);
    free(e->order);
    free(e->widths);
    free(e->heights);
    free(e->keys);
    free(e->lane_order);
    free(e->jobs);
    free(e->rcs);
    free(e->calls);
    e->data = NULL;
    e->lengths = NULL;
    e->images = NULL;
    e->order = NULL;
    e->widths = e->heights = NULL;
    e->keys = NULL;
    e->lane_order = NULL;
    e->jobs = NULL;
    e->rcs = NULL;
    e->calls = NULL;
}

void hl_jpeg_engine_open(hl_jpeg_engine *e, hl_jpeg_failure *f) {
    DEVICE_GUARD guard;
    DEVICE_ENTER(&guard, e->device, &f->cuda);
    if (f->cuda.code == 0) {
        create_all(e, f);
        if (f->call != NULL || f->cuda.code != 0) {
            hl_jpeg_failure ignored; /* the first failure is the one to report */
            memset(&ignored, 0, sizeof(ignored));
            release_all(e, &ignored);
        }
    }
    DEVICE_LEAVE(&guard, &f->cuda);
}

void hl_jpeg_engine_close(hl_jpeg_engine *e, hl_jpeg_failure *f) {
    DEVICE_GUARD guard;
    DEVICE_ENTER(&guard, e->device, &f->cuda);
    release_all(e, f);
    DEVICE_LEAVE(&guard, &f->cuda);
}

void hl_jpeg_engine_decode(hl_jpeg_engine *e, const int64_t *src, const int64_t *dst, int count, hl_stream_t stream,
                           unsigned char *status, hl_jpeg_failure *f) {
    decode_call c = {.src = src, .dst = dst, .stream = stream, .status = status, .f = f};
    DEVICE_GUARD guard;
    DEVICE_ENTER(&guard, e->device, &f->cuda);
    if (f->cuda.code == 0)
        run_decode(e, &c, count);
    DEVICE_LEAVE(&guard, &f->cuda);
}
