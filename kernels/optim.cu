/* Fused optimizer kernels over a table of float32, float16 and bfloat16 parameter tensors: Adam, AdamW and SGD with the unscale x clip factor and the skip folded in. */
#include "optim.h"
#include "dtype.cuh"
#include "table.cuh"

/* A block owns whole chunks (HL_CHUNK_ELEMS elements of one tensor), as kernels/amp.cu's passes do;
   the per-element maths is kernels/optim_math.h, shared with the C reference in csrc/optim_cpu.c, so the
   two do the same float operations. The grids are chosen in csrc/launch_optim.c, which launches the
   extern "C" entry points below with kernels/optim.h's block size. */

#define OPTIM_THREADS HL_OPTIM_THREADS

/* four gradient elements from 4 * sizeof(G) aligned bytes: one 16-, 8- load */
template <typename G> struct alignas(4 * sizeof(G)) grad4 {
    G v[4];
};

/* vector k of a gradient, a streaming load (each byte is read once: .cs keeps it from evicting the
   rest of L2), as kernels/amp.cu's passes load */
__device__ __forceinline__ grad4<float> load_grad4(const float *g, int k) {
    const float4 q = __ldcs(reinterpret_cast<const float4 *>(g) + k);
    return grad4<float>{{q.x, q.y, q.z, q.w}};
}

template <typename H> __device__ __forceinline__ grad4<H> load_grad4(const H *g, int k) {
    static_assert(sizeof(H) == 2, "half-width gradients");
    const uint2 q = __ldcs(reinterpret_cast<const uint2 *>(g) + k);
    grad4<H> out;
    memcpy(&out, &q, sizeof(out));
    return out;
}

/* The walk over one chunk [begin, end) of one tensor, shared by both optimizers: where every array
   of the tensor starts on a boundary of 4 of its elements (torch's allocations do; a view may not),
   each thread takes 4 elements at a time with one vector load per array, so every load of an iteration is in
   flight before the maths (the scalar loop waits on one 4-byte load at a time and falls far short of
   the copy rate); the rest, and unaligned tensors, one element at a time.
   f(g[4], k, count) updates elements k..k+count-1 of the other arrays (`states_aligned`: all of them
   start on such a boundary). */
template <typename G, typename F>
__device__ __forceinline__ void walk_chunk(const G *__restrict__ grad, bool states_aligned, int64_t begin, int64_t end,
                                           F f) {
    const int n = (int)(end - begin); /* at most HL_CHUNK_ELEMS */
    const G *g = grad + begin;
    const bool aligned = states_aligned && ((uintptr_t)g % (4 * sizeof(G))) == 0;
    const int nvec = aligned ? n / 4 : 0;
    for (int k = threadIdx.x; k < nvec; k += OPTIM_THREADS) {
        const grad4<G> raw = load_grad4(g, k);
        float gv[4];
#pragma unroll
        for (int j = 0; j < 4; j++)
            gv[j] = to_float(raw.v[j]);
        f(gv, begin + 4 * (int64_t)k, 4);
    }
    for (int i = 4 * nvec + threadIdx.x; i < n; i += OPTIM_THREADS) {
        float gv[4] = {to_float(g[i]), 0.0f, 0.0f, 0.0f};
        f(gv, begin + i, 1);
    }
}

__device__ inline bool aligned_to(const void *a, size_t bytes) { return ((uintptr_t)a % bytes) == 0; }

/* float to a stored element, rounded to nearest even (torch's static_cast from opmath to the dtype) */
template <typename P> __device__ inline P from_float(float x);
template <> __device__ inline float from_float<float>(float x) { return x; }
template <> __device__ inline hl_half from_float<hl_half>(float x) { return hl_float2half_rn(x); }
template <> __device__ inline hl_bfloat16 from_float<hl_bfloat16>(float x) { return hl_float2bfloat16_rn(x); }

/* elements [i, i + count) of a parameter or state array widened into registers (count 4: one 16- or
   8-byte access), and back, each rounded once */
