/* The fused optimizers' C reference on host memory: kernels/optim_math.h's per-element maths over a step's table, 16 or 8 elements at a time with AVX-512 or AVX2 where the CPU has them, the chunks shared among csrc/thread_pool.c's threads. */
#include "optim_cpu.h"

#include <stdatomic.h>

#include "chunk_walk.h"
#include "half_convert.h"
#include "tensor_table.h"
#include "thread_pool.h"

/* NOTE [ The C reference's vector path ]
   The AVX2 path does hl_adam_element's and hl_sgd_element's operations in their order on 8 lanes. IEEE
   add, sub, mul, div, sqrt and fma round each lane as the scalar operation rounds it (C99's fmaf rounds
   once, and -std=c11 contracts nothing), the float16/bfloat16 conversions are those of half_convert.h,
   NaNs included, and the lane-wise max is the scalar `old < new ? new : old`. So a lane holds the bits the
   scalar code gives (tests/optim/test_cpu_step.py compares the two on the same data), which are the GPU
   kernel's. The AVX-512 path is the same on 16 lanes: both widths are one text, optim_cpu_lanes.h,
   included once per width with its lane operations. The scalar code takes each chunk's last elements
   (fewer than 8) and CPUs without AVX2. */

/* a thread takes part for at least this many chunks (HL_CHUNK_ELEMS elements each): below that, waking
   it costs about what it saves */
#define MIN_CHUNKS_PER_THREAD 4

static inline float load_elem(int dtype, uint64_t base, int64_t i) {
    const void *a = (const void *)(uintptr_t)base;
    if (dtype == HL_FLOAT32)
        return ((const float *)a)[i];
    if (dtype == HL_FLOAT16)
        return hl_half_to_float(((const uint16_t *)a)[i]);
    return hl_bf16_to_float(((const uint16_t *)a)[i]);
}

/* rounded once to the dtype, to nearest even */
static inline void store_elem(int dtype, uint64_t base, int64_t i, float x) {
    void *a = (void *)(uintptr_t)base;
    if (dtype == HL_FLOAT32)
        ((float *)a)[i] = x;
    else if (dtype == HL_FLOAT16)
        ((uint16_t *)a)[i] = hl_float_to_half(x);
    else
        ((uint16_t *)a)[i] = hl_float_to_bf16(x);
}

static void adam_scalar(const hl_adam_scalars *s, const hl_adam_entry *e, int64_t begin, int64_t end, float scale,
                        int has_scale) {
    const int pd = e->param_dtype, gd = e->grad_dtype, amsgrad = e->max_exp_avg_sq != 0;
    for (int64_t i = begin; i < end; i++) {
        float p = load_elem(pd, e->param, i), m = load_elem(pd, e->exp_avg, i), v = load_elem(pd, e->exp_avg_sq, i);
        float vmax = amsgrad ? load_elem(pd, e->max_exp_avg_sq, i) : 0.0f;
        hl_adam_element(s, load_elem(gd, e->grad, i), scale, has_scale, &p, &m, &v, amsgrad ? &vmax : NULL);
        store_elem(pd, e->param, i, p);
        store_elem(pd, e->exp_avg, i, m);
        store_elem(pd, e->exp_avg_sq, i, v);
        if (amsgrad)
            store_elem(pd, e->max_exp_avg_sq, i, vmax);
    }
}

static void sgd_scalar(const hl_sgd_hyper *h, double lr, const hl_sgd_entry *e, int64_t begin, int64_t end,
                       float scale, int has_scale) {
    const int pd = e->param_dtype, gd = e->grad_dtype, momentum = e->momentum_buffer != 0;
    for (int64_t i = begin; i < end; i++) {
        float p = load_elem(pd, e->param, i), buf = momentum ? load_elem(pd, e->momentum_buffer, i) : 0.0f;
        hl_sgd_element(h, lr, load_elem(gd, e->grad, i), scale, has_scale, &p, momentum ? &buf : NULL);
        store_elem(pd, e->param, i, p);
        if (momentum)
            store_elem(pd, e->momentum_buffer, i, buf);
    }
}

/* How the vector paths divide a gradient by grad_scale: not at all, by dividing, or by multiplying with its
   reciprocal where that is exact (exact_reciprocal) */
enum { SCALE_NONE, SCALE_DIV, SCALE_MUL };

/* NOTE [ Dividing by a power of two ]
   A divisor x = +-2**k whose reciprocal is a normal float (as a GradScaler's scale is, and bc2_sqrt once
   1 - beta2**t rounds to 1) has 1/x exact, so y * (1/x) is the exact quotient y / x rounded once: the bits
   of the division, subnormal, inf and NaN results included (and with flush-to-zero, as the same value is
   flushed). A multiply costs a fraction of a divide, which bounds the vector paths. */
