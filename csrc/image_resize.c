/* hotloop._C.image_resize: a batch of differently sized uint8 images cropped, resized, flipped and normalised; CUDA launch and C reference. */
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

#include "cuda.h"
#include "half_convert.h"
#include "keyword_args.h"
#include "tensor.h"
#include "image_resize.h"
#include "image_resize_math.h"
#ifdef HOTLOOP_WITH_CUDA
#include "kernels.h"
#include "launch.h"
#endif

#define OUT_DTYPES (HL_FLOATING_MASK | HL_DTYPE_BIT(HL_UINT8))

static void store(void *out, size_t i, uint8_t q, int c, int dtype, const hl_image_resize_params *p) {
    if (dtype == HL_UINT8) {
        ((uint8_t *)out)[i] = q;
        return;
    }
    float y = hl_resize_normalize(q, p->scale, p->mean[c], p->std[c]);
    if (dtype == HL_FLOAT16)
        ((uint16_t *)out)[i] = hl_float_to_half(y);
    else if (dtype == HL_BFLOAT16)
        ((uint16_t *)out)[i] = hl_float_to_bf16(y);
    else
        ((float *)out)[i] = y;
}

/* C reference of kernels/image_resize.cu for image n: Pillow's two passes, output row by output row
   (each row resamples the crop rows it needs horizontally, then sums them), with the kernel's
   weights and integer sums, so every value is the kernel's. 0, or -1 when out of memory. */
static int cpu_resize_one(const hl_image_entry *e, int64_t n, void *out, int dtype, int64_t h, int64_t w,
                          int channels_last, const hl_image_resize_params *p) {
    const int ch = e->channels;
    hl_resize_taps *cols = malloc((size_t)w * sizeof(*cols));
    uint8_t *line = malloc((size_t)w * (size_t)ch);
    int32_t *acc = malloc((size_t)w * (size_t)ch * sizeof(*acc));
    int32_t *wx = NULL;
    int rc = -1;
    if (cols == NULL || line == NULL || acc == NULL)
        goto done;
    int32_t stride = 0;
    for (int64_t x = 0; x < w; x++) {
        int64_t col = e->out_left + (e->flip ? w - 1 - x : x);
        cols[x] = hl_resize_taps_of(e->box_w, e->resized_w, (int32_t)col);
        stride = cols[x].count > stride ? cols[x].count : stride;
    }
    wx = malloc((size_t)w * (size_t)stride * sizeof(*wx));
    if (wx == NULL)
        goto done;
    for (int64_t x = 0; x < w; x++)
        for (int32_t k = 0; k < cols[x].count; k++)
            wx[x * stride + k] = hl_resize_weight(&cols[x], k);

    for (int64_t y = 0; y < h; y++) {
        hl_resize_taps f = hl_resize_taps_of(e->box_h, e->resized_h, (int32_t)(e->out_top + y));
        for (int64_t i = 0; i < w * ch; i++)
            acc[i] = HL_RESIZE_HALF;
        for (int32_t k = 0; k < f.count; k++) {
            const uint8_t *row = (const uint8_t *)(uintptr_t)e->src +
                                 (size_t)(e->box_top + f.first + k) * (size_t)e->src_pitch +
                                 (size_t)e->box_left * (size_t)ch;
            for (int64_t x = 0; x < w; x++) { /* the horizontal pass, rounded to uint8 */
                const uint8_t *px = row + (size_t)cols[x].first * (size_t)ch;
                const int32_t *kx = &wx[x * stride];
                for (int c = 0; c < ch; c++) {
                    int32_t s = HL_RESIZE_HALF;
                    for (int32_t j = 0; j < cols[x].count; j++)
                        s += kx[j] * px[j * ch + c];
                    line[x * ch + c] = hl_resize_clip8(s);
                }
            }
            int32_t ky = hl_resize_weight(&f, k);
            for (int64_t i = 0; i < w * ch; i++)
                acc[i] += ky * line[i];
        }
        for (int64_t x = 0; x < w; x++)
            for (int c = 0; c < 3; c++) {
                uint8_t q = hl_resize_clip8(acc[x * ch + (ch == 3 ? c : 0)]);
                size_t i = channels_last ? (size_t)(((n * h + y) * w + x) * 3 + c)
                                         : (size_t)(((n * 3 + c) * h + y) * w + x);
                store(out, i, q, c, dtype, p);
            }
    }
    rc = 0;
done:
    free(wx);
    free(acc);
    free(line);
    free(cols);
    return rc;
}

