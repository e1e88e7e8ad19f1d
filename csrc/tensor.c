/* The tensor shim: reads DLPack capsules and packed tensor tables, checking what kernels rely on. */
#include "tensor.h"

#include <stdlib.h>
#include <string.h>

#include "dlpack.h"

/* torch's name of each dtype, in enum hl_dtype order: error messages, and the keys of _C.DTYPE_CODES */
static const char *const dtype_names[HL_DTYPE_COUNT] = {
    "float32", "float16", "bfloat16", "uint8", "int32", "int64",
    "float64", "int8", "int16", "bool", "complex64", "complex128",
};
static const int64_t dtype_sizes[HL_DTYPE_COUNT] = {4, 2, 2, 1, 4, 8, 8, 1, 2, 1, 8, 16};

int64_t hl_dtype_size(int dtype) { return dtype >= 0 && dtype < HL_DTYPE_COUNT ? dtype_sizes[dtype] : 0; }

const char *hl_dtype_name(int dtype) {
    return dtype >= 0 && dtype < HL_DTYPE_COUNT ? dtype_names[dtype] : "an unsupported dtype";
}

PyObject *hl_dtype_mask_names(unsigned mask) {
    PyObject *text = PyUnicode_FromString("");
    int total = 0, written = 0;
    for (int d = 0; d < HL_DTYPE_COUNT; d++)
        total += (mask >> d) & 1;
    for (int d = 0; d < HL_DTYPE_COUNT && text != NULL; d++) {
        if (!((mask >> d) & 1))
            continue;
        const char *sep = written == 0 ? "" : (written == total - 1 ? " or " : ", ");
        PyObject *next = PyUnicode_FromFormat("%U%s%s", text, sep, dtype_names[d]);
        Py_DECREF(text);
        text = next;
        written++;
    }
    return text;
}

PyObject *hl_device_name(int device) {
    return device < 0 ? PyUnicode_FromString("cpu") : PyUnicode_FromFormat("cuda:%d", device);
}

/* DLPack (code, bits, lanes) -> enum hl_dtype, or HL_DTYPE_UNKNOWN */
static int dtype_from_dlpack(dl_dtype t) {
    if (t.lanes != 1)
        return HL_DTYPE_UNKNOWN;
    switch (t.code) {
    case DL_FLOAT:
        return t.bits == 32 ? HL_FLOAT32 : t.bits == 16 ? HL_FLOAT16 : t.bits == 64 ? HL_FLOAT64 : HL_DTYPE_UNKNOWN;
    case DL_BFLOAT:
        return t.bits == 16 ? HL_BFLOAT16 : HL_DTYPE_UNKNOWN;
    case DL_UINT:
        return t.bits == 8 ? HL_UINT8 : HL_DTYPE_UNKNOWN;
    case DL_INT:
        return t.bits == 8 ? HL_INT8 : t.bits == 16 ? HL_INT16 : t.bits == 32 ? HL_INT32
                                                              : t.bits == 64 ? HL_INT64 : HL_DTYPE_UNKNOWN;
    case DL_BOOL:
        return HL_BOOL;
    case DL_COMPLEX:
        return t.bits == 64 ? HL_COMPLEX64 : t.bits == 128 ? HL_COMPLEX128 : HL_DTYPE_UNKNOWN;
    default:
        return HL_DTYPE_UNKNOWN;
    }
}

static int is_row_major(const dl_tensor *t) {
    if (t->strides == NULL)
        return 1;
    int64_t expected = 1;
    for (int d = t->ndim - 1; d >= 0; d--) {
        if (t->shape[d] == 0)
            return 1; /* an empty tensor has no layout to get wrong */
        if (t->shape[d] != 1 && t->strides[d] != expected)
            return 0;
        expected *= t->shape[d];
    }
    return 1;
}

static PyObject *type_name_of(PyObject *obj) {
    return PyObject_GetAttrString((PyObject *)Py_TYPE(obj), "__qualname__");
}

