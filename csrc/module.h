/* What the C files of hotloop._C share: the module state, the error helpers and each part's entry point. */
#ifndef HOTLOOP_MODULE_H
#define HOTLOOP_MODULE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* Per-module state: everything a function needs that is not an argument. No static PyObject*. */
typedef struct {
    PyObject *cuda_error; /* hotloop.CudaError, a RuntimeError */
    PyObject *nvml_error; /* hotloop.NvmlError, a RuntimeError */
    PyObject *ring_type;    /* set by ring.c, when it adds its type */
    PyObject *monitor_type; /* set by monitor.c, when it adds its type */
    PyObject *host_sampler_type; /* set by host_sampler.c */
    PyObject *nvjpeg_error;       /* hotloop.NvjpegError, a RuntimeError */
    PyObject *jpeg_info_type;     /* set by jpeg_header.c: what jpeg_header() returns */
    PyObject *jpeg_decoder_type;  /* set by jpeg_decoder.c */
    PyObject *kernel_loader;      /* set_kernel_loader(fn): what kernels.c asks for a kernel image */
} hl_state;

hl_state *hl_state_of(PyObject *module);

/* Errors (errors.c): the exception types and the one function per library that raises them. */

/* Where a failing CUDA call happened; filled without the GIL, raised once the GIL is back. */
typedef struct {
    int code; /* CUresult; 0 while nothing failed */
    const char *call;
    const char *file;
    int line;
} hl_cuda_status;

/* Run `expr` (a CUDA driver call returning CUresult) unless an earlier call already failed, and
   remember the first failure. Safe without the GIL. */
#define HL_CUDA(status, expr)                                                                      \
    do {                                                                                           \
        if ((status)->code == 0) {                                                                 \
            int hl_err_ = (int)(expr);                                                             \
            if (hl_err_ != 0) {                                                                    \
                (status)->code = hl_err_;                                                          \
                (status)->call = #expr;                                                            \
                (status)->file = __FILE__;                                                         \
                (status)->line = __LINE__;                                                         \
            }                                                                                      \
        }                                                                                          \
    } while (0)

/* The one way a hl_cuda_status becomes an exception: 0 while it holds no failure; otherwise -1 with
   hotloop.CudaError naming the call, error name and text, file and line. Needs the GIL. */
int hl_cuda_raise_if(PyObject *module, const hl_cuda_status *status);

/* Build and raise hotloop.NvmlError: `code` is NVML's return code, `text` what nvmlErrorString said.
   Only nvml.c calls it: a return code goes through its hl_nvml_raise_if. */
int hl_raise_nvml(PyObject *module, int code, const char *text, const char *call, const char *file,
                  int line);

/* Build and raise hotloop.NvjpegError: `code` is nvjpeg's status, `name` its NVJPEG_STATUS_* name,
   `detail` more text (may be empty). Only jpeg_decoder.c calls it. */
int hl_raise_nvjpeg(PyObject *module, int code, const char *name, const char *detail, const char *call,
                    const char *file, int line);

/* Add hotloop.CudaError, NvmlError and NvjpegError to the module and keep them in its state. */
int hl_errors_exec(PyObject *module);

/* A constant C owns and Python reads from _C (Python keeps no copy of the number). */
typedef struct {
    const char *name;
    long value;
} hl_int_constant;

/* Add every constant of a table ended by {NULL, 0}: 0, or -1 with an exception set. */
int hl_add_int_constants(PyObject *module, const hl_int_constant *constants);

/* Each part adds its functions (and types) to the module: 0 on success, -1 with an exception set. */
int hl_tensor_exec(PyObject *module);
int hl_cuda_exec(PyObject *module);
int hl_amp_exec(PyObject *module);
int hl_optim_exec(PyObject *module); /* fused optimizers (optim.c) */
int hl_group_key_exec(PyObject *module); /* an optimizer step's param-group key (group_key.c) */
int hl_monitor_exec(PyObject *module);
int hl_host_sampler_exec(PyObject *module);
int hl_nvml_exec(PyObject *module);
int hl_ring_exec(PyObject *module); /* the loader's ring and its CUDA copies */
int hl_normalize_exec(PyObject *module);
int hl_image_resize_exec(PyObject *module);
int hl_jpeg_header_exec(PyObject *module); /* JPEG headers read in C */
int hl_nvjpeg_exec(PyObject *module);      /* nvjpeg by dlopen: the library table */
int hl_jpeg_decoder_exec(PyObject *module); /* JpegDecoder, on nvjpeg's batched engine */
int hl_kernels_exec(PyObject *module);     /* kernels compiled at run time: loader, sources, launches */
int hl_nvrtc_exec(PyObject *module);       /* NVRTC by dlopen: Nvrtc */

#endif
