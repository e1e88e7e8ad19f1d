/* Fused optimizer entry points: argument checks, the CUDA launch, and the C reference for CPU tensors. */
#include <stdlib.h>
#include <string.h>

#include "cuda.h"
#include "half_convert.h"
#include "optim_math.h"
#include "tensor.h"
#ifdef HOTLOOP_WITH_CUDA
#include "optim.h"
#endif

/* element i of a gradient of dtype `dtype` as float, widened exactly as the kernel widens it */
static float load_grad(int dtype, uint64_t grad, int64_t i) {
    const void *g = (const void *)(uintptr_t)grad;
    if (dtype == HL_FLOAT32)
        return ((const float *)g)[i];
    if (dtype == HL_FLOAT16)
        return hl_half_to_float(((const uint16_t *)g)[i]);
    return hl_bf16_to_float(((const uint16_t *)g)[i]);
}

/* C reference of kernels/optim.cu: the same per-element maths (kernels/optim_math.h), tensor by
   tensor, then the step counts. Reads the skip flag and the factor as the kernel does. */
static void cpu_adam(const hl_adam_entry *table, int64_t count, const hl_adam_hyper *hyper, const float *grad_scale,
                     const float *found_inf) {
    if (found_inf != NULL && *found_inf != 0.0f)
        return;
    const int has_scale = grad_scale != NULL;
    const float scale = has_scale ? *grad_scale : 1.0f;
    for (int64_t t = 0; t < count; t++) {
        const hl_adam_entry *e = &table[t];
        const hl_adam_scalars s = hl_adam_scalars_for(hyper, *(const float *)(uintptr_t)e->step);
        float *p = (float *)(uintptr_t)e->param, *m = (float *)(uintptr_t)e->exp_avg;
        float *v = (float *)(uintptr_t)e->exp_avg_sq, *vmax = (float *)(uintptr_t)e->max_exp_avg_sq;
        for (int64_t i = 0; i < e->numel; i++)
            hl_adam_element(&s, load_grad(e->grad_dtype, e->grad, i), scale, has_scale, p + i, m + i, v + i,
                            vmax != NULL ? vmax + i : NULL);
    }
    for (int64_t t = 0; t < count; t++) {
        float *step = (float *)(uintptr_t)table[t].step;
        *step = *step + 1.0f;
    }
}

/* C reference of the SGD kernel */
static void cpu_sgd(const hl_sgd_entry *table, int64_t count, const hl_sgd_hyper *hyper, const float *grad_scale,
                    const float *found_inf) {
    if (found_inf != NULL && *found_inf != 0.0f)
        return;
    const int has_scale = grad_scale != NULL;
    const float scale = has_scale ? *grad_scale : 1.0f;
    for (int64_t t = 0; t < count; t++) {
        const hl_sgd_entry *e = &table[t];
        float *p = (float *)(uintptr_t)e->param, *buf = (float *)(uintptr_t)e->momentum_buffer;
        for (int64_t i = 0; i < e->numel; i++)
            hl_sgd_element(hyper, load_grad(e->grad_dtype, e->grad, i), scale, has_scale, p + i,
                           buf != NULL ? buf + i : NULL);
    }
}

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

/* grad_scale / found_inf: None, or one float32 element on the parameters' device */
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

#ifdef HOTLOOP_WITH_CUDA
typedef struct {
    const hl_adam_entry *host;
    void *device_table;
    int64_t count, total_chunks;
    const hl_adam_hyper *hyper;
    const float *grad_scale, *found_inf;
    int device;
    unsigned long long stream;
} adam_launch;

static cudaError_t launch_adam(void *ctx) {
    const adam_launch *a = ctx;
    /* from pageable memory the runtime stages the bytes before it returns, so `host` may go after */
    cudaError_t err = cudaMemcpyAsync(a->device_table, a->host, (size_t)a->count * sizeof(hl_adam_entry),
                                      cudaMemcpyHostToDevice, hl_stream(a->stream));
    if (err != cudaSuccess)
        return err;
    return hl_launch_adam((const hl_adam_entry *)a->device_table, a->count, a->total_chunks, a->hyper, a->grad_scale,
                          a->found_inf, a->device, hl_stream(a->stream));
}
#endif