/* obj.__dlpack__(stream=..., max_version=(1, x)); falls back to the legacy call for producers
   (torch < 2.4, numpy < 2.1) that do not know max_version. */
static PyObject *call_dlpack(PyObject *obj, int is_cuda) {
    PyObject *method = NULL, *args = NULL, *kwargs = NULL, *capsule = NULL, *stream = NULL,
             *version = NULL;
    method = PyObject_GetAttrString(obj, "__dlpack__");
    args = PyTuple_New(0);
    kwargs = PyDict_New();
    /* -1: no synchronisation. hotloop launches on the caller's current stream, where torch's
       ops that produced the tensor ran; None is what host producers (numpy) require. */
    stream = is_cuda ? PyLong_FromLong(-1) : Py_NewRef(Py_None);
    version = Py_BuildValue("(ii)", DL_MAJOR_VERSION, 1);
    if (method == NULL || args == NULL || kwargs == NULL || stream == NULL || version == NULL)
        goto done;
    if (PyDict_SetItemString(kwargs, "stream", stream) < 0 ||
        PyDict_SetItemString(kwargs, "max_version", version) < 0)
        goto done;
    capsule = PyObject_Call(method, args, kwargs);
    if (capsule == NULL && PyErr_ExceptionMatches(PyExc_TypeError)) {
        PyErr_Clear();
        if (PyDict_DelItemString(kwargs, "max_version") < 0)
            goto done;
        capsule = PyObject_Call(method, args, kwargs);
    }
done:
    Py_XDECREF(method);
    Py_XDECREF(args);
    Py_XDECREF(kwargs);
    Py_XDECREF(stream);
    Py_XDECREF(version);
    return capsule;
}

/* (device_type, device_id) from __dlpack_device__, so the stream argument can be chosen */
static int dlpack_device(PyObject *obj, const char *argname, int *device_type) {
    PyObject *dev = PyObject_CallMethod(obj, "__dlpack_device__", NULL);
    if (dev == NULL)
        return -1;
    if (!PyTuple_Check(dev) || PyTuple_Size(dev) != 2) {
        Py_DECREF(dev);
        PyErr_Format(PyExc_TypeError, "%s: __dlpack_device__() must return a (device_type, device_id) tuple",
                     argname);
        return -1;
    }
    *device_type = (int)PyLong_AsLong(PyTuple_GetItem(dev, 0));
    Py_DECREF(dev);
    return PyErr_Occurred() ? -1 : 0;
}

/* Take ownership of the managed tensor inside `capsule` (renamed to the "used" name, as the
   protocol asks). Returns the DLTensor or NULL with an exception. */
static dl_tensor *consume_capsule(PyObject *capsule, const char *argname, hl_tensor *out) {
    if (PyCapsule_IsValid(capsule, "dltensor_versioned")) {
        dl_managed_versioned *m = PyCapsule_GetPointer(capsule, "dltensor_versioned");
        if (m->version.major != DL_MAJOR_VERSION) {
            PyErr_Format(PyExc_ValueError, "%s: DLPack version %u.%u is not supported (expected 1.x)",
                         argname, (unsigned)m->version.major, (unsigned)m->version.minor);
            return NULL;
        }
        if (PyCapsule_SetName(capsule, "used_dltensor_versioned") < 0)
            return NULL;
        out->managed = m;
        out->versioned = 1;
        out->read_only = (m->flags & DL_FLAG_READ_ONLY) != 0;
        return &m->tensor;
    }
    if (PyCapsule_IsValid(capsule, "dltensor")) {
        dl_managed *m = PyCapsule_GetPointer(capsule, "dltensor");
        if (PyCapsule_SetName(capsule, "used_dltensor") < 0)
            return NULL;
        out->managed = m;
        out->versioned = 0;
        out->read_only = 0;
        return &m->tensor;
    }
    PyErr_Format(PyExc_TypeError, "%s: __dlpack__() returned something that is not an unused DLPack capsule",
                 argname);
    return NULL;
}

