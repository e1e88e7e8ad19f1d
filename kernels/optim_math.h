/* The fused optimizers' per-element maths, one copy for kernels/optim.cu (device) and csrc/optim_cpu.c (C reference). */
#ifndef HOTLOOP_OPTIM_MATH_H
#define HOTLOOP_OPTIM_MATH_H

#include "rtc_prelude.h"

#ifdef __CUDACC__
#define HL_OPT_FN static inline __host__ __device__
#else
#define HL_OPT_FN static inline
#endif

/* Every operation is named and rounded once: on the device the _rn intrinsics, which nvcc never
   contracts into an fma (so the 4-wide walk of kernels/optim.cu and the one-element tail do the same
   arithmetic however they are inlined and scheduled), and on the host plain C (the C part builds with
   -std=c11, so no contraction either; x86-64 floats are SSE, no extended precision) and C99's fmaf,
   which rounds once as the device's fma does. The C reference and the kernel then do the same
   arithmetic, step for step; only powf (the bias corrections) may differ in its last bit between
   CUDA's and glibc's. */
#ifdef __CUDA_ARCH__
#define HL_ADD(a, b) __fadd_rn((a), (b))
#define HL_SUB(a, b) __fsub_rn((a), (b))
#define HL_MUL(a, b) __fmul_rn((a), (b))
#define HL_DIV(a, b) __fdiv_rn((a), (b))
#define HL_SQRT(a) __fsqrt_rn(a)
#define HL_FMA(a, b, c) __fmaf_rn((a), (b), (c))
#else
#define HL_ADD(a, b) ((a) + (b))
#define HL_SUB(a, b) ((a) - (b))
#define HL_MUL(a, b) ((a) * (b))
#define HL_DIV(a, b) ((a) / (b))
#define HL_SQRT(a) sqrtf(a)
#define HL_FMA(a, b, c) fmaf((a), (b), (c))
#endif

/* The arithmetic is torch 2.11's CUDA fused kernels' (aten/src/ATen/native/cuda/fused_adam_utils.cuh
   and FusedSgdKernel.cu): they take lr, the betas, weight_decay, eps, momentum and dampening as double
   but cast them to float (the opmath type of float32 parameters) before any element is touched, a
   tensor lr is read as its float, and every operation is float. Where torch writes a*b + c, or a - b*c,
   nvcc (default -fmad=true) makes one fma of it; those are HL_FMA here, each noted. The moments are
   torch's explicit fmas: m' = fma(b1, m, fma(-b1, g, g)), v' = fma(b2, v, fma(-b2, g*g, g*g)).
   (The earlier double-mixed arithmetic, torch's before it moved to float, puts exp_avg_sq beyond the
   derived bound with beta2 = 0.999, as a float32 beta2 does.)
   Cost: about 12 float operations an element, far under what the memory feeds. */

/* One parameter tensor as the Adam kernel walks it: the addresses of everything it reads and writes.
   max_exp_avg_sq is 0 without amsgrad (that is the switch). Chunks are tensor_table.h's
   (HL_CHUNK_ELEMS elements). The moments have the parameter's dtype, as torch's fused Adam keeps them;
   a float16 or bfloat16 parameter has a gradient of its own dtype, a float32 one any of the three.
   Every element is widened to float, updated in float and rounded once when stored (torch's opmath). */
typedef struct {
    uint64_t param;          /* float32, float16 or bfloat16 (param_dtype), updated in place */
    uint64_t grad;           /* float32, float16 or bfloat16 (grad_dtype), only read */
    uint64_t exp_avg;        /* param_dtype */
    uint64_t exp_avg_sq;     /* param_dtype */
    uint64_t max_exp_avg_sq; /* param_dtype, or 0 */
    uint64_t step;           /* one float32: steps taken before this one */
    int64_t numel;
    int64_t first_chunk;
    int32_t grad_dtype;  /* enum hl_dtype */
    int32_t param_dtype; /* enum hl_dtype: of the parameter and its moments */
} hl_adam_entry;

/* The hyperparameters of one call (one param group on one device), as torch's CUDA kernel takes them.
   `lr` is used when the call has no lr tensor. */
typedef struct {
    double lr, beta1, beta2, eps, weight_decay;
    int decoupled; /* AdamW: decay the parameter, not the gradient */
    int maximize;
} hl_adam_hyper;

/* What one tensor's update needs from its step count and the learning rate, all float as torch's. */
typedef struct {
    float lr, beta1, beta2, eps, weight_decay;
    float lr_decay;  /* lr * weight_decay, rounded (AdamW's decay) */
    float step_size; /* lr / (1 - beta1^t) */
    float bc2_sqrt;  /* sqrt(1 - beta2^t) */
    int decoupled, maximize;
} hl_adam_scalars;