static inline int exact_reciprocal(float x) {
    const uint32_t bits = hl_float_to_bits(x), exponent = (bits >> 23) & 0xffu;
    return (bits & 0x7fffffu) == 0 && exponent >= 1 && exponent <= 253;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define HL_CPU_AVX2 1
#include <cpuid.h>
#include <immintrin.h>

/* compiled for AVX2, FMA and F16C whatever the build's -march; called only where the CPU has them */
#define AVX2_FN static __attribute__((target("avx2,fma,f16c")))
#define AVX2_INLINE static inline __attribute__((always_inline, target("avx2,fma,f16c")))

AVX2_INLINE __m256 load8(int dtype, uint64_t base, int64_t i) {
    if (dtype == HL_FLOAT32)
        return _mm256_loadu_ps((const float *)(uintptr_t)base + i);
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)(uintptr_t)base + i));
    if (dtype == HL_FLOAT16)
        return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)); /* bfloat16: a float's top half */
}

/* 8 lanes that each hold 16 bits, in order */
AVX2_INLINE __m128i pack16(__m256i x) {
    return _mm_packus_epi32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1));
}

/* hl_float_to_half on 8 lanes: the hardware's round to nearest even, and a NaN as sign | 0x7e00 */
AVX2_INLINE __m128i half8(__m256 f) {
    const __m128i h = _mm256_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m128i nan = _mm_packs_epi32(_mm256_castsi256_si128(_mm256_castps_si256(_mm256_cmp_ps(f, f, _CMP_UNORD_Q))),
                                        _mm256_extracti128_si256(_mm256_castps_si256(_mm256_cmp_ps(f, f, _CMP_UNORD_Q)), 1));
    const __m128i quiet = _mm_or_si128(_mm_and_si128(h, _mm_set1_epi16((short)0x8000)), _mm_set1_epi16(0x7e00));
    return _mm_blendv_epi8(h, quiet, nan);
}

/* hl_float_to_bf16 on 8 lanes, NaNs included */
AVX2_INLINE __m128i bf16x8(__m256 f) {
    const __m256i x = _mm256_castps_si256(f);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(1));
    const __m256i rounded =
        _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(x, _mm256_set1_epi32(0x7fff)), lsb), 16);
    const __m256i nan =
        _mm256_cmpgt_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x7fffffff)), _mm256_set1_epi32(0x7f800000));
    const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(0x40));
    return pack16(_mm256_blendv_epi8(rounded, quiet, nan));
}

AVX2_INLINE void store8(int dtype, uint64_t base, int64_t i, __m256 x) {
    if (dtype == HL_FLOAT32) {
        _mm256_storeu_ps((float *)(uintptr_t)base + i, x);
        return;
    }
    __m128i *dst = (__m128i *)((uint16_t *)(uintptr_t)base + i);
    _mm_storeu_si128(dst, dtype == HL_FLOAT16 ? half8(x) : bf16x8(x));
}

/* 8 lanes: -x (the sign bit flipped, as the scalar negation) and old < next ? next : old */
AVX2_INLINE __m256 negate8(__m256 x) { return _mm256_xor_ps(x, _mm256_set1_ps(-0.0f)); }
AVX2_INLINE __m256 max_lt8(__m256 old, __m256 next) {
    return _mm256_blendv_ps(old, next, _mm256_cmp_ps(old, next, _CMP_LT_OQ));
}

/* `fn(pd, gd, ...)` for the dtype pair of entry `e`, each pair a constant (the pairs a table may hold,
   which csrc/optim.c checks: a half parameter has a gradient of its dtype) */
#define FOR_DTYPE_PAIR(e, fn, ...)                                                                     \
    ((e)->param_dtype == HL_FLOAT16    ? fn(HL_FLOAT16, HL_FLOAT16, __VA_ARGS__)                       \
     : (e)->param_dtype == HL_BFLOAT16 ? fn(HL_BFLOAT16, HL_BFLOAT16, __VA_ARGS__)                     \
     : (e)->grad_dtype == HL_FLOAT16   ? fn(HL_FLOAT32, HL_FLOAT16, __VA_ARGS__)                       \
     : (e)->grad_dtype == HL_BFLOAT16  ? fn(HL_FLOAT32, HL_BFLOAT16, __VA_ARGS__)                      \
                                       : fn(HL_FLOAT32, HL_FLOAT32, __VA_ARGS__))

/* name##LANES: the functions optim_cpu_lanes.h makes for the width being included */
#define PASTE_(a, b) a##b
#define PASTE(a, b) PASTE_(a, b)
#define WITH_LANES(name) PASTE(name, LANES)

