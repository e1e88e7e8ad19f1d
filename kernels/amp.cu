/* Mixed-precision kernels over a tensor table: the non-finite check and the GradScaler's check, epilogue, apply and update. */
#include "amp.h"
#include "amp_math.h"
#include "dtype.cuh"
#include "table.cuh"

/* ---------------------------------------------------------------------------------------------
   Kernels over a tensor table. A block of AMP_THREADS owns whole chunks (HL_CHUNK_ELEMS elements, a fixed
   cut of each tensor), so the partial result of a chunk does not depend on the grid: the check
   writes one partial per chunk and the epilogue adds them in chunk order. Same inputs, same bits.
   The scalar maths (norm terms, epilogue, scale update) is kernels/amp_math.h, shared with the C
   reference in csrc/amp.c. The grids are chosen in csrc/launch_amp.c, which launches the extern "C"
   entry points below with the block sizes of kernels/amp.h.
   --------------------------------------------------------------------------------------------- */

#define AMP_THREADS HL_AMP_THREADS
#define AMP_UNROLL 8 /* 16-byte loads in flight per thread */
#define EPILOGUE_THREADS HL_AMP_EPILOGUE_THREADS

template <typename T> __device__ inline T from_float(float v);
template <> __device__ inline float from_float<float>(float v) { return v; }
template <> __device__ inline hl_half from_float<hl_half>(float v) { return hl_float2half_rn(v); }
template <> __device__ inline hl_bfloat16 from_float<hl_bfloat16>(float v) { return hl_float2bfloat16_rn(v); }

/* a value as the gradient's dtype would hold it: what torch's unscale_ leaves in a half gradient */
template <typename T> __device__ inline float round_to(float v) { return to_float(from_float<T>(v)); }

/* 16 bytes of gradient: 4 float32 or 8 half-width values */
template <typename T> struct alignas(16) vec16 {
    T v[16 / sizeof(T)];
};

/* x = f(x) for this thread's share of chunk [begin, end) of one tensor: 16-byte vectors with
   AMP_UNROLL loads in flight, and single elements before the first 16-byte boundary (a view at an
   odd offset, such as a gradient inside a DDP bucket) and after the last. With STORE the results
   are written back; without, the pass only reads (streaming loads). */
template <typename T, bool STORE, typename F>
__device__ __forceinline__ void map_chunk(const hl_table_entry &e, int64_t begin, int64_t end, F f) {
    constexpr int PER = 16 / sizeof(T);
    T *x = (T *)e.data + begin;
    const int n = (int)(end - begin); /* at most HL_CHUNK_ELEMS: 32-bit offsets from here on */
    /* [0, head): single elements up to the first 16-byte boundary; then nvec vectors; then the rest */
    int head = n;
    if (((uintptr_t)x % sizeof(T)) == 0) {
        const int offset = (int)(((uintptr_t)x & 15) / sizeof(T));
        head = offset == 0 ? 0 : min(PER - offset, n);
    }
    const int nvec = (n - head) / PER;
    uint4 *vec = (uint4 *)(x + head);
    for (int j = threadIdx.x; j < head; j += AMP_THREADS) {
        T y = f(x[j]);
        if (STORE)
            x[j] = y;
    }
    for (int v0 = threadIdx.x; v0 < nvec; v0 += AMP_UNROLL * AMP_THREADS) {
        uint4 raw[AMP_UNROLL];
#pragma unroll
        for (int k = 0; k < AMP_UNROLL; k++)
            if (v0 + k * AMP_THREADS < nvec)
                raw[k] = STORE ? vec[v0 + k * AMP_THREADS] : __ldcs(vec + v0 + k * AMP_THREADS);
#pragma unroll
        for (int k = 0; k < AMP_UNROLL; k++) {
            if (v0 + k * AMP_THREADS < nvec) {
                vec16<T> w = *reinterpret_cast<vec16<T> *>(&raw[k]);
#pragma unroll
                for (int j = 0; j < PER; j++)
                    w.v[j] = f(w.v[j]);
                if (STORE)
                    __stcs(vec + v0 + k * AMP_THREADS, *reinterpret_cast<uint4 *>(&w));
            }
        }
    }
    for (int j = head + nvec * PER + threadIdx.x; j < n; j += AMP_THREADS) {
        T y = f(x[j]);
        if (STORE)
            x[j] = y;
    }
}

/* ---- non_finite_check: one read-only pass, one racing flag ---- */

