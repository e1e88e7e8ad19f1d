/* Mixed-precision kernels over a tensor table: the non-finite check and the GradScaler's check, epilogue, apply and update. */
#include "amp.h"
#include "table.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <limits.h>
#include <math.h>

#define THREADS 256

/* inf or NaN: every exponent bit set, read straight from the bits so any float width works */
__device__ inline bool non_finite_bits(uint32_t bits, int dtype) {
    switch (dtype) {
    case HL_FLOAT32:
        return (bits & 0x7f800000u) == 0x7f800000u;
    case HL_FLOAT16:
        return (bits & 0x7c00u) == 0x7c00u;
    default: /* HL_BFLOAT16 */
        return (bits & 0x7f80u) == 0x7f80u;
    }
}

/* 16 bytes (4 float32 or 8 half-width values) at once */
__device__ inline bool non_finite_vec(uint4 v, int dtype) {
    uint32_t w[4] = {v.x, v.y, v.z, v.w};
    bool bad = false;
#pragma unroll
    for (int k = 0; k < 4; k++) {
        if (dtype == HL_FLOAT32)
            bad |= non_finite_bits(w[k], dtype);
        else
            bad |= non_finite_bits(w[k] & 0xffffu, dtype) | non_finite_bits(w[k] >> 16, dtype);
    }
    return bad;
}

__device__ inline uint32_t element_bits(const char *base, int64_t i, int dtype) {
    if (dtype == HL_FLOAT32)
        return ((const uint32_t *)base)[i];
    return ((const uint16_t *)base)[i];
}

/* does chunk [begin, end) of one tensor hold an inf or NaN? (this thread's share of it) */
__device__ bool chunk_has_non_finite(const hl_table_entry &e, int64_t begin, int64_t end) {
    const char *base = (const char *)e.data;
    const int elem = e.dtype == HL_FLOAT32 ? 4 : 2;
    const int per_vec = 16 / elem;
    bool bad = false;
    int64_t i = begin;
    if (((uintptr_t)base & 15) == 0) {
        /* chunks start at multiples of HL_CHUNK_ELEMS, so an aligned tensor gives aligned chunks;
           four independent 16-byte loads in flight per thread keep the memory system busy */
        const uint4 *vec = (const uint4 *)(base + begin * elem);
        const int64_t nvec = (end - begin) / per_vec;
        for (int64_t v0 = threadIdx.x; v0 < nvec; v0 += 4 * (int64_t)blockDim.x) {
            uint4 raw[4];
#pragma unroll
            for (int k = 0; k < 4; k++) {
                int64_t v = v0 + (int64_t)k * blockDim.x;
                if (v < nvec)
                    raw[k] = __ldcs(vec + v);
            }
#pragma unroll
            for (int k = 0; k < 4; k++)
                if (v0 + (int64_t)k * blockDim.x < nvec)
                    bad |= non_finite_vec(raw[k], e.dtype);
        }
        i = begin + nvec * per_vec;
    }
    for (int64_t j = i + threadIdx.x; j < end; j += blockDim.x)
        bad |= non_finite_bits(element_bits(base, j, e.dtype), e.dtype);
    return bad;
}

__global__ void non_finite_check_kernel(const hl_table_entry *table, int64_t count, int64_t total_chunks,
                                        float *found) {
    bool bad = false;
    for (int64_t chunk = blockIdx.x; chunk < total_chunks; chunk += gridDim.x) {
        hl_table_entry e = table[hl_entry_of_chunk(table, count, chunk)];
        int64_t begin, end;
        hl_chunk_range(e, chunk, &begin, &end);
        bad |= chunk_has_non_finite(e, begin, end);
    }
    /* every writer writes the same 1.0, so a plain racing store is enough */
    if (__syncthreads_or(bad) && threadIdx.x == 0)
        *found = 1.0f;
}

extern "C" cudaError_t hl_launch_non_finite_check(const hl_table_entry *table, int64_t count, int64_t total_chunks,
                                                  float *found, int device, cudaStream_t stream) {
    if (total_chunks == 0)
        return cudaSuccess;
    int grid = hl_grid_for_chunks(total_chunks, device, 8);
    non_finite_check_kernel<<<grid, THREADS, 0, stream>>>(table, count, total_chunks, found);
    return cudaGetLastError();
}

/* ---------------------------------------------------------------------------------------------
   GradScaler kernels. A block of AMP_THREADS owns whole chunks (HL_CHUNK_ELEMS elements, a fixed
   cut of each tensor), so the partial result of a chunk does not depend on the grid: the check
   writes one partial per chunk and the epilogue adds them in chunk order. Same inputs, same bits.
   --------------------------------------------------------------------------------------------- */

