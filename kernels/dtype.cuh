/* Device-side helpers for tables whose tensors are float32, float16 or bfloat16: reading an element as
   float, and running code with the element type an entry's dtype code names. */
#ifndef HOTLOOP_DTYPE_CUH
#define HOTLOOP_DTYPE_CUH

#include "half.cuh"
#include "tensor_table.h"

__device__ inline float to_float(float x) { return x; }
__device__ inline float to_float(hl_half x) { return hl_half2float(x); }
__device__ inline float to_float(hl_bfloat16 x) { return hl_bfloat162float(x); }

/* Calls `body`, a lambda without parameters, with `T` naming the element type of dtype code `dtype`
   (HL_FLOAT32, HL_FLOAT16, else bfloat16), as torch's AT_DISPATCH macros do. A macro rather than a
   function that takes a generic lambda: NVRTC treats a generic lambda's operator() as host code and
   refuses it (without -default-device), while a plain lambda in device code is device code. A #pragma
   written inside `body` is lost (a directive in a macro's argument): define such loops outside it. */
#define HL_WITH_DTYPE(dtype, T, ...)                                                                            \
    do {                                                                                                        \
        switch (dtype) {                                                                                        \
        case HL_FLOAT32: {                                                                                      \
            using T = float;                                                                                    \
            __VA_ARGS__();                                                                                      \
            break;                                                                                              \
        }                                                                                                       \
        case HL_FLOAT16: {                                                                                      \
            using T = hl_half;                                                                                  \
            __VA_ARGS__();                                                                                      \
            break;                                                                                              \
        }                                                                                                       \
        default: {                                                                                              \
            using T = hl_bfloat16;                                                                              \
            __VA_ARGS__();                                                                                      \
            break;                                                                                              \
        }                                                                                                       \
        }                                                                                                       \
    } while (0)

#endif
