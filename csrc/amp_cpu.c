/* The GradScaler's passes over CPU tensors: vectorisable loops, spread over threads by whole chunks. */
#include "amp_cpu.h"

#include <math.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>

#include "amp_math.h"
#include "chunk_walk.h"
#include "half_convert.h"
#include "thread_pool.h"

/* a thread is worth starting for this many chunks (about a megabyte of float32) and no fewer */
#define MIN_CHUNKS_PER_THREAD 8
/* independent accumulators per loop: the compiler turns them into vector registers; the order in
   which they are added is fixed, so results do not depend on the machine or the thread count */
#define LANES 8

/* ---- threads: a pass's chunks go to csrc/thread_pool.c's threads, in runs of consecutive chunks ---- */

/* `threads` <= 0: as many as the CPUs this process may run on */
static int threads_for(int threads) {
    if (threads <= 0) {
        cpu_set_t set;
        threads = sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set) : 1;
    }
    return threads;
}

/* what a pass does to one chunk: elements [begin, end) of entry `e` */
typedef void (*chunk_body)(void *ctx, const hl_table_entry *e, int64_t chunk, int64_t begin, int64_t end);

typedef struct {
    const hl_table_entry *table;
    int64_t count;
    chunk_body body;
    void *ctx;
} table_pass;

static void pass_chunks(void *arg, int64_t first, int64_t end) {
    const table_pass *pass = arg;
    int64_t t = 0;
    for (int64_t chunk = first; chunk < end; chunk++) {
        HL_ENTRY_OF_CHUNK(pass->table, pass->count, t, chunk);
        const hl_table_entry *e = &pass->table[t];
        int64_t begin, stop;
        hl_chunk_elems(e->numel, e->first_chunk, chunk, &begin, &stop);
        pass->body(pass->ctx, e, chunk, begin, stop);
    }
}

/* body over every chunk of the table, one thread per MIN_CHUNKS_PER_THREAD at most */
static void run_chunks(const hl_table_entry *table, int64_t count, int64_t total_chunks, int threads, chunk_body body,
                       void *ctx) {
    table_pass pass = {table, count, body, ctx};
    hl_parallel_for(total_chunks, threads_for(threads), MIN_CHUNKS_PER_THREAD, pass_chunks, &pass);
}

/* The loops below are also built for AVX2, chosen when the library loads by the CPU it runs on; the
   portable build has SSE2 alone. The same operations in wider registers: no FMA, whose contraction
   would change the sums' bits, and no reordering (the lanes are written out), so every CPU gives the
   same results. */
#if defined(__x86_64__) && defined(__GNUC__) && defined(__linux__)
#define HL_AVX2_CLONE __attribute__((target_clones("avx2", "default")))
#else
#define HL_AVX2_CLONE
#endif

/* ---- the non-finite check ---- */

/* the exponent bits all set is inf or NaN; a compare and an or per element, so the loop vectorises
   (a branch per element would not) */
HL_AVX2_CLONE static int f32_non_finite(const uint32_t *restrict x, int64_t n) {
    uint32_t bad = 0;
    for (int64_t i = 0; i < n; i++)
        bad |= (x[i] & 0x7fffffffu) > 0x7f7fffffu;
    return bad != 0;
}

HL_AVX2_CLONE static int u16_non_finite(const uint16_t *restrict x, int64_t n, uint16_t largest_finite) {
    uint16_t bad = 0;
    for (int64_t i = 0; i < n; i++)
        bad |= (uint16_t)(x[i] & 0x7fffu) > largest_finite;
    return bad != 0;
}

/* any thread's finding stops the others at their next chunk */
static void non_finite_chunk(void *arg, const hl_table_entry *e, int64_t chunk, int64_t begin, int64_t stop) {
    (void)chunk;
    atomic_int *found = arg;
    if (atomic_load_explicit(found, memory_order_relaxed))
        return;
    const void *base = (const void *)(uintptr_t)e->data;
    int bad;
    if (e->dtype == HL_FLOAT32)
        bad = f32_non_finite((const uint32_t *)base + begin, stop - begin);
    else
        bad = u16_non_finite((const uint16_t *)base + begin, stop - begin, e->dtype == HL_FLOAT16 ? 0x7bffu : 0x7f7fu);
    if (bad)
        atomic_store_explicit(found, 1, memory_order_relaxed);
}

int hl_cpu_has_non_finite(const hl_table_entry *table, int64_t count, int64_t total_chunks, int threads) {
    atomic_int found = 0;
    run_chunks(table, count, total_chunks, threads, non_finite_chunk, &found);
    return atomic_load(&found);
}

/* ---- the check pass ---- */

/* float32, 2-norm: the sum of squares is inf or NaN exactly when a value is (a finite float's square
   is finite in double, and 32768 of them too), so it is the check */