void hl_tensor_release(hl_tensor *t) {
    if (t->managed == NULL)
        return;
    if (t->versioned) {
        dl_managed_versioned *m = t->managed;
        if (m->deleter)
            m->deleter(m);
    } else {
        dl_managed *m = t->managed;
        if (m->deleter)
            m->deleter(m);
    }
    t->managed = NULL;
}

int hl_tensor_from_object(PyObject *obj, const char *argname, unsigned dtype_mask, int device,
                          int writable, hl_tensor *out) {
    PyObject *capsule = NULL, *got = NULL, *want = NULL;
    dl_tensor *t = NULL;
    int device_type = 0;
    memset(out, 0, sizeof(*out));

    if (!PyObject_HasAttrString(obj, "__dlpack__") || !PyObject_HasAttrString(obj, "__dlpack_device__")) {
        got = type_name_of(obj);
        if (got != NULL)
            PyErr_Format(PyExc_TypeError, "%s: expected a tensor (an object with __dlpack__), got %U",
                         argname, got);
        goto error;
    }
    if (dlpack_device(obj, argname, &device_type) < 0)
        goto error;
    capsule = call_dlpack(obj, device_type == DL_CUDA);
    if (capsule == NULL)
        goto error;
    t = consume_capsule(capsule, argname, out);
    if (t == NULL)
        goto error;

    out->dtype = dtype_from_dlpack(t->dtype);
    out->ndim = t->ndim;
    out->shape = t->shape;
    out->data = (char *)t->data + t->byte_offset;
    out->numel = 1;
    for (int d = 0; d < t->ndim; d++)
        out->numel *= t->shape[d];
    switch (t->device.device_type) {
    case DL_CPU:
    case DL_CUDA_HOST:
        out->device = -1;
        break;
    case DL_CUDA:
    case DL_CUDA_MANAGED:
        out->device = t->device.device_id;
        break;
    default:
        PyErr_Format(PyExc_ValueError, "%s: expected a CPU or CUDA tensor, got DLPack device type %d",
                     argname, (int)t->device.device_type);
        goto error;
    }

    if (out->dtype < 0 || !((dtype_mask >> out->dtype) & 1)) {
        want = hl_dtype_mask_names(dtype_mask);
        if (want == NULL)
            goto error;
        if (out->dtype < 0)
            PyErr_Format(PyExc_TypeError, "%s: expected %U, got DLPack dtype (code %d, %d bits, %d lanes)",
                         argname, want, (int)t->dtype.code, (int)t->dtype.bits, (int)t->dtype.lanes);
        else
            PyErr_Format(PyExc_TypeError, "%s: expected %U, got %s", argname, want,
                         hl_dtype_name(out->dtype));
        goto error;
    }
    if (!is_row_major(t)) {
        PyErr_Format(PyExc_ValueError, "%s: expected a contiguous tensor, got one with other strides "
                     "(call .contiguous() first)", argname);
        goto error;
    }
    if (out->numel > 0 && out->data == NULL) {
        PyErr_Format(PyExc_ValueError, "%s: a non-empty tensor with a null data pointer", argname);
        goto error;
    }
    if (device != HL_ANY_DEVICE && out->device != device) {
        want = hl_device_name(device);
        got = hl_device_name(out->device);
        if (want != NULL && got != NULL)
            PyErr_Format(PyExc_ValueError, "%s: expected a tensor on %U, got one on %U", argname, want, got);
        goto error;
    }
    if (writable && out->read_only) {
        PyErr_Format(PyExc_ValueError, "%s: expected a writable tensor, got a read-only one", argname);
        goto error;
    }
    Py_DECREF(capsule);
    return 0;

error:
    hl_tensor_release(out);
    Py_XDECREF(capsule);
    Py_XDECREF(got);
    Py_XDECREF(want);
    return -1;
}

