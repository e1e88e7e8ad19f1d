/* Mixed-precision entry points: argument checks, CUDA launches, and the C reference kernels for CPU tensors. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cuda.h"
#include "half_convert.h"
#include "keyword_args.h"
#include "tensor.h"
#include "amp_math.h"
#include "amp_cpu.h"
#ifdef HOTLOOP_WITH_CUDA
#include "kernels.h"
#include "launch.h"
#endif

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
             "non_finite_check(packed_table, found, table_scratch, stream, threads=0)\n\n"
             "Set found[0] = 1.0 if any element of any tensor in the packed table is inf or NaN (float32,\n"
             "float16, bfloat16, mixed). `found` is a float32 tensor on the tensors' device; it is never\n"
             "cleared. On CUDA the table goes to `table_scratch` (uint8, TABLE_ENTRY_BYTES per tensor) and\n"
             "one kernel runs on `stream` (a cudaStream_t as int); nothing waits for it. CPU tensors take\n"
             "the C reference on up to `threads` threads (0: one per CPU; table_scratch may be None).");

static PyObject *non_finite_check(PyObject *module, PyObject *args) {
    PyObject *packed, *found_obj, *scratch_obj;
    unsigned long long stream = 0;
    int threads = 0;
    hl_table table = {0};
    hl_tensor found = {0}, scratch = {0};
    PyObject *result = NULL;

    if (!PyArg_ParseTuple(args, "OOOK|i:non_finite_check", &packed, &found_obj, &scratch_obj, &stream,
                          &threads))
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
        bad = hl_cpu_has_non_finite(table.entries, table.count, table.total_chunks, threads);
        Py_END_ALLOW_THREADS
        if (bad)
            *(float *)found.data = 1.0f;
    } else {
        if (take_table_scratch(scratch_obj, &table, &scratch) < 0)
            goto error;
#ifdef HOTLOOP_WITH_CUDA
        if (hl_kernels_require(module, table.device, HL_SOURCE_AMP) < 0)
            goto error;
        hl_cuda_status status = {0};
        Py_BEGIN_ALLOW_THREADS
        hl_device_guard guard;
        hl_device_enter(&guard, table.device, &status);
        hl_table_upload(scratch.data, table.entries, (size_t)table.count * sizeof(hl_table_entry), hl_stream(stream),
                        &status);
        HL_CUDA(&status, hl_launch_non_finite_check((const hl_table_entry *)scratch.data, table.count,
                                                    table.total_chunks, (float *)found.data, table.device,
                                                    hl_stream(stream)));
        hl_device_leave(&guard, &status);
        Py_END_ALLOW_THREADS
        if (hl_cuda_raise_if(module, &status) < 0)
            goto error;
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
   rounding to the gradient's dtype), and the bindings python/hotloop/amp/grad_checks.py and
   scale_state.py call every step. Per-step calls take raw addresses of tensors those allocated and
   keep alive (the gradients' addresses were checked once, when their table was packed), so a step
   costs no DLPack round trip.
   The table reaches the device through a pinned buffer and torch's own non-blocking copy, which
   never waits for the device and keeps the buffer until the copy is done.
   --------------------------------------------------------------------------------------------- */

/* The arguments of each pass, as grad_checks.py and scale_state.py pass them (addresses of tensors they
   keep alive). */
typedef struct {
    const hl_table_entry *table;
    int64_t count, total_chunks, step;
    float *partials;
    const float *scale;
    int write, mode, blocks, device;
    float p, max_norm;
    float *aux;
    const int32_t *param_index;
    int64_t *report;
    const float *extra;
    int n_extra;
} check_args;

typedef struct {
    const hl_table_entry *table;
    int64_t count, total_chunks;
    const float *aux;
    int unscale, clip, device, threads;
} apply_args;

typedef struct {
    float *scale;
    int32_t *growth_tracker;
    int64_t *state;
    hl_found_list found;
    double growth_factor, backoff_factor;
    int64_t growth_interval, hysteresis;
    float min_scale, max_scale;
    int adjust, device;
} update_args;

/* C reference of the check pass and the epilogue: the chunks of kernels/amp.cu (spread over `blocks`
   threads, 0: one per CPU), then the partials added in chunk order, so that the result is the same
   whatever the thread count */
