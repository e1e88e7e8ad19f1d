/* Mixed-precision entry points: argument checks, CUDA launches, and the C reference kernels for CPU tensors. */
#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cuda.h"
#include "tensor.h"
#include "amp_layout.h"
#ifdef HOTLOOP_WITH_CUDA
#include "amp.h"
#endif

/* C reference: does any element of any table entry hold an inf or NaN? (float32/16, bfloat16) */
static int cpu_has_non_finite(const hl_table *table) {
    for (int64_t t = 0; t < table->count; t++) {
        const hl_table_entry *e = &table->entries[t];
        if (e->dtype == HL_FLOAT32) {
            const uint32_t *x = (const uint32_t *)(uintptr_t)e->data;
            for (int64_t i = 0; i < e->numel; i++)
                if ((x[i] & 0x7f800000u) == 0x7f800000u)
                    return 1;
        } else {
            const uint16_t exponent = e->dtype == HL_FLOAT16 ? 0x7c00u : 0x7f80u;
            const uint16_t *x = (const uint16_t *)(uintptr_t)e->data;
            for (int64_t i = 0; i < e->numel; i++)
                if ((x[i] & exponent) == exponent)
                    return 1;
        }
    }
    return 0;
}

/* The scratch tensor that receives the table on the device must be uint8, on the table's device
   and large enough. */
