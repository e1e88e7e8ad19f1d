/* nvjpeg's hybrid decode over the host's threads: one lane (state, buffers, streams) per thread, the
   Huffman decoding on the thread, the copy and the rest of the decode queued on the caller's stream. */
#include "nvjpeg_hybrid.h"
#include "nvjpeg_cuda.h"
#include "thread_pool.h"

#include <string.h>

/* NOTE [ Hybrid lanes ]
   nvjpeg's hybrid backend decodes the Huffman codes on the CPU (nvjpegDecodeJpegHost), a few tenths of
   a millisecond to milliseconds an image, and leaves the IDCT and the colour conversion to the SMs. One
   thread doing that for a whole batch is the bound on a GPU without JPEG engines, so the batch's images
   go to csrc/thread_pool.c's threads, largest first (the engine sorts them), each thread on a lane of
   its own, as nvjpeg asks of its states, streams and buffers. A lane's work on the GPU (the copy of the
   coefficients, then the decode kernels) goes on the caller's stream in the order the lane queued it,
   so its device buffer is never overwritten under a decode still queued; its pinned buffers alternate,
   and the host waits for the copy out of one (an event) before decoding the next image into it. The
   call returns once every image's host half is done and its GPU half queued: the caller's stream then
   holds the whole batch. */

static nvjpegStatus_t lane_make(hl_jpeg_lanes *l, hl_jpeg_lane *lane, hl_cuda_status *cuda, const char **call) {
    const hl_nvjpeg *n = l->lib;
    nvjpegStatus_t rc;
#define MAKE(expr, name)                                                                           \
    if ((rc = (expr)) != NVJPEG_STATUS_SUCCESS) {                                                  \
        *call = name;                                                                              \
        return rc;                                                                                 \
    }
    MAKE(n->decoder_state_create(l->handle, l->decoder, &lane->state), "nvjpegDecoderStateCreate");
    MAKE(n->params_create(l->handle, &lane->params), "nvjpegDecodeParamsCreate");
    MAKE(n->params_set_output(lane->params, NVJPEG_OUTPUT_RGBI), "nvjpegDecodeParamsSetOutputFormat");
    MAKE(n->device_buffer_create(l->handle, NULL, &lane->device_buffer), "nvjpegBufferDeviceCreate");
    MAKE(n->attach_device(lane->state, lane->device_buffer), "nvjpegStateAttachDeviceBuffer");
    for (int k = 0; k < HL_JPEG_LANE_PINNED; k++) {
        MAKE(n->pinned_create(l->handle, NULL, &lane->pinned[k]), "nvjpegBufferPinnedCreate");
        MAKE(n->stream_create(l->handle, &lane->streams[k]), "nvjpegJpegStreamCreate");
        HL_CUDA(cuda, event_create(&lane->pinned_free[k]));
    }
#undef MAKE
    return NVJPEG_STATUS_SUCCESS;
}

/* Free what exists of a lane, its copies waited for; the first failure is kept. */
static nvjpegStatus_t lane_free(const hl_nvjpeg *n, hl_jpeg_lane *lane, hl_cuda_status *cuda, const char **call) {
    nvjpegStatus_t first = NVJPEG_STATUS_SUCCESS, rc;
#define FREE(handle, expr, name)                                                                   \
    do {                                                                                           \
        if ((handle) != NULL && (rc = (expr)) != NVJPEG_STATUS_SUCCESS && first == NVJPEG_STATUS_SUCCESS) { \
            first = rc;                                                                            \
            *call = name;                                                                          \
        }                                                                                          \
        (handle) = NULL;                                                                           \
    } while (0)
    for (int k = 0; k < HL_JPEG_LANE_PINNED; k++) {
        if (lane->pinned_free[k] != NULL) {
            if (lane->pinned_pending[k])
                HL_CUDA(cuda, event_synchronize(lane->pinned_free[k]));
            HL_CUDA(cuda, event_destroy(lane->pinned_free[k]));
        }
        lane->pinned_free[k] = NULL;
        lane->pinned_pending[k] = 0;
        FREE(lane->streams[k], n->stream_destroy(lane->streams[k]), "nvjpegJpegStreamDestroy");
    }
    FREE(lane->state, n->state_destroy(lane->state), "nvjpegJpegStateDestroy");
    for (int k = 0; k < HL_JPEG_LANE_PINNED; k++)
        FREE(lane->pinned[k], n->pinned_destroy(lane->pinned[k]), "nvjpegBufferPinnedDestroy");
    FREE(lane->device_buffer, n->device_buffer_destroy(lane->device_buffer), "nvjpegBufferDeviceDestroy");
    FREE(lane->params, n->params_destroy(lane->params), "nvjpegDecodeParamsDestroy");
#undef FREE
    return first;
}

nvjpegStatus_t hl_jpeg_lanes_open(hl_jpeg_lanes *l, const hl_nvjpeg *lib, nvjpegHandle_t handle, const char **call) {
    memset(l, 0, sizeof(*l));
    l->lib = lib;
    l->handle = handle;
    *call = "nvjpegDecoderCreate";
    return lib->decoder_create(handle, NVJPEG_BACKEND_HYBRID, &l->decoder);
}

nvjpegStatus_t hl_jpeg_lanes_close(hl_jpeg_lanes *l, hl_cuda_status *cuda, const char **call) {
    nvjpegStatus_t first = NVJPEG_STATUS_SUCCESS, rc;
    const char *where = NULL;
    for (int k = 0; k < l->made; k++)
        if ((rc = lane_free(l->lib, &l->lanes[k], cuda, &where)) != 0 && first == NVJPEG_STATUS_SUCCESS) {
            first = rc;
            *call = where;
        }
    l->made = 0;
    if (l->decoder != NULL && (rc = l->lib->decoder_destroy(l->decoder)) != 0 && first == NVJPEG_STATUS_SUCCESS) {
        first = rc;
        *call = "nvjpegDecoderDestroy";
    }
    l->decoder = NULL;
    return first;
}