HL_AVX2_CLONE static double f32_sum_squares(const float *restrict x, int64_t n, float inv) {
    double lane[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int k = 0; k < LANES; k++) {
            const double u = (double)(x[i + k] * inv);
            lane[k] += u * u;
        }
    double acc = 0.0;
    for (; i < n; i++) {
        const double u = (double)(x[i] * inv);
        acc += u * u;
    }
    for (int k = 0; k < LANES; k++)
        acc += lane[k];
    return acc;
}

/* float32, inf-norm: the largest |value|, NaN winning and staying; inf or NaN exactly when a value is */
HL_AVX2_CLONE static double f32_max_abs(const float *restrict x, int64_t n, float inv) {
    float lane[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int k = 0; k < LANES; k++) {
            const float a = fabsf(x[i + k] * inv);
            lane[k] = (a > lane[k] || a != a) ? a : lane[k];
        }
    for (; i < n; i++) {
        const float a = fabsf(x[i] * inv);
        lane[0] = (a > lane[0] || a != a) ? a : lane[0];
    }
    double acc = 0.0;
    for (int k = 0; k < LANES; k++)
        acc = hl_norm_combine(HL_NORM_INF, acc, (double)lane[k]);
    return acc;
}

/* float32, no norm: value * 0 is 0 for a finite value and NaN for inf or NaN, so a sum of them is
   the check without a branch per element; with `out` the values are stored */
HL_AVX2_CLONE static int f32_scale_check(const float *restrict x, float *restrict out, int64_t n, float inv) {
    float lane[LANES] = {0};
    int64_t i = 0;
    if (out != NULL) {
        for (; i + LANES <= n; i += LANES)
            for (int k = 0; k < LANES; k++) {
                const float u = x[i + k] * inv;
                out[i + k] = u;
                lane[k] += u * 0.0f;
            }
        for (; i < n; i++) {
            const float u = x[i] * inv;
            out[i] = u;
            lane[0] += u * 0.0f;
        }
    } else {
        for (; i + LANES <= n; i += LANES)
            for (int k = 0; k < LANES; k++)
                lane[k] += (x[i + k] * inv) * 0.0f;
        for (; i < n; i++)
            lane[0] += (x[i] * inv) * 0.0f;
    }
    float any = 0.0f;
    for (int k = 0; k < LANES; k++)
        any += lane[k];
    return any != any;
}

static inline float load_elem(int dtype, const void *base, int64_t i) {
    if (dtype == HL_FLOAT32)
        return ((const float *)base)[i];
    if (dtype == HL_FLOAT16)
        return hl_half_to_float(((const uint16_t *)base)[i]);
    return hl_bf16_to_float(((const uint16_t *)base)[i]);
}

static inline void store_elem(int dtype, void *base, int64_t i, float v) {
    if (dtype == HL_FLOAT32)
        ((float *)base)[i] = v;
    else if (dtype == HL_FLOAT16)
        ((uint16_t *)base)[i] = hl_float_to_half(v);
    else
        ((uint16_t *)base)[i] = hl_float_to_bf16(v);
}

/* a value as the gradient's dtype would hold it */
static inline float round_elem(int dtype, float v) {
    if (dtype == HL_FLOAT32)
        return v;
    if (dtype == HL_FLOAT16)
        return hl_half_to_float(hl_float_to_half(v));
    return hl_bf16_to_float(hl_float_to_bf16(v));
}

static inline int finite_float(float v) { return (hl_float_to_bits(v) & 0x7f800000u) != 0x7f800000u; }

/* any dtype and mode, one element at a time (float16, bfloat16 and p-norms); `dtype` and `mode` are
   constants where it is called, so each call site is its own loop without a switch per element */
static inline __attribute__((always_inline)) double any_chunk(int dtype, int mode, void *base, int64_t begin,
                                                               int64_t end, float inv, float p, int write, int *bad) {
    double acc = 0.0;
    int found = 0;
    for (int64_t i = begin; i < end; i++) {
        const float u = round_elem(dtype, load_elem(dtype, base, i) * inv);
        found |= !finite_float(u);
        acc = hl_norm_combine(mode, acc, hl_norm_term(mode, u, p));
        if (write)
            store_elem(dtype, base, i, u);
    }
    *bad = found;
    return acc;
}

#define ANY_CHUNK_FOR_MODE(dtype)                                                                                \
    switch (mode) {                                                                                              \
    case HL_NORM_L2:                                                                                             \
        return any_chunk(dtype, HL_NORM_L2, base, begin, end, inv, p, write, bad);                               \
    case HL_NORM_INF:                                                                                            \
        return any_chunk(dtype, HL_NORM_INF, base, begin, end, inv, p, write, bad);                              \
    case HL_NORM_P:                                                                                              \
        return any_chunk(dtype, HL_NORM_P, base, begin, end, inv, p, write, bad);                                \
    default:                                                                                                     \
        return any_chunk(dtype, HL_NORM_NONE, base, begin, end, inv, p, write, bad);                             \
    }

