/* Device-side helpers for tables whose tensors are float32, float16 or bfloat16: reading an element as
   float, and calling a generic lambda with the element type an entry's dtype code names. */
#ifndef HOTLOOP_DTYPE_CUH
#define HOTLOOP_DTYPE_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "tensor_table.h"

__device__ inline float to_float(float x) { return x; }
__device__ inline float to_float(__half x) { return __half2float(x); }
__device__ inline float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

/* f(zero of the element type) for dtype code `dtype` (HL_FLOAT32, HL_FLOAT16, else bfloat16) */
template <typename F> __device__ __forceinline__ void with_dtype(int dtype, F f) {
    switch (dtype) {
    case HL_FLOAT32:
        f(float());
        break;
    case HL_FLOAT16:
        f(__half());
        break;
    default:
        f(__nv_bfloat16());
        break;
    }
}

#endif