extern "C" __global__ void __launch_bounds__(AMP_THREADS, HL_AMP_BLOCKS_PER_SM)
    hl_non_finite_check(const hl_table_entry *table, int64_t count, int64_t total_chunks, float *found) {
    bool bad = false;
    hl_for_each_chunk(table, count, total_chunks, [&](const hl_table_entry &e, int64_t, int64_t begin, int64_t end) {
        HL_WITH_DTYPE(e.dtype, T, [&] {
            map_chunk<T, false>(e, begin, end, [&](T x) {
                bad |= !isfinite(to_float(x));
                return x;
            });
        });
    });
    /* every writer writes the same 1.0, so a plain racing store is enough */
    if (__syncthreads_or(bad) && threadIdx.x == 0)
        *found = 1.0f;
}

/* ---- the GradScaler's check ---- */

/* The block's values combined in a fixed tree, so the same inputs give the same bits on every run:
   each warp by xor-shuffle (offsets 16, 8, 4, 2, 1), lane 0 of each warp parks the result in shared
   memory, then warp 0 combines those the same way (lanes past the last warp start from `pad`).
   op(own, partner) always gets this lane's value first (the inf-norm's NaN rule is not symmetric).
   Every thread of the block calls it; warp 0 (so thread 0) returns the block's result. It ends on
   a barrier, so it may be called again right away. */
template <int THREADS, typename T, typename Op> __device__ __forceinline__ T block_reduce(T v, T pad, Op op) {
    static_assert(THREADS % 32 == 0 && THREADS <= 1024, "whole warps, at most 32 of them");
    constexpr int WARPS = THREADS / 32;
    __shared__ T warp_value[WARPS];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
    if (lane == 0)
        warp_value[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = lane < WARPS ? warp_value[lane] : pad;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1)
            v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
    }
    __syncthreads(); /* warp_value is free for the next call */
    return v;
}

/* the value after unscaling, rounded to the gradient's dtype: checked and counted in the norm */
template <typename T, int MODE>
__device__ __forceinline__ T check_value(T x, float inv, float p, double &acc, bool &bad) {
    float u = round_to<T>(to_float(x) * inv);
    bad |= !isfinite(u); /* inf/NaN, or a half that overflows only once unscaled */
    acc = hl_norm_combine(MODE, acc, hl_norm_term(MODE, u, p));
    return from_float<T>(u);
}

/* the block's partial for one chunk, reduced in a fixed tree, written by thread 0 */
template <int MODE> __device__ void finish_chunk(double acc, bool bad, float2 *out) {
    const int any = __syncthreads_or(bad);
    acc = block_reduce<AMP_THREADS>(acc, 0.0, [](double a, double b) { return hl_norm_combine(MODE, a, b); });
    if (threadIdx.x == 0)
        *out = make_float2((float)acc, any ? 1.0f : 0.0f);
}

/* one pass: partials[chunk] = {norm partial, non-finite flag}; WRITE also stores the unscaled values */
template <int MODE, bool WRITE>
__device__ __forceinline__ void amp_check(const hl_table_entry *table, int64_t count, int64_t total_chunks,
                                          float2 *partials, const float *scale, float p) {
    /* the reciprocal in FP64, as torch's unscale_ takes it */
    const float inv = scale != NULL ? (float)(1.0 / (double)*scale) : 1.0f;
    hl_for_each_chunk(table, count, total_chunks, [&](const hl_table_entry &e, int64_t chunk, int64_t begin, int64_t end) {
        double acc = 0.0;
        bool bad = false;
        HL_WITH_DTYPE(e.dtype, T, [&] {
            map_chunk<T, WRITE>(e, begin, end, [&](T x) { return check_value<T, MODE>(x, inv, p, acc, bad); });
        });
        finish_chunk<MODE>(acc, bad, partials + chunk);
    });
}

/* the check's entry points, one per pass the launcher picks: a read-only scan per norm mode, and
   the unscale_ pass that also stores */
#define HL_AMP_CHECK_ENTRY(name, MODE, WRITE)                                                                      \
    extern "C" __global__ void __launch_bounds__(AMP_THREADS, HL_AMP_BLOCKS_PER_SM)                                \
        name(const hl_table_entry *table, int64_t count, int64_t total_chunks, float2 *partials, const float *scale, \
             float p) {                                                                                            \
        amp_check<MODE, WRITE>(table, count, total_chunks, partials, scale, p);                                    \
    }

HL_AMP_CHECK_ENTRY(hl_amp_check_none, HL_NORM_NONE, false)
HL_AMP_CHECK_ENTRY(hl_amp_check_l2, HL_NORM_L2, false)
HL_AMP_CHECK_ENTRY(hl_amp_check_inf, HL_NORM_INF, false)
HL_AMP_CHECK_ENTRY(hl_amp_check_p, HL_NORM_P, false)
HL_AMP_CHECK_ENTRY(hl_amp_check_write, HL_NORM_NONE, true)

