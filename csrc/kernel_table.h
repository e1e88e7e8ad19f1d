/* Every kernel entry point hotloop launches: the source (kernels/<name>.cu) it is compiled from and its extern "C" name. */
#ifndef HOTLOOP_KERNEL_TABLE_H
#define HOTLOOP_KERNEL_TABLE_H

/* one module per source, compiled by NVRTC on first use; exported as _C.KERNEL_SOURCES */
enum hl_kernel_source {
    HL_SOURCE_AMP,
    HL_SOURCE_IMAGE_RESIZE,
    HL_SOURCE_NORMALIZE,
    HL_SOURCE_OPTIM,
    HL_SOURCE_COUNT,
};

/* one id per extern "C" __global__ entry point, grouped by source; hl_kernel_entries names each */
enum hl_kernel_id {
    /* kernels/amp.cu */
    HL_KERNEL_NON_FINITE_CHECK,
    HL_KERNEL_AMP_CHECK_NONE, /* the check pass, read-only, one per norm mode (enum hl_norm_mode) */
    HL_KERNEL_AMP_CHECK_L2,
    HL_KERNEL_AMP_CHECK_INF,
    HL_KERNEL_AMP_CHECK_P,
    HL_KERNEL_AMP_CHECK_WRITE, /* the check pass that also stores the unscaled values (unscale_) */
    HL_KERNEL_AMP_EPILOGUE,
    HL_KERNEL_AMP_APPLY_UNSCALE,
    HL_KERNEL_AMP_APPLY_CLIP,
    HL_KERNEL_AMP_APPLY_UNSCALE_CLIP,
    HL_KERNEL_AMP_UPDATE,
    /* kernels/image_resize.cu */
    HL_KERNEL_IMAGE_RESIZE,
    /* kernels/normalize.cu */
    HL_KERNEL_NORMALIZE_NHWC_VECTOR,
    HL_KERNEL_NORMALIZE_GATHER,
    /* kernels/optim.cu */
    HL_KERNEL_ADAM,
    HL_KERNEL_ADAM_COUNT,
    HL_KERNEL_SGD,
    HL_KERNEL_COUNT,
};

typedef struct {
    enum hl_kernel_source source;
    const char *name; /* the extern "C" name in kernels/<source>.cu */
} hl_kernel_entry;

extern const char *const hl_kernel_source_names[HL_SOURCE_COUNT]; /* "amp", ...: the .cu base names */
extern const hl_kernel_entry hl_kernel_entries[HL_KERNEL_COUNT];  /* indexed by hl_kernel_id */

#endif
