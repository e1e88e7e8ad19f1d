/* The batched JPEG decode engine over nvjpeg (nvjpeg_engine.c): what the JpegDecoder type (jpeg_decoder.c) holds and calls. */
#ifndef HOTLOOP_NVJPEG_ENGINE_H
#define HOTLOOP_NVJPEG_ENGINE_H

#include "module.h"
#include "nvjpeg.h"
#include "nvjpeg_beside.h"
#include "nvjpeg_hybrid.h"

#include <stdint.h>

/* one status byte per image in what a decode returns */
enum { HL_JPEG_DECODED = 0, HL_JPEG_UNSUPPORTED = 1, HL_JPEG_CORRUPT_DATA = 2 };

/* which of nvjpeg's backends an engine decodes with: the JPEG engines; the SMs (Huffman codes included);
   the host's threads and the SMs (NOTE [ Hybrid lanes ] in nvjpeg_hybrid.c) */
enum { HL_JPEG_HARDWARE = 0, HL_JPEG_CUDA = 1, HL_JPEG_HYBRID = 2 };

/* a handle's batched decoder */
typedef struct {
    nvjpegHandle_t handle; /* the engine's `handle`, or a handle of its own (plain); NULL: none */
    nvjpegJpegState_t state;
    int batch; /* the batch size `state` is initialised for; 0: initialise again */
    int owns_handle;
    int alloc_width, alloc_height; /* what nvjpegDecodeBatchedPreAllocate was last given (preallocate) */
} hl_jpeg_batched;

typedef struct {
    const hl_nvjpeg *lib;
    int device, backend, max_batch;
    int interpolate; /* chroma upsampled by interpolation (as libjpeg-turbo does), not replication */
    unsigned int engines, cores_per_engine; /* hardware backend: what nvjpegGetHardwareDecoderInfo says */
    int preallocate; /* size nvjpeg's buffers for the largest image seen, ahead of the batch (NOTE [ Largest first ]) */
    int size_order;  /* hand the engines each batch's images largest first (NOTE [ Largest first ]) */

    nvjpegHandle_t handle;
    hl_jpeg_batched batched;          /* on `handle`: every image, or those with chroma to upsample */
    hl_jpeg_batched plain;            /* interpolating hardware backend: the others (NOTE [ Two handles ]) */
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

    hl_jpeg_lanes lanes;   /* hybrid backend, or the hardware backend's lanes beside the engines */
    int threads;           /* the most host threads the lanes use, the caller's included; hardware: 0, none */
    hl_jpeg_beside beside; /* hardware backend with threads: NOTE [ Lanes beside the engines ] (nvjpeg_beside.c) */

    /* per-image scratch, max_batch long; malloc'd: used without the GIL */
    const unsigned char **data;
    size_t *lengths;
    nvjpegImage_t *images;
    int *order;
    int *widths, *heights; /* each image's, from its header */
    long long *keys;       /* size_order's sort keys */
    int *lane_order;       /* hardware with threads: the lanes' images */
    hl_jpeg_job *jobs;     /* lanes: the images in decode order, and what nvjpeg said of each */
    nvjpegStatus_t *rcs;
    const char **calls;
} hl_jpeg_engine;

/* The first failure of an engine call, raised by the caller once the GIL is back. */
typedef struct {
    nvjpegStatus_t code; /* nvjpeg status, when call is set and cuda is 0 */
    hl_cuda_status cuda;
    const char *call;
    const char *detail;
    const char *file; /* where call failed: the engine's source, not its caller's */
    int line;
    /* bad input found before any work: ValueError naming the image */
    Py_ssize_t bad_index;
    const char *bad_what;
    long long bad_value, bad_limit;
} hl_jpeg_failure;

/* Settings and per-image scratch for max_batch images (1 to 65536); nothing of nvjpeg's made yet. 0, or
   -1 when out of memory (hl_jpeg_engine_free frees what was made). */
int hl_jpeg_engine_init(hl_jpeg_engine *e, const hl_nvjpeg *lib, int device, int backend, int max_batch,
                        int interpolate);
void hl_jpeg_engine_free(hl_jpeg_engine *e);

/* The handles, states, buffers and events, made on e->device (left current as it was); on a failure
   (kept in `f`) whatever was made is freed again. Without the GIL. */
void hl_jpeg_engine_open(hl_jpeg_engine *e, hl_jpeg_failure *f);

/* Wait for the last decode's work, then free what hl_jpeg_engine_open made; the first failure is kept
   in `f`. Without the GIL. */
void hl_jpeg_engine_close(hl_jpeg_engine *e, hl_jpeg_failure *f);

/* Decode `count` JPEGs (src: (host pointer, length) pairs; dst: (device pointer, pitch) pairs) to RGB
   interleaved, queued on `stream`; one HL_JPEG_* byte per image into status. Without the GIL. */
void hl_jpeg_engine_decode(hl_jpeg_engine *e, const int64_t *src, const int64_t *dst, int count, hl_stream_t stream,
                           unsigned char *status, hl_jpeg_failure *f);

#endif