PyDoc_STRVAR(optim_adam_doc,
             "optim_adam(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, lr, beta1, beta2, eps,\n"
             "           weight_decay, decoupled, amsgrad, maximize, grad_scale, found_inf, table_scratch, stream)\n\n"
             "One Adam (decoupled=False) or AdamW (decoupled=True) step over packed tensor tables, one entry per\n"
             "parameter: params, exp_avgs, exp_avg_sqs, max_exp_avg_sqs (None without amsgrad) float32; grads\n"
             "float32, float16 or bfloat16 (read, never written); steps one float32 each (steps taken so far).\n"
             "grad_scale (None or one float32 on the parameters' device) divides every gradient; when found_inf\n"
             "(None or one float32) is non-zero nothing changes. CUDA: the table goes to table_scratch (uint8,\n"
             "OPTIM_ADAM_ENTRY_BYTES per parameter) and the kernels run on `stream`; nothing waits for them.\n"
             "CPU tensors take the C reference (table_scratch may be None). Internal to hotloop.optim.");

static PyObject *optim_adam(PyObject *module, PyObject *args) {
    PyObject *params_obj, *grads_obj, *m_obj, *v_obj, *vmax_obj, *steps_obj, *scale_obj, *found_obj, *scratch_obj;
    double lr, beta1, beta2;
    float eps, weight_decay;
    int decoupled, amsgrad, maximize;
    unsigned long long stream = 0;
    hl_table params = {0}, grads = {0}, m = {0}, v = {0}, vmax = {0}, steps = {0};
    hl_tensor scale = {0}, found = {0}, scratch = {0};
    hl_adam_entry *entries = NULL;
    PyObject *result = NULL;

    if (!PyArg_ParseTuple(args, "OOOOOOdddffpppOOOK:optim_adam", &params_obj, &grads_obj, &m_obj, &v_obj, &vmax_obj,
                          &steps_obj, &lr, &beta1, &beta2, &eps, &weight_decay, &decoupled, &amsgrad, &maximize,
                          &scale_obj, &found_obj, &scratch_obj, &stream))
        return NULL;
    if (amsgrad != (vmax_obj != Py_None)) {
        PyErr_SetString(PyExc_ValueError, "max_exp_avg_sqs: expected a table with amsgrad and None without it");
        return NULL;
    }
    if (hl_table_parse(params_obj, "params", HL_DTYPE_BIT(HL_FLOAT32), &params) < 0)
        return NULL;
    if (hl_table_parse(grads_obj, "grads", HL_FLOATING_MASK, &grads) < 0 || check_matches(&params, &grads, "grads", 0) < 0)
        goto error;
    if (hl_table_parse(m_obj, "exp_avgs", HL_DTYPE_BIT(HL_FLOAT32), &m) < 0 ||
        check_matches(&params, &m, "exp_avgs", 0) < 0)
        goto error;
    if (hl_table_parse(v_obj, "exp_avg_sqs", HL_DTYPE_BIT(HL_FLOAT32), &v) < 0 ||
        check_matches(&params, &v, "exp_avg_sqs", 0) < 0)
        goto error;
    if (amsgrad && (hl_table_parse(vmax_obj, "max_exp_avg_sqs", HL_DTYPE_BIT(HL_FLOAT32), &vmax) < 0 ||
                    check_matches(&params, &vmax, "max_exp_avg_sqs", 0) < 0))
        goto error;
    if (hl_table_parse(steps_obj, "steps", HL_DTYPE_BIT(HL_FLOAT32), &steps) < 0 ||
        check_matches(&params, &steps, "steps", 1) < 0)
        goto error;
    const int device = params.device;
    if (device >= 0 && hl_cuda_require(module, device) < 0)
        goto error;
    const float *scale_ptr, *found_ptr;
    if (take_scalar(scale_obj, "grad_scale", device, &scale, &scale_ptr) < 0 ||
        take_scalar(found_obj, "found_inf", device, &found, &found_ptr) < 0)
        goto error;
    if (device >= 0) {
        if (hl_tensor_from_object(scratch_obj, "table_scratch", HL_DTYPE_BIT(HL_UINT8), device, 1, &scratch) < 0)
            goto error;
        const int64_t need = params.count * (int64_t)sizeof(hl_adam_entry);
        if (scratch.numel < need) {
            PyErr_Format(PyExc_ValueError, "table_scratch: expected at least %lld bytes for %lld tensors, got %lld",
                         (long long)need, (long long)params.count, (long long)scratch.numel);
            goto error;
        }
    }

    entries = malloc((size_t)params.count * sizeof(hl_adam_entry));
    if (entries == NULL) {
        PyErr_NoMemory();
        goto error;
    }
    for (int64_t i = 0; i < params.count; i++) {
        hl_adam_entry *e = &entries[i];
        e->param = params.entries[i].data;
        e->grad = grads.entries[i].data;
        e->exp_avg = m.entries[i].data;
        e->exp_avg_sq = v.entries[i].data;
        e->max_exp_avg_sq = amsgrad ? vmax.entries[i].data : 0;
        e->step = steps.entries[i].data;
        e->numel = params.entries[i].numel;
        e->first_chunk = params.entries[i].first_chunk;
        e->grad_dtype = grads.entries[i].dtype;
        e->reserved = 0;
    }
    const hl_adam_hyper hyper = {lr, beta1, beta2, eps, weight_decay, decoupled, amsgrad, maximize};

    if (device < 0) {
        Py_BEGIN_ALLOW_THREADS
        cpu_adam(entries, params.count, &hyper, scale_ptr, found_ptr);
        Py_END_ALLOW_THREADS
    } else {
#ifdef HOTLOOP_WITH_CUDA
        adam_launch launch = {entries, scratch.data, params.count, params.total_chunks, &hyper,
                              scale_ptr, found_ptr, device, stream};
        if (hl_cuda_run(module, device, launch_adam, &launch) < 0)
            goto error;
#else
        (void)stream;
#endif
    }
    result = Py_NewRef(Py_None);
error:
    free(entries);
    hl_tensor_release(&scratch);
    hl_tensor_release(&found);
    hl_tensor_release(&scale);
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
    const hl_sgd_entry *host;
    void *device_table;
    int64_t count, total_chunks;
    const hl_sgd_hyper *hyper;
    const float *grad_scale, *found_inf;
    int device;
    unsigned long long stream;
} sgd_launch;

