/* hotloop._C.normalize: uint8 HWC image batch -> normalised float NCHW/channels_last; CUDA launch and C reference. */
#include <string.h>

#include "cuda.h"
#include "half_convert.h"
#include "tensor.h"
#include "normalize.h"
#ifdef HOTLOOP_WITH_CUDA
#include "kernels.h"
#include "launch.h"
#endif

/* C reference of kernels/normalize.cu, element for element */
static void cpu_normalize(const uint8_t *src, void *dst, int dtype, int64_t n, int64_t h, int64_t w, int64_t c,
                          int channels_last, const hl_normalize_params *p) {
    size_t hw = (size_t)h * (size_t)w, total = (size_t)n * hw * (size_t)c;
    for (size_t o = 0; o < total; o++) {
        size_t in;
        int ch;
        if (channels_last) {
            in = o;
            ch = (int)(o % (size_t)c);
        } else {
            size_t plane = o / hw;
            ch = (int)(plane % (size_t)c);
            in = ((plane / (size_t)c) * hw + o % hw) * (size_t)c + (size_t)ch;
        }
        /* volatile: keep the two roundings (no FMA contraction, no reciprocal) */
        volatile float d = (float)src[in] - p->mean[ch];
        float y = d / p->std[ch];
        if (dtype == HL_FLOAT16)
            ((uint16_t *)dst)[o] = hl_float_to_half(y);
        else if (dtype == HL_BFLOAT16)
            ((uint16_t *)dst)[o] = hl_float_to_bf16(y);
        else
            ((float *)dst)[o] = y;
    }
}

#ifdef HOTLOOP_WITH_CUDA
typedef struct {
    const hl_tensor *src, *dst;
    int channels_last;
    const hl_normalize_params *params;
    CUstream stream;
} normalize_launch;

static CUresult run_normalize(void *ctx) {
    const normalize_launch *l = (const normalize_launch *)ctx;
    const int64_t *shape = l->src->shape;
    return hl_launch_normalize((const uint8_t *)l->src->data, l->dst->data, l->dst->dtype, shape[0], shape[1], shape[2],
                               shape[3], l->channels_last, *l->params, l->src->device, l->stream);
}
#endif

static int read_floats(PyObject *seq, const char *argname, int64_t count, float *out) {
    PyObject *list = PySequence_List(seq);
    if (list == NULL)
        return -1;
    int rc = -1;
    if (PyList_Size(list) != count) {
        PyErr_Format(PyExc_ValueError, "%s: expected %lld values (one per channel), got %zd", argname,
                     (long long)count, PyList_Size(list));
        goto error;
    }
    for (int64_t i = 0; i < count; i++) {
        double v = PyFloat_AsDouble(PyList_GetItem(list, (Py_ssize_t)i));
        if (v == -1.0 && PyErr_Occurred())
            goto error;
        out[i] = (float)v;
    }
    rc = 0;
error:
    Py_DECREF(list);
    return rc;
}

PyDoc_STRVAR(normalize_doc,
             "normalize(src, dst, mean, std, channels_last, stream)\n\n"
             "dst = (float(src) - mean[c]) / std[c] in float32, rounded once to dst's dtype. src: uint8\n"
             "[n, h, w, c], contiguous. dst: float32/float16/bfloat16 with n*c*h*w elements, contiguous in\n"
             "NCHW order, or in NHWC order when channels_last (pass out.permute(0, 2, 3, 1)). mean and\n"
             "std: c floats each, in the units of src (0-255). CUDA tensors: one kernel on `stream`;\n"
             "CPU tensors: the C reference, GIL released.");

static PyObject *normalize(PyObject *module, PyObject *args) {
    PyObject *src_obj, *dst_obj, *mean_obj, *std_obj, *result = NULL;
    int channels_last;
    unsigned long long stream = 0;
    hl_tensor src = {0}, dst = {0};
    hl_normalize_params params;
    memset(&params, 0, sizeof(params));
    if (!PyArg_ParseTuple(args, "OOOOpK:normalize", &src_obj, &dst_obj, &mean_obj, &std_obj, &channels_last,
                          &stream))
        return NULL;
    if (hl_tensor_from_object(src_obj, "src", HL_DTYPE_BIT(HL_UINT8), HL_ANY_DEVICE, 0, &src) < 0)
        goto error;
    if (hl_tensor_from_object(dst_obj, "dst", HL_FLOATING_MASK, src.device, 1, &dst) < 0)
        goto error;
    if (src.ndim != 4) {
        PyErr_Format(PyExc_ValueError, "src: expected a uint8 batch of shape [n, h, w, c], got %d dimensions",
                     src.ndim);
        goto error;
    }
    int64_t n = src.shape[0], h = src.shape[1], w = src.shape[2], c = src.shape[3];
    if (c < 1 || c > HL_NORMALIZE_MAX_CHANNELS) {
        PyErr_Format(PyExc_ValueError, "src: expected 1 to %d channels (the last dimension), got %lld",
                     HL_NORMALIZE_MAX_CHANNELS, (long long)c);
        goto error;
    }
    if (dst.numel != src.numel) {
        PyErr_Format(PyExc_ValueError, "dst: expected %lld elements like src, got %lld", (long long)src.numel,
                     (long long)dst.numel);
        goto error;
    }
    if (read_floats(mean_obj, "mean", c, params.mean) < 0 || read_floats(std_obj, "std", c, params.std) < 0)
        goto error;
    if (src.device < 0) {
        Py_BEGIN_ALLOW_THREADS
        cpu_normalize((const uint8_t *)src.data, dst.data, dst.dtype, n, h, w, c, channels_last, &params);
        Py_END_ALLOW_THREADS
    } else {
        if (hl_cuda_require(module, src.device) < 0)
            goto error;
#ifdef HOTLOOP_WITH_CUDA
        if (hl_kernels_require(module, src.device, HL_SOURCE_NORMALIZE) < 0)
            goto error;
        normalize_launch launch = {&src, &dst, channels_last, &params, hl_stream(stream)};
        if (hl_cuda_run(module, src.device, run_normalize, &launch) < 0)
            goto error;
#endif
    }
    result = Py_NewRef(Py_None);
error:
    hl_tensor_release(&dst);
    hl_tensor_release(&src);
    return result;
}

static PyMethodDef normalize_methods[] = {
    {"normalize", normalize, METH_VARARGS, normalize_doc},
    {NULL, NULL, 0, NULL},
};

static const hl_int_constant normalize_constants[] = {
    {"NORMALIZE_MAX_CHANNELS", HL_NORMALIZE_MAX_CHANNELS},
    {NULL, 0},
};

int hl_normalize_exec(PyObject *module) {
    if (PyModule_AddFunctions(module, normalize_methods) < 0)
        return -1;
    return hl_add_int_constants(module, normalize_constants);
}
