/* What the GradScaler's kernels, the C reference and python/hotloop/amp/ agree on: slots and modes. */
#ifndef HOTLOOP_AMP_LAYOUT_H
#define HOTLOOP_AMP_LAYOUT_H

#include "rtc_prelude.h"

/* csrc/amp.c exports every number here to Python as _C.AMP_* (norm modes, slots, the _LEN sizes,
   AMP_MAX_FOUND): this header is their one owner. */

/* norm modes of the check pass (python/hotloop/amp/grad_scaler.py passes these numbers) */
enum hl_norm_mode {
    HL_NORM_NONE = 0, /* found_inf only */
    HL_NORM_L2 = 1,   /* sum of squares, norm = sqrt */
    HL_NORM_INF = 2,  /* max |x| (NaN wins) */
    HL_NORM_P = 3,    /* sum |x|^p, norm = sum^(1/p) */
};

/* float32 slots of the per-step aux tensor, all written by the epilogue */
enum hl_aux_slot {
    HL_AUX_FOUND = 0,      /* 1.0 when a gradient held inf/NaN (or overflowed once unscaled), else 0.0 */
    HL_AUX_NORM = 1,       /* total norm of the unscaled gradients */
    HL_AUX_CLIP = 2,       /* min(max_norm / (norm + 1e-6), 1) as torch computes it; 1 without clipping */
    HL_AUX_INV_SCALE = 3,  /* float(1 / double(scale)), as torch's unscale_; 1 when already unscaled */
    HL_AUX_GRAD_SCALE = 4, /* scale / clip: the grad_scale a fused optimizer divides by */
    HL_AUX_ACC = 5,        /* the norm before its root (sum of squares, max, sum of |x|^p): what another
                              device's epilogue folds in as an extra partial */
    HL_AUX_PARAM = 6,      /* flat index of the first parameter found non-finite, -1 if none */
    HL_AUX_LEN = 8,
};

/* float32 slots of one extra partial the epilogue folds in after the table's chunks: gradients
   measured outside the table (sparse, non-dense, float64) or another device's totals */
enum hl_extra_slot {
    HL_EXTRA_ACC = 0,   /* norm accumulator, as HL_AUX_ACC */
    HL_EXTRA_FOUND = 1, /* non-zero when a value was inf/NaN */
    HL_EXTRA_PARAM = 2, /* flat index of the first such parameter, -1 if none */
    HL_EXTRA_LEN = 3,
};

/* int64 slots of the persistent per-optimizer overflow report */
enum hl_report_slot {
    HL_REPORT_PARAM = 0, /* flat index of the first parameter whose gradient was non-finite */
    HL_REPORT_STEP = 1,  /* the scaler's update count when that happened */
    HL_REPORT_COUNT = 2, /* checks that found a non-finite gradient */
    HL_REPORT_LEN = 4,
};

/* int64 slots of the scaler's persistent device state (next to torch's _scale and _growth_tracker) */
enum hl_state_slot {
    HL_STATE_SKIPPED = 0,    /* updates whose step was skipped */
    HL_STATE_HYSTERESIS = 1, /* overflows still tolerated before the next backoff */
    HL_STATE_LEN = 2,
};

/* the found_inf tensors update() combines (one per optimizer stepped since the last update) */
#define HL_MAX_FOUND 8
typedef struct {
    const float *ptr[HL_MAX_FOUND];
    int count;
} hl_found_list;

#endif
