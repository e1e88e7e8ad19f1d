/* Fused optimizer entry points: argument checks, then the CUDA launch or the C reference for CPU tensors (optim_cpu.c). */
#include <stdlib.h>
#include <string.h>

#include "cuda.h"
#include "keyword_args.h"
#include "optim_cpu.h"
#include "optim_math.h"
#include "tensor.h"
#ifdef HOTLOOP_WITH_CUDA
#include "kernels.h"
#include "launch.h"
#endif

/* `tables[k]` must match the parameters entry for entry: same count, device and element counts
   (`numel1`: one element each, for the step counts). */
static int check_matches(const hl_table *params, const hl_table *other, const char *argname, int numel1) {
    if (other->count != params->count) {
        PyErr_Format(PyExc_ValueError, "%s: expected %lld tensors (one per parameter), got %lld", argname,
                     (long long)params->count, (long long)other->count);
        return -1;
    }
    if (other->device != params->device) {
        PyObject *want = hl_device_name(params->device), *got = hl_device_name(other->device);
        if (want != NULL && got != NULL)
            PyErr_Format(PyExc_ValueError, "%s: expected tensors on the parameters' device %U, got %U", argname, want,
                         got);
        Py_XDECREF(want);
        Py_XDECREF(got);
        return -1;
    }
    for (int64_t i = 0; i < params->count; i++) {
        const int64_t want = numel1 ? 1 : params->entries[i].numel;
        if (other->entries[i].numel != want) {
            PyErr_Format(PyExc_ValueError, "%s: tensor %lld: expected %lld elements, got %lld", argname, (long long)i,
                         (long long)want, (long long)other->entries[i].numel);
            return -1;
        }
    }
    return 0;
}

/* how a table's dtypes must follow the parameters': not at all (the step counts, float32 whatever the
   parameter's), as a state tensor (the parameter's own: torch's fused optimizers keep the moments and
   buffers in it), or as a gradient (the parameter's, or any of the three for a float32 parameter) */
enum dtype_rule { DTYPE_FREE, DTYPE_OF_PARAM, DTYPE_OF_GRAD };

static int check_dtypes(const hl_table *params, const hl_table *other, const char *argname, enum dtype_rule rule) {
    if (rule == DTYPE_FREE)
        return 0;
    for (int64_t i = 0; i < params->count; i++) {
        const int want = params->entries[i].dtype, got = other->entries[i].dtype;
        if (got == want || (rule == DTYPE_OF_GRAD && want == HL_FLOAT32))
            continue;
        PyErr_Format(PyExc_TypeError, "%s: tensor %lld: expected %s (its parameter's dtype%s), got %s", argname,
                     (long long)i, hl_dtype_name(want),
                     rule == DTYPE_OF_GRAD ? "; only a float32 parameter takes a gradient of another" : "",
                     hl_dtype_name(got));
        return -1;
    }
    return 0;
}

/* `obj` parsed as a table of `dtypes` that matches `params` (check_matches, check_dtypes by `rule`); None
   is an empty table where `optional`, else hl_table_parse's TypeError */
static int take_matching(PyObject *obj, const char *argname, unsigned int dtypes, const hl_table *params, int numel1,
                         int optional, enum dtype_rule rule, hl_table *out) {
    if (optional && obj == Py_None)
        return 0;
    return hl_table_parse(obj, argname, dtypes, out) < 0 || check_matches(params, out, argname, numel1) < 0 ||
                   check_dtypes(params, out, argname, rule) < 0
               ? -1
               : 0;
}

/* lr / grad_scale / found_inf: None, or one float32 element on the parameters' device */
static int take_scalar(PyObject *obj, const char *argname, int device, hl_tensor *out, const float **ptr) {
    *ptr = NULL;
    if (obj == Py_None)
        return 0;
    if (hl_tensor_from_object(obj, argname, HL_DTYPE_BIT(HL_FLOAT32), device, 0, out) < 0)
        return -1;
    if (out->numel != 1) {
        PyErr_Format(PyExc_ValueError, "%s: expected one element, got %lld", argname, (long long)out->numel);
        return -1;
    }
    *ptr = (const float *)out->data;
    return 0;
}