static void cpu_check(const void *args) {
    const check_args *a = args;
    const float inv = a->scale != NULL ? (float)(1.0 / (double)*a->scale) : 1.0f;
    hl_cpu_amp_check(a->table, a->count, a->total_chunks, a->partials, inv, a->write, a->mode, a->p, a->blocks);
    int64_t first_bad = -1;
    double total = 0.0;
    for (int64_t chunk = 0; chunk < a->total_chunks; chunk++) {
        total = hl_norm_combine(a->mode, total, (double)a->partials[2 * chunk]);
        if (a->partials[2 * chunk + 1] != 0.0f && first_bad < 0)
            first_bad = chunk;
    }
    int found = first_bad >= 0;
    int64_t param = -1;
    if (found) {
        int64_t t;
        for (t = 0; t + 1 < a->count && a->table[t + 1].first_chunk <= first_bad; t++)
            ;
        param = a->param_index != NULL ? a->param_index[t] : t;
    }
    total = hl_amp_fold_extra(a->mode, total, a->extra, a->n_extra, &found, &param);
    hl_amp_finish(total, found, param, a->mode, a->p, a->max_norm, a->scale, a->aux);
    if (found && a->report != NULL) {
        a->report[HL_REPORT_PARAM] = param;
        a->report[HL_REPORT_STEP] = a->step;
        a->report[HL_REPORT_COUNT] += 1;
    }
}

static void cpu_apply(const void *args) {
    const apply_args *a = args;
    if (a->aux[HL_AUX_FOUND] != 0.0f)
        return;
    hl_cpu_amp_apply(a->table, a->count, a->total_chunks, a->aux[HL_AUX_INV_SCALE], a->aux[HL_AUX_CLIP], a->unscale,
                     a->clip, a->threads);
}

static void cpu_update(const void *args) {
    const update_args *a = args;
    float any = 0.0f; /* torch adds the optimizers' found_inf tensors */
    for (int i = 0; i < a->found.count; i++)
        any += *a->found.ptr[i];
    hl_amp_update_scale(a->scale, a->growth_tracker, a->state, any, a->growth_factor, a->backoff_factor,
                        a->growth_interval, a->hysteresis, a->min_scale, a->max_scale, a->adjust);
}

#ifdef HOTLOOP_WITH_CUDA
static int cuda_check(const void *args, void *stream) {
    const check_args *a = args;
    return hl_launch_amp_check(a->table, a->count, a->total_chunks, a->partials, a->scale, a->write, a->mode, a->p,
                               a->max_norm, a->aux, a->param_index, a->report, a->step, a->extra, a->n_extra,
                               a->blocks, a->device, stream);
}

static int cuda_apply(const void *args, void *stream) {
    const apply_args *a = args;
    return hl_launch_amp_apply(a->table, a->count, a->total_chunks, a->aux, a->unscale, a->clip, a->device, stream);
}

static int cuda_update(const void *args, void *stream) {
    const update_args *a = args;
    return hl_launch_amp_update(a->scale, a->growth_tracker, a->state, &a->found, a->growth_factor,
                                a->backoff_factor, a->growth_interval, a->hysteresis, a->min_scale, a->max_scale,
                                a->adjust, a->device, stream);
}
#define CUDA_PASS(f) f

/* one pass's launcher and arguments, in the shape hl_cuda_run calls */
typedef struct {
    int (*cuda)(const void *args, void *stream);
    const void *args;
    unsigned long long stream;
} pass_launch;

static CUresult launch_pass(void *ctx) {
    const pass_launch *p = ctx;
    return (CUresult)p->cuda(p->args, (void *)hl_stream(p->stream));
}
#else
#define CUDA_PASS(f) NULL
#endif

/* Run one pass without the GIL: the C reference for device -1, else its CUDA launcher on `device`
   and `stream` (the device made current for the call and put back after). */
static PyObject *run_pass(PyObject *module, int device, unsigned long long stream, void (*cpu)(const void *),
                          int (*cuda)(const void *, void *), const void *args) {
    if (device < 0) {
        Py_BEGIN_ALLOW_THREADS
        cpu(args);
        Py_END_ALLOW_THREADS
        Py_RETURN_NONE;
    }
    if (hl_cuda_require(module, device) < 0)
        return NULL;
#ifdef HOTLOOP_WITH_CUDA
    if (hl_kernels_require(module, device, HL_SOURCE_AMP) < 0)
        return NULL;
    pass_launch launch = {cuda, args, stream};
    if (hl_cuda_run(module, device, launch_pass, &launch) < 0)
        return NULL;
#else
    (void)cuda;
    (void)stream;
#endif
    Py_RETURN_NONE;
}