#define AMP_THREADS 512
#define AMP_WARPS (AMP_THREADS / 32)
#define AMP_UNROLL 8 /* 16-byte loads in flight per thread */
#define EPILOGUE_THREADS 1024

__device__ inline float to_float(float x) { return x; }
__device__ inline float to_float(__half x) { return __half2float(x); }
__device__ inline float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ inline T from_float(float v);
template <> __device__ inline float from_float<float>(float v) { return v; }
template <> __device__ inline __half from_float<__half>(float v) { return __float2half_rn(v); }
template <> __device__ inline __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

/* a value as the gradient's dtype would hold it: what torch's unscale_ leaves in a half gradient */
template <typename T> __device__ inline float round_to(float v) { return to_float(from_float<T>(v)); }

/* 16 bytes of gradient: 4 float32 or 8 half-width values */
template <typename T> struct alignas(16) vec16 {
    T v[16 / sizeof(T)];
};

/* the norm partial of one value, by mode; double so a 32768-element chunk adds up exactly enough */
template <int MODE> __device__ inline void accumulate(double &acc, float u, float p) {
    if (MODE == HL_NORM_L2) {
        acc = fma((double)u, (double)u, acc);
    } else if (MODE == HL_NORM_INF) {
        double a = fabs((double)u);
        acc = (a > acc || a != a) ? a : acc; /* NaN wins and stays, as torch's inf-norm */
    } else if (MODE == HL_NORM_P) {
        acc += (double)powf(fabsf(u), p);
    }
}

template <int MODE> __device__ inline double combine(double a, double b) {
    if (MODE == HL_NORM_INF)
        return (b > a || b != b) ? b : a;
    return a + b;
}

/* the value after unscaling, rounded to the gradient's dtype; checked and counted in the norm */
template <typename T, int MODE, bool WRITE>
__device__ inline T check_value(T x, float inv, float p, double &acc, bool &bad) {
    float u = round_to<T>(to_float(x) * inv);
    bad |= !isfinite(u); /* inf/NaN, or a half that overflows only once unscaled */
    accumulate<MODE>(acc, u, p);
    return WRITE ? from_float<T>(u) : x;
}

/* this thread's share of chunk [begin, end) of one tensor */
template <typename T, int MODE, bool WRITE>
__device__ void check_chunk(const hl_table_entry &e, int64_t begin, int64_t end, float inv, float p, double &acc,
                            bool &bad) {
    constexpr int PER = 16 / sizeof(T);
    T *base = (T *)e.data;
    int64_t i = begin;
    if (((uintptr_t)base & 15) == 0) {
        /* chunks start at multiples of HL_CHUNK_ELEMS, so an aligned tensor gives aligned chunks */
        uint4 *vec = (uint4 *)(base + begin);
        const int64_t nvec = (end - begin) / PER;
        for (int64_t v0 = threadIdx.x; v0 < nvec; v0 += (int64_t)AMP_UNROLL * AMP_THREADS) {
            uint4 raw[AMP_UNROLL];
#pragma unroll
            for (int k = 0; k < AMP_UNROLL; k++) {
                int64_t v = v0 + (int64_t)k * AMP_THREADS;
                if (v < nvec)
                    raw[k] = WRITE ? vec[v] : __ldcs(vec + v); /* read once: keep it out of the caches */
            }
#pragma unroll
            for (int k = 0; k < AMP_UNROLL; k++) {
                int64_t v = v0 + (int64_t)k * AMP_THREADS;
                if (v < nvec) {
                    vec16<T> x = *reinterpret_cast<vec16<T> *>(&raw[k]);
#pragma unroll
                    for (int j = 0; j < PER; j++)
                        x.v[j] = check_value<T, MODE, WRITE>(x.v[j], inv, p, acc, bad);
                    if (WRITE)
                        vec[v] = *reinterpret_cast<uint4 *>(&x);
                }
            }
        }
        i = begin + nvec * PER;
    }
    for (int64_t j = i + threadIdx.x; j < end; j += AMP_THREADS) { /* unaligned tensors and tails */
        T y = check_value<T, MODE, WRITE>(base[j], inv, p, acc, bad);
        if (WRITE)
            base[j] = y;
    }
}