/* `dst`: a writable host uint8 tensor of at least `need` bytes, for the entries of a table */
static int take_dst(PyObject *obj, int64_t need, int64_t count, hl_tensor *out) {
    if (hl_tensor_from_object(obj, "dst", HL_DTYPE_BIT(HL_UINT8), -1, 1, out) < 0)
        return -1;
    if (out->numel < need) {
        PyErr_Format(PyExc_ValueError, "dst: expected at least %lld bytes for %lld tensors, got %lld", (long long)need,
                     (long long)count, (long long)out->numel);
        return -1;
    }
    return 0;
}

/* `table`: a uint8 tensor on `device` holding at least `need` bytes of entries */
static int take_table(PyObject *obj, int device, int64_t need, hl_tensor *out) {
    if (hl_tensor_from_object(obj, "table", HL_DTYPE_BIT(HL_UINT8), device, 0, out) < 0)
        return -1;
    if (out->numel < need) {
        PyErr_Format(PyExc_ValueError, "table: expected at least %lld bytes, got %lld", (long long)need,
                     (long long)out->numel);
        return -1;
    }
    return 0;
}

/* a host copy of the entries in `table` (its bytes may sit at any alignment), or NULL with MemoryError */
static void *host_entries(const hl_tensor *table, size_t nbytes) {
    void *entries = malloc(nbytes > 0 ? nbytes : 1);
    if (entries == NULL)
        PyErr_NoMemory();
    else
        memcpy(entries, table->data, nbytes);
    return entries;
}

PyDoc_STRVAR(optim_adam_table_doc,
             "optim_adam_table(*, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs=None, steps, dst)\n"
             "    -> (count, total_chunks, device)\n\n"
             "Check packed tensor tables, one entry per parameter (params float32, float16 or bfloat16;\n"
             "exp_avgs, exp_avg_sqs, max_exp_avg_sqs (None without amsgrad) of their parameter's dtype; grads\n"
             "of it too, or float32, float16 or bfloat16 for a float32 parameter; steps one float32 each, the\n"
             "steps taken so far), all on one device, and write the Adam kernel's entries into\n"
             "`dst`, a host uint8 tensor of at least OPTIM_ADAM_ENTRY_BYTES per parameter (pinned when the\n"
             "caller copies it to a GPU). The entries hold addresses: they are valid while those tensors are.\n"
             "`device` is the tensors' CUDA device, -1 for the CPU. Keywords only (NOTE [ Keyword-only\n"
             "seams ]). Internal to hotloop.optim.");

static PyObject *optim_adam_table(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    (void)module;
    PyObject *params_obj = NULL, *grads_obj = NULL, *m_obj = NULL, *v_obj = NULL, *vmax_obj = Py_None;
    PyObject *steps_obj = NULL, *dst_obj = NULL;
    hl_table params = {0}, grads = {0}, m = {0}, v = {0}, vmax = {0}, steps = {0};
    hl_tensor dst = {0};
    PyObject *result = NULL;
    hl_arg spec[] = {
        {"params", HL_ARG_OBJECT, &params_obj, 0},
        {"grads", HL_ARG_OBJECT, &grads_obj, 0},
        {"exp_avgs", HL_ARG_OBJECT, &m_obj, 0},
        {"exp_avg_sqs", HL_ARG_OBJECT, &v_obj, 0},
        {"max_exp_avg_sqs", HL_ARG_OBJECT, &vmax_obj, 1},
        {"steps", HL_ARG_OBJECT, &steps_obj, 0},
        {"dst", HL_ARG_OBJECT, &dst_obj, 0},
    };
    if (hl_parse_keywords("optim_adam_table", args, nargs, kwnames, spec, HL_ARGS_COUNT(spec)) < 0)
        return NULL;
    const int amsgrad = vmax_obj != Py_None;
    if (hl_table_parse(params_obj, "params", HL_FLOATING_MASK, &params) < 0)
        return NULL;
    const unsigned int floating = HL_FLOATING_MASK;
    if (take_matching(grads_obj, "grads", floating, &params, 0, 0, DTYPE_OF_GRAD, &grads) < 0 ||
        take_matching(m_obj, "exp_avgs", floating, &params, 0, 0, DTYPE_OF_PARAM, &m) < 0 ||
        take_matching(v_obj, "exp_avg_sqs", floating, &params, 0, 0, DTYPE_OF_PARAM, &v) < 0 ||
        take_matching(vmax_obj, "max_exp_avg_sqs", floating, &params, 0, 1, DTYPE_OF_PARAM, &vmax) < 0 ||
        take_matching(steps_obj, "steps", HL_DTYPE_BIT(HL_FLOAT32), &params, 1, 0, DTYPE_FREE, &steps) < 0)
        goto error;
    if (take_dst(dst_obj, params.count * (int64_t)sizeof(hl_adam_entry), params.count, &dst) < 0)
        goto error;
    for (int64_t i = 0; i < params.count; i++) {
        hl_adam_entry e = {0};
        e.param = params.entries[i].data;
        e.grad = grads.entries[i].data;
        e.exp_avg = m.entries[i].data;
        e.exp_avg_sq = v.entries[i].data;
        e.max_exp_avg_sq = amsgrad ? vmax.entries[i].data : 0;
        e.step = steps.entries[i].data;
        e.numel = params.entries[i].numel;
        e.first_chunk = params.entries[i].first_chunk;
        e.grad_dtype = grads.entries[i].dtype;
        e.param_dtype = params.entries[i].dtype;
        memcpy(dst.data + i * (int64_t)sizeof(e), &e, sizeof(e));
    }
    result = Py_BuildValue("(LLi)", (long long)params.count, (long long)params.total_chunks, params.device);
error:
    hl_tensor_release(&dst);
    hl_table_free(&steps);
    hl_table_free(&vmax);
    hl_table_free(&v);
    hl_table_free(&m);
    hl_table_free(&grads);
    hl_table_free(&params);
    return result;
}

