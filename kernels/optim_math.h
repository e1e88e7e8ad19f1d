/* The fused optimizers' per-element maths, one copy for kernels/optim.cu (device) and csrc/optim.c (C reference). */
#ifndef HOTLOOP_OPTIM_MATH_H
#define HOTLOOP_OPTIM_MATH_H

#include <math.h>
#include <stdint.h>

#ifdef __CUDACC__
#define HL_OPT_FN static inline __host__ __device__
#else
#define HL_OPT_FN static inline
#endif

/* Every float operation is named and rounded once: on the device the _rn intrinsics, which nvcc never
   contracts into an fma, and on the host plain C (the C part builds with -std=c11, so no contraction
   either). The C reference and the kernel then do the same float arithmetic, step for step. */
#ifdef __CUDA_ARCH__
#define HL_ADD(a, b) __fadd_rn((a), (b))
#define HL_SUB(a, b) __fsub_rn((a), (b))
#define HL_MUL(a, b) __fmul_rn((a), (b))
#define HL_DIV(a, b) __fdiv_rn((a), (b))
#define HL_SQRT(a) __fsqrt_rn(a)
#else
#define HL_ADD(a, b) ((a) + (b))
#define HL_SUB(a, b) ((a) - (b))
#define HL_MUL(a, b) ((a) * (b))
#define HL_DIV(a, b) ((a) / (b))
#define HL_SQRT(a) sqrtf(a)
#endif

/* One parameter tensor as the Adam kernel walks it: the addresses of everything it reads and writes.
   max_exp_avg_sq is 0 without amsgrad. Chunks are tensor_table.h's (HL_CHUNK_ELEMS elements). */
typedef struct {
    uint64_t param;          /* float32, updated in place */
    uint64_t grad;           /* float32, float16 or bfloat16 (grad_dtype), only read */
    uint64_t exp_avg;        /* float32 */
    uint64_t exp_avg_sq;     /* float32 */
    uint64_t max_exp_avg_sq; /* float32, or 0 */
    uint64_t step;           /* one float32: steps taken before this one */
    int64_t numel;
    int64_t first_chunk;
    int32_t grad_dtype; /* enum hl_dtype */
    int32_t reserved;
} hl_adam_entry;

/* The hyperparameters of one call (one param group on one device). */
typedef struct {
    double lr, beta1, beta2;
    float eps, weight_decay;
    int decoupled; /* AdamW: decay the parameter, not the gradient */
    int amsgrad, maximize;
} hl_adam_hyper;

/* What one tensor's update needs from its step count, in float: bias corrections taken in double
   from the step that is being taken (`steps_before` + 1), then rounded once. */
typedef struct {
    float beta1, one_minus_beta1, beta2, one_minus_beta2;
    float step_size;     /* lr / (1 - beta1^t) */
    float bc2_sqrt;      /* sqrt(1 - beta2^t) */
    float lr_decay;      /* lr * weight_decay (decoupled decay) */
    float eps, weight_decay;
    int decoupled, amsgrad, maximize;
} hl_adam_scalars;

HL_OPT_FN hl_adam_scalars hl_adam_scalars_for(const hl_adam_hyper *h, float steps_before) {
    hl_adam_scalars s;
    const double t = (double)steps_before + 1.0;
    s.beta1 = (float)h->beta1;
    s.one_minus_beta1 = (float)(1.0 - h->beta1);
    s.beta2 = (float)h->beta2;
    s.one_minus_beta2 = (float)(1.0 - h->beta2);
    s.step_size = (float)(h->lr / (1.0 - pow(h->beta1, t)));
    s.bc2_sqrt = (float)sqrt(1.0 - pow(h->beta2, t));
    s.lr_decay = (float)(h->lr * (double)h->weight_decay);
    s.eps = h->eps;
    s.weight_decay = h->weight_decay;
    s.decoupled = h->decoupled;
    s.amsgrad = h->amsgrad;
    s.maximize = h->maximize;
    return s;
}

/* One element of torch's Adam/AdamW (the algorithm in torch.optim.Adam's documentation), with the
   gradient divided by `grad_scale` (the unscale x clip factor) on the way in and never stored.
   `g` is the gradient as float; `vmax` is NULL without amsgrad. */
HL_OPT_FN void hl_adam_element(const hl_adam_scalars *s, float g, float grad_scale, int has_scale, float *p,
                               float *m, float *v, float *vmax) {
    if (has_scale)
        g = HL_DIV(g, grad_scale);
    if (s->maximize)
        g = -g;
    float param = *p;
    if (s->weight_decay != 0.0f) {
        if (s->decoupled)
            param = HL_SUB(param, HL_MUL(s->lr_decay, param));
        else
            g = HL_ADD(g, HL_MUL(s->weight_decay, param));
    }
    const float m1 = HL_ADD(HL_MUL(s->beta1, *m), HL_MUL(s->one_minus_beta1, g));
    const float v1 = HL_ADD(HL_MUL(s->beta2, *v), HL_MUL(HL_MUL(s->one_minus_beta2, g), g));
    float second = v1;
    if (s->amsgrad) {
        /* torch.maximum: a NaN wins */
        const float old = *vmax;
        second = (v1 > old || v1 != v1) ? v1 : old;
        *vmax = second;
    }
    const float denom = HL_ADD(HL_DIV(HL_SQRT(second), s->bc2_sqrt), s->eps);
    *p = HL_SUB(param, HL_DIV(HL_MUL(s->step_size, m1), denom));
    *m = m1;
    *v = v1;
}

/* One parameter tensor as the SGD kernel walks it; momentum_buffer is 0 without momentum. */
typedef struct {
    uint64_t param;           /* float32, updated in place */
    uint64_t grad;            /* float32, float16 or bfloat16 (grad_dtype), only read */
    uint64_t momentum_buffer; /* float32, or 0 */
    int64_t numel;
    int64_t first_chunk;
    int32_t grad_dtype; /* enum hl_dtype */
    int32_t reserved;
} hl_sgd_entry;

/* The hyperparameters of one SGD call, as floats (the update is one float32 step per element). */
typedef struct {
    float lr, momentum, one_minus_dampening, weight_decay;
    int nesterov, maximize;
    int first_step; /* the momentum buffers hold nothing yet: they take the gradient as it is */
} hl_sgd_hyper;

/* One element of torch's SGD (the algorithm in torch.optim.SGD's documentation, with maximize
   negating the gradient first), the gradient divided by `grad_scale` on the way in and never
   stored. `buf` is NULL without momentum. */
HL_OPT_FN void hl_sgd_element(const hl_sgd_hyper *h, float g, float grad_scale, int has_scale, float *p, float *buf) {
    if (has_scale)
        g = HL_DIV(g, grad_scale);
    if (h->maximize)
        g = -g;
    const float param = *p;
    if (h->weight_decay != 0.0f)
        g = HL_ADD(g, HL_MUL(h->weight_decay, param));
    if (buf != NULL) {
        const float b = h->first_step ? g : HL_ADD(HL_MUL(h->momentum, *buf), HL_MUL(h->one_minus_dampening, g));
        *buf = b;
        g = h->nesterov ? HL_ADD(g, HL_MUL(h->momentum, b)) : b;
    }
    *p = HL_SUB(param, HL_MUL(h->lr, g));
}

#endif
