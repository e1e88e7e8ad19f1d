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

/* Every operation is named and rounded once: on the device the _rn intrinsics, which nvcc never
   contracts into an fma, and on the host plain C (the C part builds with -std=c11, so no contraction
   either; x86-64 doubles are SSE2, no extended precision). The C reference and the kernel then do the
   same arithmetic, step for step. */
#ifdef __CUDA_ARCH__
#define HL_ADD(a, b) __fadd_rn((a), (b))
#define HL_SUB(a, b) __fsub_rn((a), (b))
#define HL_MUL(a, b) __fmul_rn((a), (b))
#define HL_DIV(a, b) __fdiv_rn((a), (b))
#define HL_SQRT(a) __fsqrt_rn(a)
#define HL_DADD(a, b) __dadd_rn((a), (b))
#define HL_DSUB(a, b) __dadd_rn((a), -(b))
#define HL_DMUL(a, b) __dmul_rn((a), (b))
#else
#define HL_ADD(a, b) ((a) + (b))
#define HL_SUB(a, b) ((a) - (b))
#define HL_MUL(a, b) ((a) * (b))
#define HL_DIV(a, b) ((a) / (b))
#define HL_SQRT(a) sqrtf(a)
#define HL_DADD(a, b) ((double)(a) + (double)(b))
#define HL_DSUB(a, b) ((double)(a) - (double)(b))
#define HL_DMUL(a, b) ((double)(a) * (double)(b))
#endif

/* Where the arithmetic is float and where double follows torch's CUDA fused kernels
   (aten/src/ATen/native/cuda/fused_adam_utils.cuh and FusedSgdKernel.cu): they take lr, the betas,
   weight_decay, eps, momentum and dampening as double, so every expression that mixes one of them with
   a float element is evaluated in double and rounded to float once (the moments, the decay, the SGD
   update), while the expressions among floats stay float (the unscale, sqrt, the division by the bias
   correction and the final update of Adam). Doing the same makes the kernel agree with torch's bit for
   bit but for where nvcc contracted torch's double a*b + c into an fma: then the two double results
   differ in their last bit, and the float they round to differs only when a float rounding boundary
   lies between them (about 2**-29 per operation).
   The unscale g / grad_scale is a float division here, where torch divides in double and rounds to
   float: the double quotient of two floats rounds to the same float (53 >= 2 * 24 + 2 bits, so the
   double rounding is innocuous), so the two agree exactly.
   Cost: Adam does 11 double operations and 8 float<->double conversions per element, SGD up to 7 and
   6. An H200 issues 64 double operations and 16 conversions a cycle per SM: ~0.7 SM-cycles an element,
   ~390 G elements/s over 132 SMs, against the ~170 G elements/s its memory feeds at 28 bytes an
   element: still memory-bound, with about 2x to spare. A GPU with 1/64-rate FP64 (RTX 4090: 2 double
   operations and 2 conversions a cycle per SM) needs ~9.5 SM-cycles an element, ~34 G elements/s over
   128 SMs, about what its 1 TB/s feeds (36 G): there Adam is at the FP64 limit, as torch's own kernel,
   which does the same double arithmetic. */

/* One parameter tensor as the Adam kernel walks it: the addresses of everything it reads and writes.
   max_exp_avg_sq is 0 without amsgrad (that is the switch). Chunks are tensor_table.h's
   (HL_CHUNK_ELEMS elements). */
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

/* The hyperparameters of one call (one param group on one device), as torch's CUDA kernel takes them.
   `lr` is used when the call has no lr tensor. */
typedef struct {
    double lr, beta1, beta2, eps, weight_decay;
    int decoupled; /* AdamW: decay the parameter, not the gradient */
    int maximize;
} hl_adam_hyper;