#ifdef HOTLOOP_WITH_CUDA
typedef struct {
    const void *table;
    int64_t count, total_chunks;
    const void *hyper;
    const float *lr, *grad_scale, *found_inf;
    int device;
    unsigned long long stream;
} optim_launch;

static CUresult launch_adam(void *ctx) {
    const optim_launch *a = ctx;
    return hl_launch_adam(a->table, a->count, a->total_chunks, a->hyper, a->lr, a->grad_scale, a->found_inf,
                          a->device, hl_stream(a->stream));
}

static CUresult launch_sgd(void *ctx) {
    const optim_launch *a = ctx;
    return hl_launch_sgd(a->table, a->count, a->total_chunks, a->hyper, a->lr, a->grad_scale, a->found_inf,
                         a->device, hl_stream(a->stream));
}
#endif

/* the scalars of one step, checked against the table's device: lr_tensor, grad_scale, found_inf */
typedef struct {
    hl_tensor lr, scale, found;
    const float *lr_ptr, *scale_ptr, *found_ptr;
} step_scalars;

static int take_step_scalars(PyObject *lr_obj, PyObject *scale_obj, PyObject *found_obj, int device,
                             step_scalars *out) {
    return take_scalar(lr_obj, "lr", device, &out->lr, &out->lr_ptr) < 0 ||
                   take_scalar(scale_obj, "grad_scale", device, &out->scale, &out->scale_ptr) < 0 ||
                   take_scalar(found_obj, "found_inf", device, &out->found, &out->found_ptr) < 0
               ? -1
               : 0;
}

static void release_step_scalars(step_scalars *s) {
    hl_tensor_release(&s->found);
    hl_tensor_release(&s->scale);
    hl_tensor_release(&s->lr);
}