static int cpu_image_resize(const hl_image_entry *entries, int64_t count, void *out, int dtype, int64_t h, int64_t w,
                            int channels_last, const hl_image_resize_params *p) {
    for (int64_t n = 0; n < count; n++)
        if (cpu_resize_one(&entries[n], n, out, dtype, h, w, channels_last, p) < 0)
            return -1;
    return 0;
}

/* ValueError "table: entry 3: box_h: ..." */
static int entry_error(int64_t i, const char *field, const char *format, ...) {
    va_list va;
    va_start(va, format);
    PyObject *detail = PyUnicode_FromFormatV(format, va);
    va_end(va);
    if (detail != NULL) {
        PyErr_Format(PyExc_ValueError, "table: entry %lld: %s: %U", (long long)i, field, detail);
        Py_DECREF(detail);
    }
    return -1;
}

static int check_side(int64_t i, const char *field, int32_t v) {
    if (v < 1 || v > HL_IMAGE_MAX_SIDE)
        return entry_error(i, field, "expected 1 to %d (IMAGE_MAX_SIDE), got %d", HL_IMAGE_MAX_SIDE, (int)v);
    return 0;
}

/* Everything the kernel relies on, in 64-bit arithmetic: a bad entry is named before any kernel runs. */
static int check_entry(int64_t i, const hl_image_entry *e, int64_t h, int64_t w) {
    if (e->channels != 1 && e->channels != 3)
        return entry_error(i, "channels", "expected 1 (grey) or 3 (RGB), got %d", (int)e->channels);
    if (check_side(i, "src_h", e->src_h) < 0 || check_side(i, "src_w", e->src_w) < 0)
        return -1;
    int64_t row_bytes = (int64_t)e->src_w * e->channels;
    if (e->src_pitch < row_bytes)
        return entry_error(i, "src_pitch", "expected at least src_w * channels = %lld bytes, got %lld",
                           (long long)row_bytes, (long long)e->src_pitch);
    if (e->src_h > 1 && e->src_pitch > (INT64_MAX - row_bytes) / (e->src_h - 1))
        return entry_error(i, "src_pitch", "%lld bytes a row over %d rows overflows 64 bits", (long long)e->src_pitch,
                           (int)e->src_h);
    uint64_t span = (uint64_t)(e->src_pitch * (e->src_h - 1) + row_bytes);
    if (e->src == 0)
        return entry_error(i, "src", "null pointer");
    if (e->src > UINT64_MAX - span)
        return entry_error(i, "src", "the image's %llu bytes from 0x%llx wrap around the address space",
                           (unsigned long long)span, (unsigned long long)e->src);
    if (check_side(i, "box_h", e->box_h) < 0 || check_side(i, "box_w", e->box_w) < 0)
        return -1;
    if (e->box_top < 0 || (int64_t)e->box_top + e->box_h > e->src_h)
        return entry_error(i, "box_top", "rows [%d, %lld) of the crop are not inside the image's %d rows",
                           (int)e->box_top, (long long)e->box_top + e->box_h, (int)e->src_h);
    if (e->box_left < 0 || (int64_t)e->box_left + e->box_w > e->src_w)
        return entry_error(i, "box_left", "columns [%d, %lld) of the crop are not inside the image's %d columns",
                           (int)e->box_left, (long long)e->box_left + e->box_w, (int)e->src_w);
    if (check_side(i, "resized_h", e->resized_h) < 0 || check_side(i, "resized_w", e->resized_w) < 0)
        return -1;
    if (e->out_top < 0 || e->out_top + h > e->resized_h)
        return entry_error(i, "out_top", "the window's rows [%d, %lld) are not inside the resized crop's %d rows",
                           (int)e->out_top, (long long)(e->out_top + h), (int)e->resized_h);
    if (e->out_left < 0 || e->out_left + w > e->resized_w)
        return entry_error(i, "out_left",
                           "the window's columns [%d, %lld) are not inside the resized crop's %d columns",
                           (int)e->out_left, (long long)(e->out_left + w), (int)e->resized_w);
    if (e->flip != 0 && e->flip != 1)
        return entry_error(i, "flip", "expected 0 or 1, got %d", (int)e->flip);
    return 0;
}

