/* Hybrid lanes beside the JPEG engines: their handle, stream and timing events, the split of a batch and the share learnt from the batches before. */
#include "nvjpeg_beside.h"
#include "nvjpeg_cuda.h"

#include <string.h>

/* NOTE [ Lanes beside the engines ]
   The JPEG engines are one pool of decoders; the host's cores, decoding Huffman codes on the hybrid
   backend's lanes (NOTE [ Hybrid lanes ] in nvjpeg_hybrid.c), are another, and on a batch the engines
   alone would take long enough for, both together finish sooner. So with JpegDecoder.threads above 0 the
   hardware backend gives a share of each batch's pixels to the lanes: the engines' batched call runs on
   a thread of its own, on the caller's stream, while the caller's thread and the pool's decode the
   lanes' images, queueing their GPU halves on a stream of the lanes' own (so that they do not wait
   behind the engines' work), which the caller's stream then waits for.

   The share is not a constant: each call records timed events around both pools' work, and the next
   call, once the caller's stream has been synchronised (as the hardware backend does before every
   batch), reads how long each took for its pixels. The rates give the share at which both would have
   finished together; the share moves half way there per batch, so one slow batch does not swing it,
   and stays within [HL_BESIDE_SHARE_LEAST, 1 - HL_BESIDE_SHARE_LEAST] so that both rates stay measured.
   The times are wall clock on the GPU: they include what the training step's kernels, or the host's
   other threads, took from either pool, which is what the split should answer to.

   Images the engines refuse (progressive ones, most often) go to the lanes as well, instead of back
   to the workers.

   Should the lanes decode none of their part of a call, nvjpeg failing some of it for a reason that is
   not the images' (an execution failure, say), while the engines decoded theirs, the lanes stop for
   good: those images come back refused (the caller decodes them another way, as any image nvjpeg
   refuses), JpegDecoder.lane_failure names the call, and the engines decode alone from then on. */

#define SHARE_FIRST 0.25 /* before anything is measured: the engines take most */

nvjpegStatus_t hl_jpeg_beside_open(hl_jpeg_beside *b, hl_jpeg_lanes *lanes, const hl_nvjpeg *n, int interpolate,
                                   hl_cuda_status *cuda, const char **call) {
    memset(b, 0, sizeof(*b));
    b->share = SHARE_FIRST;
    *call = "nvjpegCreateEx"; /* the engines' interpolation: the engine found whether this nvjpeg has it */
    unsigned int flags = interpolate ? NVJPEG_FLAGS_UPSAMPLING_WITH_INTERPOLATION : NVJPEG_FLAGS_DEFAULT;
    nvjpegStatus_t rc = n->create_ex(NVJPEG_BACKEND_HYBRID, NULL, NULL, flags, &b->handle);
    if (rc != NVJPEG_STATUS_SUCCESS) {
        b->handle = NULL;
        return rc;
    }
    HL_CUDA(cuda, stream_create(&b->stream));
    HL_CUDA(cuda, event_create(&b->go));
    for (int k = 0; k < 4; k++)
        HL_CUDA(cuda, event_create_timed(&b->marks[k]));
    if (cuda->code != 0)
        return NVJPEG_STATUS_SUCCESS;
    return hl_jpeg_lanes_open(lanes, n, b->handle, call);
}

nvjpegStatus_t hl_jpeg_beside_close(hl_jpeg_beside *b, hl_jpeg_lanes *lanes, const hl_nvjpeg *n,
                                    hl_cuda_status *cuda, const char **call) {
    nvjpegStatus_t first = NVJPEG_STATUS_SUCCESS, rc;
    if (lanes->lib != NULL)
        first = hl_jpeg_lanes_close(lanes, cuda, call);
    lanes->lib = NULL;
    if (b->stream != NULL) {
        HL_CUDA(cuda, stream_synchronize(b->stream));
        HL_CUDA(cuda, stream_destroy(b->stream));
    }
    b->stream = NULL;
    if (b->go != NULL)
        HL_CUDA(cuda, event_destroy(b->go));
    b->go = NULL;
    for (int k = 0; k < 4; k++) {
        if (b->marks[k] != NULL)
            HL_CUDA(cuda, event_destroy(b->marks[k]));
        b->marks[k] = NULL;
    }
    if (b->handle != NULL && (rc = n->destroy(b->handle)) != 0 && first == NVJPEG_STATUS_SUCCESS) {
        first = rc;
        *call = "nvjpegDestroy";
    }
    b->handle = NULL;
    b->marks_pending = 0;
    return first;
}