/* run the C reference (device < 0) or the kernels on `stream` over the entries in `table` */
static int run_step(PyObject *module, int is_adam, const hl_tensor *table, int64_t count, int64_t total_chunks,
                    const void *hyper, const step_scalars *s, int device, unsigned long long stream, int threads) {
    const size_t nbytes = (size_t)count * (is_adam ? sizeof(hl_adam_entry) : sizeof(hl_sgd_entry));
    if (device < 0) {
        void *entries = host_entries(table, nbytes);
        if (entries == NULL)
            return -1;
        Py_BEGIN_ALLOW_THREADS
        if (is_adam)
            hl_cpu_adam(entries, count, total_chunks, hyper, s->lr_ptr, s->scale_ptr, s->found_ptr, threads);
        else
            hl_cpu_sgd(entries, count, total_chunks, hyper, s->lr_ptr, s->scale_ptr, s->found_ptr, threads);
        Py_END_ALLOW_THREADS
        free(entries);
        return 0;
    }
#ifdef HOTLOOP_WITH_CUDA
    if (hl_cuda_require(module, device) < 0 || hl_kernels_require(module, device, HL_SOURCE_OPTIM) < 0)
        return -1;
    optim_launch launch = {table->data, count, total_chunks, hyper, s->lr_ptr, s->scale_ptr, s->found_ptr, device,
                           stream};
    return hl_cuda_run(module, device, is_adam ? launch_adam : launch_sgd, &launch);
#else
    (void)module;
    (void)stream;
    PyErr_SetString(PyExc_RuntimeError, "hotloop was built without CUDA");
    return -1;
#endif
}

/* what optim_adam and optim_sgd take besides their hyperparameters (borrowed objects) */
typedef struct {
    PyObject *table, *lr, *scale, *found;
    long long count, total_chunks;
    int device, threads;
    unsigned long long stream;
} step_args;

/* optim_adam's and optim_sgd's common part: the table and scalars checked, then run_step */
static PyObject *step_call(PyObject *module, int is_adam, const step_args *c, const void *hyper) {
    hl_tensor table = {0};
    step_scalars s = {0};
    PyObject *result = NULL;
    if (c->count < 0 || c->total_chunks < 0) {
        PyErr_SetString(PyExc_ValueError, "count and total_chunks: expected >= 0");
        return NULL;
    }
    if (c->threads < 1) {
        PyErr_Format(PyExc_ValueError, "threads: expected >= 1, got %d", c->threads);
        return NULL;
    }
    const int64_t entry_bytes = is_adam ? (int64_t)sizeof(hl_adam_entry) : (int64_t)sizeof(hl_sgd_entry);
    if (take_table(c->table, c->device, c->count * entry_bytes, &table) < 0 ||
        take_step_scalars(c->lr, c->scale, c->found, c->device, &s) < 0)
        goto error;
    if (run_step(module, is_adam, &table, c->count, c->total_chunks, hyper, &s, c->device, c->stream, c->threads) < 0)
        goto error;
    result = Py_NewRef(Py_None);
error:
    release_step_scalars(&s);
    hl_tensor_release(&table);
    return result;
}

PyDoc_STRVAR(optim_adam_doc,
             "optim_adam(*, table, count, total_chunks, device, lr, lr_tensor, beta1, beta2, eps, weight_decay,\n"
             "           decoupled, maximize, grad_scale, found_inf, stream, threads=1)\n\n"
             "One Adam (decoupled=False) or AdamW (decoupled=True) step over the `count` entries that\n"
             "optim_adam_table wrote, now in `table` (uint8, on `device`: a GPU's memory, or the host for -1);\n"
             "amsgrad where the entries have max_exp_avg_sqs. The learning rate is lr_tensor (None or one float32\n"
             "on `device`, read when the kernel runs) or else `lr`. grad_scale (None or one float32 on `device`)\n"
             "divides every gradient, read once and never written; when found_inf (None or one float32) is\n"
             "non-zero nothing changes. CUDA: two kernels on `stream`, nothing waits for them and nothing is\n"
             "copied from the host, so a graph can capture the call. CPU: the C reference on up to `threads`\n"
             "threads. Keywords only (NOTE [ Keyword-only seams ]). Internal to hotloop.optim.");

/* the hl_arg entries of the step_args that optim_adam and optim_sgd share: before and after their
   hyperparameters */
#define STEP_SPEC(c)                                                                                   \
    {"table", HL_ARG_OBJECT, &(c).table, 0}, {"count", HL_ARG_INT64, &(c).count, 0},                  \
        {"total_chunks", HL_ARG_INT64, &(c).total_chunks, 0}, {"device", HL_ARG_INT, &(c).device, 0}
#define STEP_TAIL_SPEC(c)                                                                                   \
    {"grad_scale", HL_ARG_OBJECT, &(c).scale, 0}, {"found_inf", HL_ARG_OBJECT, &(c).found, 0},              \
        {"stream", HL_ARG_ADDRESS, &(c).stream, 0}, {"threads", HL_ARG_INT, &(c).threads, 1}