/* the block's partial for one chunk, reduced in a fixed tree, written by thread 0 */
template <int MODE> __device__ void finish_chunk(double acc, bool bad, float2 *out) {
    __shared__ double warp_acc[AMP_WARPS];
    __shared__ int warp_bad[AMP_WARPS];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        acc = combine<MODE>(acc, __shfl_xor_sync(0xffffffffu, acc, o));
    int any = __any_sync(0xffffffffu, bad);
    if (lane == 0) {
        warp_acc[warp] = acc;
        warp_bad[warp] = any;
    }
    __syncthreads();
    if (warp == 0) {
        acc = lane < AMP_WARPS ? warp_acc[lane] : 0.0;
        any = lane < AMP_WARPS ? warp_bad[lane] : 0;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1)
            acc = combine<MODE>(acc, __shfl_xor_sync(0xffffffffu, acc, o));
        any = __any_sync(0xffffffffu, any);
        if (lane == 0 && out != NULL)
            *out = make_float2((float)acc, any ? 1.0f : 0.0f);
    }
    __syncthreads(); /* the shared slots are reused by the next chunk */
}

/* one pass over the table: block b owns the contiguous chunk range [b*C/G, (b+1)*C/G) */
template <int MODE, bool WRITE>
__global__ void __launch_bounds__(AMP_THREADS, 2)
    amp_check_kernel(const hl_table_entry *table, int64_t count, int64_t total_chunks, float2 *partials,
                     const float *scale, float p) {
    /* FP32 division can be imprecise for some compile options, so the reciprocal is taken in FP64
       (as torch's unscale_ does) */
    const float inv = scale != NULL ? (float)(1.0 / (double)*scale) : 1.0f;
    const int64_t first = (int64_t)blockIdx.x * total_chunks / gridDim.x;
    const int64_t last = ((int64_t)blockIdx.x + 1) * total_chunks / gridDim.x;
    if (first >= last)
        return;
    int64_t t = hl_entry_of_chunk(table, count, first);
    for (int64_t chunk = first; chunk < last; chunk++) {
        while (t + 1 < count && table[t + 1].first_chunk <= chunk)
            t++;
        const hl_table_entry e = table[t];
        int64_t begin, end;
        hl_chunk_range(e, chunk, &begin, &end);
        double acc = 0.0;
        bool bad = false;
        switch (e.dtype) {
        case HL_FLOAT32:
            check_chunk<float, MODE, WRITE>(e, begin, end, inv, p, acc, bad);
            break;
        case HL_FLOAT16:
            check_chunk<__half, MODE, WRITE>(e, begin, end, inv, p, acc, bad);
            break;
        default:
            check_chunk<__nv_bfloat16, MODE, WRITE>(e, begin, end, inv, p, acc, bad);
            break;
        }
        finish_chunk<MODE>(acc, bad, partials ? (float2 *)partials + chunk : NULL);
    }
}

/* one block: partials in chunk order -> norm, clip coefficient, factors, found flag, report */
__global__ void __launch_bounds__(EPILOGUE_THREADS)
    amp_epilogue_kernel(const float2 *partials, int64_t total_chunks, int mode, float p, float max_norm,
                        const float *scale, float *aux, const hl_table_entry *table, int64_t count,
                        const int32_t *param_index, int64_t *report, int64_t step) {
    __shared__ double s_acc[EPILOGUE_THREADS / 32];
    __shared__ long long s_bad[EPILOGUE_THREADS / 32];
    const bool is_max = mode == HL_NORM_INF;
    double acc = 0.0;
    long long first_bad = LLONG_MAX;
    /* thread t adds chunks t, t+T, t+2T, ... in that order, then a fixed tree: deterministic */
#pragma unroll 4
    for (int64_t c = threadIdx.x; c < total_chunks; c += EPILOGUE_THREADS) {
        float2 pr = partials[c];
        double v = pr.x;
        acc = is_max ? ((v > acc || v != v) ? v : acc) : acc + v;
        if (pr.y != 0.0f && c < first_bad)
            first_bad = c;
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int o = 16; o > 0; o >>= 1) {
        double other = __shfl_xor_sync(0xffffffffu, acc, o);
        acc = is_max ? ((other > acc || other != other) ? other : acc) : acc + other;
        long long b = __shfl_xor_sync(0xffffffffu, first_bad, o);
        first_bad = b < first_bad ? b : first_bad;
    }
    if (lane == 0) {
        s_acc[warp] = acc;
        s_bad[warp] = first_bad;
    }
    __syncthreads();
    if (warp != 0)
        return;
    acc = s_acc[lane];
    first_bad = s_bad[lane];
    for (int o = 16; o > 0; o >>= 1) {
        double other = __shfl_xor_sync(0xffffffffu, acc, o);
        acc = is_max ? ((other > acc || other != other) ? other : acc) : acc + other;
        long long b = __shfl_xor_sync(0xffffffffu, first_bad, o);
        first_bad = b < first_bad ? b : first_bad;
    }
    if (lane != 0)
        return;

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
    const bool found = first_bad != LLONG_MAX;
    aux[HL_AUX_FOUND] = found ? 1.0f : 0.0f;
    aux[HL_AUX_NORM] = norm;
    aux[HL_AUX_CLIP] = coef;
    aux[HL_AUX_INV_SCALE] = scale != NULL ? (float)(1.0 / (double)s) : 1.0f;
    aux[HL_AUX_GRAD_SCALE] = s / coef;
    if (found && report != NULL) {
        int64_t entry = hl_entry_of_chunk(table, count, first_bad);
        report[HL_REPORT_PARAM] = param_index != NULL ? param_index[entry] : entry;
        report[HL_REPORT_STEP] = step;
        report[HL_REPORT_COUNT] += 1;
    }
}