PyDoc_STRVAR(amp_table_pack_doc,
             "amp_table_pack(packed_table, param_index, dst) -> (count, total_chunks, total_numel, device)\n\n"
             "Check a packed gradient table (float32, float16, bfloat16 on one device) and write its entries,\n"
             "followed by `param_index` (count int32 as bytes, or None for 0, 1, ...), into `dst`: a host\n"
             "uint8 tensor (pinned when the table is for CUDA; the caller copies it to the device) of at least\n"
             "count * (TABLE_ENTRY_BYTES + 4) bytes. `device` is the gradients' device (-1: CPU).");

static PyObject *amp_table_pack(PyObject *module, PyObject *args) {
    (void)module;
    PyObject *packed, *index_obj, *dst_obj, *result = NULL;
    hl_table table = {0};
    hl_tensor dst = {0};

    if (!PyArg_ParseTuple(args, "OOO:amp_table_pack", &packed, &index_obj, &dst_obj))
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
    if (hl_tensor_from_object(dst_obj, "dst", HL_DTYPE_BIT(HL_UINT8), -1, 1, &dst) < 0)
        goto error;
    if ((size_t)dst.numel < total) {
        PyErr_Format(PyExc_ValueError, "dst: expected at least %zu bytes for %lld tensors, got %lld", total,
                     (long long)table.count, (long long)dst.numel);
        goto error;
    }
    memcpy(dst.data, table.entries, entry_bytes);
    if (index_obj != Py_None)
        memcpy(dst.data + entry_bytes, PyBytes_AsString(index_obj), total - entry_bytes);
    else
        for (int64_t i = 0; i < table.count; i++) {
            int32_t v = (int32_t)i;
            memcpy(dst.data + entry_bytes + i * sizeof(int32_t), &v, sizeof(v));
        }
    result = Py_BuildValue("(LLLi)", (long long)table.count, (long long)table.total_chunks,
                           (long long)table.total_numel, table.device);
error:
    hl_tensor_release(&dst);
    hl_table_free(&table);
    return result;
}

static void *as_ptr(unsigned long long address) { return (void *)(uintptr_t)address; }

PyDoc_STRVAR(amp_check_doc,
             "amp_check(*, device, table, count, total_chunks, partials, scale=0, write=False, mode, p, max_norm,\n"
             "          aux, param_index=0, report=0, step=0, extra=0, n_extra=0, blocks=0, stream)\n\n"
             "The GradScaler's check pass and epilogue over a table from amp_table_pack (addresses as ints;\n"
             "0 for absent optional ones: scale, param_index, report, extra). partials: 2 * total_chunks float32;\n"
             "aux: AMP_AUX_LEN float32; extra: n_extra * AMP_EXTRA_LEN float32 partials folded in after the\n"
             "table's (count 0 and table 0: the epilogue alone, on them). device -1 runs the C reference, on\n"
             "up to `blocks` threads (0: one per CPU; the result is the same for any count). Keywords only\n"
             "(NOTE [ Keyword-only seams ]). Internal to hotloop.amp.");

static PyObject *amp_check(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    check_args a = {0};
    unsigned long long table = 0, partials = 0, scale = 0, aux = 0, param_index = 0, report = 0, extra = 0, stream = 0;
    long long count = 0, total_chunks = 0, step = 0;
    hl_arg spec[] = {
        {"device", HL_ARG_INT, &a.device, 0},
        {"table", HL_ARG_ADDRESS, &table, 0},
        {"count", HL_ARG_INT64, &count, 0},
        {"total_chunks", HL_ARG_INT64, &total_chunks, 0},
        {"partials", HL_ARG_ADDRESS, &partials, 0},
        {"scale", HL_ARG_ADDRESS, &scale, 1},
        {"write", HL_ARG_BOOL, &a.write, 1},
        {"mode", HL_ARG_INT, &a.mode, 0},
        {"p", HL_ARG_FLOAT, &a.p, 0},
        {"max_norm", HL_ARG_FLOAT, &a.max_norm, 0},
        {"aux", HL_ARG_ADDRESS, &aux, 0},
        {"param_index", HL_ARG_ADDRESS, &param_index, 1},
        {"report", HL_ARG_ADDRESS, &report, 1},
        {"step", HL_ARG_INT64, &step, 1},
        {"extra", HL_ARG_ADDRESS, &extra, 1},
        {"n_extra", HL_ARG_INT, &a.n_extra, 1},
        {"blocks", HL_ARG_INT, &a.blocks, 1},
        {"stream", HL_ARG_ADDRESS, &stream, 0},
    };
    if (hl_parse_keywords("amp_check", args, nargs, kwnames, spec, HL_ARGS_COUNT(spec)) < 0)
        return NULL;
    if (a.mode < HL_NORM_NONE || a.mode > HL_NORM_P || (a.write && a.mode != HL_NORM_NONE)) {
        PyErr_Format(PyExc_ValueError, "amp_check: bad mode %d (write=%d)", a.mode, a.write);
        return NULL;
    }
    /* no table at all is allowed: the epilogue then runs on the extra partials alone */
    if (count < 0 || total_chunks < 0 || (count > 0 && table == 0) || (count == 0 && total_chunks != 0) ||
        aux == 0 || (total_chunks > 0 && partials == 0) || a.n_extra < 0 || (a.n_extra > 0 && extra == 0)) {
        PyErr_SetString(PyExc_ValueError, "amp_check: a required address or count is missing");
        return NULL;
    }
    a.table = as_ptr(table);
    a.count = count;
    a.total_chunks = total_chunks;
    a.step = step;
    a.partials = as_ptr(partials);
    a.scale = as_ptr(scale);
    a.aux = as_ptr(aux);
    a.param_index = as_ptr(param_index);
    a.report = as_ptr(report);
    a.extra = as_ptr(extra);
    return run_pass(module, a.device, stream, cpu_check, CUDA_PASS(cuda_check), &a);
}

