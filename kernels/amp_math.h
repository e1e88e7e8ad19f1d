/* The GradScaler's scalar maths, one copy for kernels/amp.cu (device) and csrc/amp.c (C reference). */
#ifndef HOTLOOP_AMP_MATH_H
#define HOTLOOP_AMP_MATH_H

#include "amp_layout.h"
#include "rtc_prelude.h"

#ifdef __CUDACC__
#define HL_AMP_FN static inline __host__ __device__
#else
#define HL_AMP_FN static inline
#endif

/* one value's share of the norm (double, so a 32768-element chunk adds up exactly enough) */
HL_AMP_FN double hl_norm_term(int mode, float u, float p) {
    switch (mode) {
    case HL_NORM_L2:
        return (double)u * (double)u;
    case HL_NORM_INF:
        return fabs((double)u);
    case HL_NORM_P:
        return (double)powf(fabsf(u), p);
    default:
        return 0.0;
    }
}

/* two partial norms as one: a sum, or for the inf-norm a max in which NaN wins and stays, as torch's */
HL_AMP_FN double hl_norm_combine(int mode, double a, double b) {
    if (mode == HL_NORM_INF)
        return (b > a || b != b) ? b : a;
    return a + b;
}

/* Fold `n` extra partials (HL_EXTRA_LEN floats each) into the table's, in order, so that the result
   does not depend on timing: returns the combined accumulator, sets *found and lowers *param to the
   smallest parameter index found non-finite. */
HL_AMP_FN double hl_amp_fold_extra(int mode, double acc, const float *extra, int n, int *found, int64_t *param) {
    for (int k = 0; k < n; k++) {
        const float *x = extra + (size_t)k * HL_EXTRA_LEN;
        acc = hl_norm_combine(mode, acc, (double)x[HL_EXTRA_ACC]);
        if (x[HL_EXTRA_FOUND] != 0.0f) {
            const int64_t p = (int64_t)x[HL_EXTRA_PARAM];
            if (p >= 0 && (*param < 0 || p < *param))
                *param = p;
            *found = 1;
        }
    }
    return acc;
}

/* The epilogue from the reduced partials: norm, torch's clip coefficient and the factors, in aux.
   `scale` may be NULL (gradients already unscaled); max_norm < 0 means no clipping. */
HL_AMP_FN void hl_amp_finish(double acc, int found, int64_t param, int mode, float p, float max_norm,
                             const float *scale, float *aux) {
    float norm = 0.0f;
    if (mode == HL_NORM_L2)
        norm = (float)sqrt(acc);
    else if (mode == HL_NORM_INF)
        norm = (float)acc;
    else if (mode == HL_NORM_P)
        norm = (float)pow(acc, 1.0 / (double)p);
    float coef = 1.0f;
    if (max_norm >= 0.0f) {
        /* torch: max_norm / (total_norm + 1e-6) is reciprocal(total_norm + 1e-6) * max_norm in
           float32, then clamp(max=1.0), which keeps NaN */
        float r = 1.0f / (norm + 1e-6f);
        coef = r * max_norm;
        coef = coef != coef ? coef : fminf(coef, 1.0f);
    }
    const float s = scale != NULL ? *scale : 1.0f;
    aux[HL_AUX_FOUND] = found ? 1.0f : 0.0f;
    aux[HL_AUX_NORM] = norm;
    aux[HL_AUX_CLIP] = coef;
    /* the reciprocal in FP64, as torch's unscale_ takes it */
    aux[HL_AUX_INV_SCALE] = scale != NULL ? (float)(1.0 / (double)s) : 1.0f;
    aux[HL_AUX_GRAD_SCALE] = s / coef;
    aux[HL_AUX_ACC] = (float)acc;
    aux[HL_AUX_PARAM] = (float)param;
}

/* torch._amp_update_scale_ (float32 scale times a double factor, rounded once), plus hysteresis
   (back off once `hysteresis` overflows were seen since the last growth, Megatron-LM's rule),
   min/max bounds and the skipped-step counter. `any` is the sum of the found_inf values. With
   hysteresis 1 and no bounds (0 and inf) the numbers are torch's. */
HL_AMP_FN void hl_amp_update_scale(float *scale, int32_t *growth_tracker, int64_t *state, float any,
                                   double growth_factor, double backoff_factor, int64_t growth_interval,
                                   int64_t hysteresis, float min_scale, float max_scale, int adjust) {
    if (any != 0.0f)
        state[HL_STATE_SKIPPED] += 1;
    if (!adjust)
        return;
    if (any != 0.0f) {
        int64_t left = state[HL_STATE_HYSTERESIS] - 1;
        state[HL_STATE_HYSTERESIS] = left > 0 ? left : 0;
        if (left <= 0) {
            /* a comparison, not fmaxf: a NaN scale stays NaN, as torch keeps it */
            const float backed = (float)((double)*scale * backoff_factor);
            *scale = backed < min_scale ? min_scale : backed;
        }
        *growth_tracker = 0;
    } else {
        int64_t successful = (int64_t)*growth_tracker + 1;
        if (successful == growth_interval) {
            float grown = (float)((double)*scale * growth_factor);
            if (fabsf(grown) <= FLT_MAX) /* do not grow past float32's range to inf (nor a NaN) */
                *scale = grown > max_scale ? max_scale : grown;
            *growth_tracker = 0;
            state[HL_STATE_HYSTERESIS] = hysteresis;
        } else {
            *growth_tracker = (int32_t)successful;
        }
    }
}

#endif