typedef struct {
    hl_jpeg_lanes *lanes;
    int device, lane_count;
    const hl_jpeg_job *jobs;
    hl_stream_t stream;
    nvjpegStatus_t *rcs;
    const char **calls;
    atomic_int stopped;      /* a CUDA failure: the threads take no more images */
    atomic_flag failure_set; /* the first thread to fail writes `cuda` */
    hl_cuda_status *cuda;
} lanes_call;

/* One image on `lane`: nvjpeg's status, with *call naming the failed call. 0 with cuda->code set on
   a CUDA failure. */
static nvjpegStatus_t decode_on_lane(const hl_nvjpeg *n, lanes_call *c, hl_jpeg_lane *lane, const hl_jpeg_job *job,
                                     hl_cuda_status *cuda, const char **call) {
    nvjpegHandle_t h = c->lanes->handle;
    nvjpegJpegDecoder_t decoder = c->lanes->decoder;
    int k = lane->next_pinned;
    nvjpegStatus_t rc;
    /* pinned[k] is written by the host half: its previous copy to the device must be over */
    if (lane->pinned_pending[k]) {
        HL_CUDA(cuda, event_synchronize(lane->pinned_free[k]));
        if (cuda->code != 0)
            return NVJPEG_STATUS_SUCCESS;
        lane->pinned_pending[k] = 0;
    }
    *call = "nvjpegJpegStreamParse";
    if ((rc = n->parse(h, job->data, job->length, 0, 0, lane->streams[k])) != 0)
        return rc;
    *call = "nvjpegStateAttachPinnedBuffer";
    if ((rc = n->attach_pinned(lane->state, lane->pinned[k])) != 0)
        return rc;
    *call = "nvjpegDecodeJpegHost";
    if ((rc = n->decode_host(h, decoder, lane->state, lane->params, lane->streams[k])) != 0)
        return rc;
    *call = "nvjpegDecodeJpegTransferToDevice";
    if ((rc = n->decode_transfer(h, decoder, lane->state, lane->streams[k], c->stream)) != 0)
        return rc;
    HL_CUDA(cuda, event_record(lane->pinned_free[k], c->stream));
    if (cuda->code != 0)
        return NVJPEG_STATUS_SUCCESS;
    lane->pinned_pending[k] = 1;
    lane->next_pinned = (k + 1) % HL_JPEG_LANE_PINNED;
    nvjpegImage_t image = job->image;
    *call = "nvjpegDecodeJpegDevice";
    return n->decode_device(h, decoder, lane->state, &image, c->stream);
}

/* A free lane: at most lane_count threads take part, so one is always free. */
static hl_jpeg_lane *lane_take(lanes_call *c) {
    for (;;)
        for (int k = 0; k < c->lane_count; k++) {
            int free_ = 0;
            if (atomic_compare_exchange_strong(&c->lanes->lanes[k].taken, &free_, 1))
                return &c->lanes->lanes[k];
        }
}

static void decode_run(void *ctx, int64_t first, int64_t end) {
    lanes_call *c = ctx;
    hl_jpeg_lane *lane = lane_take(c);
    hl_cuda_status cuda = {0};
    DEVICE_GUARD guard;
    DEVICE_ENTER(&guard, c->device, &cuda);
    for (int64_t k = first; k < end; k++) {
        c->rcs[k] = NVJPEG_STATUS_EXECUTION_FAILED;
        c->calls[k] = "not reached: an earlier CUDA call failed";
        if (cuda.code != 0 || atomic_load(&c->stopped))
            continue;
        c->rcs[k] = decode_on_lane(c->lanes->lib, c, lane, &c->jobs[k], &cuda, &c->calls[k]);
    }
    DEVICE_LEAVE(&guard, &cuda);
    atomic_store(&lane->taken, 0);
    if (cuda.code != 0) {
        atomic_store(&c->stopped, 1);
        if (!atomic_flag_test_and_set(&c->failure_set))
            *c->cuda = cuda;
    }
}

void hl_jpeg_lanes_decode(hl_jpeg_lanes *l, int device, const hl_jpeg_job *jobs, int count, hl_stream_t stream,
                          int threads, nvjpegStatus_t *rcs, const char **calls, hl_cuda_status *cuda) {
    if (threads > HL_JPEG_MAX_LANES)
        threads = HL_JPEG_MAX_LANES;
    if (threads < 1)
        threads = 1;
    while (l->made < threads) {
        const char *call = NULL;
        nvjpegStatus_t rc = lane_make(l, &l->lanes[l->made], cuda, &call);
        if (rc != NVJPEG_STATUS_SUCCESS || cuda->code != 0) {
            /* a lane half made is freed now and made again by a later call: counted as made, its
               missing objects would reach nvjpeg */
            const char *ignored_call = NULL;
            hl_cuda_status ignored = {0};
            lane_free(l->lib, &l->lanes[l->made], &ignored, &ignored_call);
            for (int k = 0; k < count; k++) {
                rcs[k] = rc != NVJPEG_STATUS_SUCCESS ? rc : NVJPEG_STATUS_EXECUTION_FAILED;
                calls[k] = call != NULL ? call : "cuEventCreate";
            }
            return;
        }
        l->made++;
    }
    lanes_call c = {.lanes = l, .device = device, .lane_count = threads, .jobs = jobs, .stream = stream,
                    .rcs = rcs, .calls = calls, .cuda = cuda};
    atomic_init(&c.stopped, 0);
    atomic_flag_clear(&c.failure_set);
    hl_parallel_for(count, threads, 1, decode_run, &c);
}
