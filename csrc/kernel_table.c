/* The kernel sources' names and every entry point's source and extern "C" name, indexed by enum hl_kernel_id. */
#include "kernel_table.h"

/* the base names of kernels/<name>.cu: the loader compiles that file for a source */
const char *const hl_kernel_source_names[HL_SOURCE_COUNT] = {
    [HL_SOURCE_AMP] = "amp",
    [HL_SOURCE_IMAGE_RESIZE] = "image_resize",
    [HL_SOURCE_NORMALIZE] = "normalize",
    [HL_SOURCE_OPTIM] = "optim",
};

/* each name is the kernel's extern "C" name in kernels/<source>.cu, which is also its .entry in the PTX */
const hl_kernel_entry hl_kernel_entries[HL_KERNEL_COUNT] = {
    [HL_KERNEL_NON_FINITE_CHECK] = {HL_SOURCE_AMP, "hl_non_finite_check"},
    [HL_KERNEL_AMP_CHECK_NONE] = {HL_SOURCE_AMP, "hl_amp_check_none"},
    [HL_KERNEL_AMP_CHECK_L2] = {HL_SOURCE_AMP, "hl_amp_check_l2"},
    [HL_KERNEL_AMP_CHECK_INF] = {HL_SOURCE_AMP, "hl_amp_check_inf"},
    [HL_KERNEL_AMP_CHECK_P] = {HL_SOURCE_AMP, "hl_amp_check_p"},
    [HL_KERNEL_AMP_CHECK_WRITE] = {HL_SOURCE_AMP, "hl_amp_check_write"},
    [HL_KERNEL_AMP_EPILOGUE] = {HL_SOURCE_AMP, "hl_amp_epilogue"},
    [HL_KERNEL_AMP_APPLY_UNSCALE] = {HL_SOURCE_AMP, "hl_amp_apply_unscale"},
    [HL_KERNEL_AMP_APPLY_CLIP] = {HL_SOURCE_AMP, "hl_amp_apply_clip"},
    [HL_KERNEL_AMP_APPLY_UNSCALE_CLIP] = {HL_SOURCE_AMP, "hl_amp_apply_unscale_clip"},
    [HL_KERNEL_AMP_UPDATE] = {HL_SOURCE_AMP, "hl_amp_update"},
    [HL_KERNEL_IMAGE_RESIZE] = {HL_SOURCE_IMAGE_RESIZE, "hl_image_resize"},
    [HL_KERNEL_NORMALIZE_NHWC_VECTOR] = {HL_SOURCE_NORMALIZE, "hl_normalize_nhwc_vector"},
    [HL_KERNEL_NORMALIZE_GATHER] = {HL_SOURCE_NORMALIZE, "hl_normalize_gather"},
    [HL_KERNEL_ADAM] = {HL_SOURCE_OPTIM, "hl_adam"},
    [HL_KERNEL_ADAM_COUNT] = {HL_SOURCE_OPTIM, "hl_adam_count"},
    [HL_KERNEL_SGD] = {HL_SOURCE_OPTIM, "hl_sgd"},
};
