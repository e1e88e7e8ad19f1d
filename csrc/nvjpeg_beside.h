/* Hybrid lanes beside the JPEG engines (nvjpeg_beside.c): the hardware backend's batch shared with the
   host's threads, in proportion to what each delivered on the batches before. */
#ifndef HOTLOOP_NVJPEG_BESIDE_H
#define HOTLOOP_NVJPEG_BESIDE_H

#include "module.h"
#include "nvjpeg.h"
#include "nvjpeg_hybrid.h"

/* the lanes' share of a batch's pixels never leaves [SHARE_LEAST, 1 - SHARE_LEAST], so that neither
   pool's rate goes unmeasured */
#define HL_BESIDE_SHARE_LEAST 0.02

typedef struct {
    nvjpegHandle_t handle; /* hybrid, of the lanes' own; NULL: not opened yet */
    hl_stream_t stream;    /* the lanes queue their GPU halves here, beside the engines' stream */
    void *go;              /* recorded on the caller's stream before the batch; the lanes' stream waits for it */
    void *marks[4];        /* timed: the engines' start and end on the caller's stream, the lanes' on theirs */
    int marks_pending;     /* the last call recorded all four, not yet read */
    long long pixels[2];   /* what the last timed call gave the engines and the lanes */
    double share;          /* the lanes' share of a batch's pixels now */
    long long images;      /* images the lanes decoded, since the decoder opened */
    const char *failed_call; /* the call that failed the lanes' part of a call: they stop (NOTE in nvjpeg_beside.c) */
    nvjpegStatus_t failed_status;
} hl_jpeg_beside;

/* The lanes' handle (with the engines' interpolation flag), stream and events, and `lanes` opened on
   that handle; the device current. 0, or nvjpeg's failed status with *call set; CUDA's in `cuda`. */
nvjpegStatus_t hl_jpeg_beside_open(hl_jpeg_beside *b, hl_jpeg_lanes *lanes, const hl_nvjpeg *n, int interpolate,
                                   hl_cuda_status *cuda, const char **call);

/* Free what hl_jpeg_beside_open made, `lanes` first (its copies waited for); the first failure is kept. */
nvjpegStatus_t hl_jpeg_beside_close(hl_jpeg_beside *b, hl_jpeg_lanes *lanes, const hl_nvjpeg *n,
                                    hl_cuda_status *cuda, const char **call);

/* Move the share toward the one at which the engines and the lanes would have finished the last timed
   call together; call once that call's work is over (the caller's stream synchronised). */
void hl_jpeg_beside_learn(hl_jpeg_beside *b);

/* Split a batch between the pools: of order[0..*batched) and plain_order[0..*plain) (each largest
   first, the engines' two handles), move images to lane_order (which holds *lanes images already, those
   the engines refuse) until the lanes hold their share of the pixels, each pool keeping at least one
   image where the batch allows (so that both rates stay measured); the engines' images stay in order
   at the front of each list, whose counts shrink. */
void hl_jpeg_beside_split(const hl_jpeg_beside *b, const int *widths, const int *heights, int *order, int *batched,
                          int *plain_order, int *plain, int *lane_order, int *lanes);

#endif
