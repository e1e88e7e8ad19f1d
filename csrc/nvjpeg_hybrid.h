/* nvjpeg's hybrid decode for the engine's "hybrid" backend (nvjpeg_hybrid.c): the Huffman decoding on the
   host's threads, each with a lane of its own, the rest on the SMs. */
#ifndef HOTLOOP_NVJPEG_HYBRID_H
#define HOTLOOP_NVJPEG_HYBRID_H

#include "module.h"
#include "nvjpeg.h"

#include <stdatomic.h>
#include <stddef.h>

/* the most lanes, and so host threads, one engine decodes with */
#define HL_JPEG_MAX_LANES 64

/* pinned buffers per lane: one fills while the others' copies to the device run */
#define HL_JPEG_LANE_PINNED 2

/* What one thread decodes an image with: nvjpeg wants each of these per thread. */
typedef struct {
    nvjpegJpegState_t state;
    nvjpegDecodeParams_t params;
    nvjpegBufferDevice_t device_buffer;
    nvjpegBufferPinned_t pinned[HL_JPEG_LANE_PINNED];
    nvjpegJpegStream_t streams[HL_JPEG_LANE_PINNED];
    void *pinned_free[HL_JPEG_LANE_PINNED]; /* cudaEvent_t, recorded after the copy out of pinned[k] */
    int pinned_pending[HL_JPEG_LANE_PINNED];
    int next_pinned;
    atomic_int taken; /* a thread decodes on this lane now */
} hl_jpeg_lane;

typedef struct {
    const hl_nvjpeg *lib;
    nvjpegHandle_t handle;          /* the engine's */
    nvjpegJpegDecoder_t decoder;    /* nvjpeg's hybrid decoder, shared by the lanes */
    hl_jpeg_lane lanes[HL_JPEG_MAX_LANES];
    int made;                       /* lanes[0..made) exist */
} hl_jpeg_lanes;

/* One image of a call: its JPEG bytes and where its RGB goes. */
typedef struct {
    const unsigned char *data;
    size_t length;
    nvjpegImage_t image;
} hl_jpeg_job;

/* The hybrid decoder on `handle` (the device current); 0, or the failed call's status with *call set. */
nvjpegStatus_t hl_jpeg_lanes_open(hl_jpeg_lanes *l, const hl_nvjpeg *lib, nvjpegHandle_t handle, const char **call);

/* Wait for every lane's copies, then free the lanes and the decoder (the device current); the first
   failure is kept: nvjpeg's status in the return value with *call set, CUDA's in `cuda`. */
nvjpegStatus_t hl_jpeg_lanes_close(hl_jpeg_lanes *l, hl_cuda_status *cuda, const char **call);

/* Decode jobs[0..count) to RGB interleaved, queued on `stream`, on up to `threads` threads (the caller's
   included) of csrc/thread_pool.c, each on a lane of its own: rcs[k] is job k's nvjpeg status, and
   calls[k] names the call that failed it. A CUDA failure stops the call (kept in `cuda`; the jobs not
   reached then say NVJPEG_STATUS_EXECUTION_FAILED). Lanes are made here as needed, with `device` current
   in the caller; without the GIL. */
void hl_jpeg_lanes_decode(hl_jpeg_lanes *l, int device, const hl_jpeg_job *jobs, int count, hl_stream_t stream,
                          int threads, nvjpegStatus_t *rcs, const char **calls, hl_cuda_status *cuda);

#endif
