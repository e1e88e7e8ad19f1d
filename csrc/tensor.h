/* The tensor shim: one tensor through DLPack, many tensors through a packed tensor table. */
#ifndef HOTLOOP_TENSOR_H
#define HOTLOOP_TENSOR_H

#include "module.h"
#include "tensor_table.h"

#define HL_ANY_DEVICE (-2)

/* One tensor, borrowed from its producer for the length of a call. */
typedef struct {
    char *data;           /* element 0, byte offset applied */
    int64_t numel;
    int ndim;
    const int64_t *shape;
    int dtype;            /* enum hl_dtype */
    int device;           /* CUDA device index, -1 for host memory */
    int read_only;
    void *managed;        /* the DLPack managed tensor, released by hl_tensor_release */
    int versioned;
} hl_tensor;

/* Take `obj` through __dlpack__: it must be contiguous and of a dtype in `dtype_mask`, on `device`
   (or HL_ANY_DEVICE), and writable when `writable`. Errors are TypeError (not a tensor, wrong dtype)
   or ValueError (layout, device, read-only) naming `argname`, what was expected and what came. */
int hl_tensor_from_object(PyObject *obj, const char *argname, unsigned dtype_mask, int device,
                          int writable, hl_tensor *out);
void hl_tensor_release(hl_tensor *t);

/* Many tensors, as Python packed them: int64 quadruples (data pointer, element count, dtype code,
   device index or -1) in a bytes object. Entries live in malloc'd memory (malloc is outside
   the limited API), so launchers and C loops can read them without the GIL. */
typedef struct {
    hl_table_entry *entries;
    int64_t count;
    int64_t total_chunks;
    int64_t total_numel;
    int device; /* shared by all entries */
} hl_table;

/* Check every entry (dtype in `dtype_mask`, one device for all, no null data for non-empty
   tensors, at least one tensor) and lay out the chunks. TypeError/ValueError otherwise. */
int hl_table_parse(PyObject *packed, const char *argname, unsigned dtype_mask, hl_table *out);
void hl_table_free(hl_table *t);

int64_t hl_dtype_size(int dtype);
const char *hl_dtype_name(int dtype);
/* "float32, float16 or bfloat16": the dtypes of a mask, for error messages */
PyObject *hl_dtype_mask_names(unsigned mask);
/* "cuda:0" / "cpu" */
PyObject *hl_device_name(int device);

#endif
