/* Antialiased bilinear filters and 8-bit fixed point as Pillow computes them: one copy for kernels/image_resize.cu and csrc/image_resize.c. */
#ifndef HOTLOOP_KERNELS_IMAGE_RESIZE_MATH_H
#define HOTLOOP_KERNELS_IMAGE_RESIZE_MATH_H

#include "rtc_prelude.h"

#ifdef __CUDACC__
#define HL_RESIZE_FN static inline __host__ __device__
#else
#define HL_RESIZE_FN static inline
#endif

/* Each operation rounded once on both sides: nvcc would otherwise fuse a multiply and an add into
   one FMA (one rounding) where the C compiler (C11 mode: no contraction) rounds twice, and the
   weights, so the pixels, would differ between the kernel and the C reference. */
#ifdef __CUDA_ARCH__
#define HL_DADD(a, b) __dadd_rn(a, b)
#define HL_DSUB(a, b) __dsub_rn(a, b)
#define HL_DMUL(a, b) __dmul_rn(a, b)
#define HL_DDIV(a, b) __ddiv_rn(a, b)
#define HL_FSUB(a, b) __fsub_rn(a, b)
#define HL_FDIV(a, b) __fdiv_rn(a, b)
#else
#define HL_DADD(a, b) ((a) + (b))
#define HL_DSUB(a, b) ((a) - (b))
#define HL_DMUL(a, b) ((a) * (b))
#define HL_DDIV(a, b) ((a) / (b))
#define HL_FSUB(a, b) ((a) - (b))
#define HL_FDIV(a, b) ((a) / (b))
#endif

/* Pillow's fixed point for 8-bit images: weights carry 22 fractional bits and a sum starts at one
   half, so the shift back rounds. With at most HL_IMAGE_MAX_SIDE (2^20) taps the weights add up to
   at most 2^22 + 2^19 (each rounded by at most one half), and 255 times that plus the half stays
   below 2^31. */
#define HL_RESIZE_PRECISION_BITS 22
#define HL_RESIZE_HALF (1 << (HL_RESIZE_PRECISION_BITS - 1))

/* The filter of one output position along one axis of the crop: taps [first, first + count) of
   the crop, tap t weighing triangle((t - center + 0.5) * inv_scale) / sum. */
typedef struct {
    double center, inv_scale, sum;
    int32_t first, count;
} hl_resize_taps;

HL_RESIZE_FN double hl_resize_triangle(double x) {
    if (x < 0.0)
        x = -x;
    return x < 1.0 ? 1.0 - x : 0.0;
}

/* tap t's weight before normalisation */
HL_RESIZE_FN double hl_resize_raw_weight(const hl_resize_taps *f, int32_t t) {
    return hl_resize_triangle(HL_DMUL(HL_DADD(HL_DSUB((double)t, f->center), 0.5), f->inv_scale));
}

/* Output position i of in_len -> out_len, as Pillow's precompute_coeffs and torch's
   _compute_indices_min_size_weights_aa: a shrink stretches the triangle to cover `scale` inputs
   (antialiasing); edges clamp at the crop (0 and in_len). */
HL_RESIZE_FN hl_resize_taps hl_resize_taps_of(int32_t in_len, int32_t out_len, int32_t i) {
    hl_resize_taps f;
    double scale = HL_DDIV((double)in_len, (double)out_len);
    double support = scale < 1.0 ? 1.0 : scale; /* the triangle's half-width, 1, stretched */
    f.center = HL_DMUL(HL_DADD((double)i, 0.5), scale);
    f.inv_scale = HL_DDIV(1.0, support);
    int32_t lo = (int32_t)HL_DADD(HL_DSUB(f.center, support), 0.5); /* truncation, as Pillow's (int) */
    int32_t hi = (int32_t)HL_DADD(HL_DADD(f.center, support), 0.5);
    lo = lo < 0 ? 0 : lo;
    hi = hi > in_len ? in_len : hi;
    f.first = lo;
    f.count = hi - lo;
    f.sum = 0.0;
    for (int32_t t = lo; t < hi; t++) /* in order: the same sum on both sides */
        f.sum = HL_DADD(f.sum, hl_resize_raw_weight(&f, t));
    return f;
}

/* weight of the filter's k-th tap (0 <= k < count) in fixed point, as Pillow's normalize_coeffs_8bpc */
HL_RESIZE_FN int32_t hl_resize_weight(const hl_resize_taps *f, int32_t k) {
    double w = hl_resize_raw_weight(f, f->first + k);
    if (f->sum != 0.0)
        w = HL_DDIV(w, f->sum);
    return (int32_t)HL_DADD(0.5, HL_DMUL(w, (double)(1 << HL_RESIZE_PRECISION_BITS)));
}

/* a fixed-point sum (started at HL_RESIZE_HALF) back to 0..255, as Pillow's clip8 */
HL_RESIZE_FN uint8_t hl_resize_clip8(int32_t sum) {
    int32_t v = sum >> HL_RESIZE_PRECISION_BITS;
    return (uint8_t)(v < 0 ? 0 : v > 255 ? 255 : v);
}

/* torchvision's ToTensor then Normalize, in float32: (q / scale - mean) / std, each step rounded */
HL_RESIZE_FN float hl_resize_normalize(uint8_t q, float scale, float mean, float std) {
    return HL_FDIV(HL_FSUB(HL_FDIV((float)q, scale), mean), std);
}

#endif