extern "C" cudaError_t hl_launch_amp_check(const hl_table_entry *table, int64_t count, int64_t total_chunks,
                                           float *partials, const float *scale, int write, int mode, float p,
                                           float max_norm, float *aux, const int32_t *param_index, int64_t *report,
                                           int64_t step, int blocks, int device, cudaStream_t stream) {
    if (total_chunks > 0) {
        int grid = blocks > 0 ? blocks : hl_grid_for_chunks(total_chunks, device, 2);
        float2 *out = (float2 *)partials;
        if (write) {
            amp_check_kernel<HL_NORM_NONE, true><<<grid, AMP_THREADS, 0, stream>>>(table, count, total_chunks, out,
                                                                                  scale, p);
        } else {
            switch (mode) {
            case HL_NORM_L2:
                amp_check_kernel<HL_NORM_L2, false><<<grid, AMP_THREADS, 0, stream>>>(table, count, total_chunks,
                                                                                     out, scale, p);
                break;
            case HL_NORM_INF:
                amp_check_kernel<HL_NORM_INF, false><<<grid, AMP_THREADS, 0, stream>>>(table, count, total_chunks,
                                                                                      out, scale, p);
                break;
            case HL_NORM_P:
                amp_check_kernel<HL_NORM_P, false><<<grid, AMP_THREADS, 0, stream>>>(table, count, total_chunks,
                                                                                    out, scale, p);
                break;
            default:
                amp_check_kernel<HL_NORM_NONE, false><<<grid, AMP_THREADS, 0, stream>>>(table, count, total_chunks,
                                                                                       out, scale, p);
                break;
            }
        }
        cudaError_t err = cudaGetLastError();
        if (err != cudaSuccess)
            return err;
    }
    amp_epilogue_kernel<<<1, EPILOGUE_THREADS, 0, stream>>>((const float2 *)partials, total_chunks, mode, p,
                                                            max_norm, scale, aux, table, count, param_index,
                                                            report, step);
    return cudaGetLastError();
}

/* ---- apply: one read-write pass with the factors the epilogue computed ---- */

template <typename T, bool UNSCALE, bool CLIP> __device__ inline T apply_value(T x, float inv, float coef) {
    float u = to_float(x);
    if (UNSCALE)
        u = round_to<T>(u * inv);
    if (CLIP)
        u = round_to<T>(u * coef);
    return from_float<T>(u);
}

template <typename T, bool UNSCALE, bool CLIP>
__device__ void apply_chunk(const hl_table_entry &e, int64_t begin, int64_t end, float inv, float coef) {
    constexpr int PER = 16 / sizeof(T);
    T *base = (T *)e.data;
    int64_t i = begin;
    if (((uintptr_t)base & 15) == 0) {
        uint4 *vec = (uint4 *)(base + begin);
        const int64_t nvec = (end - begin) / PER;
        for (int64_t v0 = threadIdx.x; v0 < nvec; v0 += (int64_t)AMP_UNROLL * AMP_THREADS) {
            uint4 raw[AMP_UNROLL];
#pragma unroll
            for (int k = 0; k < AMP_UNROLL; k++) {
                int64_t v = v0 + (int64_t)k * AMP_THREADS;
                if (v < nvec)
                    raw[k] = vec[v];
            }
#pragma unroll
            for (int k = 0; k < AMP_UNROLL; k++) {
                int64_t v = v0 + (int64_t)k * AMP_THREADS;
                if (v < nvec) {
                    vec16<T> x = *reinterpret_cast<vec16<T> *>(&raw[k]);
#pragma unroll
                    for (int j = 0; j < PER; j++)
                        x.v[j] = apply_value<T, UNSCALE, CLIP>(x.v[j], inv, coef);
                    __stcs(vec + v, *reinterpret_cast<uint4 *>(&x));
                }
            }
        }
        i = begin + nvec * PER;
    }
    for (int64_t j = i + threadIdx.x; j < end; j += AMP_THREADS)
        base[j] = apply_value<T, UNSCALE, CLIP>(base[j], inv, coef);
}

