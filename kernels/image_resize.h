/* The batched crop-resize-flip-normalise kernel's entry table (64 bytes per image), parameters and tile shape, shared by kernels/image_resize.cu, its launcher and the C reference. */
#ifndef HOTLOOP_KERNELS_IMAGE_RESIZE_H
#define HOTLOOP_KERNELS_IMAGE_RESIZE_H

#include "rtc_prelude.h"
#include "tensor_table.h"

/* The largest side (source, crop, resized crop) an entry may have: _C.IMAGE_MAX_SIDE. It bounds a
   filter's taps, so that every fixed-point sum of kernels/image_resize_math.h stays inside int32. */
#define HL_IMAGE_MAX_SIDE (1 << 20)

/* _C.IMAGE_ENTRY_BYTES; python/hotloop/data/image_resize.py packs an entry as struct "<Qq12i" */
#define HL_IMAGE_ENTRY_BYTES 64

/* The kernel's work item: a block of HL_RESIZE_THREADS makes one tile of HL_RESIZE_TILE_H rows x
   HL_RESIZE_TILE_W columns of one image's output. The launcher counts tiles with the same numbers. */
#define HL_RESIZE_TILE_W 32
#define HL_RESIZE_TILE_H 16
#define HL_RESIZE_THREADS 256

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

#endif