PyDoc_STRVAR(amp_apply_doc,
             "amp_apply(*, device, table, count, total_chunks, aux, unscale, clip, stream, threads=0)\n\n"
             "Multiply every gradient of the table by aux's inverse scale and/or clip coefficient, in place,\n"
             "unless aux says the step is skipped. The C reference runs on up to `threads` threads (0: one\n"
             "per CPU). Keywords only (NOTE [ Keyword-only seams ]). Internal to hotloop.amp.");

static PyObject *amp_apply(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    apply_args a = {0};
    unsigned long long table = 0, aux = 0, stream = 0;
    long long count = 0, total_chunks = 0;
    hl_arg spec[] = {
        {"device", HL_ARG_INT, &a.device, 0},
        {"table", HL_ARG_ADDRESS, &table, 0},
        {"count", HL_ARG_INT64, &count, 0},
        {"total_chunks", HL_ARG_INT64, &total_chunks, 0},
        {"aux", HL_ARG_ADDRESS, &aux, 0},
        {"unscale", HL_ARG_BOOL, &a.unscale, 0},
        {"clip", HL_ARG_BOOL, &a.clip, 0},
        {"stream", HL_ARG_ADDRESS, &stream, 0},
        {"threads", HL_ARG_INT, &a.threads, 1},
    };
    if (hl_parse_keywords("amp_apply", args, nargs, kwnames, spec, HL_ARGS_COUNT(spec)) < 0)
        return NULL;
    if (count < 1 || table == 0 || aux == 0) {
        PyErr_SetString(PyExc_ValueError, "amp_apply: a required address or count is missing");
        return NULL;
    }
    a.table = as_ptr(table);
    a.count = count;
    a.total_chunks = total_chunks;
    a.aux = as_ptr(aux);
    return run_pass(module, a.device, stream, cpu_apply, CUDA_PASS(cuda_apply), &a);
}

PyDoc_STRVAR(amp_update_doc,
             "amp_update(*, device, scale, growth_tracker, state, found, growth_factor, backoff_factor,\n"
             "           growth_interval, hysteresis, min_scale, max_scale, adjust, stream)\n\n"
             "The scale update on the device (one thread): `found` is a tuple of up to AMP_MAX_FOUND addresses\n"
             "of float32 found_inf values. adjust=False only counts a skipped step. Keywords only (NOTE\n"
             "[ Keyword-only seams ]). Internal to hotloop.amp.");