static PyObject *optim_adam(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    step_args c = {.threads = 1};
    int decoupled = 0, maximize = 0;
    hl_adam_hyper hyper = {0};
    hl_arg spec[] = {
        STEP_SPEC(c),
        {"lr", HL_ARG_DOUBLE, &hyper.lr, 0},
        {"lr_tensor", HL_ARG_OBJECT, &c.lr, 0},
        {"beta1", HL_ARG_DOUBLE, &hyper.beta1, 0},
        {"beta2", HL_ARG_DOUBLE, &hyper.beta2, 0},
        {"eps", HL_ARG_DOUBLE, &hyper.eps, 0},
        {"weight_decay", HL_ARG_DOUBLE, &hyper.weight_decay, 0},
        {"decoupled", HL_ARG_BOOL, &decoupled, 0},
        {"maximize", HL_ARG_BOOL, &maximize, 0},
        STEP_TAIL_SPEC(c),
    };
    if (hl_parse_keywords("optim_adam", args, nargs, kwnames, spec, HL_ARGS_COUNT(spec)) < 0)
        return NULL;
    hyper.decoupled = decoupled;
    hyper.maximize = maximize;
    return step_call(module, 1, &c, &hyper);
}

PyDoc_STRVAR(optim_sgd_table_doc,
             "optim_sgd_table(params, grads, momentum_buffers, dst) -> (count, total_chunks, device)\n\n"
             "Check packed tensor tables, one entry per parameter (params, grads and momentum_buffers, None\n"
             "without momentum, with optim_adam_table's dtypes) on one device and write the SGD\n"
             "kernel's entries into `dst` (OPTIM_SGD_ENTRY_BYTES per parameter), as optim_adam_table does.");

static PyObject *optim_sgd_table(PyObject *module, PyObject *args) {
    (void)module;
    PyObject *params_obj, *grads_obj, *buf_obj, *dst_obj;
    hl_table params = {0}, grads = {0}, bufs = {0};
    hl_tensor dst = {0};
    PyObject *result = NULL;

    if (!PyArg_ParseTuple(args, "OOOO:optim_sgd_table", &params_obj, &grads_obj, &buf_obj, &dst_obj))
        return NULL;
    const int has_bufs = buf_obj != Py_None;
    if (hl_table_parse(params_obj, "params", HL_FLOATING_MASK, &params) < 0)
        return NULL;
    if (take_matching(grads_obj, "grads", HL_FLOATING_MASK, &params, 0, 0, DTYPE_OF_GRAD, &grads) < 0 ||
        take_matching(buf_obj, "momentum_buffers", HL_FLOATING_MASK, &params, 0, 1, DTYPE_OF_PARAM, &bufs) < 0)
        goto error;
    if (take_dst(dst_obj, params.count * (int64_t)sizeof(hl_sgd_entry), params.count, &dst) < 0)
        goto error;
    for (int64_t i = 0; i < params.count; i++) {
        hl_sgd_entry e = {0};
        e.param = params.entries[i].data;
        e.grad = grads.entries[i].data;
        e.momentum_buffer = has_bufs ? bufs.entries[i].data : 0;
        e.numel = params.entries[i].numel;
        e.first_chunk = params.entries[i].first_chunk;
        e.grad_dtype = grads.entries[i].dtype;
        e.param_dtype = params.entries[i].dtype;
        memcpy(dst.data + i * (int64_t)sizeof(e), &e, sizeof(e));
    }
    result = Py_BuildValue("(LLi)", (long long)params.count, (long long)params.total_chunks, params.device);
error:
    hl_tensor_release(&dst);
    hl_table_free(&bufs);
    hl_table_free(&grads);
    hl_table_free(&params);
    return result;
}

PyDoc_STRVAR(optim_sgd_doc,
             "optim_sgd(*, table, count, total_chunks, device, lr, lr_tensor, momentum, dampening, weight_decay,\n"
             "          nesterov, maximize, first_step, grad_scale, found_inf, stream, threads=1)\n\n"
             "One SGD step over the entries optim_sgd_table wrote, now in `table`; momentum where the entries\n"
             "have buffers, which take the gradient as it is when first_step. lr, lr_tensor, grad_scale,\n"
             "found_inf, stream and threads as optim_adam takes them; one kernel. Keywords only (NOTE\n"
             "[ Keyword-only seams ]). Internal to hotloop.optim.");