/* one chunk's norm accumulator, and in *bad whether a value was inf or NaN once unscaled */
static double check_chunk(const hl_table_entry *e, int64_t begin, int64_t end, float inv, int write, int mode,
                          float p, int *bad) {
    void *base = (void *)(uintptr_t)e->data;
    if (e->dtype == HL_FLOAT32 && !(write && mode != HL_NORM_NONE)) {
        const float *x = (const float *)base + begin;
        const int64_t n = end - begin;
        double acc;
        switch (mode) {
        case HL_NORM_NONE:
            *bad = f32_scale_check(x, write ? (float *)base + begin : NULL, n, inv);
            return 0.0;
        case HL_NORM_L2:
            acc = f32_sum_squares(x, n, inv);
            *bad = !isfinite(acc);
            return acc;
        case HL_NORM_INF:
            acc = f32_max_abs(x, n, inv);
            *bad = !isfinite(acc);
            return acc;
        default: /* a finite value's |u|^p may overflow in float: the p-norm checks each value */
            break;
        }
    }
    switch (e->dtype) {
    case HL_FLOAT32:
        ANY_CHUNK_FOR_MODE(HL_FLOAT32)
    case HL_FLOAT16:
        ANY_CHUNK_FOR_MODE(HL_FLOAT16)
    default:
        ANY_CHUNK_FOR_MODE(HL_BFLOAT16)
    }
}

typedef struct {
    float *partials;
    float inv, p;
    int write, mode;
} check_ctx;

static void check_one_chunk(void *arg, const hl_table_entry *e, int64_t chunk, int64_t begin, int64_t stop) {
    const check_ctx *c = arg;
    int bad = 0;
    const double acc = check_chunk(e, begin, stop, c->inv, c->write, c->mode, c->p, &bad);
    c->partials[2 * chunk] = (float)acc;
    c->partials[2 * chunk + 1] = bad ? 1.0f : 0.0f;
}

void hl_cpu_amp_check(const hl_table_entry *table, int64_t count, int64_t total_chunks, float *partials, float inv,
                      int write, int mode, float p, int threads) {
    check_ctx c = {partials, inv, p, write, mode};
    run_chunks(table, count, total_chunks, threads, check_one_chunk, &c);
}

/* ---- the apply pass ---- */

/* float32: two roundings, as torch's unscale_ then clip multiply (never fused into one factor) */
HL_AVX2_CLONE static void f32_apply(float *restrict x, int64_t n, float inv, float coef, int unscale, int clip) {
    if (unscale && clip) {
        for (int64_t i = 0; i < n; i++)
            x[i] = (x[i] * inv) * coef;
    } else {
        const float f = unscale ? inv : coef;
        for (int64_t i = 0; i < n; i++)
            x[i] = x[i] * f;
    }
}

static inline __attribute__((always_inline)) void any_apply(int dtype, void *base, int64_t begin, int64_t end,
                                                             float inv, float coef, int unscale, int clip) {
    for (int64_t i = begin; i < end; i++) {
        float u = load_elem(dtype, base, i);
        if (unscale) /* torch's unscale_ rounds to the gradient's dtype, then its clip multiplies */
            u = round_elem(dtype, u * inv);
        if (clip)
            u = round_elem(dtype, u * coef);
        store_elem(dtype, base, i, u);
    }
}

typedef struct {
    float inv, coef;
    int unscale, clip;
} apply_ctx;

static void apply_chunk(void *arg, const hl_table_entry *e, int64_t chunk, int64_t begin, int64_t stop) {
    (void)chunk;
    const apply_ctx *c = arg;
    void *base = (void *)(uintptr_t)e->data;
    if (e->dtype == HL_FLOAT32)
        f32_apply((float *)base + begin, stop - begin, c->inv, c->coef, c->unscale, c->clip);
    else if (e->dtype == HL_FLOAT16)
        any_apply(HL_FLOAT16, base, begin, stop, c->inv, c->coef, c->unscale, c->clip);
    else
        any_apply(HL_BFLOAT16, base, begin, stop, c->inv, c->coef, c->unscale, c->clip);
}

void hl_cpu_amp_apply(const hl_table_entry *table, int64_t count, int64_t total_chunks, float inv, float coef,
                      int unscale, int clip, int threads) {
    apply_ctx c = {inv, coef, unscale, clip};
    if (unscale || clip)
        run_chunks(table, count, total_chunks, threads, apply_chunk, &c);
}