static PyObject *amp_update(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    update_args a;
    unsigned long long scale = 0, tracker = 0, state = 0, stream = 0;
    PyObject *found_obj = NULL;
    long long interval = 0, hysteresis = 0;
    memset(&a, 0, sizeof(a));
    hl_arg spec[] = {
        {"device", HL_ARG_INT, &a.device, 0},
        {"scale", HL_ARG_ADDRESS, &scale, 0},
        {"growth_tracker", HL_ARG_ADDRESS, &tracker, 0},
        {"state", HL_ARG_ADDRESS, &state, 0},
        {"found", HL_ARG_OBJECT, &found_obj, 0},
        {"growth_factor", HL_ARG_DOUBLE, &a.growth_factor, 0},
        {"backoff_factor", HL_ARG_DOUBLE, &a.backoff_factor, 0},
        {"growth_interval", HL_ARG_INT64, &interval, 0},
        {"hysteresis", HL_ARG_INT64, &hysteresis, 0},
        {"min_scale", HL_ARG_FLOAT, &a.min_scale, 0},
        {"max_scale", HL_ARG_FLOAT, &a.max_scale, 0},
        {"adjust", HL_ARG_BOOL, &a.adjust, 0},
        {"stream", HL_ARG_ADDRESS, &stream, 0},
    };
    if (hl_parse_keywords("amp_update", args, nargs, kwnames, spec, HL_ARGS_COUNT(spec)) < 0)
        return NULL;
    if (!PyTuple_Check(found_obj) || PyTuple_Size(found_obj) > HL_MAX_FOUND) {
        PyErr_Format(PyExc_ValueError, "amp_update: found: expected a tuple of at most %d addresses", HL_MAX_FOUND);
        return NULL;
    }
    a.found.count = (int)PyTuple_Size(found_obj);
    for (int i = 0; i < a.found.count; i++) {
        a.found.ptr[i] = as_ptr(PyLong_AsUnsignedLongLong(PyTuple_GetItem(found_obj, i)));
        if (PyErr_Occurred())
            return NULL;
    }
    if (scale == 0 || tracker == 0 || state == 0) {
        PyErr_SetString(PyExc_ValueError, "amp_update: a required address is missing");
        return NULL;
    }
    a.scale = as_ptr(scale);
    a.growth_tracker = as_ptr(tracker);
    a.state = as_ptr(state);
    a.growth_interval = interval;
    a.hysteresis = hysteresis;
    return run_pass(module, a.device, stream, cpu_update, CUDA_PASS(cuda_update), &a);
}

static PyMethodDef amp_methods[] = {
    {"non_finite_check", non_finite_check, METH_VARARGS, non_finite_check_doc},
    {"amp_table_pack", amp_table_pack, METH_VARARGS, amp_table_pack_doc},
    {"amp_check", HL_FASTCALL_KEYWORDS(amp_check), METH_FASTCALL | METH_KEYWORDS, amp_check_doc},
    {"amp_apply", HL_FASTCALL_KEYWORDS(amp_apply), METH_FASTCALL | METH_KEYWORDS, amp_apply_doc},
    {"amp_update", HL_FASTCALL_KEYWORDS(amp_update), METH_FASTCALL | METH_KEYWORDS, amp_update_doc},
    {NULL, NULL, 0, NULL},
};

/* kernels/amp_layout.h's slots and modes, for python/hotloop/amp/grad_scaler.py */
static const hl_int_constant amp_constants[] = {
    {"AMP_AUX_LEN", HL_AUX_LEN},
    {"AMP_REPORT_LEN", HL_REPORT_LEN},
    {"AMP_STATE_LEN", HL_STATE_LEN},
    {"AMP_MAX_FOUND", HL_MAX_FOUND},
    {"AMP_AUX_FOUND", HL_AUX_FOUND},
    {"AMP_AUX_NORM", HL_AUX_NORM},
    {"AMP_AUX_CLIP", HL_AUX_CLIP},
    {"AMP_AUX_INV_SCALE", HL_AUX_INV_SCALE},
    {"AMP_AUX_GRAD_SCALE", HL_AUX_GRAD_SCALE},
    {"AMP_AUX_ACC", HL_AUX_ACC},
    {"AMP_AUX_PARAM", HL_AUX_PARAM},
    {"AMP_EXTRA_LEN", HL_EXTRA_LEN},
    {"AMP_EXTRA_ACC", HL_EXTRA_ACC},
    {"AMP_EXTRA_FOUND", HL_EXTRA_FOUND},
    {"AMP_EXTRA_PARAM", HL_EXTRA_PARAM},
    {"AMP_STATE_SKIPPED", HL_STATE_SKIPPED},
    {"AMP_STATE_HYSTERESIS", HL_STATE_HYSTERESIS},
    {"AMP_REPORT_PARAM", HL_REPORT_PARAM},
    {"AMP_REPORT_STEP", HL_REPORT_STEP},
    {"AMP_REPORT_COUNT", HL_REPORT_COUNT},
    {"AMP_NORM_NONE", HL_NORM_NONE},
    {"AMP_NORM_L2", HL_NORM_L2},
    {"AMP_NORM_INF", HL_NORM_INF},
    {"AMP_NORM_P", HL_NORM_P},
    {NULL, 0},
};

int hl_amp_exec(PyObject *module) {
    if (PyModule_AddFunctions(module, amp_methods) < 0)
        return -1;
    return hl_add_int_constants(module, amp_constants);
}