__device__ __forceinline__ void load_state(const float *a, int64_t i, int count, float out[4]) {
    if (count == 4) {
        const float4 q = __ldcs(reinterpret_cast<const float4 *>(a + i));
        out[0] = q.x, out[1] = q.y, out[2] = q.z, out[3] = q.w;
    } else {
        out[0] = __ldcs(a + i);
    }
}

template <typename H> __device__ __forceinline__ void load_state(const H *a, int64_t i, int count, float out[4]) {
    static_assert(sizeof(H) == 2, "half-width states");
    if (count == 4) {
        const uint2 q = __ldcs(reinterpret_cast<const uint2 *>(a + i));
        H h[4];
        memcpy(h, &q, sizeof(q));
#pragma unroll
        for (int j = 0; j < 4; j++)
            out[j] = to_float(h[j]);
    } else {
        H h;
        const unsigned short bits = __ldcs(reinterpret_cast<const unsigned short *>(a + i));
        memcpy(&h, &bits, sizeof(h));
        out[0] = to_float(h);
    }
}

__device__ __forceinline__ void store_state(float *a, int64_t i, int count, const float in[4]) {
    if (count == 4)
        __stcs(reinterpret_cast<float4 *>(a + i), make_float4(in[0], in[1], in[2], in[3]));
    else
        __stcs(a + i, in[0]);
}

template <typename H> __device__ __forceinline__ void store_state(H *a, int64_t i, int count, const float in[4]) {
    if (count == 4) {
        H h[4];
#pragma unroll
        for (int j = 0; j < 4; j++)
            h[j] = from_float<H>(in[j]);
        uint2 q;
        memcpy(&q, h, sizeof(q));
        __stcs(reinterpret_cast<uint2 *>(a + i), q);
    } else {
        const H h = from_float<H>(in[0]);
        unsigned short bits;
        memcpy(&bits, &h, sizeof(bits));
        __stcs(reinterpret_cast<unsigned short *>(a + i), bits);
    }
}

/* One chunk of one Adam entry whose parameter and moments are P and gradient G: every value widened to
   float, hl_adam_element, every result rounded once to P on its store (torch's opmath arithmetic). */
template <typename P, typename G>
__device__ __forceinline__ void adam_chunk(const hl_adam_entry &e, const hl_adam_scalars &s, int64_t begin, int64_t end,
                                           float scale, int has_scale) {
    P *__restrict__ p = (P *)e.param, *__restrict__ m = (P *)e.exp_avg;
    P *__restrict__ v = (P *)e.exp_avg_sq, *__restrict__ vmax = (P *)e.max_exp_avg_sq;
    const size_t vec = 4 * sizeof(P);
    const bool states_aligned =
        aligned_to(p, vec) && aligned_to(m, vec) && aligned_to(v, vec) && (vmax == NULL || aligned_to(vmax, vec));
    const auto update = [&](const float g[4], int64_t i, int count) {
        float pp[4], mm[4], vv[4], xx[4];
        load_state(p, i, count, pp);
        load_state(m, i, count, mm);
        load_state(v, i, count, vv);
        if (vmax != NULL)
            load_state(vmax, i, count, xx);
#pragma unroll
        for (int j = 0; j < 4; j++)
            if (j < count)
                hl_adam_element(&s, g[j], scale, has_scale, pp + j, mm + j, vv + j, vmax != NULL ? xx + j : NULL);
        store_state(p, i, count, pp);
        store_state(m, i, count, mm);
        store_state(v, i, count, vv);
        if (vmax != NULL)
            store_state(vmax, i, count, xx);
    };
    walk_chunk((const G *)e.grad, states_aligned, begin, end, update);
}