template <bool UNSCALE, bool CLIP>
__global__ void __launch_bounds__(AMP_THREADS, 2)
    amp_apply_kernel(const hl_table_entry *table, int64_t count, int64_t total_chunks, const float *aux) {
    if (aux[HL_AUX_FOUND] != 0.0f)
        return; /* a skipped step: leave every gradient as it is */
    const float inv = aux[HL_AUX_INV_SCALE], coef = aux[HL_AUX_CLIP];
    const int64_t first = (int64_t)blockIdx.x * total_chunks / gridDim.x;
    const int64_t last = ((int64_t)blockIdx.x + 1) * total_chunks / gridDim.x;
    if (first >= last)
        return;
    int64_t t = hl_entry_of_chunk(table, count, first);
    for (int64_t chunk = first; chunk < last; chunk++) {
        while (t + 1 < count && table[t + 1].first_chunk <= chunk)
            t++;
        const hl_table_entry e = table[t];
        int64_t begin, end;
        hl_chunk_range(e, chunk, &begin, &end);
        switch (e.dtype) {
        case HL_FLOAT32:
            apply_chunk<float, UNSCALE, CLIP>(e, begin, end, inv, coef);
            break;
        case HL_FLOAT16:
            apply_chunk<__half, UNSCALE, CLIP>(e, begin, end, inv, coef);
            break;
        default:
            apply_chunk<__nv_bfloat16, UNSCALE, CLIP>(e, begin, end, inv, coef);
            break;
        }
    }
}

extern "C" cudaError_t hl_launch_amp_apply(const hl_table_entry *table, int64_t count, int64_t total_chunks,
                                           const float *aux, int unscale, int clip, int device, cudaStream_t stream) {
    if (total_chunks == 0 || (!unscale && !clip))
        return cudaSuccess;
    int grid = hl_grid_for_chunks(total_chunks, device, 2);
    if (unscale && clip)
        amp_apply_kernel<true, true><<<grid, AMP_THREADS, 0, stream>>>(table, count, total_chunks, aux);
    else if (unscale)
        amp_apply_kernel<true, false><<<grid, AMP_THREADS, 0, stream>>>(table, count, total_chunks, aux);
    else
        amp_apply_kernel<false, true><<<grid, AMP_THREADS, 0, stream>>>(table, count, total_chunks, aux);
    return cudaGetLastError();
}

/* ---- update: the scale's next value, on the device ---- */

__global__ void amp_update_kernel(float *scale, int32_t *growth_tracker, int64_t *state, hl_found_list found,
                                  double growth_factor, double backoff_factor, int64_t growth_interval,
                                  int64_t hysteresis, float min_scale, float max_scale, int adjust) {
    float any = 0.0f;
    for (int i = 0; i < found.count; i++)
        any += *found.ptr[i];
    if (any != 0.0f)
        state[HL_STATE_SKIPPED] += 1;
    if (!adjust)
        return;
    /* torch._amp_update_scale_, with hysteresis (backoff once `hysteresis` overflows were seen since
       the last growth) and min/max bounds; hysteresis 1 and no bounds give torch's numbers */
    if (any != 0.0f) {
        int64_t left = state[HL_STATE_HYSTERESIS] - 1;
        state[HL_STATE_HYSTERESIS] = left > 0 ? left : 0;
        if (left <= 0)
            *scale = fmaxf((float)((*scale) * backoff_factor), min_scale);
        *growth_tracker = 0;
    } else {
        int64_t successful = (int64_t)(*growth_tracker) + 1;
        if (successful == growth_interval) {
            float grown = (float)((*scale) * growth_factor);
            if (isfinite(grown)) /* do not grow past float32's range */
                *scale = fminf(grown, max_scale);
            *growth_tracker = 0;
            state[HL_STATE_HYSTERESIS] = hysteresis;
        } else {
            *growth_tracker = (int32_t)successful;
        }
    }
}

extern "C" cudaError_t hl_launch_amp_update(float *scale, int32_t *growth_tracker, int64_t *state,
                                            const hl_found_list *found, double growth_factor, double backoff_factor,
                                            int64_t growth_interval, int64_t hysteresis, float min_scale,
                                            float max_scale, int adjust, cudaStream_t stream) {
    amp_update_kernel<<<1, 1, 0, stream>>>(scale, growth_tracker, state, *found, growth_factor, backoff_factor,
                                           growth_interval, hysteresis, min_scale, max_scale, adjust);
    return cudaGetLastError();
}
