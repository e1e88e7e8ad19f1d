/* Fused optimizer kernels over a table of parameter tensors: Adam, AdamW and SGD with the unscale x clip factor and the skip folded in. */
#include "optim.h"
#include "dtype.cuh"
#include "table.cuh"

/* A block owns whole chunks (HL_CHUNK_ELEMS elements of one tensor), as kernels/amp.cu's passes do;
   the per-element maths is kernels/optim_math.h, shared with the C reference in csrc/optim.c, so the
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
   of the tensor starts on a 16-byte boundary (torch's allocations do; a view may not), each thread
   takes 4 elements at a time with one vector load per array, so every load of an iteration is in
   flight before the maths (the scalar loop waits on one 4-byte load at a time and reached 44 % of
   the copy rate on an H200); the rest, and unaligned tensors, one element at a time.
   f(g[4], k, count) updates elements k..k+count-1 of the float arrays. */
template <typename G, typename F>
__device__ __forceinline__ void walk_chunk(const G *__restrict__ grad, bool floats_aligned, int64_t begin, int64_t end,
                                           F f) {
    const int n = (int)(end - begin); /* at most HL_CHUNK_ELEMS */
    const G *g = grad + begin;
    const bool aligned = floats_aligned && ((uintptr_t)g % (4 * sizeof(G))) == 0;
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

__device__ inline bool aligned16(const void *a) { return ((uintptr_t)a & 15) == 0; }

/* elements [i, i + count) of a float array into/out of registers: one 16-byte access for 4 */
__device__ __forceinline__ void load_floats(const float *a, int64_t i, int count, float out[4]) {
    if (count == 4) {
        const float4 q = __ldcs(reinterpret_cast<const float4 *>(a + i));
        out[0] = q.x, out[1] = q.y, out[2] = q.z, out[3] = q.w;
    } else {
        out[0] = __ldcs(a + i);
    }
}

__device__ __forceinline__ void store_floats(float *a, int64_t i, int count, const float in[4]) {
    if (count == 4)
        __stcs(reinterpret_cast<float4 *>(a + i), make_float4(in[0], in[1], in[2], in[3]));
    else
        __stcs(a + i, in[0]);
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
        float *__restrict__ p = (float *)e.param, *__restrict__ m = (float *)e.exp_avg;
        float *__restrict__ v = (float *)e.exp_avg_sq, *__restrict__ vmax = (float *)e.max_exp_avg_sq;
        const bool floats_aligned = aligned16(p) && aligned16(m) && aligned16(v) && (vmax == NULL || aligned16(vmax));
        /* defined outside HL_WITH_DTYPE: a #pragma inside a macro's argument is lost */
        const auto update = [&](const float g[4], int64_t i, int count) {
            float pp[4], mm[4], vv[4], xx[4];
            load_floats(p, i, count, pp);
            load_floats(m, i, count, mm);
            load_floats(v, i, count, vv);
            if (vmax != NULL)
                load_floats(vmax, i, count, xx);
#pragma unroll
            for (int j = 0; j < 4; j++)
                if (j < count)
                    hl_adam_element(&s, g[j], scale, has_scale, pp + j, mm + j, vv + j, vmax != NULL ? xx + j : NULL);
            store_floats(p, i, count, pp);
            store_floats(m, i, count, mm);
            store_floats(v, i, count, vv);
            if (vmax != NULL)
                store_floats(vmax, i, count, xx);
        };
        HL_WITH_DTYPE(e.grad_dtype, G, [&] { walk_chunk((const G *)e.grad, floats_aligned, begin, end, update); });
    });
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
        float *__restrict__ p = (float *)e.param, *__restrict__ buf = (float *)e.momentum_buffer;
        const bool floats_aligned = aligned16(p) && (buf == NULL || aligned16(buf));
        const auto update = [&](const float g[4], int64_t i, int count) { /* outside the macro, for its #pragma */
            float pp[4], bb[4];
            load_floats(p, i, count, pp);
            if (buf != NULL)
                load_floats(buf, i, count, bb);
#pragma unroll
            for (int j = 0; j < 4; j++)
                if (j < count)
                    hl_sgd_element(&hyper, lr, g[j], scale, has_scale, pp + j, buf != NULL ? bb + j : NULL);
            store_floats(p, i, count, pp);
            if (buf != NULL)
                store_floats(buf, i, count, bb);
        };
        HL_WITH_DTYPE(e.grad_dtype, G, [&] { walk_chunk((const G *)e.grad, floats_aligned, begin, end, update); });
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