/* adam_vector8 and sgd_vector8 */
#define LANES 8
#define VEC __m256
#define VEC_INLINE AVX2_INLINE
#define VEC_FN AVX2_FN
#define V_LOAD load8
#define V_STORE store8
#define V_SET1 _mm256_set1_ps
#define V_ADD _mm256_add_ps
#define V_SUB _mm256_sub_ps
#define V_MUL _mm256_mul_ps
#define V_DIV _mm256_div_ps
#define V_FMADD _mm256_fmadd_ps
#define V_SQRT _mm256_sqrt_ps
#define V_NEG negate8
#define V_MAX_LT max_lt8
#include "optim_cpu_lanes.h"

/* The same on 16 lanes with AVX-512 (F, BW, VL): half the instructions an element, which the half-width
   dtypes' conversions need to keep up with the memory. A chunk's elements go 16 at a time here, then 8
   at a time (at most once) by AVX2, then one at a time: all three give the same bits (NOTE above). */
#define AVX512_TARGET "avx512f,avx512bw,avx512vl,avx2,fma,f16c"
#define AVX512_FN static __attribute__((target(AVX512_TARGET)))
#define AVX512_INLINE static inline __attribute__((always_inline, target(AVX512_TARGET)))

AVX512_INLINE __m512 load16(int dtype, uint64_t base, int64_t i) {
    if (dtype == HL_FLOAT32)
        return _mm512_loadu_ps((const float *)(uintptr_t)base + i);
    const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)(uintptr_t)base + i));
    if (dtype == HL_FLOAT16)
        return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

AVX512_INLINE void store16(int dtype, uint64_t base, int64_t i, __m512 x) {
    if (dtype == HL_FLOAT32) {
        _mm512_storeu_ps((float *)(uintptr_t)base + i, x);
        return;
    }
    __m256i *dst = (__m256i *)((uint16_t *)(uintptr_t)base + i);
    if (dtype == HL_FLOAT16) { /* half8's rounding, and a NaN as sign | 0x7e00 */
        const __m256i h = _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m256i quiet = _mm256_or_si256(_mm256_and_si256(h, _mm256_set1_epi16((short)0x8000)),
                                              _mm256_set1_epi16(0x7e00));
        _mm256_storeu_si256(dst, _mm256_mask_blend_epi16(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), h, quiet));
        return;
    }
    /* bf16x8's integer rounding, NaNs included; every lane then holds 16 bits, which the narrowing keeps */
    const __m512i v = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(v, 16), _mm512_set1_epi32(1));
    const __m512i rounded =
        _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(v, _mm512_set1_epi32(0x7fff)), lsb), 16);
    const __mmask16 nan =
        _mm512_cmpgt_epi32_mask(_mm512_and_si512(v, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
    const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(v, 16), _mm512_set1_epi32(0x40));
    _mm256_storeu_si256(dst, _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(nan, rounded, quiet)));
}

/* -x on 16 lanes: the sign bit flipped, as the scalar negation */
AVX512_INLINE __m512 negate16(__m512 x) {
    return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(x), _mm512_set1_epi32((int)0x80000000u)));
}

AVX512_INLINE __m512 max_lt16(__m512 old, __m512 next) {
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(old, next, _CMP_LT_OQ), old, next);
}

/* adam_vector16 and sgd_vector16 */
#define LANES 16
#define VEC __m512
#define VEC_INLINE AVX512_INLINE
#define VEC_FN AVX512_FN
#define V_LOAD load16
#define V_STORE store16
#define V_SET1 _mm512_set1_ps
#define V_ADD _mm512_add_ps
#define V_SUB _mm512_sub_ps
#define V_MUL _mm512_mul_ps
#define V_DIV _mm512_div_ps
#define V_FMADD _mm512_fmadd_ps
#define V_SQRT _mm512_sqrt_ps
#define V_NEG negate16
#define V_MAX_LT max_lt16
#include "optim_cpu_lanes.h"

/* The widest vector path the CPU has, asked once (cpuid is a VM exit under a hypervisor): 2 for AVX-512
   (F, BW, VL) with AVX2, 1 for AVX2, FMA and F16C, 0 for none. F16C by cpuid itself, since not every
   compiler's __builtin_cpu_supports knows its name. */
static int cpu_vector_level(void) {
    static _Atomic int known = -1;
    int level = atomic_load(&known);
    if (level < 0) {
        unsigned int a, b, c, d;
        level = __get_cpuid(1, &a, &b, &c, &d) && (c & bit_F16C) && __builtin_cpu_supports("avx2") &&
                __builtin_cpu_supports("fma");
        if (level && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
            __builtin_cpu_supports("avx512vl"))
            level = 2;
        atomic_store(&known, level);
    }
    return level;
}
#else
static int cpu_vector_level(void) { return 0; }
#endif