void hl_jpeg_beside_learn(hl_jpeg_beside *b) {
    if (!b->marks_pending)
        return;
    b->marks_pending = 0;
    float engines_ms = 0, lanes_ms = 0;
    /* a failed read (work still queued, a sticky error) teaches nothing; the decode reports errors */
    if (event_elapsed(&engines_ms, b->marks[0], b->marks[1]) != 0 ||
        event_elapsed(&lanes_ms, b->marks[2], b->marks[3]) != 0)
        return;
    if (engines_ms <= 0 || lanes_ms <= 0 || b->pixels[0] <= 0 || b->pixels[1] <= 0)
        return;
    double engines_rate = (double)b->pixels[0] / engines_ms, lanes_rate = (double)b->pixels[1] / lanes_ms;
    double target = lanes_rate / (engines_rate + lanes_rate);
    double share = 0.5 * (b->share + target);
    if (share < HL_BESIDE_SHARE_LEAST)
        share = HL_BESIDE_SHARE_LEAST;
    if (share > 1 - HL_BESIDE_SHARE_LEAST)
        share = 1 - HL_BESIDE_SHARE_LEAST;
    b->share = share;
}

static double pixels_of(const int *widths, const int *heights, int i) { return (double)widths[i] * heights[i]; }

/* order[0..count), largest first: each image goes where the lanes' pixels stay closest to their share
   of those dealt so far (dealt[0]: all, dealt[1]: the lanes'), so that both pools get large and small
   ones, each still largest first. The engines' images stay in order[0..returned). */
static int deal(const hl_jpeg_beside *b, const int *widths, const int *heights, int *order, int count,
                int *lane_order, int *lanes, double dealt[2]) {
    int kept = 0;
    for (int k = 0; k < count; k++) {
        int i = order[k];
        double pixels = pixels_of(widths, heights, i);
        dealt[0] += pixels;
        if (dealt[1] + 0.5 * pixels <= b->share * dealt[0]) {
            dealt[1] += pixels;
            lane_order[(*lanes)++] = i;
        } else {
            order[kept++] = i;
        }
    }
    return kept;
}

void hl_jpeg_beside_split(const hl_jpeg_beside *b, const int *widths, const int *heights, int *order, int *batched,
                          int *plain_order, int *plain, int *lane_order, int *lanes) {
    const int refused = *lanes; /* the lanes take these whatever the share: they count as dealt to them */
    double dealt[2] = {0, 0};
    for (int k = 0; k < refused; k++)
        dealt[0] += pixels_of(widths, heights, lane_order[k]);
    dealt[1] = dealt[0];
    *batched = deal(b, widths, heights, order, *batched, lane_order, lanes, dealt);
    const int from_batched = *lanes - refused;
    *plain = deal(b, widths, heights, plain_order, *plain, lane_order, lanes, dealt);
    /* a small batch at a share near either end could leave one pool nothing */
    if (*lanes == refused && *batched > 1) {
        lane_order[(*lanes)++] = order[--*batched]; /* the engines' smallest */
    } else if (*batched + *plain == 0 && from_batched > 1) {
        order[(*batched)++] = lane_order[refused]; /* the largest the lanes took that the engines could */
        memmove(lane_order + refused, lane_order + refused + 1, sizeof(int) * (size_t)(--*lanes - refused));
    }
}