/* The first `count` entries of the packed table, copied to malloc'd memory (read without the GIL,
   uploaded from there) and checked. NULL with an exception set. */
static hl_image_entry *read_entries(PyObject *table, int64_t count, int64_t h, int64_t w) {
    char *bytes = NULL;
    Py_ssize_t size = 0;
    if (!PyBytes_Check(table)) {
        PyObject *type = PyObject_GetAttrString((PyObject *)Py_TYPE(table), "__qualname__");
        if (type != NULL)
            PyErr_Format(PyExc_TypeError, "table: expected bytes (from pack_entries), got %U", type);
        Py_XDECREF(type);
        return NULL;
    }
    if (PyBytes_AsStringAndSize(table, &bytes, &size) < 0)
        return NULL;
    if (count < 0 || count > (int64_t)(size / HL_IMAGE_ENTRY_BYTES)) {
        PyErr_Format(PyExc_ValueError, "count: expected 0 to %zd (a table of %zd bytes holds %zd entries of %d), got %lld",
                     size / HL_IMAGE_ENTRY_BYTES, size, size / HL_IMAGE_ENTRY_BYTES, HL_IMAGE_ENTRY_BYTES,
                     (long long)count);
        return NULL;
    }
    hl_image_entry *entries = malloc((size_t)(count > 0 ? count : 1) * sizeof(hl_image_entry));
    if (entries == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    memcpy(entries, bytes, (size_t)count * sizeof(hl_image_entry));
    for (int64_t i = 0; i < count; i++)
        if (check_entry(i, &entries[i], h, w) < 0) {
            free(entries);
            return NULL;
        }
    return entries;
}

static int read_params(PyObject *mean, PyObject *std, double scale, int dtype, hl_image_resize_params *p) {
    PyObject *seqs[2] = {mean, std};
    const char *names[2] = {"mean", "std"};
    float *dst[2] = {p->mean, p->std};
    for (int s = 0; s < 2; s++) {
        PyObject *list = PySequence_List(seqs[s]);
        if (list == NULL)
            return -1;
        if (PyList_Size(list) != 3) {
            PyErr_Format(PyExc_ValueError, "%s: expected 3 values (R, G, B), got %zd", names[s], PyList_Size(list));
            Py_DECREF(list);
            return -1;
        }
        for (Py_ssize_t c = 0; c < 3; c++) {
            double v = PyFloat_AsDouble(PyList_GetItem(list, c));
            dst[s][c] = (float)v;
            if (v == -1.0 && PyErr_Occurred()) {
                Py_DECREF(list);
                return -1;
            }
        }
        Py_DECREF(list);
    }
    p->scale = (float)scale;
    if (dtype != HL_UINT8) {
        if (p->scale == 0.0f || p->std[0] == 0.0f || p->std[1] == 0.0f || p->std[2] == 0.0f) {
            PyErr_SetString(PyExc_ValueError, "scale and std must not be zero (they divide)");
            return -1;
        }
    }
    return 0;
}

PyDoc_STRVAR(image_resize_doc,
             "image_resize(*, table, count, table_dev, out, channels_last, mean, std, scale, stream,\n"
             "             table_host=None)\n\n"
             "Crop, resize (antialiased bilinear, Pillow's arithmetic: horizontal pass, rounded to uint8,\n"
             "then vertical), window, flip and normalise `count` uint8 images into `out`. table: bytes,\n"
             "at least count * IMAGE_ENTRY_BYTES, one packed hl_image_entry per image (pack_entries).\n"
             "out: uint8, float32, float16 or bfloat16, contiguous [count, 3, h, w], or [count, h, w, 3]\n"
             "when channels_last. A float output holds ((q / scale) - mean[c]) / std[c] computed in\n"
             "float32 (ToTensor then Normalize), a uint8 one q. CUDA `out`: the table goes to `table_dev`\n"
             "(uint8 on out's device, at least count * IMAGE_ENTRY_BYTES, 8-byte aligned) and one kernel\n"
             "runs on `stream`; nothing waits for it, and the images must stay alive until it ran. table_host:\n"
             "None, or page-locked uint8 host memory of as many bytes that the table is copied through (and\n"
             "that must then stay unchanged until `stream` passed the copy): from pageable memory the\n"
             "driver may wait for the stream before it copies. CPU `out`: the C reference, GIL released\n"
             "(table_dev and table_host unused; the entries hold host pointers). Keywords only (NOTE\n"
             "[ Keyword-only seams ]).");

static PyObject *image_resize(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    PyObject *table_obj = NULL, *table_dev_obj = NULL, *out_obj = NULL, *mean_obj = NULL, *std_obj = NULL;
    PyObject *table_host_obj = Py_None, *result = NULL;
    long long count = 0;
    int channels_last = 0;
    double scale = 0.0;
    unsigned long long stream = 0;
    hl_tensor out = {0}, table_dev = {0}, table_host = {0};
    hl_image_entry *entries = NULL;
    hl_image_resize_params params;
    memset(&params, 0, sizeof(params));
    hl_arg spec[] = {
        {"table", HL_ARG_OBJECT, &table_obj, 0},
        {"count", HL_ARG_INT64, &count, 0},
        {"table_dev", HL_ARG_OBJECT, &table_dev_obj, 0},
        {"out", HL_ARG_OBJECT, &out_obj, 0},
        {"channels_last", HL_ARG_BOOL, &channels_last, 0},
        {"mean", HL_ARG_OBJECT, &mean_obj, 0},
        {"std", HL_ARG_OBJECT, &std_obj, 0},
        {"scale", HL_ARG_DOUBLE, &scale, 0},
        {"stream", HL_ARG_ADDRESS, &stream, 0},
        {"table_host", HL_ARG_OBJECT, &table_host_obj, 1},
    };
    if (hl_parse_keywords("image_resize", args, nargs, kwnames, spec, HL_ARGS_COUNT(spec)) < 0)
        return NULL;
    if (hl_tensor_from_object(out_obj, "out", OUT_DTYPES, HL_ANY_DEVICE, 1, &out) < 0)
        goto error;
    const int c_dim = channels_last ? 3 : 1;
    if (out.ndim != 4 || out.shape[0] != count || out.shape[c_dim] != 3) {
        PyErr_Format(PyExc_ValueError, "out: expected a contiguous [%lld, %s] batch (channels_last=%s), got %d dimensions "
                     "of shape [%lld, %lld, %lld, %lld]", count, channels_last ? "h, w, 3" : "3, h, w",
                     channels_last ? "True" : "False", out.ndim, (long long)(out.ndim > 0 ? out.shape[0] : 0),
                     (long long)(out.ndim > 1 ? out.shape[1] : 0), (long long)(out.ndim > 2 ? out.shape[2] : 0),
                     (long long)(out.ndim > 3 ? out.shape[3] : 0));
        goto error;
    }
    const int64_t h = out.shape[channels_last ? 1 : 2], w = out.shape[channels_last ? 2 : 3];
    if (h < 1 || w < 1) {
        PyErr_Format(PyExc_ValueError, "out: expected an image size of at least 1 x 1, got %lld x %lld", (long long)h,
                     (long long)w);
        goto error;
    }
    if (read_params(mean_obj, std_obj, scale, out.dtype, &params) < 0)
        goto error;
    entries = read_entries(table_obj, (int64_t)count, h, w);
    if (entries == NULL)
        goto error;

    if (out.device < 0) {
        int rc;
        Py_BEGIN_ALLOW_THREADS
        rc = cpu_image_resize(entries, count, out.data, out.dtype, h, w, channels_last, &params);
        Py_END_ALLOW_THREADS
        if (rc < 0) {
            PyErr_NoMemory();
            goto error;
        }
    } else {
        if (hl_cuda_require(module, out.device) < 0)
            goto error;
        if (table_dev_obj == Py_None) {
            PyErr_Format(PyExc_ValueError, "table_dev: a CUDA batch needs a uint8 buffer on cuda:%d of at least %lld "
                         "bytes, got None", out.device, count * HL_IMAGE_ENTRY_BYTES);
            goto error;
        }
        if (hl_tensor_from_object(table_dev_obj, "table_dev", HL_DTYPE_BIT(HL_UINT8), out.device, 1, &table_dev) < 0)
            goto error;
        if (table_dev.numel < count * HL_IMAGE_ENTRY_BYTES || (uintptr_t)table_dev.data % 8 != 0) {
            PyErr_Format(PyExc_ValueError, "table_dev: expected at least %lld bytes at an 8-byte aligned address, got "
                         "%lld bytes at %p", count * HL_IMAGE_ENTRY_BYTES, (long long)table_dev.numel, table_dev.data);
            goto error;
        }
        const void *upload = entries; /* pageable (NOTE [ Table uploads ]) */
        if (table_host_obj != Py_None) {
            if (hl_tensor_from_object(table_host_obj, "table_host", HL_DTYPE_BIT(HL_UINT8), -1, 1, &table_host) < 0)
                goto error;
            if (table_host.numel < count * HL_IMAGE_ENTRY_BYTES) {
                PyErr_Format(PyExc_ValueError, "table_host: expected at least %lld bytes, got %lld",
                             count * HL_IMAGE_ENTRY_BYTES, (long long)table_host.numel);
                goto error;
            }
            memcpy(table_host.data, entries, (size_t)count * sizeof(hl_image_entry));
            upload = table_host.data;
        }
#ifdef HOTLOOP_WITH_CUDA
        if (hl_kernels_require(module, out.device, HL_SOURCE_IMAGE_RESIZE) < 0)
            goto error;
        hl_cuda_status status = {0};
        CUstream s = hl_stream(stream);
        Py_BEGIN_ALLOW_THREADS
        hl_device_guard guard;
        hl_device_enter(&guard, out.device, &status);
        /* the loader's stream waits for the batch's decode: from pageable memory the host might wait
           for the decode too, which page-locked table_host avoids (NOTE [ Table uploads ]) */
        hl_table_upload(table_dev.data, upload, (size_t)count * sizeof(hl_image_entry), s, &status);
        HL_CUDA(&status, hl_launch_image_resize((const hl_image_entry *)table_dev.data, count, out.data, out.dtype, h, w,
                                                channels_last, params, out.device, s));
        hl_device_leave(&guard, &status);
        Py_END_ALLOW_THREADS
        if (hl_cuda_raise_if(module, &status) < 0)
            goto error;
#else
        (void)upload; /* not reached: hl_cuda_require refused above */
#endif
    }
    result = Py_NewRef(Py_None);
error:
    free(entries);
    hl_tensor_release(&table_host);
    hl_tensor_release(&table_dev);
    hl_tensor_release(&out);
    return result;
}

static PyMethodDef image_resize_methods[] = {
    {"image_resize", HL_FASTCALL_KEYWORDS(image_resize), METH_FASTCALL | METH_KEYWORDS, image_resize_doc},
    {NULL, NULL, 0, NULL},
};

static const hl_int_constant image_resize_constants[] = {
    {"IMAGE_ENTRY_BYTES", HL_IMAGE_ENTRY_BYTES},
    {"IMAGE_MAX_SIDE", HL_IMAGE_MAX_SIDE},
    {NULL, 0},
};

int hl_image_resize_exec(PyObject *module) {
    if (PyModule_AddFunctions(module, image_resize_methods) < 0)
        return -1;
    return hl_add_int_constants(module, image_resize_constants);
}
