/* The fused uint8 HWC -> normalised float image kernel's parameters, shared by kernels/normalize.cu, its launcher and the C reference. */
#ifndef HOTLOOP_KERNELS_NORMALIZE_H
#define HOTLOOP_KERNELS_NORMALIZE_H

#include "rtc_prelude.h"
#include "tensor_table.h"

/* the one definition: the kernel's shared-memory table, normalize.c's check and _C.NORMALIZE_MAX_CHANNELS */
#define HL_NORMALIZE_MAX_CHANNELS 16

/* input bytes per vector load of the channels_last kernel; the launcher takes that kernel only when
   src is aligned to it and dst to its outputs */
#define HL_NORMALIZE_VEC 16

/* per-channel constants, passed by value */
typedef struct {
    float mean[HL_NORMALIZE_MAX_CHANNELS];
    float std[HL_NORMALIZE_MAX_CHANNELS];
} hl_normalize_params;

#endif
