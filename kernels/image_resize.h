/* The batched crop-resize-flip-normalise kernel's entry table (64 bytes per image) and its launcher in kernels/image_resize.cu. */
#ifndef HOTLOOP_KERNELS_IMAGE_RESIZE_H
#define HOTLOOP_KERNELS_IMAGE_RESIZE_H

#include <stdint.h>

#include "tensor_table.h"

/* the launcher exists only where CUDA does (nvcc, or a C file of a CUDA build); the entry and the
   parameters serve the C reference of a CPU-only build too */
#if defined(__CUDACC__) || defined(HOTLOOP_WITH_CUDA)
#include <cuda_runtime_api.h>
#endif

/* The largest side (source, crop, resized crop) an entry may have: _C.IMAGE_MAX_SIDE. It bounds a
   filter's taps, so that every fixed-point sum of kernels/image_resize_math.h stays inside int32. */
#define HL_IMAGE_MAX_SIDE (1 << 20)

/* _C.IMAGE_ENTRY_BYTES; python/hotloop/data/image_resize.py packs an entry as struct "<Qq12i" */
#define HL_IMAGE_ENTRY_BYTES 64

#ifdef __cplusplus
extern "C" {
#endif

/* One image of a batch: where its pixels are, the crop taken from it, the size the crop is resized
   to and the batch-sized window of the resized crop that is written out. */
typedef struct {
    uint64_t src;          /* uint8 pixels, interleaved (HWC), `channels` per pixel; device memory for a
                              CUDA batch, host memory for the C reference */
    int64_t src_pitch;     /* bytes between rows */
    int32_t src_h, src_w;  /* the decoded image */
    int32_t box_top, box_left, box_h, box_w; /* the crop taken from it, inside it */
    int32_t resized_h, resized_w;            /* the crop is resized to this */
    int32_t out_top, out_left; /* corner, in the resized crop, of the window written out (a CenterCrop
                                  after a Resize); the window is the batch's h x w */
    int32_t flip;              /* 1: the window mirrored left-right */
    int32_t channels;          /* 3 (RGB) or 1 (grey: replicated into R, G and B) */
} hl_image_entry;

/* a size both compilers check: the table Python packs is laid out exactly so */
typedef char hl_image_entry_is_64_bytes[sizeof(hl_image_entry) == HL_IMAGE_ENTRY_BYTES ? 1 : -1];

/* out = ((q / scale) - mean[c]) / std[c] for a float output (torchvision's ToTensor, then
   Normalize); a uint8 output stores q itself */
typedef struct {
    float mean[3];
    float std[3];
    float scale;
} hl_image_resize_params;

#if defined(__CUDACC__) || defined(HOTLOOP_WITH_CUDA)
/* Every image of `entries` (device memory, `count` checked entries) cropped, resized, windowed,
   flipped and normalised into out: `count` images of 3 x h x w of `out_dtype` (HL_UINT8, HL_FLOAT32,
   HL_FLOAT16 or HL_BFLOAT16), in [count, 3, h, w] order, or [count, h, w, 3] when channels_last.
   One kernel on `stream`. */
cudaError_t hl_launch_image_resize(const hl_image_entry *entries, int64_t count, void *out, int out_dtype, int64_t h,
                                   int64_t w, int channels_last, hl_image_resize_params params, cudaStream_t stream);
#endif

#ifdef __cplusplus
}
#endif

#endif