extern "C" __global__ void __launch_bounds__(OPTIM_THREADS)
    hl_adam(const hl_adam_entry *table, int64_t count, int64_t total_chunks, hl_adam_hyper hyper, const float *lr_ptr,
            const float *grad_scale, const float *found_inf) {
    /* a skipped step reads no gradient and writes nothing: every block leaves at once */
    if (found_inf != NULL && *found_inf != 0.0f)
        return;
    const int has_scale = grad_scale != NULL;
    const float scale = has_scale ? *grad_scale : 1.0f;
    const double lr = lr_ptr != NULL ? (double)*lr_ptr : hyper.lr; /* read at run time: a graph replays it */
    int64_t scalars_of = -1; /* the first_chunk of the tensor s is for */
    hl_adam_scalars s;
    hl_for_each_chunk(table, count, total_chunks, [&](const hl_adam_entry &e, int64_t, int64_t begin, int64_t end) {
        if (scalars_of != e.first_chunk) { /* the bias corrections once per tensor per block (powf) */
            s = hl_adam_scalars_for(&hyper, lr, *(const float *)e.step);
            scalars_of = e.first_chunk;
        }
        /* the dtype pairs csrc/optim.c lets through: a half parameter's gradient has its dtype */
        if (e.param_dtype == HL_FLOAT16)
            adam_chunk<hl_half, hl_half>(e, s, begin, end, scale, has_scale);
        else if (e.param_dtype == HL_BFLOAT16)
            adam_chunk<hl_bfloat16, hl_bfloat16>(e, s, begin, end, scale, has_scale);
        else
            HL_WITH_DTYPE(e.grad_dtype, G, [&] { adam_chunk<float, G>(e, s, begin, end, scale, has_scale); });
    });
}

/* One chunk of one SGD entry, as adam_chunk */
template <typename P, typename G>
__device__ __forceinline__ void sgd_chunk(const hl_sgd_entry &e, const hl_sgd_hyper &hyper, double lr, int64_t begin,
                                          int64_t end, float scale, int has_scale) {
    P *__restrict__ p = (P *)e.param, *__restrict__ buf = (P *)e.momentum_buffer;
    const size_t vec = 4 * sizeof(P);
    const bool states_aligned = aligned_to(p, vec) && (buf == NULL || aligned_to(buf, vec));
    const auto update = [&](const float g[4], int64_t i, int count) {
        float pp[4], bb[4];
        load_state(p, i, count, pp);
        if (buf != NULL)
            load_state(buf, i, count, bb);
#pragma unroll
        for (int j = 0; j < 4; j++)
            if (j < count)
                hl_sgd_element(&hyper, lr, g[j], scale, has_scale, pp + j, buf != NULL ? bb + j : NULL);
        store_state(p, i, count, pp);
        if (buf != NULL)
            store_state(buf, i, count, bb);
    };
    walk_chunk((const G *)e.grad, states_aligned, begin, end, update);
}

extern "C" __global__ void __launch_bounds__(OPTIM_THREADS)
    hl_sgd(const hl_sgd_entry *table, int64_t count, int64_t total_chunks, hl_sgd_hyper hyper, const float *lr_ptr,
           const float *grad_scale, const float *found_inf) {
    if (found_inf != NULL && *found_inf != 0.0f)
        return; /* a skipped step reads no gradient and writes nothing */
    const int has_scale = grad_scale != NULL;
    const float scale = has_scale ? *grad_scale : 1.0f;
    const double lr = lr_ptr != NULL ? (double)*lr_ptr : hyper.lr;
    hl_for_each_chunk(table, count, total_chunks, [&](const hl_sgd_entry &e, int64_t, int64_t begin, int64_t end) {
        if (e.param_dtype == HL_FLOAT16)
            sgd_chunk<hl_half, hl_half>(e, hyper, lr, begin, end, scale, has_scale);
        else if (e.param_dtype == HL_BFLOAT16)
            sgd_chunk<hl_bfloat16, hl_bfloat16>(e, hyper, lr, begin, end, scale, has_scale);
        else
            HL_WITH_DTYPE(e.grad_dtype, G, [&] { sgd_chunk<float, G>(e, hyper, lr, begin, end, scale, has_scale); });
    });
}

/* after the update: every tensor's step count + 1, unless the step was skipped */
extern "C" __global__ void hl_adam_count(const hl_adam_entry *table, int64_t count, const float *found_inf) {
    if (found_inf != NULL && *found_inf != 0.0f)
        return;
    for (int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; t < count; t += (int64_t)gridDim.x * blockDim.x) {
        float *step = (float *)table[t].step;
        *step = *step + 1.0f;
    }
}
