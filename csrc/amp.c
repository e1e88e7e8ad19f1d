/* Mixed-precision entry points: argument checks, CUDA launches, and the C reference kernels for CPU tensors. */
#include <string.h>

#include "cuda.h"
#include "tensor.h"
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

static PyMethodDef amp_methods[] = {
    {"non_finite_check", non_finite_check, METH_VARARGS, non_finite_check_doc},
    {NULL, NULL, 0, NULL},
};

int hl_amp_exec(PyObject *module) { return PyModule_AddFunctions(module, amp_methods); }