static PyObject *optim_sgd(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    step_args c = {.threads = 1};
    int nesterov = 0, maximize = 0, first_step = 0;
    double dampening = 0.0;
    hl_sgd_hyper hyper = {0};
    hl_arg spec[] = {
        STEP_SPEC(c),
        {"lr", HL_ARG_DOUBLE, &hyper.lr, 0},
        {"lr_tensor", HL_ARG_OBJECT, &c.lr, 0},
        {"momentum", HL_ARG_DOUBLE, &hyper.momentum, 0},
        {"dampening", HL_ARG_DOUBLE, &dampening, 0},
        {"weight_decay", HL_ARG_DOUBLE, &hyper.weight_decay, 0},
        {"nesterov", HL_ARG_BOOL, &nesterov, 0},
        {"maximize", HL_ARG_BOOL, &maximize, 0},
        {"first_step", HL_ARG_BOOL, &first_step, 0},
        STEP_TAIL_SPEC(c),
    };
    if (hl_parse_keywords("optim_sgd", args, nargs, kwnames, spec, HL_ARGS_COUNT(spec)) < 0)
        return NULL;
    hyper.one_minus_dampening = (double)(1.0f - (float)dampening); /* in float, as torch's (1 - dampening) */
    hyper.nesterov = nesterov;
    hyper.maximize = maximize;
    hyper.first_step = first_step;
    return step_call(module, 0, &c, &hyper);
}

PyDoc_STRVAR(optim_count_steps_doc,
             "optim_count_steps(steps)\n\n"
             "Add one to each step count of a packed table (tensor_table.pack) of one-element float32 CPU\n"
             "tensors, in float32 as torch._foreach_add_(steps, 1) does: what a step by torch's fused CPU kernel\n"
             "does first (optim/torch_cpu_step.py), in one call instead of one dispatch per tensor. TypeError\n"
             "or ValueError, before any count changes, for another dtype, size or device.");

static PyObject *optim_count_steps(PyObject *module, PyObject *packed) {
    (void)module;
    hl_table steps;
    if (hl_table_parse(packed, "steps", HL_DTYPE_BIT(HL_FLOAT32), &steps) < 0)
        return NULL;
    int ok = steps.device == -1;
    for (int64_t i = 0; i < steps.count && ok; i++)
        ok = steps.entries[i].numel == 1;
    if (!ok)
        PyErr_SetString(PyExc_ValueError, "optim_count_steps: steps: expected one-element CPU tensors");
    for (int64_t i = 0; i < steps.count && ok; i++)
        *(float *)(uintptr_t)steps.entries[i].data += 1.0f;
    hl_table_free(&steps);
    if (!ok)
        return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef optim_methods[] = {
    {"optim_adam_table", HL_FASTCALL_KEYWORDS(optim_adam_table), METH_FASTCALL | METH_KEYWORDS,
     optim_adam_table_doc},
    {"optim_adam", HL_FASTCALL_KEYWORDS(optim_adam), METH_FASTCALL | METH_KEYWORDS, optim_adam_doc},
    {"optim_sgd_table", optim_sgd_table, METH_VARARGS, optim_sgd_table_doc},
    {"optim_sgd", HL_FASTCALL_KEYWORDS(optim_sgd), METH_FASTCALL | METH_KEYWORDS, optim_sgd_doc},
    {"optim_count_steps", optim_count_steps, METH_O, optim_count_steps_doc},
    {NULL, NULL, 0, NULL},
};

static const hl_int_constant optim_constants[] = {
    {"OPTIM_ADAM_ENTRY_BYTES", (long)sizeof(hl_adam_entry)},
    {"OPTIM_SGD_ENTRY_BYTES", (long)sizeof(hl_sgd_entry)},
    {NULL, 0},
};

int hl_optim_exec(PyObject *module) {
    if (PyModule_AddFunctions(module, optim_methods) < 0)
        return -1;
    return hl_add_int_constants(module, optim_constants);
}