/* `lr` is the learning rate of this call (the hyper's, or the lr tensor's float); the bias corrections
   are taken in float from the step being taken (`steps_before` + 1, exact below 2**24), with powf as
   torch's pow_ of two floats. */
HL_OPT_FN hl_adam_scalars hl_adam_scalars_for(const hl_adam_hyper *h, double lr, float steps_before) {
    hl_adam_scalars s;
    const float t = HL_ADD(steps_before, 1.0f);
    s.lr = (float)lr;
    s.beta1 = (float)h->beta1;
    s.beta2 = (float)h->beta2;
    s.eps = (float)h->eps;
    s.weight_decay = (float)h->weight_decay;
    const float bc1 = HL_SUB(1.0f, powf(s.beta1, t));
    s.step_size = HL_DIV(s.lr, bc1);
    s.bc2_sqrt = HL_SQRT(HL_SUB(1.0f, powf(s.beta2, t)));
    s.lr_decay = HL_MUL(s.lr, s.weight_decay);
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
    if (s->weight_decay != 0.0f) {
        if (s->decoupled)
            param = HL_FMA(-s->lr_decay, param, param); /* torch: param -= lr * weight_decay * param */
        else
            g = HL_FMA(param, s->weight_decay, g); /* torch: grad += param * weight_decay */
    }
    const float m1 = HL_FMA(s->beta1, *m, HL_FMA(-s->beta1, g, g));
    const float gg = HL_MUL(g, g);
    const float v1 = HL_FMA(s->beta2, *v, HL_FMA(-s->beta2, gg, gg));
    float second = v1;
    if (vmax != NULL) {
        /* std::max(old, new): the old one unless the new one is larger (a NaN never is) */
        const float old = *vmax;
        second = old < v1 ? v1 : old;
        *vmax = second;
    }
    const float denom = HL_ADD(HL_DIV(HL_SQRT(second), s->bc2_sqrt), s->eps);
    *p = HL_SUB(param, HL_DIV(HL_MUL(s->step_size, m1), denom));
    *m = m1;
    *v = v1;
}

/* One parameter tensor as the SGD kernel walks it; momentum_buffer is 0 without momentum. Dtypes as
   hl_adam_entry's: the buffer has the parameter's. */
typedef struct {
    uint64_t param;           /* float32, float16 or bfloat16 (param_dtype), updated in place */
    uint64_t grad;            /* float32, float16 or bfloat16 (grad_dtype), only read */
    uint64_t momentum_buffer; /* param_dtype, or 0 */
    int64_t numel;
    int64_t first_chunk;
    int32_t grad_dtype;  /* enum hl_dtype */
    int32_t param_dtype; /* enum hl_dtype: of the parameter and its buffer */
} hl_sgd_entry;

/* The hyperparameters of one SGD call, as torch's CUDA kernel takes them (double; it rounds them to
   float, as hl_sgd_element does; one_minus_dampening is already float 1 - dampening); `lr` is used when
   the call has no lr tensor. */
typedef struct {
    double lr, momentum, one_minus_dampening, weight_decay;
    int nesterov, maximize;
    int first_step; /* the momentum buffers hold nothing yet: they take the gradient as it is */
} hl_sgd_hyper;

/* One element of torch's SGD (the algorithm in torch.optim.SGD's documentation, with maximize
   negating the gradient first), the gradient divided by `grad_scale` on the way in and never stored;
   `buf` is NULL without momentum. All float, as torch's kernel: lr, momentum, weight_decay and
   (1 - dampening) rounded to float. Which of torch's a*b + c nvcc fuses: g + wd * p, g + momentum * buf
   (nesterov) and p - lr * g become fmas; momentum * buf + (1 - dampening) * g becomes
   fma(1 - dampening, g, momentum * buf): that form matches torch's buffer element for element where
   the unfused one does not (tests/optim/test_sgd.py checks it on every GPU run).
   p - lr * g is an fma here as in torch's kernel, but for one path of torch's own: with a grad_scale, its
   vectorized loop rounds the product first in three lanes of four (test_sgd.rounded_one_way_by_torch). */
HL_OPT_FN void hl_sgd_element(const hl_sgd_hyper *h, double lr, float g, float grad_scale, int has_scale, float *p,
                              float *buf) {
    if (has_scale)
        g = HL_DIV(g, grad_scale);
    if (h->maximize)
        g = -g;
    const float param = *p;
    const float wd = (float)h->weight_decay, momentum = (float)h->momentum;
    if (wd != 0.0f)
        g = HL_FMA(wd, param, g);
    if (buf != NULL) {
        const float b = h->first_step ? g
                                      : HL_FMA((float)h->one_minus_dampening, g, HL_MUL(momentum, *buf));
        *buf = b;
        g = h->nesterov ? HL_FMA(momentum, b, g) : b;
    }
    *p = HL_FMA(-(float)lr, g, param);
}

#endif