static cudaError_t launch_sgd(void *ctx) {
    const sgd_launch *a = ctx;
    cudaError_t err = cudaMemcpyAsync(a->device_table, a->host, (size_t)a->count * sizeof(hl_sgd_entry),
                                      cudaMemcpyHostToDevice, hl_stream(a->stream));
    if (err != cudaSuccess)
        return err;
    return hl_launch_sgd((const hl_sgd_entry *)a->device_table, a->count, a->total_chunks, a->hyper, a->grad_scale,
                         a->found_inf, a->device, hl_stream(a->stream));
}
#endif

PyDoc_STRVAR(optim_sgd_doc,
             "optim_sgd(params, grads, momentum_buffers, lr, momentum, dampening, weight_decay, nesterov, maximize,\n"
             "          first_step, grad_scale, found_inf, table_scratch, stream)\n\n"
             "One SGD step over packed tensor tables, one entry per parameter: params float32; grads float32,\n"
             "float16 or bfloat16 (never written); momentum_buffers float32 (None without momentum), which take\n"
             "the gradient as it is when first_step. grad_scale, found_inf, table_scratch (OPTIM_SGD_ENTRY_BYTES\n"
             "per parameter) and stream as optim_adam takes them. Internal to hotloop.optim.");

static PyObject *optim_sgd(PyObject *module, PyObject *args) {
    PyObject *params_obj, *grads_obj, *buf_obj, *scale_obj, *found_obj, *scratch_obj;
    float lr, momentum, dampening, weight_decay;
    int nesterov, maximize, first_step;
    unsigned long long stream = 0;
    hl_table params = {0}, grads = {0}, bufs = {0};
    hl_tensor scale = {0}, found = {0}, scratch = {0};
    hl_sgd_entry *entries = NULL;
    PyObject *result = NULL;

    if (!PyArg_ParseTuple(args, "OOOffffpppOOOK:optim_sgd", &params_obj, &grads_obj, &buf_obj, &lr, &momentum,
                          &dampening, &weight_decay, &nesterov, &maximize, &first_step, &scale_obj, &found_obj,
                          &scratch_obj, &stream))
        return NULL;
    if ((momentum != 0.0f) != (buf_obj != Py_None)) {
        PyErr_SetString(PyExc_ValueError, "momentum_buffers: expected a table with momentum and None without it");
        return NULL;
    }
    if (hl_table_parse(params_obj, "params", HL_DTYPE_BIT(HL_FLOAT32), &params) < 0)
        return NULL;
    if (hl_table_parse(grads_obj, "grads", HL_FLOATING_MASK, &grads) < 0 || check_matches(&params, &grads, "grads", 0) < 0)
        goto error;
    if (buf_obj != Py_None && (hl_table_parse(buf_obj, "momentum_buffers", HL_DTYPE_BIT(HL_FLOAT32), &bufs) < 0 ||
                               check_matches(&params, &bufs, "momentum_buffers", 0) < 0))
        goto error;
    const int device = params.device;
    if (device >= 0 && hl_cuda_require(module, device) < 0)
        goto error;
    const float *scale_ptr, *found_ptr;
    if (take_scalar(scale_obj, "grad_scale", device, &scale, &scale_ptr) < 0 ||
        take_scalar(found_obj, "found_inf", device, &found, &found_ptr) < 0)
        goto error;
    if (device >= 0) {
        if (hl_tensor_from_object(scratch_obj, "table_scratch", HL_DTYPE_BIT(HL_UINT8), device, 1, &scratch) < 0)
            goto error;
        const int64_t need = params.count * (int64_t)sizeof(hl_sgd_entry);
        if (scratch.numel < need) {
            PyErr_Format(PyExc_ValueError, "table_scratch: expected at least %lld bytes for %lld tensors, got %lld",
                         (long long)need, (long long)params.count, (long long)scratch.numel);
            goto error;
        }
    }
    entries = malloc((size_t)params.count * sizeof(hl_sgd_entry));
    if (entries == NULL) {
        PyErr_NoMemory();
        goto error;
    }
    for (int64_t i = 0; i < params.count; i++) {
        hl_sgd_entry *e = &entries[i];
        e->param = params.entries[i].data;
        e->grad = grads.entries[i].data;
        e->momentum_buffer = buf_obj != Py_None ? bufs.entries[i].data : 0;
        e->numel = params.entries[i].numel;
        e->first_chunk = params.entries[i].first_chunk;
        e->grad_dtype = grads.entries[i].dtype;
        e->reserved = 0;
    }
    const hl_sgd_hyper hyper = {lr, momentum, 1.0f - dampening, weight_decay, nesterov, maximize, first_step};
    if (device < 0) {
        Py_BEGIN_ALLOW_THREADS
        cpu_sgd(entries, params.count, &hyper, scale_ptr, found_ptr);
        Py_END_ALLOW_THREADS
    } else {
#ifdef HOTLOOP_WITH_CUDA
        sgd_launch launch = {entries, scratch.data, params.count, params.total_chunks, &hyper,
                             scale_ptr, found_ptr, device, stream};
        if (hl_cuda_run(module, device, launch_sgd, &launch) < 0)
            goto error;
#else
        (void)stream;
#endif
    }
    result = Py_NewRef(Py_None);
error:
    free(entries);
    hl_tensor_release(&scratch);
    hl_tensor_release(&found);
    hl_tensor_release(&scale);
    hl_table_free(&bufs);
    hl_table_free(&grads);
    hl_table_free(&params);
    return result;
}

static PyMethodDef optim_methods[] = {
    {"optim_adam", optim_adam, METH_VARARGS, optim_adam_doc},
    {"optim_sgd", optim_sgd, METH_VARARGS, optim_sgd_doc},
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