/* What one tensor's update needs from its step count and the learning rate. */
typedef struct {
    double beta1, one_minus_beta1, beta2, one_minus_beta2;
    double lr_decay; /* lr * weight_decay (decoupled decay) */
    double eps, weight_decay;
    float step_size; /* lr / (1 - beta1^t), the correction rounded to float first, as torch */
    float bc2_sqrt;  /* sqrt(1 - beta2^t) */
    int decoupled, maximize;
} hl_adam_scalars;

/* `lr` is the learning rate of this call (the hyper's, or the lr tensor's float as double); the bias
   corrections are taken in double from the step being taken (`steps_before` + 1). */
HL_OPT_FN hl_adam_scalars hl_adam_scalars_for(const hl_adam_hyper *h, double lr, float steps_before) {
    hl_adam_scalars s;
    const double t = (double)steps_before + 1.0;
    s.beta1 = h->beta1;
    s.one_minus_beta1 = 1.0 - h->beta1;
    s.beta2 = h->beta2;
    s.one_minus_beta2 = 1.0 - h->beta2;
    const float bc1 = (float)(1.0 - pow(h->beta1, t));
    s.step_size = (float)(lr / (double)bc1);
    s.bc2_sqrt = (float)sqrt(1.0 - pow(h->beta2, t));
    s.lr_decay = lr * h->weight_decay;
    s.eps = h->eps;
    s.weight_decay = h->weight_decay;
    s.decoupled = h->decoupled;
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
    if (s->weight_decay != 0.0) {
        if (s->decoupled)
            param = (float)HL_DSUB((double)param, HL_DMUL(s->lr_decay, (double)param));
        else
            g = (float)HL_DADD((double)g, HL_DMUL((double)param, s->weight_decay));
    }
    const double gd = (double)g;
    const float m1 = (float)HL_DADD(HL_DMUL(s->beta1, (double)*m), HL_DMUL(s->one_minus_beta1, gd));
    const float v1 = (float)HL_DADD(HL_DMUL(s->beta2, (double)*v), HL_DMUL(HL_DMUL(s->one_minus_beta2, gd), gd));
    float second = v1;
    if (vmax != NULL) {
        /* torch.maximum: a NaN wins */
        const float old = *vmax;
        second = (v1 > old || v1 != v1) ? v1 : old;
        *vmax = second;
    }
    const float denom = (float)HL_DADD((double)HL_DIV(HL_SQRT(second), s->bc2_sqrt), s->eps);
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

/* The hyperparameters of one SGD call, as torch's CUDA kernel takes them (double); `lr` is used when
   the call has no lr tensor. */
typedef struct {
    double lr, momentum, one_minus_dampening, weight_decay;
    int nesterov, maximize;
    int first_step; /* the momentum buffers hold nothing yet: they take the gradient as it is */
} hl_sgd_hyper;

/* One element of torch's SGD (the algorithm in torch.optim.SGD's documentation, with maximize
   negating the gradient first), the gradient divided by `grad_scale` on the way in and never
   stored. `buf` is NULL without momentum. As torch's CUDA kernel, the new buffer stays double for
   nesterov's g + momentum * buf (only its stored copy is rounded). */
HL_OPT_FN void hl_sgd_element(const hl_sgd_hyper *h, double lr, float g, float grad_scale, int has_scale, float *p,
                              float *buf) {
    if (has_scale)
        g = HL_DIV(g, grad_scale);
    if (h->maximize)
        g = -g;
    const float param = *p;
    if (h->weight_decay != 0.0)
        g = (float)HL_DADD((double)g, HL_DMUL(h->weight_decay, (double)param));
    if (buf != NULL) {
        const double b = h->first_step ? (double)g
                                       : HL_DADD(HL_DMUL(h->momentum, (double)*buf), HL_DMUL(h->one_minus_dampening, (double)g));
        *buf = (float)b;
        g = h->nesterov ? (float)HL_DADD((double)g, HL_DMUL(h->momentum, b)) : (float)b;
    }
    *p = (float)HL_DSUB((double)param, HL_DMUL(lr, (double)g));
}

#endif