void hl_table_free(hl_table *t) {
    free(t->entries);
    t->entries = NULL;
    t->count = 0;
}

/* packed layout: one int64 quadruple per tensor */
enum { PACKED_DATA, PACKED_NUMEL, PACKED_DTYPE, PACKED_DEVICE, PACKED_FIELDS };

int hl_table_parse(PyObject *packed, const char *argname, unsigned dtype_mask, hl_table *out) {
    char *bytes = NULL;
    Py_ssize_t size = 0;
    PyObject *want = NULL, *got = NULL, *first = NULL;
    memset(out, 0, sizeof(*out));

    if (!PyBytes_Check(packed)) {
        PyErr_Format(PyExc_TypeError, "%s: expected a packed tensor table (bytes)", argname);
        return -1;
    }
    if (PyBytes_AsStringAndSize(packed, &bytes, &size) < 0)
        return -1;
    const Py_ssize_t entry_bytes = PACKED_FIELDS * (Py_ssize_t)sizeof(int64_t);
    if (size % entry_bytes != 0) {
        PyErr_Format(PyExc_ValueError, "%s: a packed tensor table holds 4 int64 per tensor; got %zd bytes",
                     argname, size);
        return -1;
    }
    out->count = size / entry_bytes;
    if (out->count == 0) {
        PyErr_Format(PyExc_ValueError, "%s: expected at least one tensor, got an empty list", argname);
        return -1;
    }
    out->entries = malloc((size_t)out->count * sizeof(hl_table_entry));
    if (out->entries == NULL) {
        PyErr_NoMemory();
        return -1;
    }

    int64_t chunk = 0;
    for (int64_t i = 0; i < out->count; i++) {
        int64_t field[PACKED_FIELDS];
        memcpy(field, bytes + i * entry_bytes, sizeof(field)); /* bytes need not be 8-aligned */
        hl_table_entry *e = &out->entries[i];
        e->data = (uint64_t)field[PACKED_DATA];
        e->numel = field[PACKED_NUMEL];
        e->dtype = (int32_t)field[PACKED_DTYPE];
        e->device = (int32_t)field[PACKED_DEVICE];
        e->first_chunk = chunk;
        if (e->dtype < 0 || e->dtype >= HL_DTYPE_COUNT || !((dtype_mask >> e->dtype) & 1)) {
            want = hl_dtype_mask_names(dtype_mask);
            if (want != NULL)
                PyErr_Format(PyExc_TypeError, "%s: tensor %lld: expected %U, got %s", argname, (long long)i,
                             want, hl_dtype_name(e->dtype));
            goto error;
        }
        if (e->numel < 0) {
            PyErr_Format(PyExc_ValueError, "%s: tensor %lld: negative element count %lld", argname,
                         (long long)i, (long long)e->numel);
            goto error;
        }
        if (e->numel > 0 && e->data == 0) {
            PyErr_Format(PyExc_ValueError, "%s: tensor %lld: null data pointer for %lld elements", argname,
                         (long long)i, (long long)e->numel);
            goto error;
        }
        if (e->device < -1) {
            PyErr_Format(PyExc_ValueError, "%s: tensor %lld: bad device index %d", argname, (long long)i,
                         (int)e->device);
            goto error;
        }
        if (e->device != out->entries[0].device) {
            first = hl_device_name(out->entries[0].device);
            got = hl_device_name(e->device);
            if (first != NULL && got != NULL)
                PyErr_Format(PyExc_ValueError,
                             "%s: expected all tensors on one device; tensor 0 is on %U, tensor %lld on %U",
                             argname, first, (long long)i, got);
            goto error;
        }
        chunk += hl_chunks_of(e->numel);
        out->total_numel += e->numel;
    }
    out->total_chunks = chunk;
    out->device = out->entries[0].device;
    return 0;

error:
    Py_XDECREF(want);
    Py_XDECREF(got);
    Py_XDECREF(first);
    hl_table_free(out);
    return -1;
}