/* One step's work: chunks of its table, done by whichever thread takes them (csrc/thread_pool.c). */
typedef struct {
    const void *table;
    int64_t count;
    const void *hyper;
    double lr;
    float scale;
    int has_scale;
    float vector_scale; /* what the vector paths take: scale, or its reciprocal for SCALE_MUL */
    int scale_op;       /* SCALE_* */
    int vector;         /* cpu_vector_level() */
} step_work;

/* One step's work over `table`: this call's lr (the lr tensor's, else the hyperparameters' `hyper_lr`),
   its grad_scale, and the vector paths' way with it (NOTE [ Dividing by a power of two ]). */
static step_work step_work_for(const void *table, int64_t count, const void *hyper, double hyper_lr,
                               const float *lr_ptr, const float *grad_scale) {
    step_work w = {.table = table, .count = count, .hyper = hyper,
                   .lr = lr_ptr != NULL ? (double)*lr_ptr : hyper_lr, .scale = grad_scale != NULL ? *grad_scale : 1.0f,
                   .has_scale = grad_scale != NULL, .vector = cpu_vector_level()};
    w.scale_op = !w.has_scale ? SCALE_NONE : exact_reciprocal(w.scale) ? SCALE_MUL : SCALE_DIV;
    w.vector_scale = w.scale_op == SCALE_MUL ? 1.0f / w.scale : w.scale;
    return w;
}

static void adam_chunks(void *arg, int64_t first, int64_t end_chunk) {
    const step_work *w = arg;
    const hl_adam_entry *table = w->table;
    int64_t t = 0, scalars_of = -1;
    hl_adam_scalars s = {0};
    for (int64_t chunk = first; chunk < end_chunk; chunk++) {
        HL_ENTRY_OF_CHUNK(table, w->count, t, chunk);
        const hl_adam_entry *e = &table[t];
        if (scalars_of != t) { /* the bias corrections once per tensor per call (powf) */
            s = hl_adam_scalars_for(w->hyper, w->lr, *(const float *)(uintptr_t)e->step);
            scalars_of = t;
        }
        int64_t i, end;
        hl_chunk_elems(e->numel, e->first_chunk, chunk, &i, &end);
#ifdef HL_CPU_AVX2
        if (w->vector >= 2)
            i = adam_vector16(&s, e, i, end, w->vector_scale, w->scale_op);
        if (w->vector >= 1)
            i = adam_vector8(&s, e, i, end, w->vector_scale, w->scale_op);
#endif
        adam_scalar(&s, e, i, end, w->scale, w->has_scale);
    }
}

static void sgd_chunks(void *arg, int64_t first, int64_t end_chunk) {
    const step_work *w = arg;
    const hl_sgd_entry *table = w->table;
    int64_t t = 0;
    for (int64_t chunk = first; chunk < end_chunk; chunk++) {
        HL_ENTRY_OF_CHUNK(table, w->count, t, chunk);
        const hl_sgd_entry *e = &table[t];
        int64_t i, end;
        hl_chunk_elems(e->numel, e->first_chunk, chunk, &i, &end);
#ifdef HL_CPU_AVX2
        if (w->vector >= 2)
            i = sgd_vector16(w->hyper, w->lr, e, i, end, w->vector_scale, w->scale_op);
        if (w->vector >= 1)
            i = sgd_vector8(w->hyper, w->lr, e, i, end, w->vector_scale, w->scale_op);
#endif
        sgd_scalar(w->hyper, w->lr, e, i, end, w->scale, w->has_scale);
    }
}

void hl_cpu_adam(const hl_adam_entry *table, int64_t count, int64_t total_chunks, const hl_adam_hyper *hyper,
                 const float *lr_ptr, const float *grad_scale, const float *found_inf, int threads) {
    if (found_inf != NULL && *found_inf != 0.0f)
        return;
    step_work w = step_work_for(table, count, hyper, hyper->lr, lr_ptr, grad_scale);
    hl_parallel_for(total_chunks, threads, MIN_CHUNKS_PER_THREAD, adam_chunks, &w);
    /* after every thread has read its tensors' step counts */
    for (int64_t t = 0; t < count; t++) {
        float *step = (float *)(uintptr_t)table[t].step;
        *step = *step + 1.0f;
    }
}

void hl_cpu_sgd(const hl_sgd_entry *table, int64_t count, int64_t total_chunks, const hl_sgd_hyper *hyper,
                const float *lr_ptr, const float *grad_scale, const float *found_inf, int threads) {
    if (found_inf != NULL && *found_inf != 0.0f)
        return;
    step_work w = step_work_for(table, count, hyper, hyper->lr, lr_ptr, grad_scale);
    hl_parallel_for(total_chunks, threads, MIN_CHUNKS_PER_THREAD, sgd_chunks, &w);
}