/* one block: partials in chunk order -> norm, clip coefficient, factors, found flag, report */
extern "C" __global__ void __launch_bounds__(EPILOGUE_THREADS)
    hl_amp_epilogue(const float2 *partials, int64_t total_chunks, int mode, float p, float max_norm,
                    const float *scale, float *aux, const hl_table_entry *table, int64_t count,
                    const int32_t *param_index, int64_t *report, int64_t step, const float *extra, int n_extra) {
    double acc = 0.0;
    long long first_bad = LLONG_MAX;
    /* thread t adds chunks t, t+T, t+2T, ... in that order, then a fixed tree: deterministic */
#pragma unroll 4
    for (int64_t c = threadIdx.x; c < total_chunks; c += EPILOGUE_THREADS) {
        float2 pr = partials[c];
        acc = hl_norm_combine(mode, acc, (double)pr.x);
        if (pr.y != 0.0f && c < first_bad)
            first_bad = c;
    }
    acc = block_reduce<EPILOGUE_THREADS>(acc, 0.0, [mode](double a, double b) { return hl_norm_combine(mode, a, b); });
    first_bad = block_reduce<EPILOGUE_THREADS>(first_bad, LLONG_MAX,
                                               [](long long a, long long b) { return b < a ? b : a; });
    if (threadIdx.x != 0)
        return;
    int found = first_bad != LLONG_MAX;
    int64_t param = -1;
    if (found) {
        const int64_t entry = hl_entry_of_chunk(table, count, first_bad);
        param = param_index != NULL ? param_index[entry] : entry;
    }
    acc = hl_amp_fold_extra(mode, acc, extra, n_extra, &found, &param);
    hl_amp_finish(acc, found, param, mode, p, max_norm, scale, aux);
    if (found && report != NULL) {
        report[HL_REPORT_PARAM] = param;
        report[HL_REPORT_STEP] = step;
        report[HL_REPORT_COUNT] += 1;
    }
}

/* ---- apply: one read-write pass with the factors the epilogue computed, rounded as torch rounds ---- */

template <bool UNSCALE, bool CLIP>
__device__ __forceinline__ void amp_apply(const hl_table_entry *table, int64_t count, int64_t total_chunks,
                                          const float *aux) {
    if (aux[HL_AUX_FOUND] != 0.0f)
        return; /* a skipped step: leave every gradient as it is */
    const float inv = aux[HL_AUX_INV_SCALE], coef = aux[HL_AUX_CLIP];
    hl_for_each_chunk(table, count, total_chunks, [&](const hl_table_entry &e, int64_t, int64_t begin, int64_t end) {
        HL_WITH_DTYPE(e.dtype, T, [&] {
            map_chunk<T, true>(e, begin, end, [&](T x) {
                float u = to_float(x);
                if (UNSCALE) /* torch's unscale_ rounds to the gradient's dtype, then its clip multiplies */
                    u = round_to<T>(u * inv);
                if (CLIP)
                    u = round_to<T>(u * coef);
                return from_float<T>(u);
            });
        });
    });
}

/* apply's entry points: unscale, clip, or both (the launcher runs none when neither is asked) */
extern "C" __global__ void __launch_bounds__(AMP_THREADS, HL_AMP_BLOCKS_PER_SM)
    hl_amp_apply_unscale(const hl_table_entry *table, int64_t count, int64_t total_chunks, const float *aux) {
    amp_apply<true, false>(table, count, total_chunks, aux);
}

extern "C" __global__ void __launch_bounds__(AMP_THREADS, HL_AMP_BLOCKS_PER_SM)
    hl_amp_apply_clip(const hl_table_entry *table, int64_t count, int64_t total_chunks, const float *aux) {
    amp_apply<false, true>(table, count, total_chunks, aux);
}

extern "C" __global__ void __launch_bounds__(AMP_THREADS, HL_AMP_BLOCKS_PER_SM)
    hl_amp_apply_unscale_clip(const hl_table_entry *table, int64_t count, int64_t total_chunks, const float *aux) {
    amp_apply<true, true>(table, count, total_chunks, aux);
}

/* ---- update: the scale's next value, on the device ---- */

extern "C" __global__ void hl_amp_update(float *scale, int32_t *growth_tracker, int64_t *state, hl_found_list found,
                                         double growth_factor, double backoff_factor, int64_t growth_interval,
                                         int64_t hysteresis, float min_scale, float max_scale, int adjust) {
    float any = 0.0f; /* torch adds the optimizers' found_inf tensors */
    for (int i = 0; i < found.count; i++)
        any += *found.ptr[i];
    hl_amp_update_scale(scale, growth_tracker, state, any, growth_factor, backoff_factor, growth_interval, hysteresis,
                        min_scale, max_scale, adjust);
}