static int take_table_scratch(PyObject *obj, const hl_table *table, hl_tensor *scratch) {
    if (hl_tensor_from_object(obj, "table_scratch", HL_DTYPE_BIT(HL_UINT8), table->device, 1, scratch) < 0)
        return -1;
    int64_t need = table->count * (int64_t)sizeof(hl_table_entry);
    if (scratch->numel < need) {
        PyErr_Format(PyExc_ValueError, "table_scratch: expected at least %lld bytes for %lld tensors, got %lld",
                     (long long)need, (long long)table->count, (long long)scratch->numel);
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(non_finite_check_doc,
             "non_finite_check(packed_table, found, table_scratch, stream)\n\n"
             "Set found[0] = 1.0 if any element of any tensor in the packed table is inf or NaN (float32,\n"
             "float16, bfloat16, mixed). `found` is a float32 tensor on the tensors' device; it is never\n"
             "cleared. On CUDA the table goes to `table_scratch` (uint8, TABLE_ENTRY_BYTES per tensor) and\n"
             "one kernel runs on `stream` (a cudaStream_t as int); nothing waits for it. CPU tensors take\n"
             "the C reference (table_scratch may be None).");

static PyObject *non_finite_check(PyObject *module, PyObject *args) {
    PyObject *packed, *found_obj, *scratch_obj;
    unsigned long long stream = 0;
    hl_table table = {0};
    hl_tensor found = {0}, scratch = {0};
    PyObject *result = NULL;

    if (!PyArg_ParseTuple(args, "OOOK:non_finite_check", &packed, &found_obj, &scratch_obj, &stream))
        return NULL;
    if (hl_table_parse(packed, "tensors", HL_FLOATING_MASK, &table) < 0)
        return NULL;
    if (table.device >= 0 && hl_cuda_require(module, table.device) < 0)
        goto error;
    if (hl_tensor_from_object(found_obj, "found", HL_DTYPE_BIT(HL_FLOAT32), table.device, 1, &found) < 0)
        goto error;
    if (found.numel < 1) {
        PyErr_SetString(PyExc_ValueError, "found: expected a tensor of at least one element, got an empty one");
        goto error;
    }

    if (table.device < 0) {
        int bad;
        Py_BEGIN_ALLOW_THREADS
        bad = cpu_has_non_finite(&table);
        Py_END_ALLOW_THREADS
        if (bad)
            *(float *)found.data = 1.0f;
    } else {
        if (take_table_scratch(scratch_obj, &table, &scratch) < 0)
            goto error;
#ifdef HOTLOOP_WITH_CUDA
        hl_cuda_status status = {0};
        Py_BEGIN_ALLOW_THREADS
        hl_device_guard guard;
        hl_device_enter(&guard, table.device, &status);
        hl_table_upload(&table, scratch.data, hl_stream(stream), &status);
        HL_CUDA(&status, hl_launch_non_finite_check((const hl_table_entry *)scratch.data, table.count,
                                                    table.total_chunks, (float *)found.data, table.device,
                                                    hl_stream(stream)));
        hl_device_leave(&guard, &status);
        Py_END_ALLOW_THREADS
        if (status.code != 0) {
            hl_raise_cuda(module, &status);
            goto error;
        }
#endif
    }
    result = Py_NewRef(Py_None);
error:
    hl_tensor_release(&scratch);
    hl_tensor_release(&found);
    hl_table_free(&table);
    return result;
}

/* ---------------------------------------------------------------------------------------------
   GradScaler: the C reference of kernels/amp.cu for CPU tensors (same chunks, same maths, same
   rounding to the gradient's dtype), and the bindings python/hotloop/amp.py calls every step.
   Per-step calls take raw addresses of tensors amp.py allocated and keeps alive (the gradients'
   addresses were checked once, when their table was built), so a step costs no DLPack round trip.
   --------------------------------------------------------------------------------------------- */

static float bits_to_float(uint32_t b) {
    float f;
    memcpy(&f, &b, sizeof(f));
    return f;
}

static uint32_t float_to_bits(float f) {
    uint32_t b;
    memcpy(&b, &f, sizeof(b));
    return b;
}

static float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    if (exp == 0) {
        if (man == 0)
            return bits_to_float(sign);
        int shifts = 0; /* a subnormal: normalise it */
        while (!(man & 0x400u)) {
            man <<= 1;
            shifts++;
        }
        return bits_to_float(sign | ((uint32_t)(113 - shifts) << 23) | ((man & 0x3ffu) << 13));
    }
    if (exp == 31)
        return bits_to_float(sign | 0x7f800000u | (man << 13));
    return bits_to_float(sign | ((exp + 112) << 23) | (man << 13));
}

/* round to nearest even, as __float2half_rn */
static uint16_t float_to_half(float f) {
    uint32_t x = float_to_bits(f), sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
    if (ax > 0x7f800000u)
        return (uint16_t)(sign | 0x7e00u); /* NaN */
    if (ax >= 0x477ff000u)
        return (uint16_t)(sign | 0x7c00u); /* 65520 and up round to inf */
    if (ax < 0x38800000u) {                /* below 2^-14: a subnormal half or zero */
        if (ax <= 0x33000000u)
            return (uint16_t)sign; /* up to 2^-25 (a tie, to even) rounds to zero */
        uint32_t e = ax >> 23, m = (ax & 0x7fffffu) | 0x800000u, shift = 126 - e;
        uint32_t r = m >> shift, rem = m & ((1u << shift) - 1), halfway = 1u << (shift - 1);
        if (rem > halfway || (rem == halfway && (r & 1u)))
            r++;
        return (uint16_t)(sign | r);
    }
    uint32_t r = ax + 0xfffu + ((ax >> 13) & 1u);
    return (uint16_t)(sign | ((r - (112u << 23)) >> 13));
}

static float bf16_to_float(uint16_t h) { return bits_to_float((uint32_t)h << 16); }

static uint16_t float_to_bf16(float f) {
    uint32_t x = float_to_bits(f);
    if ((x & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((x >> 16) | 0x40u); /* NaN stays NaN */
    return (uint16_t)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

static float load_elem(const hl_table_entry *e, int64_t i) {
    const void *base = (const void *)(uintptr_t)e->data;
    switch (e->dtype) {
    case HL_FLOAT32:
        return ((const float *)base)[i];
    case HL_FLOAT16:
        return half_to_float(((const uint16_t *)base)[i]);
    default:
        return bf16_to_float(((const uint16_t *)base)[i]);
    }
}

static void store_elem(const hl_table_entry *e, int64_t i, float v) {
    void *base = (void *)(uintptr_t)e->data;
    switch (e->dtype) {
    case HL_FLOAT32:
        ((float *)base)[i] = v;
        break;
    case HL_FLOAT16:
        ((uint16_t *)base)[i] = float_to_half(v);
        break;
    default:
        ((uint16_t *)base)[i] = float_to_bf16(v);
        break;
    }
}

/* a value as the gradient's dtype would hold it */
static float round_elem(int dtype, float v) {
    switch (dtype) {
    case HL_FLOAT32:
        return v;
    case HL_FLOAT16:
        return half_to_float(float_to_half(v));
    default:
        return bf16_to_float(float_to_bf16(v));
    }
}

static int finite_float(float v) { return (float_to_bits(v) & 0x7f800000u) != 0x7f800000u; }

static double norm_combine(int mode, double acc, double v) {
    if (mode == HL_NORM_INF)
        return (v > acc || v != v) ? v : acc; /* NaN wins and stays */
    return acc + v;
}

static double norm_term(int mode, float u, float p) {
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

static int64_t entry_of_chunk(const hl_table_entry *table, int64_t count, int64_t chunk) {
    int64_t lo = 0, hi = count - 1;
    while (lo < hi) {
        int64_t mid = (lo + hi + 1) / 2;
        if (table[mid].first_chunk <= chunk)
            lo = mid;
        else
            hi = mid - 1;
    }
    return lo;
}

static void chunk_range(const hl_table_entry *e, int64_t chunk, int64_t *begin, int64_t *end) {
    *begin = (chunk - e->first_chunk) * (int64_t)HL_CHUNK_ELEMS;
    *end = *begin + HL_CHUNK_ELEMS < e->numel ? *begin + HL_CHUNK_ELEMS : e->numel;
}

static void cpu_amp_check(const hl_table_entry *table, int64_t count, int64_t total_chunks, float *partials,
                          const float *scale, int write, int mode, float p) {
    const float inv = scale != NULL ? (float)(1.0 / (double)*scale) : 1.0f;
    int64_t t = 0;
    for (int64_t chunk = 0; chunk < total_chunks; chunk++) {
        while (t + 1 < count && table[t + 1].first_chunk <= chunk)
            t++;
        const hl_table_entry *e = &table[t];
        int64_t begin, end;
        chunk_range(e, chunk, &begin, &end);
        double acc = 0.0;
        int bad = 0;
        for (int64_t i = begin; i < end; i++) {
            float u = round_elem(e->dtype, load_elem(e, i) * inv);
            bad |= !finite_float(u);
            acc = norm_combine(mode, acc, norm_term(mode, u, p));
            if (write)
                store_elem(e, i, u);
        }
        partials[2 * chunk] = (float)acc;
        partials[2 * chunk + 1] = bad ? 1.0f : 0.0f;
    }
}

static void cpu_amp_epilogue(const float *partials, int64_t total_chunks, int mode, float p, float max_norm,
                             const float *scale, float *aux, const hl_table_entry *table, int64_t count,
                             const int32_t *param_index, int64_t *report, int64_t step) {
    double acc = 0.0;
    int64_t first_bad = -1;
    for (int64_t c = 0; c < total_chunks; c++) {
        acc = norm_combine(mode, acc, (double)partials[2 * c]);
        if (partials[2 * c + 1] != 0.0f && first_bad < 0)
            first_bad = c;
    }
    float norm = 0.0f;
    if (mode == HL_NORM_L2)
        norm = (float)sqrt(acc);
    else if (mode == HL_NORM_INF)
        norm = (float)acc;
    else if (mode == HL_NORM_P)
        norm = (float)pow(acc, 1.0 / (double)p);
    float coef = 1.0f;
    if (max_norm >= 0.0f) {
        float r = 1.0f / (norm + 1e-6f); /* as torch: reciprocal(norm + 1e-6) * max_norm, clamp(max=1) */
        coef = r * max_norm;
        coef = coef != coef ? coef : fminf(coef, 1.0f);
    }
    const float s = scale != NULL ? *scale : 1.0f;
    aux[HL_AUX_FOUND] = first_bad >= 0 ? 1.0f : 0.0f;
    aux[HL_AUX_NORM] = norm;
    aux[HL_AUX_CLIP] = coef;
    aux[HL_AUX_INV_SCALE] = scale != NULL ? (float)(1.0 / (double)s) : 1.0f;
    aux[HL_AUX_GRAD_SCALE] = s / coef;
    if (first_bad >= 0 && report != NULL) {
        int64_t entry = entry_of_chunk(table, count, first_bad);
        report[HL_REPORT_PARAM] = param_index != NULL ? param_index[entry] : entry;
        report[HL_REPORT_STEP] = step;
        report[HL_REPORT_COUNT] += 1;
    }
}

static void cpu_amp_apply(const hl_table_entry *table, int64_t count, const float *aux, int unscale, int clip) {
    if (aux[HL_AUX_FOUND] != 0.0f)
        return;
    const float inv = aux[HL_AUX_INV_SCALE], coef = aux[HL_AUX_CLIP];
    for (int64_t t = 0; t < count; t++) {
        const hl_table_entry *e = &table[t];
        for (int64_t i = 0; i < e->numel; i++) {
            float u = load_elem(e, i);
            if (unscale)
                u = round_elem(e->dtype, u * inv);
            if (clip)
                u = round_elem(e->dtype, u * coef);
            store_elem(e, i, u);
        }
    }
}

static void cpu_amp_update(float *scale, int32_t *growth_tracker, int64_t *state, const hl_found_list *found,
                           double growth_factor, double backoff_factor, int64_t growth_interval, int64_t hysteresis,
                           float min_scale, float max_scale, int adjust) {
    float any = 0.0f;
    for (int i = 0; i < found->count; i++)
        any += *found->ptr[i];
    if (any != 0.0f)
        state[HL_STATE_SKIPPED] += 1;
    if (!adjust)
        return;
    if (any != 0.0f) {
        int64_t left = state[HL_STATE_HYSTERESIS] - 1;
        state[HL_STATE_HYSTERESIS] = left > 0 ? left : 0;
        if (left <= 0)
            *scale = fmaxf((float)((double)*scale * backoff_factor), min_scale);
        *growth_tracker = 0;
    } else {
        int64_t successful = (int64_t)*growth_tracker + 1;
        if (successful == growth_interval) {
            float grown = (float)((double)*scale * growth_factor);
            if (finite_float(grown))
                *scale = fminf(grown, max_scale);
            *growth_tracker = 0;
            state[HL_STATE_HYSTERESIS] = hysteresis;
        } else {
            *growth_tracker = (int32_t)successful;
        }
    }
}

#ifdef HOTLOOP_WITH_CUDA
/* raise the failed status once the GIL is back; 0 when nothing failed */
static int finish_cuda(PyObject *module, const hl_cuda_status *status) {
    return status->code != 0 ? hl_raise_cuda(module, status) : 0;
}
#endif

PyDoc_STRVAR(amp_table_upload_doc,
             "amp_table_upload(packed_table, param_index, dst, stream) -> (count, total_chunks, total_numel, device)\n\n"
             "Check a packed gradient table (float32, float16, bfloat16 on one device) and copy its entries,\n"
             "followed by `param_index` (count int32 as bytes, or None), into `dst` (a uint8 tensor on the\n"
             "table's device of at least count * (TABLE_ENTRY_BYTES + 4) bytes), on `stream` for CUDA.");

static PyObject *amp_table_upload(PyObject *module, PyObject *args) {
    PyObject *packed, *index_obj, *dst_obj, *result = NULL;
    unsigned long long stream = 0;
    hl_table table = {0};
    hl_tensor dst = {0};
    char *host = NULL;

    if (!PyArg_ParseTuple(args, "OOOK:amp_table_upload", &packed, &index_obj, &dst_obj, &stream))
        return NULL;
    if (hl_table_parse(packed, "gradients", HL_FLOATING_MASK, &table) < 0)
        return NULL;
    const size_t entry_bytes = (size_t)table.count * sizeof(hl_table_entry);
    const size_t total = entry_bytes + (size_t)table.count * sizeof(int32_t);
    if (index_obj != Py_None && (!PyBytes_Check(index_obj) ||
                                 PyBytes_Size(index_obj) != (Py_ssize_t)(table.count * sizeof(int32_t)))) {
        PyErr_Format(PyExc_ValueError, "param_index: expected None or %lld bytes (one int32 per tensor)",
                     (long long)(table.count * sizeof(int32_t)));
        goto error;
    }
    if (table.device >= 0 && hl_cuda_require(module, table.device) < 0)
        goto error;
    if (hl_tensor_from_object(dst_obj, "dst", HL_DTYPE_BIT(HL_UINT8), table.device, 1, &dst) < 0)
        goto error;
    if ((size_t)dst.numel < total) {
        PyErr_Format(PyExc_ValueError, "dst: expected at least %zu bytes for %lld tensors, got %lld", total,
                     (long long)table.count, (long long)dst.numel);
        goto error;
    }
    host = malloc(total);
    if (host == NULL) {
        PyErr_NoMemory();
        goto error;
    }
    memcpy(host, table.entries, entry_bytes);
    if (index_obj != Py_None)
        memcpy(host + entry_bytes, PyBytes_AsString(index_obj), total - entry_bytes);
    else
        for (int64_t i = 0; i < table.count; i++) {
            int32_t v = (int32_t)i;
            memcpy(host + entry_bytes + i * sizeof(int32_t), &v, sizeof(v));
        }
    if (table.device < 0) {
        memcpy(dst.data, host, total);
    } else {
#ifdef HOTLOOP_WITH_CUDA
        hl_cuda_status status = {0};
        Py_BEGIN_ALLOW_THREADS
        hl_device_guard guard;
        hl_device_enter(&guard, table.device, &status);
        /* from pageable memory: staged before the call returns, so `host` may go right after */
        HL_CUDA(&status, cudaMemcpyAsync(dst.data, host, total, cudaMemcpyHostToDevice, hl_stream(stream)));
        hl_device_leave(&guard, &status);
        Py_END_ALLOW_THREADS
        if (finish_cuda(module, &status) < 0)
            goto error;
#endif
    }
    result = Py_BuildValue("(LLLi)", (long long)table.count, (long long)table.total_chunks,
                           (long long)table.total_numel, table.device);
error:
    free(host);
    hl_tensor_release(&dst);
    hl_table_free(&table);
    return result;
}

static void *as_ptr(unsigned long long address) { return (void *)(uintptr_t)address; }

PyDoc_STRVAR(amp_check_doc,
             "amp_check(device, table, count, total_chunks, partials, scale, write, mode, p, max_norm, aux,\n"
             "          param_index, report, step, blocks, stream)\n\n"
             "The GradScaler's check pass and epilogue over a table from amp_table_upload (addresses as ints;\n"
             "0 for absent optional ones: scale, param_index, report). partials: 2 * total_chunks float32;\n"
             "aux: AMP_AUX_LEN float32. device -1 runs the C reference. Internal to hotloop.amp.");

static PyObject *amp_check(PyObject *module, PyObject *args) {
    int device, write, mode, blocks;
    unsigned long long table, partials, scale, aux, param_index, report, stream;
    long long count, total_chunks, step;
    float p, max_norm;
    if (!PyArg_ParseTuple(args, "iKLLKKiiffKKKLiK:amp_check", &device, &table, &count, &total_chunks, &partials,
                          &scale, &write, &mode, &p, &max_norm, &aux, &param_index, &report, &step, &blocks, &stream))
        return NULL;
    if (mode < HL_NORM_NONE || mode > HL_NORM_P || (write && mode != HL_NORM_NONE)) {
        PyErr_Format(PyExc_ValueError, "amp_check: bad mode %d (write=%d)", mode, write);
        return NULL;
    }
    if (count < 1 || total_chunks < 0 || table == 0 || aux == 0 || (total_chunks > 0 && partials == 0)) {
        PyErr_SetString(PyExc_ValueError, "amp_check: a required address or count is missing");
        return NULL;
    }
    if (device < 0) {
        Py_BEGIN_ALLOW_THREADS
        cpu_amp_check(as_ptr(table), count, total_chunks, as_ptr(partials), as_ptr(scale), write, mode, p);
        cpu_amp_epilogue(as_ptr(partials), total_chunks, mode, p, max_norm, as_ptr(scale), as_ptr(aux),
                         as_ptr(table), count, as_ptr(param_index), as_ptr(report), step);
        Py_END_ALLOW_THREADS
        Py_RETURN_NONE;
    }
    if (hl_cuda_require(module, device) < 0)
        return NULL;
#ifdef HOTLOOP_WITH_CUDA
    hl_cuda_status status = {0};
    Py_BEGIN_ALLOW_THREADS
    hl_device_guard guard;
    hl_device_enter(&guard, device, &status);
    HL_CUDA(&status, hl_launch_amp_check(as_ptr(table), count, total_chunks, as_ptr(partials), as_ptr(scale), write,
                                         mode, p, max_norm, as_ptr(aux), as_ptr(param_index), as_ptr(report), step,
                                         blocks, device, hl_stream(stream)));
    hl_device_leave(&guard, &status);
    Py_END_ALLOW_THREADS
    if (finish_cuda(module, &status) < 0)
        return NULL;
#endif
    (void)blocks;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(amp_apply_doc,
             "amp_apply(device, table, count, total_chunks, aux, unscale, clip, stream)\n\n"
             "Multiply every gradient of the table by aux's inverse scale and/or clip coefficient, in place,\n"
             "unless aux says the step is skipped. Internal to hotloop.amp.");

static PyObject *amp_apply(PyObject *module, PyObject *args) {
    int device, unscale, clip;
    unsigned long long table, aux, stream;
    long long count, total_chunks;
    if (!PyArg_ParseTuple(args, "iKLLKiiK:amp_apply", &device, &table, &count, &total_chunks, &aux, &unscale, &clip,
                          &stream))
        return NULL;
    if (count < 1 || table == 0 || aux == 0) {
        PyErr_SetString(PyExc_ValueError, "amp_apply: a required address or count is missing");
        return NULL;
    }
    if (device < 0) {
        Py_BEGIN_ALLOW_THREADS
        cpu_amp_apply(as_ptr(table), count, as_ptr(aux), unscale, clip);
        Py_END_ALLOW_THREADS
        Py_RETURN_NONE;
    }
    if (hl_cuda_require(module, device) < 0)
        return NULL;
#ifdef HOTLOOP_WITH_CUDA
    hl_cuda_status status = {0};
    Py_BEGIN_ALLOW_THREADS
    hl_device_guard guard;
    hl_device_enter(&guard, device, &status);
    HL_CUDA(&status, hl_launch_amp_apply(as_ptr(table), count, total_chunks, as_ptr(aux), unscale, clip, device,
                                         hl_stream(stream)));
    hl_device_leave(&guard, &status);
    Py_END_ALLOW_THREADS
    if (finish_cuda(module, &status) < 0)
        return NULL;
#endif
    Py_RETURN_NONE;
}

PyDoc_STRVAR(amp_update_doc,
             "amp_update(device, scale, growth_tracker, state, found, growth_factor, backoff_factor,\n"
             "           growth_interval, hysteresis, min_scale, max_scale, adjust, stream)\n\n"
             "The scale update on the device (one thread): `found` is a tuple of up to AMP_MAX_FOUND addresses\n"
             "of float32 found_inf values. adjust=0 only counts a skipped step. Internal to hotloop.amp.");

static PyObject *amp_update(PyObject *module, PyObject *args) {
    int device, adjust;
    unsigned long long scale, tracker, state, stream;
    PyObject *found_obj;
    double growth, backoff;
    long long interval, hysteresis;
    float min_scale, max_scale;
    hl_found_list found = {{0}, 0};
    if (!PyArg_ParseTuple(args, "iKKKOddLLffiK:amp_update", &device, &scale, &tracker, &state, &found_obj, &growth,
                          &backoff, &interval, &hysteresis, &min_scale, &max_scale, &adjust, &stream))
        return NULL;
    if (!PyTuple_Check(found_obj) || PyTuple_Size(found_obj) > HL_MAX_FOUND) {
        PyErr_Format(PyExc_ValueError, "amp_update: found: expected a tuple of at most %d addresses", HL_MAX_FOUND);
        return NULL;
    }
    found.count = (int)PyTuple_Size(found_obj);
    for (int i = 0; i < found.count; i++) {
        found.ptr[i] = as_ptr(PyLong_AsUnsignedLongLong(PyTuple_GetItem(found_obj, i)));
        if (PyErr_Occurred())
            return NULL;
    }
    if (scale == 0 || tracker == 0 || state == 0) {
        PyErr_SetString(PyExc_ValueError, "amp_update: a required address is missing");
        return NULL;
    }
    if (device < 0) {
        cpu_amp_update(as_ptr(scale), as_ptr(tracker), as_ptr(state), &found, growth, backoff, interval, hysteresis,
                       min_scale, max_scale, adjust);
        Py_RETURN_NONE;
    }
    if (hl_cuda_require(module, device) < 0)
        return NULL;
#ifdef HOTLOOP_WITH_CUDA
    hl_cuda_status status = {0};
    Py_BEGIN_ALLOW_THREADS
    hl_device_guard guard;
    hl_device_enter(&guard, device, &status);
    HL_CUDA(&status, hl_launch_amp_update(as_ptr(scale), as_ptr(tracker), as_ptr(state), &found, growth, backoff,
                                          interval, hysteresis, min_scale, max_scale, adjust, hl_stream(stream)));
    hl_device_leave(&guard, &status);
    Py_END_ALLOW_THREADS
    if (finish_cuda(module, &status) < 0)
        return NULL;
#endif
    Py_RETURN_NONE;
}

static PyMethodDef amp_methods[] = {
    {"non_finite_check", non_finite_check, METH_VARARGS, non_finite_check_doc},
    {"amp_table_upload", amp_table_upload, METH_VARARGS, amp_table_upload_doc},
    {"amp_check", amp_check, METH_VARARGS, amp_check_doc},
    {"amp_apply", amp_apply, METH_VARARGS, amp_apply_doc},
    {"amp_update", amp_update, METH_VARARGS, amp_update_doc},
    {NULL, NULL, 0, NULL},
};

int hl_amp_exec(PyObject *module) {
    if (PyModule_AddFunctions(module, amp_methods) < 0)
        return -1;
    if (PyModule_AddIntConstant(module, "AMP_AUX_LEN", HL_AUX_LEN) < 0 ||
        PyModule_AddIntConstant(module, "AMP_REPORT_LEN", HL_REPORT_LEN) < 0 ||
        PyModule_AddIntConstant(module, "AMP_STATE_LEN", HL_STATE_LEN) < 0 ||
        PyModule_AddIntConstant(module, "AMP_MAX_FOUND", HL_MAX_FOUND) < 0)
        return -1;
    return 0;
}