PyDoc_STRVAR(describe_tensor_doc, "describe_tensor(tensor) -> dict\n\n"
             "What the shim reads from one tensor through DLPack: data pointer, device (-1: host), dtype\n"
             "name, shape, numel, read_only. Any dtype the shim knows is accepted; used by tests and info.");

static PyObject *describe_tensor(PyObject *module, PyObject *obj) {
    (void)module;
    hl_tensor t;
    if (hl_tensor_from_object(obj, "tensor", (1u << HL_DTYPE_COUNT) - 1, HL_ANY_DEVICE, 0, &t) < 0)
        return NULL;
    PyObject *shape = PyTuple_New(t.ndim), *result = NULL;
    for (int d = 0; shape != NULL && d < t.ndim; d++) {
        PyObject *n = PyLong_FromLongLong(t.shape[d]);
        if (n == NULL || PyTuple_SetItem(shape, d, n) < 0)
            Py_CLEAR(shape);
    }
    if (shape != NULL)
        result = Py_BuildValue("{s:K, s:i, s:s, s:O, s:L, s:O}", "data_ptr", (unsigned long long)(uintptr_t)t.data,
                               "device", t.device, "dtype", hl_dtype_name(t.dtype), "shape", shape, "numel",
                               (long long)t.numel, "read_only", t.read_only ? Py_True : Py_False);
    Py_XDECREF(shape);
    hl_tensor_release(&t);
    return result;
}

PyDoc_STRVAR(check_table_doc, "check_table(packed, dtype_mask) -> (count, total_numel, total_chunks, device)\n\n"
             "Validate a packed tensor table as every kernel entry point does, and say what it holds.");

static PyObject *check_table(PyObject *module, PyObject *args) {
    (void)module;
    PyObject *packed;
    unsigned int mask;
    hl_table table;
    if (!PyArg_ParseTuple(args, "OI:check_table", &packed, &mask))
        return NULL;
    if (hl_table_parse(packed, "tensors", mask, &table) < 0)
        return NULL;
    PyObject *result = Py_BuildValue("(LLLi)", (long long)table.count, (long long)table.total_numel,
                                     (long long)table.total_chunks, table.device);
    hl_table_free(&table);
    return result;
}

static PyMethodDef tensor_methods[] = {
    {"describe_tensor", describe_tensor, METH_O, describe_tensor_doc},
    {"check_table", check_table, METH_VARARGS, check_table_doc},
    {NULL, NULL, 0, NULL},
};

static const hl_int_constant tensor_constants[] = {
    {"TABLE_ENTRY_BYTES", (long)sizeof(hl_table_entry)},
    {"CHUNK_ELEMS", HL_CHUNK_ELEMS},
    {"DTYPE_UNKNOWN", HL_DTYPE_UNKNOWN},
    {"FLOATING_DTYPE_MASK", (long)HL_FLOATING_MASK},
    {NULL, 0},
};

/* {"float32": 0, "float16": 1, ...}: enum hl_dtype by torch's name of each dtype, so that Python
   packs the codes C reads without a copy of its own */
static int add_dtype_codes(PyObject *module) {
    PyObject *codes = PyDict_New(), *code = NULL;
    int rc = -1;
    if (codes == NULL)
        return -1;
    for (int d = 0; d < HL_DTYPE_COUNT; d++) {
        code = PyLong_FromLong(d);
        if (code == NULL || PyDict_SetItemString(codes, dtype_names[d], code) < 0)
            goto error;
        Py_CLEAR(code);
    }
    rc = PyModule_AddObjectRef(module, "DTYPE_CODES", codes);
error:
    Py_XDECREF(code);
    Py_DECREF(codes);
    return rc;
}

int hl_tensor_exec(PyObject *module) {
    if (PyModule_AddFunctions(module, tensor_methods) < 0)
        return -1;
    if (hl_add_int_constants(module, tensor_constants) < 0 || add_dtype_codes(module) < 0)
        return -1;
    return 0;
}
